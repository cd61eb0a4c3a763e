"""Thread pool and build information of the native core."""
from __future__ import annotations

import contextlib
import os
import platform
import threading

import torch

from atb import _C, soc


def get_num_threads() -> int:
    """Threads the kernels' logical cores run on (the caller's thread included)."""
    return int(_C.get_num_threads())


def set_num_threads(n: int) -> None:
    """Sets the kernel thread pool size (default: ``torch.get_num_threads()`` at import)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"set_num_threads: n must be a positive int, got {n!r}")
    _C.set_num_threads(n)
    soc._forget_host()


def set_isa(isa: str) -> None:
    """Forces a SIMD path: ``"auto"`` (the fastest this CPU runs, from CPUID), ``"avx512-amx"`` (AVX512-BF16
    with the bf16 prefill GEMM on AMX tiles), ``"avx512"``, ``"avx2"``, ``"portable"``, or the test-only
    ``"avx512-simde"`` (the AVX-512 code built against SIMDe, which runs on any CPU) and ``"avx512-amx-simde"``
    (that, with the AMX GEMM over an emulation of the tiles); ValueError when this CPU or build cannot run it (``available_isas()`` lists those that can)."""
    if not isinstance(isa, str):
        raise TypeError(f"set_isa: isa must be a str, got {type(isa).__name__}")
    _C.set_isa(isa)


def available_isas() -> list[str]:
    """The SIMD tables this CPU and build can run, fastest native first (the SIMDe tables last, if built)."""
    return _C.available_isas().split()


_MAX_STREAM_PREFETCH_KB = 1 << 20


def stream_prefetch_kb() -> int:
    """KiB ahead that the batch-1 decode GEMV (the rows4 copies' one stream per core) prefetches its weights into
    L2; 0: the hardware prefetcher alone. Default: ``ATB_STREAM_PREFETCH_KB`` if set, else by CPU vendor (16 on
    Intel, where it measured 0.8x the bf16 decode step, 0 elsewhere); :func:`set_stream_prefetch_kb` changes it."""
    return int(_C.stream_prefetch_bytes()) // 1024


def set_stream_prefetch_kb(kb: int | None) -> None:
    """Sets :func:`stream_prefetch_kb` (0 to 1048576 KiB); ``None`` restores the default. Only speed changes,
    never a result."""
    if kb is None:
        _C.set_stream_prefetch_bytes(-1 if _env_prefetch_kb is None else _env_prefetch_kb * 1024)
        return
    if not isinstance(kb, int) or isinstance(kb, bool) or not 0 <= kb <= _MAX_STREAM_PREFETCH_KB:
        raise ValueError(f"set_stream_prefetch_kb: kb must be an int in [0, {_MAX_STREAM_PREFETCH_KB}] or None, "
                         f"got {kb!r}")
    _C.set_stream_prefetch_bytes(kb * 1024)


def fp32_decode_copy() -> bool:
    """Whether the fp32 decode GEMV at 1 or 2 rows of x reads the decode graph's rows4 copy of the weights (one
    front-to-back stream per core) rather than the weights as they lie (4 runs of rows per core, each run's next
    rows requested into L1); a decode graph built while it is off keeps copies only of the weights its batch
    steps read from one. Default: ``ATB_FP32_DECODE_COPY`` (``0`` or ``1``) if set, else by CPU vendor (off on
    Intel, where reading as they lie measured 0.87x the SmolLM2 fp32 decode step, on elsewhere);
    :func:`set_fp32_decode_copy` changes it."""
    return bool(_C.fp32_decode_copy())


def set_fp32_decode_copy(on: bool | None) -> None:
    """Sets :func:`fp32_decode_copy`; ``None`` restores the default. Only speed (and, for graphs built after it,
    the copies' memory) changes, never a result: a step reads a copy where its graph has one and the setting is
    on, the weights as they lie otherwise."""
    if on is None:
        _C.set_fp32_decode_copy(-1 if _env_fp32_copy is None else int(_env_fp32_copy))
        return
    if not isinstance(on, bool):
        raise ValueError(f"set_fp32_decode_copy: on must be True, False or None, got {on!r}")
    _C.set_fp32_decode_copy(int(on))


def set_threading(backend: str) -> None:
    """Where kernel launches get their threads.

    ``"openmp"``: the OpenMP team torch already loaded, so torch ops and kernels share one set of threads
    (two sets on the same cores make each other's workers spin on the cores the other needs);
    ``"pool"``: a private persistent pool; ``"auto"`` (default): openmp when torch's runtime is loaded.
    """
    if backend not in ("auto", "openmp", "pool"):
        raise ValueError(f"set_threading: backend must be 'auto', 'openmp' or 'pool', got {backend!r}")
    _C.set_threading(backend)


def build_info() -> dict:
    """Which SIMD path is active (and which could be), what the CPU offers, the pool size, and how linears are
    routed (the mode and the decisions measured so far on this machine)."""
    from atb.kernels.linear import measured_decisions, routing_cache_path, routing_mode

    return {
        "isa": _C.isa(),
        "available_isas": available_isas(),
        "cpu_features": _C.cpu_features(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "num_threads": get_num_threads(),
        "threading": _C.threading(),
        "stream_prefetch_kb": stream_prefetch_kb(),
        "fp32_decode_copy": fp32_decode_copy(),
        # Whether batch decode's packed-x GEMM reads fp32 weights' rows4 copy for rows under 16 KiB (by CPU
        # vendor: on for Intel; see Fp32BatchReadsCopy in csrc/ascendc/simd.h).
        "fp32_batch_copy": bool(_C.fp32_batch_copy()),
        "torch": torch.__version__,
        "default_soc": soc.default_soc(),
        "routing": {"mode": routing_mode(), "cache": routing_cache_path(), "measured": measured_decisions()},
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_C.set_num_threads(max(1, torch.get_num_threads()))
# ATB_ISA forces a table; a name this machine cannot run fails here, at import, rather than silently running
# another table (the native selector falls back to the fastest one).
if os.environ.get("ATB_ISA", "auto") not in ("", "auto"):
    try:
        set_isa(os.environ["ATB_ISA"])
    except ValueError as e:
        raise ValueError(f"ATB_ISA={os.environ['ATB_ISA']}: {e}") from None


def _stream_prefetch_kb_from_env() -> int | None:
    """ATB_STREAM_PREFETCH_KB, checked (None: unset); a bad value fails at import, as ATB_ISA's does."""
    value = os.environ.get("ATB_STREAM_PREFETCH_KB", "")
    if not value:
        return None
    if not (value.isdigit() and int(value) <= _MAX_STREAM_PREFETCH_KB):
        raise ValueError(f"ATB_STREAM_PREFETCH_KB={value!r}: expected an int in [0, {_MAX_STREAM_PREFETCH_KB}] "
                         "(KiB the batch-1 decode GEMV prefetches ahead)")
    return int(value)


_env_prefetch_kb = _stream_prefetch_kb_from_env()
set_stream_prefetch_kb(None)


def _fp32_decode_copy_from_env() -> bool | None:
    """ATB_FP32_DECODE_COPY, checked (None: unset); a bad value fails at import."""
    value = os.environ.get("ATB_FP32_DECODE_COPY", "")
    if not value:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"ATB_FP32_DECODE_COPY={value!r}: expected 0 (the fp32 decode GEMV reads weights as they "
                         "lie) or 1 (it reads the decode graph's rows4 copy)")
    return value == "1"


_env_fp32_copy = _fp32_decode_copy_from_env()
set_fp32_decode_copy(None)


@contextlib.contextmanager
def pool_launches_off_main_thread():
    """Under ``"auto"`` threading, the calling thread's launches run on the private pool while inside, if it
    is not the main thread: libgomp's team, driven from another thread, sleeps between launches. The server's
    engine thread steps under it. Zen 4, 2 threads, SmolLM2 bf16 engine prefill (128-token prompts) from a
    worker thread, OpenMP -> pool, medians of 5 interleaved runs: batch 1 731 -> 858 tok/s, batch 16 1120 ->
    1251 (from the main thread mixed, 945 -> 998 and 1264 -> 1182: it stays on OpenMP)."""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    saved = _C.set_thread_prefers_pool(True)
    try:
        yield
    finally:
        _C.set_thread_prefers_pool(saved)

