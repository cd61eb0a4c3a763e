"""Weight-only quantization (W8A16 / W4A16) and GGUF checkpoints at their own precision.

* :class:`QuantizedWeight` and the formats: :mod:`atb.quant.formats` (README "Quantized weights").
* :func:`quantize` converts a float weight, or every projection (and the embedding / LM head)
  of a model, to a format; :func:`dequantize` gives float back.
* :mod:`atb.quant.gguf` loads GGUF Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K / Q6_K tensors straight into these formats.
* :func:`set_isa` / :func:`isa_paths`: the quantized kernels' SIMD path (AVX-512, AVX2, portable).
"""
from __future__ import annotations

from atb import _C
from atb.quant.formats import (FORMATS, GROUP_SIZES, QuantizedWeight, dequantize_reference, pack_int4,
                               quantize_weight, unpack_int4)
from atb.quant.api import dequantize, quantize

_ISAS = ("avx512-i16", "avx512", "avx2", "portable", "avx512-i16-simde")


def set_isa(isa: str) -> None:
    """Forces the quantized kernels' SIMD path: 'auto' (CPUID), 'avx512-i16', 'avx512', 'avx2', 'portable' or
    the test-only 'avx512-i16-simde' (the AVX2 table with the AVX512-VNNI W4 GEMV built against SIMDe, which
    runs that GEMV's logic on a CPU without AVX-512; present when the build found SIMDe).

    'avx512-i16' (auto's pick where the CPU runs AVX-512 and AVX2) is the AVX-512 table with int16 GEMVs
    for 16-bit activations, measured faster than its own bf16 route for W4: the AVX2 table's for W8, and for
    W4 the AVX512-VNNI one where the CPU has it (else the AVX2 table's).
    The environment variable ``ATB_QUANT_ISA`` does the same at start-up.
    """
    if isa not in ("auto",) + _ISAS:
        raise ValueError(f"quant.set_isa: isa must be 'auto', {', '.join(repr(i) for i in _ISAS)}, got {isa!r}")
    _C.quant_set_isa(isa)


def isa() -> str:
    """The quantized kernels' active SIMD path."""
    return _C.quant_isa()


def isa_paths() -> list[str]:
    """The SIMD paths this CPU can run, fastest first, then 'avx512-i16-simde' where built (tests run every one)."""
    return list(_C.quant_isa_paths())


__all__ = ["QuantizedWeight", "quantize", "quantize_weight", "dequantize", "dequantize_reference", "pack_int4",
           "unpack_int4", "FORMATS", "GROUP_SIZES", "set_isa", "isa", "isa_paths"]
