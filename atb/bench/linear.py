"""Benchmark of the decode-shaped linear kernel vs torch.matmul.

Run: ``python -m atb.bench.linear``. Reports the weight bytes streamed per
second (GB/s) for atb.kernels.linear and torch.nn.functional.linear side by
side, and each as a fraction of a streaming-read bandwidth measured in the same
run over a buffer of the same size. Several weight copies are cycled so the
working set (>= 96 MiB) exceeds the L3 and every call reads from DRAM.
"""
from __future__ import annotations

import argparse

import torch

from atb.bench.roofline import median_seconds, stream_read_gbps

import atb


def bench_linear(shapes=((4096, 4096), (1536, 576)), ms=(1, 16), dtypes=(torch.float32, torch.bfloat16),
                 working_set: int = 96 << 20, repeats: int = 15) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for n, k in shapes:
            copies = max(1, working_set // (n * k * dtype.itemsize))
            weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            nbytes = copies * n * k * dtype.itemsize
            bw = stream_read_gbps(nbytes) * 1e9
            for m in ms:
                x = torch.randn(m, k).to(dtype)

                def run_atb():
                    for w in weights:
                        atb.kernels.linear(x, w)

                def run_torch():
                    for w in weights:
                        torch.nn.functional.linear(x, w)

                t_atb = median_seconds(run_atb, repeats)
                t_torch = median_seconds(run_torch, repeats)
                rows.append({
                    "dtype": str(dtype).replace("torch.", ""), "n": n, "k": k, "m": m,
                    "atb_gbs": nbytes / t_atb / 1e9, "torch_gbs": nbytes / t_torch / 1e9,
                    "bandwidth_gbs": bw / 1e9, "atb_us": t_atb / copies * 1e6, "torch_us": t_torch / copies * 1e6,
                    "speedup": t_torch / t_atb, "atb_roofline": nbytes / t_atb / bw,
                })
    return rows


def crossover(k: int = 576, n: int = 1536, dtype=torch.float32, ms=(1, 2, 4, 8, 16, 24, 32, 48, 64, 128)) -> list[dict]:
    """Time per call of atb.kernels.linear and torch.nn.functional.linear over M (cache-warm weight)."""
    w = torch.randn(n, k).to(dtype)
    out = []
    for m in ms:
        x = torch.randn(m, k).to(dtype)
        t_atb = median_seconds(lambda: atb.kernels.linear(x, w), 30)
        t_torch = median_seconds(lambda: torch.nn.functional.linear(x, w), 30)
        out.append({"m": m, "atb_us": t_atb * 1e6, "torch_us": t_torch * 1e6, "native_wins": t_atb < t_torch})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m atb.bench.linear", description=__doc__.split("\n\n")[0])
    p.parse_args(argv)
    print(f"threads={atb.get_num_threads()}  isa={atb.build_info()['isa']}")
    print(f"{'dtype':9s} {'N x K':>11s} {'M':>3s} {'atb GB/s':>9s} {'torch GB/s':>10s} {'speedup':>8s} "
          f"{'read BW':>8s} {'atb %BW':>8s} {'atb us':>8s}")
    for r in bench_linear():
        print(f"{r['dtype']:9s} {r['n']:>5d}x{r['k']:<5d} {r['m']:>3d} {r['atb_gbs']:9.1f} {r['torch_gbs']:10.1f} "
              f"{r['speedup']:7.2f}x {r['bandwidth_gbs']:8.1f} {100 * r['atb_roofline']:7.0f}% {r['atb_us']:8.0f}")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"crossover 576x1536 {str(dtype).replace('torch.', '')}: " + "  ".join(
            f"M={c['m']}: {c['atb_us']:.0f}/{c['torch_us']:.0f}us" for c in crossover(dtype=dtype)))


if __name__ == "__main__":
    main()
