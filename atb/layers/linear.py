"""The one routing point for every projection of the Python executor.

Each function takes a ``route``, how its projections pick a kernel:

* ``"policy"`` (default): ask :func:`atb.kernels.linear.native_linear_wins` (the one routing policy) for
  ``(rows, dtype, op)`` (op: ``linear``, ``qkv`` for a fused multi-weight projection, ``residual``,
  ``swiglu``) and run the native kernel family (``linear``, ``linear_multi``, ``linear_residual``,
  ``linear_swiglu``) when it says so, torch's GEMM otherwise;
* ``"torch"``: torch's GEMM (``patch_hf_model(linear=False)``);
* ``"row_invariant"``: the native GEMM kernel at every row count, so a row's bits do not depend on how many
  rows are computed with it (``row_invariant`` of the kernels). The engine's prefill runs this way: a prompt
  whose prefix is cached computes its suffix rows exactly as a whole-prompt prefill does, which the policy
  cannot promise (it sends 1000 rows and 30 rows to different kernels, which round differently). Its LM
  head (``atb.layers.decoder.lm_head``, one row per prompt) runs those rows one at a time instead.

Nothing else in the executor touches a weight except to read its ``.shape``, so a weight entry can later hold
another kind of weight object (quantized) by teaching only this module about it. Inputs are 2-D
``[rows, in]``; callers flatten leading dimensions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from atb import kernels as K
from atb.kernels.linear import native_linear_wins
from atb.quant.formats import QuantizedWeight

ROUTE_POLICY, ROUTE_TORCH, ROUTE_ROW_INVARIANT = "policy", "torch", "row_invariant"
ROUTES = (ROUTE_POLICY, ROUTE_TORCH, ROUTE_ROW_INVARIANT)


def _native(x: torch.Tensor, weight, route: str, op: str = "linear") -> bool:
    # A quantized weight has no torch path: its projections always run the native kernels
    # (at every row count: the GEMM kernel dequantizes a tile once per 384 rows).
    if isinstance(weight, QuantizedWeight) or route == ROUTE_ROW_INVARIANT:
        return True
    if route == ROUTE_POLICY:
        return native_linear_wins(x.shape[0], x.dtype, op)
    if route == ROUTE_TORCH:
        return False
    raise ValueError(f"linear: route must be one of {', '.join(ROUTES)}, got {route!r}")


def _kernel_args(soc_type: str | None, route: str) -> dict:
    return {"soc_type": soc_type, "row_invariant": route == ROUTE_ROW_INVARIANT}


def linear(x: torch.Tensor, weight, bias=None, *, residual: torch.Tensor | None = None,
           soc_type: str | None = None, route: str = ROUTE_POLICY) -> torch.Tensor:
    """``x @ weight.T + bias`` (``+ residual``, rounded after the projection as HF's separate add is)."""
    if _native(x, weight, route, "linear" if residual is None else "residual"):
        kw = _kernel_args(soc_type, route)
        if residual is None:
            return K.linear(x, weight, bias, **kw)
        return K.linear_residual(x, weight, residual, bias, **kw)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def linear_multi(x: torch.Tensor, weights, biases, *, soc_type: str | None = None,
                 route: str = ROUTE_POLICY) -> tuple[torch.Tensor, ...]:
    """Several projections of one input (q/k/v): one native launch over all weights."""
    quantized = [isinstance(w, QuantizedWeight) for w in weights]
    if any(quantized) and not all(quantized):  # e.g. a GGUF file with one tensor of a type not loaded natively
        return tuple(linear(x, w, b, soc_type=soc_type, route=route) for w, b in zip(weights, biases))
    if _native(x, weights[0], route, "qkv" if len(weights) > 1 else "linear"):
        return K.linear_multi(x, weights, biases, **_kernel_args(soc_type, route))
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))


def swiglu(x: torch.Tensor, gate, up, gate_bias=None, up_bias=None, *, soc_type: str | None = None,
           route: str = ROUTE_POLICY) -> torch.Tensor:
    """``silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias)``: one fused weight pass when there is no bias."""
    if isinstance(gate, QuantizedWeight) != isinstance(up, QuantizedWeight):
        g, u = (linear(x, w, b, soc_type=soc_type, route=route) for w, b in ((gate, gate_bias), (up, up_bias)))
    elif _native(x, gate, route, "swiglu"):
        kw = _kernel_args(soc_type, route)
        if gate_bias is None and up_bias is None:
            return K.linear_swiglu(x, gate, up, **kw)
        g, u = K.linear_multi(x, (gate, up), (gate_bias, up_bias), **kw)
    else:
        g, u = F.linear(x, gate, gate_bias), F.linear(x, up, up_bias)
    return K.silu_mul(g, u, soc_type=soc_type)
