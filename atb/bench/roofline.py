"""Shared benchmark utilities: a timing helper and the memory-bandwidth roofline.

The API (reuse it; keep benchmarks comparable):

* :func:`time_us` -- median microseconds per call of ``fn()``, after warm-up, each sample
  batching enough calls to last ``min_sample_us`` so timer resolution does not matter.
* :func:`time_us_many` -- the same for several candidates (e.g. stock vs fused), samples taken
  in turns so the load of a shared machine falls on every candidate alike; use it for ratios.
* :func:`stream_read_gbps` -- streaming-read memory bandwidth of this machine in GB/s, measured
  now (median of repeats) by a native read loop over a buffer far larger than the L3, on every
  kernel thread, with the SIMD table's widest loads in 4 interleaved runs per thread (the fastest
  plain read measured). Divide a kernel's achieved GB/s by it for the fraction of the roofline
  (:func:`achieved_gbps` turns bytes moved and µs into GB/s).
* :func:`generate_rates` -- prefill and decode tok/s from a one-token and an n-token generate.
* :func:`decode_step_bytes` / :func:`kv_bytes` -- what one decode step must read (the weights it
  streams and the K/V history): the numerator of every decode roofline, defined once.
* :func:`keep_freed_memory` -- call once before timing: stops glibc from handing large freed
  blocks back to the OS, so a fresh output tensor does not page-fault on every call.
* :func:`kernel_bench_parser` / :func:`apply_threads` / :func:`bench_clock` -- the command line
  (``--repeat --quick --threads --cpu-time``) and clock every kernel benchmark shares.
* :func:`add_table_or_json_args` / :func:`print_table_head` / :func:`json_results` -- the
  ``--threads`` / ``--json`` options and output of the end-to-end benchmarks that print a table
  row by row or, with ``--json``, their results at the end.

The machine is shared and noisy: compare ratios measured in one run, never absolute numbers
across runs.
"""
from __future__ import annotations

import argparse
import json
import ctypes
import ctypes.util
import statistics
import time
from typing import Callable

import torch

import atb
from atb import _C, hugepages

_BANDWIDTH_BUFFER_BYTES = 256 << 20  # 8x a 32 MiB L3: every pass comes from DRAM


