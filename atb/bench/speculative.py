"""Speculative decoding by prompt lookup on SmolLM2-135M: greedy generate tok/s with and without it.

    python -m atb.bench.speculative [--dtype bfloat16] [--new 128] [--repeats 3] [--tokens 3]
                                    [--lookup-min 2] [--lookup-max 8] [--temperature 0] [--no-hf]
                                    [--threads N] [--json]

Each task is a chat prompt answered greedily (or sampled at ``--temperature``
with a fixed seed; up to ``--new`` tokens, EOS ends it), one request at a
time, by:

* ``hf``: HF eager ``model.generate`` (the stock path);
* ``hf-lookup``: HF eager with its own prompt lookup
  (``prompt_lookup_num_tokens`` = the largest ``--tokens``);
* ``atb``: ``TransformerInfer.generate`` (graph mode);
* ``atb-k<K>``: the same with ``speculative_config`` (k = K draft tokens).

The variants run interleaved, task after task, ``--repeats`` times; each
cell is the median of tokens / wall time of the whole ``generate`` call
(prefill included). ``acc/step``: draft tokens accepted per verification
step; ``tok/fwd``: tokens produced per decode forward (plain decode is 1).
Greedy speculative tokens must equal plain ``atb``'s (``same``); HF's are shown for
reference (bf16 kernels round differently, so a near tie may split). Sampled
runs draw differently with and without speculation (same distribution), so
their lengths differ and only tok/s compare.

``--series N`` measures drafting across requests instead (``lookup_history``):
a series of requests of one shape (a JSON record of the same keys for each of
N people, one request after another, greedy) through a fresh engine per
variant and repeat: plain, ``atb-k<K>`` (each request's own tokens only) and
``atb-k<K>-h``, which also looks up the finished requests of the series. The
cell is the series' tokens over its wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from atb.bench.roofline import add_table_or_json_args, apply_threads, json_results, print_table_head

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def print_table(rows):
    for row in rows:
        print(" | ".join(str(cell) for cell in row))
'''

_PARAGRAPH = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin spans seven million "
              "square kilometres, of which five and a half million are covered by the rainforest. The region includes "
              "territory belonging to nine nations, and most of the forest lies within Brazil.")

# --series: one request shape, other contents (the people of a made-up directory).
_PEOPLE = [("Alice", 30, "Paris", "painting"), ("Bob", 25, "Berlin", "cycling"), ("Carol", 41, "Madrid", "chess"),
           ("Dave", 35, "Rome", "cooking"), ("Erin", 28, "Lisbon", "surfing"), ("Frank", 52, "Vienna", "opera"),
           ("Grace", 33, "Dublin", "running"), ("Heidi", 47, "Oslo", "skiing"), ("Ivan", 39, "Prague", "jazz"),
           ("Judy", 22, "Athens", "poetry"), ("Karl", 61, "Zurich", "hiking"), ("Laura", 31, "Milan", "fashion")]


def series_prompt(name: str, age: int, city: str, hobby: str) -> str:
    return (f"Write a JSON object with the keys name, age, city, hobby and greeting for this person: {name} is "
            f"{age}, lives in {city} and loves {hobby}. The greeting is one sentence in the person's voice.")


# (name, user message): tasks whose answers copy from their context, then free prose.
TASKS = [
    ("code-edit", "Rewrite this Python code, renaming fibonacci to fib and rows to table:\n\n" + _CODE),
    ("json", "Write this as a JSON list of objects with keys name, age and city: Alice is 30 and lives in Paris. "
             "Bob is 25 and lives in Berlin. Carol is 41 and lives in Madrid. Dave is 35 and lives in Rome."),
    ("quote", "Here is a paragraph:\n\n" + _PARAGRAPH + "\n\nCopy the paragraph exactly, then give it a title."),
    ("list", "List the twelve months of the year, one per line, each with its number of days."),
    ("summary", "Summarize this paragraph in two sentences:\n\n" + _PARAGRAPH),
    ("prose", "Write a short story about a lighthouse keeper."),
]


def chat_ids(tok, text: str) -> list[int]:
    return tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"]


def _timed(fn) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> list[dict]:
    import atb
    from atb.checkpoints import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--new", type=int, default=128, help="max new tokens per task")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", default="3", help="comma-separated num_speculative_tokens values to run")
    ap.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--lookup-max", type=int, default=8, help="prompt_lookup_max")
    ap.add_argument("--tasks", default=",".join(n for n, _ in TASKS), help="comma-separated subset of the tasks")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled (seed 0)")
    ap.add_argument("--no-hf", action="store_true", help="skip the two HF eager variants")
    ap.add_argument("--series", type=int, default=0, metavar="N",
                    help="instead: N requests of one shape in a row, with and without lookup_history")
    add_table_or_json_args(ap)
    args = ap.parse_args(argv)
    apply_threads(args.threads)
    if args.series:
        if not 2 <= args.series <= len(_PEOPLE):
            ap.error(f"--series: between 2 and {len(_PEOPLE)} requests")
        return json_results(bench_series(args), args.json)
    ks = [int(k) for k in args.tokens.split(",")]
    tasks = [(n, t) for n, t in TASKS if n in args.tasks.split(",")]

    model, tok = load_model(dtype=_DTYPES[args.dtype])
    model.eval()
    max_seq_len = 1024
    plain = atb.TransformerInfer(model, max_seq_len=max_seq_len, max_batch_size=1)
    specs = {k: atb.TransformerInfer(model, max_seq_len=max_seq_len, max_batch_size=1, speculative_config={
        "num_speculative_tokens": k, "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max})
        for k in ks}
    prompts = {n: chat_ids(tok, t) for n, t in tasks}

    sample = args.temperature > 0
    sampling = {"do_sample": True, "temperature": args.temperature} if sample else {}

    def hf(ids, lookup):
        x = torch.tensor([ids])
        extra = {"prompt_lookup_num_tokens": max(ks)} if lookup else {}
        torch.manual_seed(0)
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new,
                               pad_token_id=tok.eos_token_id, **(sampling or {"do_sample": False}), **extra)
        return y[0, len(ids):].tolist()

    def ours(infer):
        return lambda ids: infer.generate([ids], args.new, seed=0 if sample else None, **sampling)[0]

    variants = {} if args.no_hf else {"hf": lambda ids: hf(ids, False), "hf-lookup": lambda ids: hf(ids, True)}
    variants["atb"] = ours(plain)
    for k, infer in specs.items():
        variants[f"atb-k{k}"] = ours(infer)
    for fn in variants.values():   # warm-up: kernels, allocator, HF's first call
        fn(prompts[tasks[0][0]][:16])

    info = atb.build_info()
    results = []
    if not args.json:
        how = f"sampled at temperature {args.temperature}" if sample else "greedy"
        print_table_head(f"SmolLM2-135M {args.dtype}, {how}, batch 1, up to {args.new} new tokens, prompt lookup "
                         f"n = {args.lookup_max}..{args.lookup_min} | {info['processor']} isa {info['isa']} | "
                         f"threads={torch.get_num_threads()} | median of {args.repeats}",
                         f"{'task':10} {'variant':10} {'tokens':>6} {'tok/s':>7} {'x hf':>6} {'x atb':>6} "
                         f"{'acc/step':>8} {'tok/fwd':>7} | tokens")
    for name, _ in tasks:
        ids = prompts[name]
        times: dict[str, list[float]] = {v: [] for v in variants}
        outs, counters = {}, {}
        for _ in range(args.repeats):
            for v, fn in variants.items():
                infer = specs.get(int(v[5:])) if v.startswith("atb-k") else None
                before = infer.stats() if infer is not None else None
                out, dt = _timed(lambda: fn(ids))
                times[v].append(dt)
                outs[v] = out
                if infer is not None:
                    after = infer.stats()
                    counters[v] = {key: after[key] - before[key] for key in
                                   ("spec_decode_steps", "spec_draft_tokens", "spec_accepted_tokens")}
        rate = {v: len(outs[v]) / statistics.median(times[v]) for v in variants}
        for v in variants:
            c = counters.get(v)
            steps = c["spec_decode_steps"] if c else 0
            # Decode forwards: one per generated token but the first (prefill), less what verification saved.
            forwards = len(outs[v]) - 1 - (c["spec_accepted_tokens"] if c else 0)
            row = {"task": name, "variant": v, "dtype": args.dtype, "tokens": len(outs[v]), "tok_s": rate[v],
                   "x_hf": rate[v] / rate["hf"] if "hf" in rate else None, "x_atb": rate[v] / rate["atb"],
                   "accepted_per_step": c["spec_accepted_tokens"] / steps if steps else None,
                   "tokens_per_forward": (len(outs[v]) - 1) / forwards if forwards > 0 and v.startswith("atb")
                   else None,
                   "same_as_atb": outs[v] == outs["atb"], "same_as_hf": outs[v] == outs["hf"] if "hf" in outs else None,
                   **(c or {})}
            results.append(row)
            if not args.json:
                f = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
                same = "same" if row["same_as_atb"] else "DIFFERENT"
                if row["same_as_hf"] is not None:
                    same += ", = hf" if row["same_as_hf"] else ", != hf"
                if sample:
                    same = "sampled (draws differ)"
                print(f"{name:10} {v:10} {row['tokens']:6d} {row['tok_s']:7.1f} {f(row['x_hf'], '6.2f')} "
                      f"{row['x_atb']:6.2f} {f(row['accepted_per_step'], '8.2f')} "
                      f"{f(row['tokens_per_forward'], '7.2f')} | {same}", flush=True)
    return json_results(results, args.json)


def bench_series(args) -> list[dict]:
    """``--series``: tok/s of a series of same-shape requests per variant (module docstring)."""
    import atb
    from atb.checkpoints import load_model

    model, tok = load_model(dtype=_DTYPES[args.dtype])
    model.eval()
    k = int(args.tokens.split(",")[0])
    prompts = [chat_ids(tok, series_prompt(*p)) for p in _PEOPLE[:args.series]]
    spec = {"num_speculative_tokens": k, "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    variants = {"atb": None, f"atb-k{k}": spec, f"atb-k{k}-h": {**spec, "lookup_history": args.series}}
    times = {v: [] for v in variants}
    outs, stats = {}, {}
    for _ in range(args.repeats):
        for v, cfg in variants.items():
            # A fresh engine per run: the history starts empty (the kernels are warm from the first run on).
            infer = atb.TransformerInfer(model, max_seq_len=1024, max_batch_size=1, speculative_config=cfg)
            t0 = time.perf_counter()
            outs[v] = [infer.generate([ids], args.new)[0] for ids in prompts]
            times[v].append(time.perf_counter() - t0)
            stats[v] = infer.stats()
    rows = []
    if not args.json:
        info = atb.build_info()
        print_table_head(f"SmolLM2-135M {args.dtype}, greedy, a series of {args.series} JSON records, up to {args.new} "
                         f"new tokens each | {info['processor']} isa {info['isa']} | median of {args.repeats}",
                         f"{'variant':12} {'tokens':>6} {'tok/s':>7} {'x atb':>6} {'acc/step':>8} | tokens")
    for v in variants:
        n = sum(len(o) for o in outs[v])
        st = stats[v]
        row = {"variant": v, "tokens": n, "tok_s": n / statistics.median(times[v]),
               "accepted_per_step": (st["spec_accepted_tokens"] / st["spec_decode_steps"]
                                     if st["spec_decode_steps"] else None),
               "same_as_atb": outs[v] == outs["atb"]}
        row["x_atb"] = row["tok_s"] / (rows[0]["tok_s"] if rows else row["tok_s"])
        rows.append(row)
        if not args.json:
            acc = f"{row['accepted_per_step']:8.2f}" if row["accepted_per_step"] is not None else f"{'-':>8}"
            print(f"{v:12} {n:6d} {row['tok_s']:7.1f} {row['x_atb']:6.2f} {acc} | "
                  f"{'same' if row['same_as_atb'] else 'DIFFERENT'}", flush=True)
    return rows


if __name__ == "__main__":
    main()
