"""ReshapeAndCache: write new K/V rows into the paged KV cache (in place)."""
from __future__ import annotations

import torch

from atb import _C
from atb.kernels._common import float_code, int_tensor, kv_cache_pair, resolve_soc, same_dtype

_OP = "reshape_and_cache"


def _rows(name: str, t: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``t`` with packed heads/head_dim (any token stride, e.g. a slice of a fused QKV output)."""
    if t.dim() != 3 or t.shape[1] != kv_heads or t.shape[2] != head_dim:
        raise ValueError(f"{_OP}: {name} has shape {tuple(t.shape)}, expected [tokens, {kv_heads}, {head_dim}] "
                         "(kv_heads and head_dim of the cache)")
    if t.shape[0] and (t.stride(2) != 1 or (kv_heads > 1 and t.stride(1) != head_dim) or t.stride(0) < kv_heads * head_dim):
        t = t.contiguous()
    return t


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, soc_type: str | None = None) -> None:
    """Writes ``key[i]``/``value[i]`` into cache slot ``slot_mapping[i]`` (in place).

    key/value: ``[tokens, kv_heads, head_dim]`` (a token stride is fine: views
    into a fused QKV output need no copy); key_cache/value_cache: contiguous
    ``[num_blocks, block_size, kv_heads, head_dim]`` of the same dtype;
    slot_mapping: int32 ``[tokens]`` (int64 accepted), ``slot = block *
    block_size + offset``, negative = skip (padding).

    Every slot is checked before anything is written, so a bad call leaves the
    cache untouched: a slot >= num_blocks * block_size, or the same slot given
    to two tokens, raises ValueError (a duplicate is a scheduler bug, and which
    token would win depends on how the tokens split over cores).
    """
    code = float_code(_OP, "key_cache", key_cache)
    float_code(_OP, "value_cache", value_cache)
    float_code(_OP, "key", key)
    float_code(_OP, "value", value)
    same_dtype(_OP, "value_cache", value_cache, "key_cache", key_cache)
    same_dtype(_OP, "key", key, "key_cache", key_cache)
    same_dtype(_OP, "value", value, "key_cache", key_cache)
    kv_cache_pair(_OP, key_cache, value_cache, "kv_heads", " (they are written in place)")
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    key = _rows("key", key, kv_heads, head_dim)
    value = _rows("value", value, kv_heads, head_dim)
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"{_OP}: value has {value.shape[0]} tokens, key has {key.shape[0]}; they must match")
    slots = int_tensor(_OP, "slot_mapping", slot_mapping, ndim=1)
    if slots.shape[0] != key.shape[0]:
        raise ValueError(f"{_OP}: slot_mapping has {slots.shape[0]} entries, key has {key.shape[0]} tokens; "
                         "they must match")
    tokens = key.shape[0]
    if tokens == 0 or key_cache.numel() == 0:
        if tokens and int((slots >= 0).sum()):
            raise ValueError(f"{_OP}: the cache is empty but slot_mapping writes to it")
        return
    # One token's stride is never used and torch may report any value there (.contiguous() keeps such a
    # view as it is): give the kernel the packed stride.
    packed = kv_heads * head_dim
    key_stride, value_stride = (key.stride(0), value.stride(0)) if tokens > 1 else (packed, packed)
    _C.reshape_and_cache(key.data_ptr(), key_stride, value.data_ptr(), value_stride, key_cache.data_ptr(),
                         value_cache.data_ptr(), slots.data_ptr(), tokens, kv_heads, head_dim, num_blocks, block_size,
                         code, resolve_soc(soc_type, _OP))
