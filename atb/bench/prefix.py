"""Prefix caching on SmolLM2-135M: TTFT of requests that share a system prompt, caching on vs off.

    python -m atb.bench.prefix [--dtype bfloat16] [--requests 8] [--system 1024] [--user 32] [--new 64]
                               [--patterns sequential,burst,conversation] [--threads N] [--json]

Each request is a ``--system``-token shared prompt plus its own ``--user``
tokens and generates ``--new`` tokens (greedy, EOS ignored). Two arrival
patterns, each on a fresh engine with caching off and on:

* ``sequential``: a request is added when the previous one has finished (a
  chat server answering one user after another);
* ``burst``: all requests are added at once;
* ``conversation`` (with ``--patterns conversation``): one chat, a turn after
  another: each request's prompt is the previous prompt, its answer and the
  request's own ``--user`` tokens, so with caching on a turn reuses the
  blocks the previous answer filled during decode.

TTFT is the wall time from ``add_request`` to the step that returns the
request's first token. Reported: the first request's TTFT, the mean and max of
the others', their ratio to the first, and the total wall time. The tokens of
caching on and off are compared (they must be equal). The machine is shared:
read the ratios.
"""
from __future__ import annotations

import argparse
import time

import torch

from atb.bench.roofline import add_table_or_json_args, apply_threads, json_results, print_table_head
from atb.engine import SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _prompts(n: int, system: int, user: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ordinary tokens only (ids below 17 are SmolLM2's special tokens).
    shared = torch.randint(17, vocab, (system,), generator=g).tolist()
    return [shared + torch.randint(17, vocab, (user,), generator=g).tolist() for _ in range(n)]


def run(infer, prompts: list[list[int]], new: int, pattern: str, user: int = 0) -> dict:
    """Drives the step API; per request its TTFT (s) and tokens, and the total wall time. ``user``: the tokens
    of a prompt past the shared ones (a turn's own tokens in ``conversation``)."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    added, ttft, tokens, sent = {}, {}, {}, []
    pending = list(enumerate(prompts))
    t_start = time.perf_counter()

    def add():
        i, p = pending.pop(0)
        if pattern == "conversation" and i:
            p = sent[-1] + tokens[f"r{i - 1}"] + p[len(p) - user:]   # the chat so far + this turn's tokens
        sent.append(p)
        rid = infer.add_request(p, params, request_id=f"r{i}")
        added[rid] = time.perf_counter()

    if pattern == "burst":
        while pending:
            add()
    else:
        add()
    while infer.has_unfinished() or pending:
        if not infer.has_unfinished():
            add()
        outs = infer.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in ttft and o.output_token_ids:
                ttft[o.request_id] = now - added[o.request_id]
            if o.finished:
                tokens[o.request_id] = o.output_token_ids
    total = time.perf_counter() - t_start
    order = [f"r{i}" for i in range(len(prompts))]
    return {"ttft_s": [ttft[r] for r in order], "tokens": [tokens[r] for r in order], "total_s": total}


def main(argv=None) -> list[dict]:
    import atb
    from atb.checkpoints import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system", type=int, default=1024, help="shared prompt tokens")
    ap.add_argument("--user", type=int, default=32, help="per-request prompt tokens after the shared ones")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--patterns", default="sequential,burst", help="comma-separated: sequential, burst, conversation")
    add_table_or_json_args(ap)
    args = ap.parse_args(argv)
    apply_threads(args.threads)

    model, _ = load_model(dtype=_DTYPES[args.dtype])
    prompts = _prompts(args.requests, args.system, args.user, model.config.vocab_size)
    patterns = args.patterns.split(",")
    # A conversation's last turn holds every earlier turn and answer.
    turns = args.requests if "conversation" in patterns else 1
    max_seq_len = args.system + turns * (args.user + args.new)
    # Warm-up: kernels, allocator, the pool's first touch.
    warm = atb.TransformerInfer(model, max_seq_len=max_seq_len, max_batch_size=args.requests)
    warm.generate(prompts[:2], 2, eos_token_id=[])
    del warm

    results = []
    if not args.json:
        print_table_head(f"SmolLM2-135M {args.dtype}, {args.requests} requests: {args.system}-token shared prompt + "
                         f"{args.user}-token user turns, {args.new} new tokens, threads={torch.get_num_threads()}",
                         f"{'pattern':10} {'caching':>7} | {'TTFT #1 ms':>10} {'others mean':>11} {'max':>8} "
                         f"{'ratio':>6} | {'total s':>7} | tokens")
    for pattern in patterns:
        ref = None
        for caching in (False, True):
            infer = atb.TransformerInfer(model, max_seq_len=max_seq_len, max_batch_size=args.requests,
                                         enable_prefix_caching=caching)
            r = run(infer, prompts, args.new, pattern, args.user)
            first, others = r["ttft_s"][0], r["ttft_s"][1:]
            mean = sum(others) / max(1, len(others))
            same = ref is None or r["tokens"] == ref
            ref = r["tokens"] if ref is None else ref
            row = {"pattern": pattern, "prefix_caching": caching, "ttft_first_ms": 1e3 * first,
                   "ttft_others_mean_ms": 1e3 * mean, "ttft_others_max_ms": 1e3 * max(others, default=0.0),
                   "ttft_ratio": mean / first, "total_s": r["total_s"], "tokens_equal_to_off": same,
                   "stats": infer.stats()}
            results.append(row)
            if not args.json:
                print(f"{pattern:10} {'on' if caching else 'off':>7} | {row['ttft_first_ms']:10.0f} "
                      f"{row['ttft_others_mean_ms']:11.0f} {row['ttft_others_max_ms']:8.0f} {row['ttft_ratio']:6.1%} | "
                      f"{row['total_s']:7.2f} | {'same' if same else 'DIFFERENT'}", flush=True)
            del infer
    return json_results(results, args.json)


if __name__ == "__main__":
    main()
