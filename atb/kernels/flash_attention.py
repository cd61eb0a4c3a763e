"""Flash attention for prefill: varlen packed sequences, GQA/MQA, causal, sliding window."""
from __future__ import annotations

import math

import torch

from atb import _C
from atb.kernels._common import float_code, int_tensor, real_arg, resolve_soc, same_dtype, window_arg

_OP = "flash_attention"
MAX_HEAD_DIM = 256


def _rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 3:
        raise ValueError(f"{_OP}: {name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    # Any token and head strides are read in place (e.g. q/k/v sliced from one
    # fused QKV projection); only the head_dim elements must be contiguous.
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                    scale: float | None = None, causal: bool = True, window: int | None = None,
                    soc_type: str | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` per sequence of a packed varlen batch.

    q: ``[tokens, heads, head_dim]``; k, v: ``[tokens, kv_heads, head_dim]``, same dtype
    (float32/float16/bfloat16); heads % kv_heads == 0 (GQA/MQA); head_dim <= 256.
    cu_seqlens: int32 (int64 accepted) ``[batch + 1]``, 0 first, non-decreasing, tokens last;
    sequence b is tokens ``cu_seqlens[b]:cu_seqlens[b+1]``, attending only within itself.
    scale: default ``1/sqrt(head_dim)``. causal: query i sees keys j <= i.
    window: sliding window size (HF/Mistral): query i sees keys j with ``i - window < j``
    (and, when not causal, ``j < i + window``); None = unlimited.
    Inputs may be strided views (any token/head stride, contiguous head_dim): no copy.
    Returns a new contiguous ``[tokens, heads, head_dim]`` tensor in q's dtype.
    """
    code = float_code(_OP, "q", q)
    float_code(_OP, "k", k)
    float_code(_OP, "v", v)
    same_dtype(_OP, "k", k, "q", q)
    same_dtype(_OP, "v", v, "q", q)
    q, k, v = _rows_view("q", q), _rows_view("k", k), _rows_view("v", v)
    tokens, heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{_OP}: k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match")
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"{_OP}: k has shape {tuple(k.shape)}, expected ({tokens}, kv_heads, {head_dim}) to match q "
                         f"{tuple(q.shape)}")
    kv_heads = k.shape[1]
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{_OP}: q's heads ({heads}) must be a positive multiple of k/v's kv_heads ({kv_heads})")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{_OP}: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    cu = int_tensor(_OP, "cu_seqlens", cu_seqlens, ndim=1)
    if cu.numel() < 1:
        raise ValueError(f"{_OP}: cu_seqlens must have batch + 1 >= 1 entries, got 0")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else real_arg(_OP, "scale", scale)
    if not isinstance(causal, bool):
        raise TypeError(f"{_OP}: causal must be a bool, got {type(causal).__name__}")
    window = window_arg(_OP, window)
    soc = resolve_soc(soc_type, _OP)
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype)
    strides = [q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)]
    # The C++ side validates cu_seqlens' values (and bf16 support on the SoC) before any work.
    _C.flash_attention(out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), cu.data_ptr(), cu.numel() - 1,
                       tokens, heads, kv_heads, head_dim, strides, code, scale, causal, window, soc)
    return out


def flash_attention_tiling(cu_seqlens, num_heads: int, num_kv_heads: int, head_dim: int, dtype=torch.float32, *,
                           causal: bool = True, window: int | None = None, soc_type: str | None = None) -> dict:
    """The host tiling the kernel would use (block sizes, UB bytes, core split), for inspection and tests."""
    from atb.kernels._common import DTYPE_CODES

    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    return _C.flash_attention_tiling(cu, num_heads, num_kv_heads, head_dim, DTYPE_CODES[dtype], resolve_soc(soc_type),
                                     causal, int(window or 0))
