"""The attention core in HF's layout, over the fused kernels.

(The engine's own attention, over its paged KV cache, is in ``atb.engine.runner``;
the projections and rope around it in ``atb.layers.decoder``.)

``hf_attention`` is the attention core in HF's layout (q ``[B, H, S, D]``,
k/v ``[B, KH, L, D]`` as a transformers Cache hands them over); it backs the
``"atb"`` AttentionInterface function that ``atb.patch_hf_model`` registers.

* No past (``S == L``): ``flash_attention`` over the tokens, varlen. Rows
  with padding (a 2-D ``padding_mask``) are packed to their valid tokens
  first; packed sequences in one row (position ids restarting, as HF detects
  them) become separate varlen sequences.
* With a past (``S < L``): ``paged_attention`` reading HF's contiguous cache
  in place. Each (batch row, kv head) pair is one "sequence" whose cache is a
  single block ``[L, 1 kv head, D]`` (the ``[B, KH, L, D]`` tensor viewed as
  ``[B*KH, L, 1, D]``) and whose queries are that kv head's ``H/KH`` heads:
  no copy of K/V, GQA kept. With padding, block size 1 and a block table
  listing each row's valid positions skip the padding.

Sliding windows follow HF/Mistral (query at p sees keys j, p - window < j <= p).
Packing valid tokens keeps distances only when each row's valid tokens are
contiguous (left or right padding); a windowed layer with holes in its
padding mask is refused rather than computed wrongly.
"""
from __future__ import annotations

import torch

from atb import kernels

# Last block table / context lengths built, reused by every layer of one forward (and by later steps when the
# shapes repeat). Keys hold the mask tensor itself, so its id cannot be recycled while cached.
_memo: dict = {}