def time_us(fn: Callable[[], object], *, repeat: int = 15, warmup: int = 3, min_sample_us: float = 2000.0,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Median wall time of one ``fn()`` call in microseconds.

    ``warmup`` calls run first (allocator, caches, thread pool). Each of the ``repeat`` samples then
    runs ``fn`` back to back as many times as needed to last about ``min_sample_us``; the median over
    samples is divided by that count. ``clock`` is wall time by default; ``time.thread_time`` counts
    only this thread's CPU time, immune to being descheduled on a busy machine, but valid only when
    all the work runs on the calling thread (torch and atb set to one thread).
    """
    return time_us_many([fn], repeat=repeat, warmup=warmup, min_sample_us=min_sample_us, clock=clock)[0]


def time_us_many(fns, *, repeat: int = 15, warmup: int = 3, min_sample_us: float = 2000.0,
                 clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median µs per call of each function in ``fns``, like :func:`time_us`, with samples interleaved.

    Round r times sample r of every candidate back to back, so a burst of load from other processes
    lands on all of them rather than on whichever happened to be running.
    """
    inner = []
    for fn in fns:
        for _ in range(max(0, warmup)):
            fn()
        t0 = clock()
        fn()
        inner.append(max(1, int(min_sample_us * 1e-6 / max(clock() - t0, 1e-7))))
    samples = [[] for _ in fns]
    for _ in range(max(1, repeat)):
        for fn, n, out in zip(fns, inner, samples):
            t0 = clock()
            for _ in range(n):
                fn()
            out.append((clock() - t0) / n)
    return [statistics.median(s) * 1e6 for s in samples]


def median_seconds(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of single ``fn()`` calls after ``warmup`` calls: for long calls (a whole
    ``generate``) where batching calls as :func:`time_us` does is not needed."""
    for _ in range(max(0, warmup)):
        fn()
    samples = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def stream_read_gbps(nbytes: int = _BANDWIDTH_BUFFER_BYTES, *, repeat: int = 9) -> float:
    """Streaming-read bandwidth in GB/s (1e9 bytes/s): median over ``repeat`` full reads of ``nbytes``.

    The buffer lies in the memory the engine's weights do: 2 MiB huge pages where `atb.hugepages` moves weights
    there (reads run faster in them, so the roofline is measured there too), else ordinary pages."""
    buf = hugepages.empty((max(1, nbytes // 8),), torch.int64).fill_(1)  # written once: every page resident
    size = buf.numel() * 8
    us = time_us(lambda: _C.stream_read(buf.data_ptr(), size), repeat=repeat, warmup=1, min_sample_us=0.0)
    return size / (us * 1e-6) / 1e9


def generate_rates(t1: float, tn: float, batch: int, prompt_len: int, n: int) -> tuple[float, float]:
    """Prefill and decode tok/s from two generates of ``batch`` prompts of ``prompt_len`` tokens: one of a single new
    token (``t1`` s, the prefill) and one of ``n`` (``tn`` s); decode is the n - 1 later steps over the difference."""
    prefill = batch * prompt_len / t1
    # With very few new tokens the difference drowns in noise: report NaN, not nonsense.
    decode = batch * (n - 1) / (tn - t1) if tn > 1.05 * t1 else float("nan")
    return prefill, decode


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes(config, batch: int, context: int, element_size: int) -> int:
    """K and V bytes of ``batch`` sequences of ``context`` positions each: what one decode step's attention reads."""
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * _head_dim(config) * element_size
    return per_position * batch * context


def decode_step_bytes(model, batch: int = 1, context: int = 0) -> int:
    """Bytes one decode step of the HF ``model`` must read: every weight once, except an input embedding table
    that is not also the LM head (a step reads one row of it per sequence), plus the K/V of ``batch`` sequences
    of ``context`` positions in the weights' dtype."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb or emb is head)
    return weights + kv_bytes(model.config, batch, context, emb.element_size())


def decode_token_flops(model, context: int = 0) -> int:
    """FLOPs (2 per multiply-add) one sequence's decode step does in the HF ``model``: every linear weight once,
    the LM head included (a tied table counts there), and attention's q.k and p.v over ``context`` positions per
    query head. At batch 16 a step is compute-bound on a CPU without a bf16 dot product, so this over the GEMM
    peak, not bytes over bandwidth, is its roofline."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    attention = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * _head_dim(cfg) * context
    return 2 * (linear + attention)


def achieved_gbps(bytes_moved: int, us: float) -> float:
    """GB/s of a kernel that moved ``bytes_moved`` (read + written) in ``us`` microseconds."""
    return bytes_moved / (us * 1e-6) / 1e9


def keep_freed_memory() -> bool:
    """Makes glibc keep freed memory for reuse (as jemalloc/tcmalloc do); returns whether it applied.

    glibc serves blocks of 32 MiB and more with mmap and unmaps them on free, so every fresh
    2048x4096 fp32 output page-faults all over again: 8192 faults, tens of ms on this VM, more than
    the kernel itself. With mmap off and trimming off, freed blocks are reused. Stock torch code and
    atb allocate through the same allocator, so both sides benefit alike. Process-wide; for
    benchmarks only.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 40))
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to tune
        return False


def gemm_gflops(dtype: torch.dtype = torch.float32, n: int = 1024, *, repeat: int = 5) -> float:
    """Peak GEMM throughput in GFLOP/s for ``dtype``, measured now with torch.matmul on n x n x n.

    A 16-bit GEMM can always run at the fp32 FMA rate by widening its operands (atb's GEMM does), so for
    fp16/bf16 this is the larger of torch's rate in that dtype (AVX512-BF16 or AMX make it the faster one)
    and in fp32 (on AVX2 torch's own bf16 GEMM runs at a tenth of it, which would be no ceiling at all)."""
    def rate(dt):
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        us = time_us(lambda: torch.matmul(a, b), repeat=repeat, warmup=1, min_sample_us=0.0)
        return 2 * n**3 / (us * 1e-6) / 1e9

    return rate(dtype) if dtype == torch.float32 else max(rate(dtype), rate(torch.float32))


class Machine:
    """This machine's limits, measured in the run that uses them: streaming-read bandwidth
    (bytes/s) and GEMM peak (FLOP/s) for one dtype. A kernel's roofline time is
    ``max(bytes / bandwidth, flops / gemm_peak)``."""

    def __init__(self, bandwidth: float, gemm_peak: float, dtype: torch.dtype):
        self.bandwidth, self.gemm_peak, self.dtype = bandwidth, gemm_peak, dtype

    @classmethod
    def measure(cls, dtype: torch.dtype) -> "Machine":
        return cls(stream_read_gbps() * 1e9, gemm_gflops(dtype) * 1e9, dtype)

    def floor_seconds(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.gemm_peak)

    def bound(self, nbytes: float, flops: float) -> str:
        return "compute" if flops / self.gemm_peak > nbytes / self.bandwidth else "memory"


def kernel_bench_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A kernel benchmark's parser: ``--repeat``, ``--quick``, ``--threads``, ``--cpu-time``."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--repeat", type=int, default=15, help="timed samples per measurement (median taken)")
    p.add_argument("--quick", action="store_true", help="shorter samples and bandwidth probe (smoke run)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both torch and atb (default: as configured, torch's count)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this thread's CPU time (needs --threads 1): steadier on a busy shared machine")
    return p


def apply_threads(threads: int | None) -> None:
    """``--threads``: the same count for torch and atb (None keeps both)."""
    if threads is not None:
        torch.set_num_threads(threads)
        atb.set_num_threads(threads)


def add_table_or_json_args(p: argparse.ArgumentParser) -> None:
    """``--threads`` (see :func:`apply_threads`) and ``--json`` (the results as JSON instead of the table)."""
    p.add_argument("--threads", type=int, default=None, help="torch and atb thread count (default: as set)")
    p.add_argument("--json", action="store_true")


def print_table_head(title: str, head: str) -> None:
    """A table's title line, column heads and rule (flushed: the rows follow as they are measured)."""
    print(title)
    print(head)
    print("-" * len(head), flush=True)


def json_results(results: list[dict], as_json: bool) -> list[dict]:
    """``results``, printed as JSON first under ``--json``."""
    if as_json:
        print(json.dumps(results, indent=1))
    return results


def bench_clock(cpu_time: bool):
    """Thread CPU time (steadier on a busy machine, needs one thread everywhere) or wall time."""
    if cpu_time and (torch.get_num_threads() != 1 or atb.get_num_threads() != 1):
        raise SystemExit("--cpu-time needs --threads 1: thread CPU time misses work done on other threads")
    return time.thread_time if cpu_time else time.perf_counter


def print_end_bandwidth(bw: float, quick: bool) -> None:
    """Measures the streaming read again after a table, so drift from the load of other processes shows."""
    end_bw = stream_read_gbps(repeat=3 if quick else 9)
    print(f"streaming read measured again at the end: {end_bw:.1f} GB/s (% bw above uses the first, {bw:.1f} GB/s)")
