"""GGUF files at their own precision: atb against llama.cpp on the same files, in the same run.

    python -m atb.bench.gguf [FILE.gguf ...] [--llama-bench PATH] [--float] [--rest FORMAT] [--prompt 128]
                             [--new 128] [--repeats 3] [--json]

For each file (default: the embedded SmolLM2 Q4_1): prefill and decode tok/s at batch 1 of
``TransformerInfer(model, quantize="gguf:FILE")`` (every Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K tensor as
stored, the rest float, or with ``--rest FORMAT`` quantized to it; bf16 activations), and with ``--float`` of
the same model with float bf16 weights.
With ``--llama-bench`` (the ``llama-bench`` binary of a llama.cpp build, which this project does not ship
or build) the same file goes through llama.cpp's own benchmark with the same prompt length, token count
and thread count (``-p``, ``-n``, ``-t``). The runs are interleaved, repeat by repeat, and the table shows
medians: this machine's speed drifts between minutes. atb's decode is the ``new - 1`` steps after the first
token over the time beyond a one-token generate (``atb.bench.roofline.generate_rates``); llama-bench times
``new`` tokens after its prompt, so the two count the same steps to within one.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import time

import torch

from atb.bench.roofline import add_table_or_json_args, apply_threads, generate_rates, json_results


def tensor_types(report: dict) -> str:
    """``load_native``'s per-tensor report as counts per GGUF type, e.g. ``Q5_0 166, Q4_K 16, Q5_1 (float) 30``
    (``Q5_1 (as w8a16) 30`` where ``rest`` quantized them)."""
    kinds = collections.Counter()
    for what in report.values():
        if "from gguf:" in what:
            kinds[what.rsplit("from gguf:", 1)[1].rstrip(")")] += 1
        elif what.startswith("not in file") or what.startswith("tied"):
            continue
        else:  # "<type>: float ..." or "<type>: quantized from float, QuantizedWeight(w8a16, ...)"
            kind, how = what.split(": ", 1)
            kinds[f"{kind} (as {how.split('(', 1)[1].split(',')[0]})" if how.startswith("quantized") else
                  f"{kind} (float)"] += 1
    return ", ".join(f"{k} {n}" for k, n in kinds.most_common())


def llama_bench(binary: str, path: str, prompt: int, new: int, threads: int) -> tuple[float, float]:
    """(prefill, decode) tok/s of llama.cpp's ``llama-bench`` on ``path``: one repetition of each, JSON output."""
    cmd = [binary, "-m", path, "-p", str(prompt), "-n", str(new), "-t", str(threads), "-r", "1", "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except OSError as e:
        raise SystemExit(f"bench.gguf: --llama-bench {binary}: cannot run it ({e})") from None
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"bench.gguf: {' '.join(cmd)} exited with {out.returncode}: {' / '.join(tail)}")
    try:
        rows = json.loads(out.stdout)
        prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
        decode = next(r["avg_ts"] for r in rows if r["n_gen"] == new and r["n_prompt"] == 0)
    except (ValueError, KeyError, TypeError, StopIteration):
        raise SystemExit(f"bench.gguf: {binary} printed no pp{prompt} / tg{new} results in JSON: "
                         f"{out.stdout[:200]!r}") from None
    return float(prefill), float(decode)


def _engine_rates(engine, prompt_ids: list[int], new: int) -> tuple[float, float]:
    def run(n):
        t0 = time.perf_counter()
        engine.generate([prompt_ids], max_new_tokens=n, eos_token_id=[])
        return time.perf_counter() - t0

    t1 = run(1)
    return generate_rates(t1, run(new), 1, len(prompt_ids), new)