def _uniform(n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables ``[[0], [1], ...]`` and context lengths ``[length] * n`` (one block per sequence)."""
    key = ("uniform", n, length)
    hit = _memo.get("uniform")
    if hit is not None and hit[0] == key:
        return hit[1]
    value = (torch.arange(n, dtype=torch.int32).view(n, 1), torch.full((n,), length, dtype=torch.int32))
    _memo["uniform"] = (key, value)
    return value


def _cu_seqlens(batch: int, seq: int) -> torch.Tensor:
    key = ("cu", batch, seq)
    hit = _memo.get("cu")
    if hit is not None and hit[0] == key:
        return hit[1]
    value = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    _memo["cu"] = (key, value)
    return value


def _contiguous_rows(mask: torch.Tensor) -> bool:
    """True when every row's valid entries form one run (left or right padding)."""
    m = mask.to(torch.int8)
    starts = (m[:, 1:] > m[:, :-1]).sum(1) + m[:, 0]
    return bool((starts <= 1).all())


def _segments(position_ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor | None:
    """cu_seqlens of packed sequences (a position not following its predecessor starts one), None if unpacked.

    Every layer of a forward gets the same position_ids tensor: computed once (the memo keeps the tensor, so
    its id cannot be recycled while cached)."""
    # An in-place update bumps _version, a new key. Inference tensors have no version counter; HF builds new
    # position ids every forward rather than updating them, so identity is the key there.
    version = -1 if position_ids.is_inference() else position_ids._version
    key = (batch, seq, version)
    hit = _memo.get("segments")
    if hit is not None and hit[0][0] is position_ids and hit[0][1:] == key:
        return hit[1]
    value = _find_segments(position_ids, batch, seq)
    _memo["segments"] = ((position_ids, *key), value)
    return value


def _find_segments(position_ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor | None:
    pos = position_ids.expand(batch, seq)
    starts = torch.ones(batch, seq, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if int(starts.sum()) == batch:
        return None
    idx = starts.reshape(-1).nonzero().squeeze(1).to(torch.int32)
    return torch.cat([idx, torch.tensor([batch * seq], dtype=torch.int32)])


def _prefill(query, key, value, mask, scale, window, position_ids, soc_type):
    B, H, S, D = query.shape
    KH = key.shape[1]
    # [B, H, S, D] -> token-major [B*S, H, D]: a view when the caller produced token-major tensors.
    q = query.transpose(1, 2).reshape(B * S, H, D)
    k = key.transpose(1, 2).reshape(B * S, KH, D)
    v = value.transpose(1, 2).reshape(B * S, KH, D)
    if mask is None:
        cu = _segments(position_ids, B, S) if (position_ids is not None and S > 1) else None
        if cu is None:
            cu = _cu_seqlens(B, S)
        out = kernels.flash_attention(q, k, v, cu, scale=scale, causal=True, window=window, soc_type=soc_type)
        return out.view(B, S, H, D)
    if window is not None and not _contiguous_rows(mask):
        raise ValueError("atb attention: a sliding-window layer got a padding mask with holes inside a row; "
                         "only left/right padding keeps window distances (patch with attention=False for such masks)")
    keep = mask.reshape(-1).nonzero().squeeze(1)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    torch.cumsum(mask.sum(1, dtype=torch.int32), 0, out=cu[1:])
    out = q.new_zeros(B * S, H, D)
    if keep.numel():
        out[keep] = kernels.flash_attention(q[keep], k[keep], v[keep], cu, scale=scale, causal=True, window=window,
                                            soc_type=soc_type)
    return out.view(B, S, H, D)


def _padded_tables(mask: torch.Tensor, kv_heads: int, length: int):
    """Block-size-1 tables listing each row's valid positions (ascending), repeated per kv head."""
    hit = _memo.get("pad")
    key = (mask, kv_heads, length)
    if hit is not None and hit[0][0] is mask and hit[0][1:] == key[1:]:
        return hit[1]
    B = mask.shape[0]
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # valid positions first, in order
    base = (torch.arange(B * kv_heads, dtype=torch.int64) * length).view(B, kv_heads, 1)
    tables = (base + order.view(B, 1, length)).view(B * kv_heads, length).to(torch.int32)
    ctx = mask.sum(1, dtype=torch.int32).repeat_interleave(kv_heads)
    value = (tables, ctx)
    _memo["pad"] = (key, value)
    return value


def _with_past(query, key, value, mask, scale, window, soc_type):
    B, H, S, D = query.shape
    KH, L = key.shape[1], key.shape[2]
    rep = H // KH
    kc, vc = key.contiguous(), value.contiguous()
    q = query.reshape(B, KH, rep, S, D)
    q = q.reshape(B * KH, rep, D) if S == 1 else q.permute(0, 1, 3, 2, 4).reshape(B * KH * S, rep, D)
    if mask is None:
        kc, vc = kc.view(B * KH, L, 1, D), vc.view(B * KH, L, 1, D)
        tables, ctx = _uniform(B * KH, L)
    else:
        if window is not None and not _contiguous_rows(mask):
            raise ValueError("atb attention: a sliding-window layer got a padding mask with holes inside a row; "
                             "only left/right padding keeps window distances (patch with attention=False)")
        if S > 1 and not bool(mask[:, -S:].all()):
            raise ValueError("atb attention: with a cache, every new token must be unpadded (attention_mask 1 for "
                             "the last q_len positions)")
        kc, vc = kc.view(B * KH * L, 1, 1, D), vc.view(B * KH * L, 1, 1, D)
        tables, ctx = _padded_tables(mask, KH, L)
    q_lens = None if S == 1 else torch.full((B * KH,), S, dtype=torch.int32)
    out = kernels.paged_attention(q, kc, vc, tables, ctx, scale=scale, q_lens=q_lens, window=window, soc_type=soc_type)
    if S == 1:
        return out.view(B, 1, H, D)
    return out.view(B, KH, S, rep, D).permute(0, 2, 1, 3, 4).reshape(B, S, H, D)


def hf_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 padding_mask: torch.Tensor | None = None, scale: float | None = None, window: int | None = None,
                 position_ids: torch.Tensor | None = None, soc_type: str | None = None) -> torch.Tensor:
    """Causal attention in HF's layout; returns ``[B, S, H, D]``.

    query ``[B, H, S, D]``, key/value ``[B, KH, L, D]`` (L >= S: the S queries are the last S positions),
    padding_mask: None or bool ``[B, L]`` (True = real token), window: sliding window or None,
    position_ids ``[B or 1, S]`` (only used to find packed sequences when there is no past and no mask).
    """
    B, H, S, D = query.shape
    L = key.shape[2]
    if key.shape[0] != B or key.shape[3] != D or value.shape != key.shape or H % key.shape[1] or L < S:
        raise ValueError(f"atb attention: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)} do not fit [B, H, S, D] / [B, KH, L>=S, D] with H % KH == 0")
    if padding_mask is not None:
        if padding_mask.dim() != 2 or padding_mask.shape[0] != B or padding_mask.shape[1] != L:
            raise ValueError(f"atb attention: the padding mask must be bool [batch={B}, kv_len={L}], got "
                             f"{padding_mask.dim()}-D {tuple(padding_mask.shape)} (custom 4-D masks: patch with "
                             "attention=False)")
        if padding_mask.dtype != torch.bool:
            padding_mask = padding_mask.bool()
    if S == L:
        return _prefill(query, key, value, padding_mask, scale, window, position_ids, soc_type)
    return _with_past(query, key, value, padding_mask, scale, window, soc_type)
