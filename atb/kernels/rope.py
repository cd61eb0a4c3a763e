"""Rotary position embedding (RoPE) on q and k in one fused kernel."""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels._common import float_code, resolve_soc

_STYLES = {"neox": False, "interleave": True}


def _check_inplace(name: str, t: torch.Tensor) -> None:
    # The kernel rewrites each head row where it lies; rows that overlap each other, q and k sharing
    # elements, and cos/sin inside q or k are rejected by the C++ entry (exact, and nanoseconds there).
    if t.shape[2] > 1 and t.stride(2) != 1:
        raise ValueError(f"rope: inplace=True needs {name}'s last dim contiguous, got strides {t.stride()}")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, style: str = "neox",
         inplace: bool = False, soc_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k with HF ``apply_rotary_pos_emb`` numerics; returns ``(q_out, k_out)``.

    q ``[tokens, heads, head_dim]``, k ``[tokens, kv_heads, head_dim]``, float32/float16/bfloat16, same dtype.
    Any token/head strides are read in place (e.g. q/k views of a fused QKV projection output); only the
    last dim must be contiguous (otherwise it is copied first, or rejected when ``inplace``).

    cos, sin ``[tokens, rotary_dim]``, ``rotary_dim <= head_dim`` and even; the first ``rotary_dim``
    columns rotate, the rest pass through unchanged. They are q's dtype or float32; float32 tables are
    rounded to q's dtype first, exactly as HF's rotary embedding hands them over (``cos.to(x.dtype)``).

    * ``style="neox"`` (LLaMA, HF ``rotate_half``): ``x*cos + cat(-x2, x1)*sin`` with
      ``x1, x2 = x[:r/2], x[r/2:r]``; cos/sin as HF builds them, ``cat(freqs, freqs).cos()``.
    * ``style="interleave"`` (GPT-J, ``rotate_every_two``): pairs ``(2i, 2i+1)`` rotate,
      ``x*cos + (-x[2i+1], x[2i])*sin``; cos/sin are per element, i.e. in the
      ``repeat_interleave(freqs, 2)`` layout (``cos[2i] == cos[2i+1]``).

    Numerics: each product and the sum are rounded to the dtype, as torch evaluates HF's expression,
    so results are bit-identical to HF for every dtype. ``inplace=True`` writes into q and k and
    returns them.
    """
    code = float_code("rope", "q", q)
    if float_code("rope", "k", k) != code:
        raise TypeError(f"rope: k is {k.dtype} but q is {q.dtype}; they must match")
    ccode = float_code("rope", "cos", cos)
    if float_code("rope", "sin", sin) != ccode:
        raise TypeError(f"rope: sin is {sin.dtype} but cos is {cos.dtype}; they must match")
    if ccode != code and ccode != 0:
        raise TypeError(f"rope: cos/sin must be {q.dtype} (q's dtype) or torch.float32, got {cos.dtype}")
    interleave = _STYLES.get(style)
    if interleave is None:
        raise ValueError(f"rope: style must be 'neox' or 'interleave', got {style!r}")
    if q.ndim != 3 or k.ndim != 3:
        name, t = ("q", q) if q.ndim != 3 else ("k", k)
        raise ValueError(f"rope: {name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    tokens, heads, head_dim = q.shape
    _, kv_heads, k_dim = k.shape
    if k.shape[0] != tokens or k_dim != head_dim:
        raise ValueError(f"rope: k has shape {tuple(k.shape)}, expected [{tokens}, kv_heads, {head_dim}] to match q "
                         f"{tuple(q.shape)}")
    if cos.ndim != 2 or cos.shape[0] != tokens:
        raise ValueError(f"rope: cos has shape {tuple(cos.shape)}, expected [{tokens}, rotary_dim] (one row per token)")
    if sin.shape != cos.shape:
        raise ValueError(f"rope: sin has shape {tuple(sin.shape)}, cos has {tuple(cos.shape)}; they must match")
    if heads == 0 or kv_heads == 0:
        raise ValueError(f"rope: q and k need at least one head, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    rotary = cos.shape[1]
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise ValueError(f"rope: rotary_dim (cos.shape[1]) must be even and in [2, head_dim={head_dim}], got {rotary}")
    if inplace:
        _check_inplace("q", q)
        _check_inplace("k", k)
        q_out, k_out = q, k
    else:
        if q.stride(2) != 1:
            q = q.contiguous()
        if k.stride(2) != 1:
            k = k.contiguous()
        # empty_like is the cheapest allocation torch offers (no shape/dtype parsing); it is contiguous here.
        q_out = torch.empty_like(q) if q.is_contiguous() else torch.empty((tokens, heads, head_dim), dtype=q.dtype)
        k_out = torch.empty_like(k) if k.is_contiguous() else torch.empty((tokens, kv_heads, head_dim), dtype=k.dtype)
    if tokens == 0:
        return q_out, k_out
    if not cos.is_contiguous():
        cos = cos.contiguous()
    if not sin.is_contiguous():
        sin = sin.contiguous()
    qs, ks, qos, kos = q.stride(), k.stride(), q_out.stride(), k_out.stride()
    _C.rope(q_out.data_ptr(), qos[0], qos[1], k_out.data_ptr(), kos[0], kos[1], q.data_ptr(), qs[0], qs[1],
            k.data_ptr(), ks[0], ks[1], cos.data_ptr(), sin.data_ptr(), tokens, heads, kv_heads, head_dim, rotary, code,
            ccode, interleave, resolve_soc(soc_type, "rope"))
    return q_out, k_out
