"""PagedAttention: attention of new queries over a paged KV cache (decode, chunked prefill)."""
from __future__ import annotations

import math

import torch

from atb import _C
from atb.kernels._common import float_code, int_tensor, kv_cache_pair, real_arg, resolve_soc, same_dtype, window_arg

_OP = "paged_attention"


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, *, scale: float | None = None, q_lens: torch.Tensor | None = None,
                    window: int | None = None, soc_type: str | None = None) -> torch.Tensor:
    """Attention of each sequence's newest queries over its cached K/V.

    q: ``[batch, num_heads, head_dim]`` (decode: one query per sequence, at
    position ``context_lens[b] - 1``), or ``[sum(q_lens), num_heads, head_dim]``
    with ``q_lens`` int32 ``[batch]``: sequence b's q_lens[b] queries sit at
    positions ``context_lens[b] - q_lens[b] .. context_lens[b] - 1``, causal
    among themselves (chunked prefill, speculative verification).
    key_cache/value_cache: contiguous ``[num_blocks, block_size, num_kv_heads,
    head_dim]``, q's dtype; ``num_heads % num_kv_heads == 0`` (GQA/MQA).
    block_tables: int32 ``[batch, max_blocks]``; context_lens: int32 ``[batch]``
    (full context including the new tokens, 1 .. max_blocks * block_size).
    int64 index tensors are accepted. window: sliding window (HF/Mistral: the
    query at p sees keys j with p - window < j <= p); None = full context.
    scale: default ``head_dim ** -0.5``. Returns ``[rows, num_heads, head_dim]``.

    Only the first ceil(context_len / block_size) block ids of each row are
    read; they must be valid block indices. Everything is checked before the
    launch (ValueError/TypeError naming the argument).
    """
    code = float_code(_OP, "q", q)
    if not (isinstance(key_cache, torch.Tensor) and isinstance(value_cache, torch.Tensor)
            and key_cache.dtype == q.dtype and value_cache.dtype == q.dtype and key_cache.is_cpu and value_cache.is_cpu):
        float_code(_OP, "key_cache", key_cache)
        float_code(_OP, "value_cache", value_cache)
        same_dtype(_OP, "key_cache", key_cache, "q", q)
        same_dtype(_OP, "value_cache", value_cache, "q", q)
    kv_cache_pair(_OP, key_cache, value_cache, "num_kv_heads")
    cache_shape = key_cache.shape
    num_blocks, block_size, kv_heads, head_dim = cache_shape
    if not (num_blocks and block_size and kv_heads and head_dim):
        raise ValueError(f"{_OP}: the cache is empty (shape {tuple(cache_shape)})")
    q_shape = q.shape
    if len(q_shape) != 3:
        raise ValueError(f"{_OP}: q must be 3-D [tokens, num_heads, head_dim], got shape {tuple(q_shape)}")
    rows, num_heads, q_dim = q_shape
    if q_dim != head_dim:
        raise ValueError(f"{_OP}: q's head_dim is {q_dim}, the cache's is {head_dim}; they must match")
    if num_heads % kv_heads:
        raise ValueError(f"{_OP}: num_heads ({num_heads}) must be a multiple of the cache's num_kv_heads ({kv_heads})")
    bt = int_tensor(_OP, "block_tables", block_tables, ndim=2)
    ctx = int_tensor(_OP, "context_lens", context_lens, ndim=1)
    batch = ctx.shape[0]
    if bt.shape[0] != batch:
        raise ValueError(f"{_OP}: block_tables has {bt.shape[0]} rows, context_lens has {batch} entries; they must match")
    if batch == 0:
        raise ValueError(f"{_OP}: context_lens is empty (batch must be >= 1)")
    if bt.shape[1] == 0:
        raise ValueError(f"{_OP}: block_tables has no columns (max_blocks must be >= 1)")
    if q_lens is None:
        ql = None
        if rows != batch:
            raise ValueError(f"{_OP}: q has {rows} rows but batch is {batch}; pass q_lens for several queries per sequence")
    else:
        ql = int_tensor(_OP, "q_lens", q_lens, ndim=1)
        if ql.shape[0] != batch:
            raise ValueError(f"{_OP}: q_lens has {ql.shape[0]} entries, context_lens has {batch}; they must match")
    window = window_arg(_OP, window)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else real_arg(_OP, "scale", scale)
    q_stride = q.stride()
    if rows and (q_stride[2] != 1 or (num_heads > 1 and q_stride[1] != head_dim) or q_stride[0] < num_heads * head_dim):
        q = q.contiguous()
        q_stride = q.stride()
    out = torch.empty((rows, num_heads, head_dim), dtype=q.dtype)
    # A single row's token stride is never used, and torch leaves any value there (e.g. a transposed view):
    # .contiguous() keeps such a tensor as it is, so the kernel gets the packed stride.
    _C.paged_attention(out.data_ptr(), q.data_ptr(), q_stride[0] if rows > 1 else num_heads * head_dim,
                       key_cache.data_ptr(), value_cache.data_ptr(), bt.data_ptr(), ctx.data_ptr(),
                       0 if ql is None else ql.data_ptr(), batch, num_heads, kv_heads, head_dim, num_blocks,
                       block_size, bt.shape[1], rows, scale, window, code,
                       resolve_soc(soc_type, _OP))
    return out
