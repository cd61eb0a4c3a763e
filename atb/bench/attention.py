"""Attention kernels vs torch SDPA.

Run: ``python -m atb.bench.attention [--repeat N] [--quick] [--threads N] [--cpu-time] [--section prefill|decode|all]``.

Prefill (:func:`bench_prefill`): ``atb.kernels.flash_attention`` on one causal
sequence of S tokens (``[S, H, D]``) against
``torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``
on ``[1, H, S, D]``, each in its natural layout, samples taken in turns. GFLOP/s
counts the products over the visible (causal) pairs only: 4 * D * H * S(S+1)/2; "of peak" is atb's
GFLOP/s as a fraction of the dtype's GEMM peak (torch.matmul 2048^3, the best of three medians measured at the
start of the same run):
attention can only beat SDPA by as much as SDPA leaves of that peak.

Decode (:func:`bench_decode`): ``atb.kernels.paged_attention``, one query per
sequence over a paged KV cache (block_size 128, random non-monotonic block
table), against ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)``
over the same K/V already gathered contiguous ``[batch, kv_heads, ctx, head_dim]``
(the gather is not timed). Several cache copies are cycled so the K/V working
set (>= 96 MiB, 3x the L3) comes from DRAM on every call, as in a decode step
where the other layers' weights evicted this layer's cache. Prints the median
µs per call of both, the speedup, the K/V bytes read per second and that as a
percentage of the streaming-read bandwidth measured at the start of the same
run. SDPA and atb samples are taken in turns so load from other processes hits
both alike.
"""
from __future__ import annotations

import gc

import torch

import atb
from atb.bench.roofline import (achieved_gbps, apply_threads, bench_clock, gemm_gflops, keep_freed_memory,
                                kernel_bench_parser, print_end_bandwidth, stream_read_gbps, time_us_many)

PREFILL_SHAPES = ((9, 3, 64), (32, 8, 128))  # (heads, kv_heads, head_dim): SmolLM2-135M, Llama-8B-like
PREFILL_SEQS = (512, 2048)
DECODE_SHAPES = ((32, 8, 128), (9, 3, 64))  # (heads, kv_heads, head_dim): Llama-8B-like, SmolLM2-135M
BLOCK_SIZE = 128