def bench_file(path: str | None, *, llama: str | None, with_float: bool, prompt: int, new: int, repeats: int,
               threads: int, rest: str | None = None) -> dict:
    import atb
    from atb.checkpoints import default_model_path, load_model
    from atb.quant.engine import parse_spec
    from atb.quant.gguf import load_native

    model, _ = load_model(path, dtype=torch.bfloat16, progress=False)
    path = path or default_model_path()
    native = load_native(model, path, rest=parse_spec(rest) if rest else None)
    engines = {"atb": atb.TransformerInfer(model, max_seq_len=prompt + new, max_batch_size=1, quantize=native)}
    if with_float:
        engines["atb float"] = atb.TransformerInfer(model, max_seq_len=prompt + new, max_batch_size=1)
    ids = torch.randint(17, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    for e in engines.values():
        e.generate([ids], max_new_tokens=4, eos_token_id=[])  # warm-up: thread pool, cache pages
    rates = {label: [] for label in (*engines, *(["llama.cpp"] if llama else []))}
    for _ in range(repeats):
        for label, e in engines.items():
            rates[label].append(_engine_rates(e, ids, new))
        if llama:
            rates["llama.cpp"].append(llama_bench(llama, path, prompt, new, threads))
    med = {label: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
           for label, rs in rates.items()}
    return {"file": os.path.basename(path), "tensors": tensor_types(native.report),
            "weights_mb": native.nbytes() / 1e6,
            **{f"{label} prefill tok/s": v[0] for label, v in med.items()},
            **{f"{label} decode tok/s": v[1] for label, v in med.items()}}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m atb.bench.gguf", description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="GGUF files (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH",
                    help="llama.cpp's llama-bench binary: run it on the same files in the same rounds")
    ap.add_argument("--float", action="store_true", help="also the model with float bf16 weights")
    ap.add_argument("--rest", default=None, metavar="FORMAT",
                    help="quantize tensors of types with no native form to FORMAT (w8a16, w4a16, -gN suffix: "
                         "quantize='native+FORMAT'); default: they stay float")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    add_table_or_json_args(ap)  # --threads (llama-bench's -t too) and --json
    args = ap.parse_args(argv)
    for f in args.files:
        if not os.path.isfile(f):
            ap.error(f"no such GGUF file: {f}")
    if args.llama_bench and not os.access(args.llama_bench, os.X_OK):
        ap.error(f"--llama-bench {args.llama_bench}: not an executable file")
    if args.rest:
        from atb.quant.engine import parse_spec

        try:
            parse_spec(args.rest)
        except ValueError as e:
            ap.error(f"--rest: {e}")
    if args.prompt < 1 or args.new < 2 or args.repeats < 1:
        ap.error("--prompt >= 1, --new >= 2 and --repeats >= 1")
    import atb

    apply_threads(args.threads)
    threads = atb.get_num_threads()
    info = atb.build_info()
    if not args.json:
        print(f"# {info['processor']}, {threads} threads, isa {info['isa']}; batch 1, {args.prompt}-token prompt, "
              f"{args.new} new tokens, medians of {args.repeats} interleaved rounds")
    results = []
    for f in args.files or [None]:
        r = bench_file(f, llama=args.llama_bench, with_float=args.float, prompt=args.prompt, new=args.new,
                       repeats=args.repeats, threads=threads, rest=args.rest)
        results.append(r)
        if not args.json:
            print(f"{r['file']}: {r['weights_mb']:.1f} MB of weights; {r['tensors']}")
            for label in ("atb", "atb float", "llama.cpp"):
                if f"{label} decode tok/s" in r:
                    print(f"    {label:10s} prefill {r[f'{label} prefill tok/s']:8.1f} tok/s   "
                          f"decode {r[f'{label} decode tok/s']:7.1f} tok/s")
            if "llama.cpp decode tok/s" in r:
                print(f"    atb / llama.cpp: prefill {r['atb prefill tok/s'] / r['llama.cpp prefill tok/s']:.2f}x, "
                      f"decode {r['atb decode tok/s'] / r['llama.cpp decode tok/s']:.2f}x")
    return json_results(results, args.json)


if __name__ == "__main__":
    main()
