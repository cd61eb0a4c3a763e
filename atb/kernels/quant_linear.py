"""Linear kernels over quantized weights (W8A16 / W4A16): the ``atb.kernels.linear*`` entries
route here when given a :class:`atb.quant.QuantizedWeight`.

Same semantics, epilogues and kernel split as the float linear (STREAM below 32 rows:
each packed weight byte streamed once for all rows and dequantized in registers; GEMM from
32 rows: a weight tile dequantized into UB, reused by up to 384 rows), activations
fp32/fp16/bf16, fp32 accumulation, output in x's dtype.
"""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels._common import (EPILOGUE_PLAIN, EPILOGUE_RESIDUAL, EPILOGUE_SWIGLU, linear_bias,
                                 linear_lists, linear_residual_arg, linear_x, resolve_soc, same_shape)
from atb.quant.formats import QuantizedWeight

def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def _check_weight(op: str, name: str, w, x) -> None:
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"{op}: {name} must be a QuantizedWeight like the other weights of this call, "
                        f"got {type(w).__name__}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: {name} has shape {tuple(w.shape)}, expected [N, {x.shape[1]}] (HF layout [out, in])")


def _run(op, x, code, segs, residual, epilogue, soc_type):
    if x.shape[0]:
        _C.quant_linear(x.data_ptr(), x.shape[0], x.shape[1], segs, residual, epilogue, code, resolve_soc(soc_type))


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
           soc_type: str | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias``."""
    code = linear_x("linear", x)
    _check_weight("linear", "weight", weight, x)
    linear_bias("linear", "bias", bias, weight, x)
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    _run("linear", x, code, [weight.segment(0 if bias is None else bias.data_ptr(), out.data_ptr())], 0,
         EPILOGUE_PLAIN, soc_type)
    return out


def linear_multi(x: torch.Tensor, weights, biases=None, *, soc_type: str | None = None) -> tuple[torch.Tensor, ...]:
    """Fused q/k/v projection over 1..3 quantized weights (formats may differ) sharing x."""
    code = linear_x("linear_multi", x)
    weights, biases = linear_lists("linear_multi", weights, biases, x, _check_weight)
    x = x.contiguous()
    outs = tuple(torch.empty(x.shape[0], w.shape[0], dtype=x.dtype) for w in weights)
    segs = [w.segment(0 if b is None else b.data_ptr(), out.data_ptr()) for w, b, out in zip(weights, biases, outs)]
    _run("linear_multi", x, code, segs, 0, EPILOGUE_PLAIN, soc_type)
    return outs


def linear_residual(x: torch.Tensor, weight: QuantizedWeight, residual: torch.Tensor,
                    bias: torch.Tensor | None = None, *, soc_type: str | None = None) -> torch.Tensor:
    """``residual + linear(x, weight, bias)``, each rounded to x's dtype as HF does."""
    code = linear_x("linear_residual", x)
    _check_weight("linear_residual", "weight", weight, x)
    linear_bias("linear_residual", "bias", bias, weight, x)
    linear_residual_arg("linear_residual", residual, x, weight)
    x, residual = x.contiguous(), residual.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    _run("linear_residual", x, code, [weight.segment(0 if bias is None else bias.data_ptr(), out.data_ptr())],
         residual.data_ptr(), EPILOGUE_RESIDUAL, soc_type)
    return out


def linear_swiglu(x: torch.Tensor, gate_weight: QuantizedWeight, up_weight: QuantizedWeight, *,
                  soc_type: str | None = None) -> torch.Tensor:
    """``silu(x @ dequant(gate).T) * (x @ dequant(up).T)`` in one pass over both weights."""
    code = linear_x("linear_swiglu", x)
    _check_weight("linear_swiglu", "gate_weight", gate_weight, x)
    _check_weight("linear_swiglu", "up_weight", up_weight, x)
    same_shape("linear_swiglu", "gate_weight", gate_weight, "up_weight", up_weight)
    x = x.contiguous()
    out = torch.empty(x.shape[0], gate_weight.shape[0], dtype=x.dtype)
    _run("linear_swiglu", x, code, [gate_weight.segment(0, out.data_ptr()), up_weight.segment(0, 0)], 0,
         EPILOGUE_SWIGLU, soc_type)
    return out


def embedding(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype, *,
              soc_type: str | None = None) -> torch.Tensor:
    """Embedding lookup in a quantized table: each requested row dequantized (natively) to ``dtype``."""
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"embedding: weight must be a QuantizedWeight, got {type(weight).__name__}")
    return weight.rows(ids, dtype, soc_type=soc_type)