def _decode_case(batch, ctx, heads, kv_heads, head_dim, dtype, working_set, repeat, sample_us, clock):
    blocks_per_seq = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    kv_bytes = batch * ctx * kv_heads * head_dim * 2 * dtype.itemsize
    copies = max(1, working_set // kv_bytes)
    num_blocks = batch * blocks_per_seq
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32)
    pos = torch.arange(ctx)
    paged, dense = [], []
    for _ in range(copies):
        kc = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim).to(dtype)
        vc = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim).to(dtype)
        bt = torch.randperm(num_blocks).view(batch, blocks_per_seq).int()
        paged.append((kc, vc, bt))
        blk, off = bt.long()[:, pos // BLOCK_SIZE], pos % BLOCK_SIZE
        dense.append((kc[blk, off].transpose(1, 2).contiguous(), vc[blk, off].transpose(1, 2).contiguous()))
    q = torch.randn(batch, heads, head_dim).to(dtype)
    q4 = q.unsqueeze(2)

    def run_atb():
        for kc, vc, bt in paged:
            atb.kernels.paged_attention(q, kc, vc, bt, ctx_lens)

    def run_sdpa():
        for k, v in dense:
            torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    # Same answer first (fp32 accumulation on both sides; bf16 outputs differ by an ulp or so).
    out = atb.kernels.paged_attention(q, *paged[0], ctx_lens).float()
    ref = torch.nn.functional.scaled_dot_product_attention(q4, *dense[0], enable_gqa=True).squeeze(2).float()
    diff = (out - ref).abs().max().item()
    t_sdpa, t_atb = (t / copies for t in time_us_many((run_sdpa, run_atb), repeat=repeat, min_sample_us=sample_us,
                                                                   clock=clock))
    return dict(dtype=str(dtype).removeprefix("torch."), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                batch=batch, ctx=ctx, sdpa_us=t_sdpa, atb_us=t_atb, speedup=t_sdpa / t_atb, bytes=kv_bytes,
                atb_gbps=achieved_gbps(kv_bytes, t_atb), sdpa_gbps=achieved_gbps(kv_bytes, t_sdpa), max_diff=diff)


def bench_decode(contexts=(512, 2048, 8192), batches=(1, 16), shapes=DECODE_SHAPES,
                 dtypes=(torch.float32, torch.bfloat16), *, repeat: int = 15, quick: bool = False,
                 cpu_time: bool = False, working_set: int = 96 << 20) -> list[dict]:
    """paged_attention decode vs SDPA over the same K/V, one printed row per configuration.

    cpu_time: time with the calling thread's CPU time (steadier on a busy machine; needs one thread
    for torch and atb, since it misses work done on other threads).
    """
    clock = bench_clock(cpu_time)
    sample_us = 500.0 if quick else 2000.0
    bw = stream_read_gbps(repeat=3 if quick else 9)
    print(f"decode: paged_attention (block_size {BLOCK_SIZE}) vs SDPA(enable_gqa) over pre-gathered K/V | "
          f"measured streaming read {bw:.1f} GB/s | clock: {'thread CPU time' if cpu_time else 'wall'}")
    head = (f"{'dtype':<9} {'H/KH/D':<9} {'batch':>5} {'ctx':>5} {'sdpa µs':>9} {'atb µs':>9} {'speedup':>8} "
            f"{'KV MB':>7} {'sdpa GB/s':>9} {'atb GB/s':>8} {'% bw':>5} {'max|diff|':>9}")
    print(head)
    print("-" * len(head))
    rows = []
    with torch.inference_mode():
        for dtype in dtypes:
            for heads, kv_heads, head_dim in shapes:
                for batch in batches:
                    for ctx in contexts:
                        r = _decode_case(batch, ctx, heads, kv_heads, head_dim, dtype, working_set, repeat, sample_us,
                                         clock)
                        r["pct_bw"] = 100 * r["atb_gbps"] / bw
                        rows.append(r)
                        print(f"{r['dtype']:<9} {f'{heads}/{kv_heads}/{head_dim}':<9} {batch:>5} {ctx:>5} "
                              f"{r['sdpa_us']:>9.1f} {r['atb_us']:>9.1f} {r['speedup']:>7.2f}x {r['bytes'] / 1e6:>7.1f} "
                              f"{r['sdpa_gbps']:>9.1f} {r['atb_gbps']:>8.1f} {r['pct_bw']:>4.0f}% {r['max_diff']:>9.1e}",
                              flush=True)
                        gc.collect()
    print_end_bandwidth(bw, quick)
    return rows


def bench_prefill(seqs=PREFILL_SEQS, shapes=PREFILL_SHAPES, dtypes=(torch.float32, torch.bfloat16), *,
                  repeat: int = 5, cpu_time: bool = False) -> list[dict]:
    """flash_attention prefill vs SDPA(is_causal=True), one printed row per configuration.

    cpu_time: as for :func:`bench_decode` (needs one thread for torch and atb).
    """
    clock = bench_clock(cpu_time)
    print("prefill: flash_attention vs SDPA(is_causal=True, enable_gqa=True), one causal sequence of S tokens | "
          f"clock: {'thread CPU time' if cpu_time else 'wall'}")
    # (the best of three medians: a shared machine's load only ever lowers a peak)
    peaks = {dtype: max(gemm_gflops(dtype, n=2048) for _ in range(3)) for dtype in dtypes}
    print("GEMM peak (torch.matmul 2048^3): " + ", ".join(f"{str(d).removeprefix('torch.')} {p:.0f} GFLOP/s"
                                                          for d, p in peaks.items()))
    head = (f"{'dtype':<9} {'H/KH/D':<9} {'S':>5} {'sdpa ms':>9} {'atb ms':>9} {'speedup':>8} "
            f"{'sdpa GF/s':>9} {'atb GF/s':>9} {'of peak':>8} {'max|diff|':>9}")
    print(head)
    print("-" * len(head))
    rows = []
    with torch.inference_mode():
        for dtype in dtypes:
            for heads, kv_heads, head_dim in shapes:
                for s in seqs:
                    q = torch.randn(s, heads, head_dim).to(dtype)
                    k = torch.randn(s, kv_heads, head_dim).to(dtype)
                    v = torch.randn(s, kv_heads, head_dim).to(dtype)
                    cu = torch.tensor([0, s], dtype=torch.int32)
                    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))

                    def run_atb():
                        return atb.kernels.flash_attention(q, k, v, cu)

                    def run_sdpa():
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                                enable_gqa=True)

                    diff = (run_atb().float() - run_sdpa()[0].transpose(0, 1).float()).abs().max().item()
                    t_sdpa, t_atb = time_us_many((run_sdpa, run_atb), repeat=repeat, warmup=1, min_sample_us=0.0,
                                                 clock=clock)
                    flops = 4 * head_dim * heads * s * (s + 1) / 2
                    r = dict(dtype=str(dtype).removeprefix("torch."), heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, seq=s, sdpa_ms=t_sdpa / 1e3, atb_ms=t_atb / 1e3,
                             speedup=t_sdpa / t_atb, sdpa_gflops=flops / t_sdpa / 1e3,
                             atb_gflops=flops / t_atb / 1e3, peak_fraction=flops / t_atb / 1e3 / peaks[dtype],
                             max_diff=diff)
                    rows.append(r)
                    print(f"{r['dtype']:<9} {f'{heads}/{kv_heads}/{head_dim}':<9} {s:>5} {r['sdpa_ms']:>9.2f} "
                          f"{r['atb_ms']:>9.2f} {r['speedup']:>7.2f}x {r['sdpa_gflops']:>9.1f} "
                          f"{r['atb_gflops']:>9.1f} {100 * r['peak_fraction']:>7.0f}% {diff:>9.1e}", flush=True)
                    gc.collect()
    return rows


def main(argv=None) -> None:
    p = kernel_bench_parser("python -m atb.bench.attention", __doc__.split("\n\n")[0])
    p.add_argument("--section", choices=("all", "prefill", "decode"), default="all", help="which benchmark to run")
    args = p.parse_args(argv)
    apply_threads(args.threads)
    torch.manual_seed(0)
    tuned = keep_freed_memory()
    info = atb.build_info()
    print(f"atb attention vs torch SDPA | isa {info['isa']} | {info['num_threads']} threads | "
          f"torch threads {torch.get_num_threads()} | freed memory kept for reuse: {'yes' if tuned else 'no'}")
    if args.section in ("all", "prefill"):
        bench_prefill(seqs=PREFILL_SEQS[:1] if args.quick else PREFILL_SEQS, repeat=3 if args.quick else 5,
                      cpu_time=args.cpu_time)
    if args.section in ("all", "decode"):
        bench_decode(repeat=args.repeat, quick=args.quick, cpu_time=args.cpu_time)


if __name__ == "__main__":
    main()
