"""Rotary position embedding (RoPE) on q and k in one fused kernel."""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels._common import float_code, resolve_soc

_STYLES = {"neox": False, "interleave": True}


def _check_inplace(name: str, t: torch.Tensor) -> None:
    st = t.stride()
    if t.shape[2] > 1 and st[2] != 1:
        raise ValueError(f"rope: inplace=True needs {name}'s last dim contiguous, got strides {st}")
    # Rows written in place must not overlap (an expanded or aliased view would race). Walking the dims from
    # the smallest stride up, each stride must clear everything the smaller ones reach: any token/head order
    # (e.g. a transposed [heads, tokens, head_dim] buffer) passes, overlapping views do not.
    reach = 1
    for stride, n in sorted((s, n) for n, s in zip(t.shape, st) if n > 1):
        if stride < reach:
            raise ValueError(f"rope: inplace=True needs {name}'s rows not to overlap, got shape {tuple(t.shape)} "
                             f"strides {st}")
        reach += (n - 1) * stride


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last] byte address a 3-D view touches (non-negative strides; t is not empty)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size() - 1


def _elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two 3-D views of one dtype share an element (exact, for layouts the quick tests cannot clear)."""
    es = a.element_size()
    if (b.data_ptr() - a.data_ptr()) % es:
        return True  # elements straddle each other's bytes: treat as overlapping

    def offsets(t):
        idx = [torch.arange(n, dtype=torch.int64) * st for n, st in zip(t.shape, t.stride())]
        base = (t.data_ptr() - a.data_ptr()) // es
        return (base + idx[0][:, None, None] + idx[1][None, :, None] + idx[2][None, None, :]).flatten()

    return bool(torch.isin(offsets(a), offsets(b)).any())


def _check_inplace_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place, q and k must not share an element (the kernel would rotate it twice, or read it already
    rotated), and cos/sin must not lie in memory the kernel writes. Checked after _check_inplace."""
    q0, q1 = _extent(q)
    k0, k1 = _extent(k)
    for name, t in (("cos", cos), ("sin", sin)):
        t0, t1 = _extent(t)
        if (t0 <= q1 and q0 <= t1) or (t0 <= k1 and k0 <= t1):
            raise ValueError(f"rope: inplace=True needs {name} not to overlap q or k in memory")
    if k0 > q1 or q0 > k1:
        return
    # The usual case that reaches here: q and k sliced from one fused QKV output, so both advance by
    # the same token stride P bytes. q's rows are [q0 + tP, q0 + tP + rq), k's [k0 + tP, k0 + tP + rk);
    # they never meet if, within one period, k's row lies after q's row and ends before q's next row.
    tokens, es = q.shape[0], q.element_size()
    if tokens > 1 and k.stride(0) == q.stride(0):
        period = q.stride(0) * es
        rq = ((q.shape[1] - 1) * q.stride(1) + q.shape[2]) * es
        rk = ((k.shape[1] - 1) * k.stride(1) + k.shape[2]) * es
        off = (k0 - q0) % period
        if rq <= off and off + rk <= period:
            return
    if _elements_overlap(q, k):
        raise ValueError(f"rope: inplace=True needs q and k not to overlap in memory, got q shape {tuple(q.shape)} "
                         f"strides {q.stride()} and k shape {tuple(k.shape)} strides {k.stride()} sharing elements")


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
        if tokens:
            _check_inplace_pair(q, k, cos, sin)
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
