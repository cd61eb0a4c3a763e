"""Quantized weights (W8A16 / W4A16) in the linear entries: every ``atb.kernels.linear*`` function takes an
:class:`atb.quant.QuantizedWeight` where it takes a weight, and then checks, describes and launches it through
this module's ``check_weight``, ``segment`` and ``launch`` (linear.py holds the float weights'
counterparts; everything else about a call is shared).

Same semantics, epilogues and kernel split as the float linear (STREAM below 32 rows:
each packed weight byte streamed once for all rows and dequantized in registers; GEMM from
32 rows, from 16 with 16-bit x on AVX2: a weight tile dequantized into UB, reused by
up to 384 rows), activations
fp32/fp16/bf16, fp32 accumulation, output in x's dtype.
"""
from __future__ import annotations

import torch

from atb import _C
from atb.quant.formats import QuantizedWeight


def launch(x: int, m: int, k: int, segments: list, residual: int, epilogue: int, dtype: int, soc,
           row_invariant: bool) -> None:
    """The native entry, called as ``atb._C.linear`` is. ``row_invariant`` has no quantized counterpart: the
    quantized kernels choose STREAM or GEMM by M (see ``atb.kernels.linear.linear``)."""
    _C.quant_linear(x, m, k, segments, residual, epilogue, dtype, soc)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def check_weight(op: str, name: str, w, x) -> None:
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"{op}: {name} must be a QuantizedWeight like the other weights of this call, "
                        f"got {type(w).__name__}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: {name} has shape {tuple(w.shape)}, expected [N, {x.shape[1]}] (HF layout [out, in])")


def segment(w: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor | None) -> tuple:
    """``launch``'s segment for weight ``w`` with ``bias`` and output ``out`` (None: none)."""
    return w.segment(0 if bias is None else bias.data_ptr(), 0 if out is None else out.data_ptr())


def embedding(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype, *,
              soc_type: str | None = None) -> torch.Tensor:
    """Embedding lookup in a quantized table: each requested row dequantized (natively) to ``dtype``."""
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"embedding: weight must be a QuantizedWeight, got {type(weight).__name__}")
    return weight.rows(ids, dtype, soc_type=soc_type)
