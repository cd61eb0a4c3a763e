"""RMSNorm and its fused residual-add form (ATB PRENORM)."""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels._common import float_code, real_arg, resolve_soc, same_dtype, same_shape


def _check(op: str, x: torch.Tensor, weight: torch.Tensor) -> int:
    """dtype code of x after checking x and weight; every message names ``op``."""
    code = float_code(op, "x", x)
    float_code(op, "weight", weight)
    same_dtype(op, "weight", weight, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least 1 dimension, got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},) to match x's last dim")
    return code


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, soc_type: str | None = None) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))`` with HF ``LlamaRMSNorm`` numerics.

    x: ``[..., hidden]`` float32/float16/bfloat16; weight: ``[hidden]``, same dtype.
    Variance in fp32, normalized value cast back to x's dtype, then scaled.
    """
    code = _check("rms_norm", x, weight)
    eps = real_arg("rms_norm", "eps", eps, min_value=0.0)
    x = x.contiguous()
    # Bound to a name: a temporary's storage would be freed before the kernel reads it.
    weight = weight.contiguous()
    y = torch.empty_like(x)
    cols = x.shape[-1]
    if x.numel():
        _C.rms_norm(y.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // cols, cols, code, eps,
                    resolve_soc(soc_type, "rms_norm"))
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                 soc_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ATB PRENORM: ``h = x + residual``; returns ``(rms_norm(h), h)``.

    ``h`` is rounded to the input dtype before it is normalized, exactly as the
    HF decoder layer computes ``hidden_states = residual + hidden_states``.
    """
    code = _check("add_rms_norm", x, weight)
    float_code("add_rms_norm", "residual", residual)
    same_dtype("add_rms_norm", "residual", residual, "x", x)
    same_shape("add_rms_norm", "residual", residual, "x", x)
    eps = real_arg("add_rms_norm", "eps", eps, min_value=0.0)
    x = x.contiguous()
    residual = residual.contiguous()
    weight = weight.contiguous()  # kept alive across the call (see rms_norm)
    y = torch.empty_like(x)
    h = torch.empty_like(x)
    cols = x.shape[-1]
    if x.numel():
        _C.add_rms_norm(y.data_ptr(), h.data_ptr(), x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                        x.numel() // cols, cols, code, eps, resolve_soc(soc_type, "add_rms_norm"))
    return y, h
