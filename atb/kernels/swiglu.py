"""SwiGLU: silu(gate) * up in one fused kernel, on two tensors or on the halves of one."""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels._common import float_code, resolve_soc, same_shape


def _rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t as a 2-D [rows, cols] view with unit column stride (copied only if no such view exists)."""
    if t.ndim == 2 and t.stride(1) == 1:
        return t
    if t.stride(-1) != 1 and cols > 1:
        t = t.contiguous()
    try:
        return t.view(-1, cols)
    except RuntimeError:  # leading dims that cannot merge into one row stride
        return t.contiguous().view(-1, cols)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, soc_type: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` with HF numerics (``act_fn(gate) * up`` in the dtype: silu rounded, then the product).

    gate, up: same shape ``[..., n]``, same dtype (float32/float16/bfloat16). Rows may be strided views
    (e.g. halves of a fused gate/up projection); only the last dim must be contiguous (else copied).
    """
    code = float_code("silu_mul", "gate", gate)
    if float_code("silu_mul", "up", up) != code:
        raise TypeError(f"silu_mul: up is {up.dtype} but gate is {gate.dtype}; they must match")
    shape = gate.shape
    same_shape("silu_mul", "up", up, "gate", gate)
    if not shape:
        raise ValueError("silu_mul: gate must have at least 1 dimension, got a scalar")
    cols = shape[-1]
    if gate.is_contiguous() and up.is_contiguous():  # the decode hot path: no views, cheapest allocation
        out = torch.empty_like(gate)
        n = out.numel()
        if n:
            _C.silu_mul(out.data_ptr(), gate.data_ptr(), cols, up.data_ptr(), cols, n // cols, cols, code,
                        resolve_soc(soc_type, "silu_mul", code))
        return out
    out = torch.empty(shape, dtype=gate.dtype)
    if out.numel() == 0:
        return out
    g, u = _rows(gate, cols), _rows(up, cols)
    _C.silu_mul(out.data_ptr(), g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.numel() // cols, cols, code,
                resolve_soc(soc_type, "silu_mul", code))
    return out


def swiglu(x: torch.Tensor, *, soc_type: str | None = None) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` with ``n = x.shape[-1] // 2``, for a fused gate/up output.

    x: ``[..., 2n]`` float32/float16/bfloat16; returns ``[..., n]``. Same numerics as :func:`silu_mul`;
    the halves are read in place (no split copies).
    """
    code = float_code("swiglu", "x", x)
    if x.ndim == 0:
        raise ValueError("swiglu: x must have at least 1 dimension, got a scalar")
    shape = x.shape
    if shape[-1] % 2:
        raise ValueError(f"swiglu: x's last dim must be even (gate and up halves), got {shape[-1]}")
    n = shape[-1] // 2
    out = torch.empty((*shape[:-1], n), dtype=x.dtype)
    if out.numel() == 0:
        return out
    x2 = _rows(x, 2 * n)
    ptr, stride = x2.data_ptr(), x2.stride(0)
    _C.silu_mul(out.data_ptr(), ptr, stride, ptr + n * x.element_size(), stride, x2.shape[0], n, code,
                resolve_soc(soc_type, "swiglu", code))
    return out
