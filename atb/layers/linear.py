"""The one routing point for every projection of the Python executor.

Each function asks :func:`atb.kernels.linear.native_linear_wins` (the one
routing policy) for ``(rows, dtype)`` and runs the native kernel family
(``linear``, ``linear_multi``, ``linear_residual``, ``linear_swiglu``) when it
says so, torch's GEMM otherwise. Nothing else in the executor touches a weight
except to read its ``.shape``, so a weight entry can later hold another kind of
weight object (quantized) by teaching only this module about it.

Inputs are 2-D ``[rows, in]``; callers flatten leading dimensions. ``native=False``
keeps every projection on torch (``patch_hf_model(linear=False)``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from atb import kernels as K
from atb.kernels.linear import native_linear_wins
from atb.quant.formats import QuantizedWeight


def _native(x: torch.Tensor, weight, native: bool) -> bool:
    # A quantized weight has no torch path: its projections always run the native kernels
    # (at every row count: the GEMM kernel dequantizes a tile once per 384 rows).
    return isinstance(weight, QuantizedWeight) or (native and native_linear_wins(x.shape[0], x.dtype))


def linear(x: torch.Tensor, weight, bias=None, *, residual: torch.Tensor | None = None,
           soc_type: str | None = None, native: bool = True) -> torch.Tensor:
    """``x @ weight.T + bias`` (``+ residual``, rounded after the projection as HF's separate add is)."""
    if _native(x, weight, native):
        if residual is None:
            return K.linear(x, weight, bias, soc_type=soc_type)
        return K.linear_residual(x, weight, residual, bias, soc_type=soc_type)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def linear_multi(x: torch.Tensor, weights, biases, *, soc_type: str | None = None,
                 native: bool = True) -> tuple[torch.Tensor, ...]:
    """Several projections of one input (q/k/v): one native launch over all weights."""
    quantized = [isinstance(w, QuantizedWeight) for w in weights]
    if any(quantized) and not all(quantized):  # e.g. a GGUF file with one tensor of a type not loaded natively
        return tuple(linear(x, w, b, soc_type=soc_type, native=native) for w, b in zip(weights, biases))
    if _native(x, weights[0], native):
        return K.linear_multi(x, weights, biases, soc_type=soc_type)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))


def swiglu(x: torch.Tensor, gate, up, gate_bias=None, up_bias=None, *, soc_type: str | None = None,
           native: bool = True) -> torch.Tensor:
    """``silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias)``: one fused weight pass when there is no bias."""
    if isinstance(gate, QuantizedWeight) != isinstance(up, QuantizedWeight):
        g, u = (linear(x, w, b, soc_type=soc_type, native=native) for w, b in ((gate, gate_bias), (up, up_bias)))
    elif _native(x, gate, native):
        if gate_bias is None and up_bias is None:
            return K.linear_swiglu(x, gate, up, soc_type=soc_type)
        g, u = K.linear_multi(x, (gate, up), (gate_bias, up_bias), soc_type=soc_type)
    else:
        g, u = F.linear(x, gate, gate_bias), F.linear(x, up, up_bias)
    return K.silu_mul(g, u, soc_type=soc_type)
