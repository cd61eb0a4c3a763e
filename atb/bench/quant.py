"""Benchmark of the quantized GEMV (decode) kernels: W8A16 and W4A16 against bf16.

Run: ``python -m atb.bench.quant [--quick] [--m 1 16]``. For each weight shape of SmolLM2-135M
and TinyLlama-1.1B and each format, reports µs per GEMV, the weight bytes it streams (packed
values + scales + mins), the achieved GB/s, and that as a fraction of the streaming-read
bandwidth measured in the same run. Enough copies of each weight are cycled that the working
set (>= 2x the 32 MiB L3 of this machine class) comes from DRAM, as in a whole-model decode
step. Activations are bf16; the formats' kernels run on the ISA path shown.
"""
from __future__ import annotations

import argparse

import torch

import atb
from atb.bench.roofline import keep_freed_memory, median_seconds, stream_read_gbps
from atb.quant import quantize_weight

# (label, N, K): the projections of one decoder layer and the LM head.
SHAPES = {
    "smollm2": [("q/o 576x576", 576, 576), ("gate/up 1536x576", 1536, 576), ("down 576x1536", 576, 1536),
                ("lm_head 49152x576", 49152, 576)],
    "tinyllama": [("q/o 2048x2048", 2048, 2048), ("gate/up 5632x2048", 5632, 2048), ("down 2048x5632", 2048, 5632),
                  ("lm_head 32000x2048", 32000, 2048)],
}
FORMATS = [("bf16", None, None), ("w8a16", "w8a16", 0), ("w4a16 g32", "w4a16", 32), ("w4a16 g128", "w4a16", 128)]


def _weight(kind, fmt, group, n, k):
    w = torch.randn(n, k) * k ** -0.5
    if kind == "bf16":
        return w.bfloat16(), n * k * 2
    q = quantize_weight(w, fmt, group)
    return q, q.nbytes


def bench_quant(models=("smollm2", "tinyllama"), ms=(1,), working_set: int = 64 << 20, repeats: int = 7,
                quick: bool = False) -> list[dict]:
    keep_freed_memory()
    bw = stream_read_gbps()
    rows = []
    for model in models:
        shapes = SHAPES[model][1:3] if quick else SHAPES[model]
        for label, n, k in shapes:
            for kind, fmt, group in FORMATS:
                one, nbytes = _weight(kind, fmt, group, n, k)
                copies = max(1, working_set // nbytes)
                weights = [one] + [_weight(kind, fmt, group, n, k)[0] for _ in range(copies - 1)]
                for m in ms:
                    x = torch.randn(m, k).bfloat16()

                    def run():
                        for w in weights:
                            atb.kernels.linear(x, w)

                    us = median_seconds(run, repeats) / copies * 1e6
                    gbps = nbytes / (us * 1e-6) / 1e9
                    rows.append(dict(model=model, shape=label, format=kind, m=m, us=us, bytes=nbytes, gbps=gbps,
                                     roofline=gbps / bw, bandwidth=bw))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m atb.bench.quant", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes per model, fewer repeats")
    p.add_argument("--m", type=int, nargs="+", default=[1], help="rows of x (decode batch)")
    p.add_argument("--models", nargs="+", default=["smollm2", "tinyllama"], choices=sorted(SHAPES))
    a = p.parse_args(argv)
    info = atb.build_info()
    print(f"# {info['processor']}, {info['num_threads']} threads; quantized kernels: {atb.quant.isa()} "
          f"(paths {', '.join(atb.quant.isa_paths())}); CPU features: {info['cpu_features']}")
    rows = bench_quant(a.models, tuple(a.m), repeats=3 if a.quick else 7, quick=a.quick)
    print(f"# streaming read: {rows[0]['bandwidth']:.1f} GB/s (the roofline)")
    print(f"{'model':10} {'shape':20} {'format':11} {'M':>3} {'us':>9} {'MB':>8} {'GB/s':>7} {'roofline':>8} {'vs bf16':>7}")
    base = {}
    for r in rows:
        key = (r["model"], r["shape"], r["m"])
        if r["format"] == "bf16":
            base[key] = r["us"]
        speed = base.get(key, r["us"]) / r["us"]
        print(f"{r['model']:10} {r['shape']:20} {r['format']:11} {r['m']:>3} {r['us']:9.1f} {r['bytes'] / 1e6:8.2f} "
              f"{r['gbps']:7.1f} {r['roofline']:8.0%} {speed:6.2f}x")


if __name__ == "__main__":
    main()
