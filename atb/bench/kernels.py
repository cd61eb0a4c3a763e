"""Fused elementwise kernels vs the stock torch/HF code they replace.

Run: ``python -m atb.bench.kernels [--repeat N] [--quick] [--threads N] [--cpu-time]``.

For rms_norm, add_rms_norm, rope, silu_mul and swiglu at decode (1 token) and prefill (2048 tokens)
shapes, hidden 576 (SmolLM2: rope 9/3 heads x 64) and 4096 (Llama: rope 32/8 heads x 128), float32
and bfloat16, it prints the median µs of the stock code and of atb, the speedup, the bytes the kernel
must move (inputs read + outputs written), the GB/s that makes, and that as a percentage of the
streaming-read bandwidth measured at the start of the same run. Stock and atb samples are taken in
turns (medians of ``--repeat`` samples each), so load from other processes hits both alike.

Stock code: HF ``LlamaRMSNorm`` forward; ``residual + x`` then ``LlamaRMSNorm``; HF
``apply_rotary_pos_emb`` on HF's ``[1, heads, tokens, head_dim]`` layout; ``F.silu(g) * u``; and
``F.silu(x[..., :n]) * x[..., n:]``.
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import atb
from atb.bench.roofline import (achieved_gbps, apply_threads, bench_clock, keep_freed_memory, kernel_bench_parser,
                                print_end_bandwidth, stream_read_gbps, time_us_many)

ROPE_HEADS = {576: (9, 3, 64), 4096: (32, 8, 128)}
EPS = 1e-5


def _cases(hidden: int, tokens: int, dtype: torch.dtype):
    """(kernel name, shape text, bytes moved, stock fn, atb fn) for one configuration."""
    elt = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(tokens, hidden).to(dtype)
    r = torch.randn(tokens, hidden).to(dtype)
    norm = LlamaRMSNorm(hidden, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    w = norm.weight.detach()
    x3, r3 = x[None], r[None]
    shape = f"{tokens}x{hidden}"
    nbytes = tokens * hidden * elt
    yield "rms_norm", shape, 2 * nbytes + hidden * elt, lambda: norm(x3), lambda: atb.kernels.rms_norm(x, w, EPS)
    yield ("add_rms_norm", shape, 4 * nbytes + hidden * elt, lambda: norm(x3 + r3),
           lambda: atb.kernels.add_rms_norm(x, r, w, EPS))

    heads, kv_heads, d = ROPE_HEADS[hidden]
    q, k = torch.randn(tokens, heads, d).to(dtype), torch.randn(tokens, kv_heads, d).to(dtype)
    freqs = torch.arange(tokens, dtype=torch.float32)[:, None] * torch.rand(d // 2)[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q4, k4 = q.transpose(0, 1).contiguous()[None], k.transpose(0, 1).contiguous()[None]
    cos3, sin3 = cos[None], sin[None]
    rope_bytes = 2 * tokens * (heads + kv_heads) * d * elt + 2 * tokens * d * elt
    yield (f"rope {heads}/{kv_heads}x{d}", f"{tokens} tok", rope_bytes, lambda: apply_rotary_pos_emb(q4, k4, cos3, sin3),
           lambda: atb.kernels.rope(q, k, cos, sin))

    g, u = x, r
    yield "silu_mul", shape, 3 * nbytes, lambda: F.silu(g) * u, lambda: atb.kernels.silu_mul(g, u)
    xu = torch.cat((x, r), dim=-1)
    yield ("swiglu", f"{tokens}x2*{hidden}", 3 * nbytes, lambda: F.silu(xu[..., :hidden]) * xu[..., hidden:],
           lambda: atb.kernels.swiglu(xu))


def run(repeat: int = 15, quick: bool = False, cpu_time: bool = False) -> list[dict]:
    torch.manual_seed(0)
    tuned = keep_freed_memory()
    clock = bench_clock(cpu_time)
    sample_us = 500.0 if quick else 2000.0
    bw = stream_read_gbps(repeat=3 if quick else 9)
    info = atb.build_info()
    print(f"atb kernels vs stock torch/HF | isa {info['isa']} | {info['num_threads']} threads | "
          f"torch threads {torch.get_num_threads()} | measured streaming read {bw:.1f} GB/s | "
          f"freed memory kept for reuse: {'yes' if tuned else 'no (not glibc)'} | "
          f"clock: {'thread CPU time' if cpu_time else 'wall'}")
    head = f"{'kernel':<16} {'dtype':<9} {'shape':<12} {'stock µs':>10} {'atb µs':>10} {'speedup':>8} " \
           f"{'MB moved':>9} {'GB/s':>7} {'% bw':>6}"
    print(head)
    print("-" * len(head))
    rows = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for hidden in (576, 4096):
                for tokens in (1, 2048):
                    for name, shape, nbytes, stock, fused in _cases(hidden, tokens, dtype):
                        t_stock, t_atb = time_us_many((stock, fused), repeat=repeat, min_sample_us=sample_us,
                                                      clock=clock)
                        gbps = achieved_gbps(nbytes, t_atb)
                        row = dict(kernel=name, dtype=str(dtype).removeprefix("torch."), shape=shape,
                                   stock_us=t_stock, atb_us=t_atb, speedup=t_stock / t_atb, bytes=nbytes,
                                   gbps=gbps, pct_bw=100 * gbps / bw)
                        rows.append(row)
                        print(f"{name:<16} {row['dtype']:<9} {shape:<12} {t_stock:>10.1f} {t_atb:>10.1f} "
                              f"{row['speedup']:>7.2f}x {nbytes / 1e6:>9.3f} {gbps:>7.1f} {row['pct_bw']:>5.0f}%",
                              flush=True)
                    gc.collect()
    print_end_bandwidth(bw, quick)
    return rows


def main(argv=None) -> None:
    args = kernel_bench_parser("python -m atb.bench.kernels", __doc__.split("\n\n")[0]).parse_args(argv)
    apply_threads(args.threads)
    run(repeat=args.repeat, quick=args.quick, cpu_time=args.cpu_time)


if __name__ == "__main__":
    main()
