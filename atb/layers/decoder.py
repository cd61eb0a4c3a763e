"""The decoder layer of the Python executor, written once.

Every Python path runs these functions over a `LayerWeights` (the one layer
description): ``TransformerInfer``'s prefill and decode at every batch size,
and the modules ``atb.patch_hf_model`` binds onto HF's attention, MLP and
decoder-layer classes. Projections go through ``atb.layers.linear`` (the one
routing point); the attention core is the caller's (``attend``): flash or paged
attention over the engine's KV cache, or HF's cache and attention interface in
a patched model. That is vLLM's split: the layer is fixed, the attention
backend is swapped through its metadata.

Tensors are token-major: ``x [T, hidden]``, q ``[T, H, D]``, k/v ``[T, KH, D]``,
cos/sin ``[T, rotary_dim]`` (the rows of each token's position).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from atb import _C
from atb import kernels as K
from atb.layers.linear import ROUTE_POLICY, ROUTE_ROW_INVARIANT, linear, linear_multi, swiglu
from atb.quant.formats import QuantizedWeight


@dataclass(frozen=True)
class AttentionShape:
    """What the layer needs besides its weights: head counts, norm epsilon, HF's attention ``scaling``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float

    @classmethod
    def from_spec(cls, spec, scale: float) -> "AttentionShape":
        return cls(spec.num_heads, spec.num_kv_heads, spec.head_dim, float(spec.rms_norm_eps), float(scale))


def qkv_rope(h: torch.Tensor, w, s: AttentionShape, cos: torch.Tensor, sin: torch.Tensor, *,
             soc_type: str | None = None, route: str = ROUTE_POLICY) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v projections of the normed input ``h [T, hidden]``, q/k RMSNorm (Qwen3), rope in place."""
    T = h.shape[0]
    q, k, v = linear_multi(h, (w.q, w.k, w.v), (w.q_bias, w.k_bias, w.v_bias), soc_type=soc_type, route=route)
    q, k, v = q.view(T, s.num_heads, s.head_dim), k.view(T, s.num_kv_heads, s.head_dim), v.view(T, s.num_kv_heads,
                                                                                                 s.head_dim)
    if w.q_norm is not None:
        q = K.rms_norm(q, w.q_norm, s.eps, soc_type=soc_type)
        k = K.rms_norm(k, w.k_norm, s.eps, soc_type=soc_type)
    K.rope(q, k, cos, sin, inplace=True, soc_type=soc_type)
    return q, k, v


def o_proj(out: torch.Tensor, w, residual: torch.Tensor | None = None, *, soc_type: str | None = None,
           route: str = ROUTE_POLICY) -> torch.Tensor:
    """The attention output projection of ``out [T, H*D]`` (+ residual, fused where native)."""
    return linear(out, w.o, w.o_bias, residual=residual, soc_type=soc_type, route=route)


def mlp(h: torch.Tensor, w, residual: torch.Tensor | None = None, *, soc_type: str | None = None,
        route: str = ROUTE_POLICY) -> torch.Tensor:
    """SwiGLU MLP of ``h [T, hidden]``: ``down(silu(gate(h)) * up(h))`` (+ residual, fused where native)."""
    a = swiglu(h, w.gate, w.up, w.gate_bias, w.up_bias, soc_type=soc_type, route=route)
    return linear(a, w.down, w.down_bias, residual=residual, soc_type=soc_type, route=route)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decoder_layer(x: torch.Tensor, w, s: AttentionShape, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, *,
                  soc_type: str | None = None, tp=None, route: str = ROUTE_POLICY) -> torch.Tensor:
    """One pre-norm decoder layer over ``x [T, hidden]``; ``attend(q, k, v) -> [T, H, D]`` is the attention core
    (it also writes the KV cache). The residual adds are fused into o_proj and down_proj. ``route``: how every
    projection picks its kernel (``atb.layers.linear``).

    ``tp`` (an ``atb.distributed.TensorParallel``): ``w`` is this rank's shard, the o and down projections
    give partial sums that ``tp.all_reduce`` adds up; rank 0 alone adds the residual (fused, as without tp)."""
    own = tp is None or tp.rank == 0
    h = K.rms_norm(x, w.input_norm, s.eps, soc_type=soc_type)
    q, k, v = qkv_rope(h, w, s, cos, sin, soc_type=soc_type, route=route)
    x = o_proj(attend(q, k, v).view(x.shape[0], -1), w, x if own else None, soc_type=soc_type, route=route)
    if tp is not None:
        tp.all_reduce(x)
    h = K.rms_norm(x, w.post_attention_norm, s.eps, soc_type=soc_type)
    x = mlp(h, w, x if own else None, soc_type=soc_type, route=route)
    if tp is not None:
        tp.all_reduce(x)
    return x


def lm_head(x: torch.Tensor, final_norm: torch.Tensor, head, eps: float, *, soc_type: str | None = None,
            route: str = ROUTE_POLICY) -> torch.Tensor:
    """Final RMSNorm and the LM head projection: logits ``[T, vocab]``."""
    h = K.rms_norm(x, final_norm, eps, soc_type=soc_type)
    if route == ROUTE_ROW_INVARIANT and h.shape[0]:
        # The engine prefill's LM head sees one row per prompt. Those rows through the native STREAM kernel
        # are as row-invariant as the GEMM kernel at any M, and far cheaper: for a few rows the GEMM kernel
        # packs the whole vocabulary's weights (fp32 SmolLM2: ~50 ms, against ~4 ms a row). The STREAM
        # kernel computes a row the same way at every M it takes, so float heads go a few rows per call
        # (one weight pass for them all: bf16 SmolLM2, 16 rows 34 -> ~11 ms); quantized ones one at a time
        # (their STREAM kernel switches micro-kernels by M on some tables).
        step = 1 if isinstance(head, QuantizedWeight) else _C.LINEAR_STREAM_MAX_ROWS
        return torch.cat([K.linear(h[i:i + step], head, soc_type=soc_type) for i in range(0, h.shape[0], step)])
    return linear(h, head, soc_type=soc_type, route=route)
