"""SwiGLU: silu(gate) * up in one fused kernel, on two tensors or on the halves of one."""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels._common import float_code, resolve_soc


def _rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t as a 2-D [rows, cols] view with unit column stride (copied only if no such view exists)."""
    if t.stride(-1) != 1 and cols > 1:
        t = t.contiguous()
    try:
        return t.view(-1, cols)
    except RuntimeError:  # leading dims that cannot merge into one row stride
        return t.contiguous().view(-1, cols)


def _launch(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, code: int, soc_type) -> torch.Tensor:
    rows, cols = gate.shape
    if rows and cols:
        _C.silu_mul(out.data_ptr(), gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), rows, cols, code,
                    resolve_soc(soc_type))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, soc_type: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` with HF numerics (``act_fn(gate) * up`` in the dtype: silu rounded, then the product).

    gate, up: same shape ``[..., n]``, same dtype (float32/float16/bfloat16). Rows may be strided views
    (e.g. halves of a fused gate/up projection); only the last dim must be contiguous (else copied).
    """
    code = float_code("silu_mul", "gate", gate)
    float_code("silu_mul", "up", up)
    if up.dtype != gate.dtype:
        raise TypeError(f"silu_mul: up is {up.dtype} but gate is {gate.dtype}; they must match")
    if up.shape != gate.shape:
        raise ValueError(f"silu_mul: up has shape {tuple(up.shape)}, gate has {tuple(gate.shape)}; they must match")
    if gate.dim() == 0:
        raise ValueError("silu_mul: gate must have at least 1 dimension, got a scalar")
    out = torch.empty(gate.shape, dtype=gate.dtype)
    if out.numel() == 0:
        return out
    cols = gate.shape[-1]
    _launch(out.view(-1, cols), _rows(gate, cols), _rows(up, cols), code, soc_type)
    return out


def swiglu(x: torch.Tensor, *, soc_type: str | None = None) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` with ``n = x.shape[-1] // 2``, for a fused gate/up output.

    x: ``[..., 2n]`` float32/float16/bfloat16; returns ``[..., n]``. Same numerics as :func:`silu_mul`;
    the halves are read in place (no split copies).
    """
    code = float_code("swiglu", "x", x)
    if x.dim() == 0:
        raise ValueError("swiglu: x must have at least 1 dimension, got a scalar")
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: x's last dim must be even (gate and up halves), got {x.shape[-1]}")
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    if out.numel() == 0:
        return out
    x2 = _rows(x, 2 * n)
    _launch(out.view(-1, n), x2[:, :n], x2[:, n:], code, soc_type)
    return out
