"""Per-layer latency of one decoder layer: stock HF modules vs the engine's own layer code.

For a decode shape (``batch`` new tokens over a ``context``-token KV cache)
and a prefill shape (``prompt_len`` tokens), every row times the stock HF code
and the piece of ``atb.layers.decoder`` (the Python executor, with its
projections routed by ``atb.layers.linear``) that replaces it, on the same
inputs and weights (layer 0 of the model), and reports bytes moved, achieved GB/s (GFLOP/s for GEMM-bound
rows) and the fraction of this machine's roofline measured in the same run:
``roofline = max(bytes / bandwidth, flops / gemm_peak) / atb_time``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import atb
from atb.bench.roofline import Machine, time_us
from atb.layers import decoder
from atb.layers import linear as routed

ROW_NAMES = [
    "embedding", "input_norm", "qkv_proj", "rope", "kv_cache_write", "attention", "o_proj_residual",
    "post_norm", "mlp_gate_up_swiglu", "mlp_down_residual", "final_norm", "lm_head",
]


@dataclass
class LayerRow:
    phase: str        # "decode" or "prefill"
    name: str
    shape: str
    stock_us: float
    atb_us: float
    bytes: int
    flops: int
    gbps: float
    gflops: float
    roofline: float   # fraction of the machine's limit the atb time reaches
    bound: str        # "memory" or "compute"

    @property
    def speedup(self) -> float:
        return self.stock_us / self.atb_us if self.atb_us > 0 else float("nan")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["speedup"] = self.speedup
        return d


def _hf_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def layer_table(model, *, phase: str, batch: int, tokens: int, context: int, machine: Machine, repeat: int,
                soc_type: str | None = None, progress=None) -> list[LayerRow]:
    """Times every row of one decoder layer (layer 0 of ``model``) for one phase.

    decode: ``batch`` sequences, 1 new token each, ``context`` tokens already cached.
    prefill: ``batch`` sequences of ``tokens`` tokens (HF's generate computes the
    lm_head on the last token only, and so does atb).
    """
    from atb.registry import get_adapter

    cfg = model.config
    adapter = get_adapter(cfg)
    spec = adapter.spec
    lw = adapter.layer_weights(model, 0)
    dtype = next(model.parameters()).dtype
    esz = torch.finfo(dtype).bits // 8
    hf_layer = model.model.layers[0]
    attn = hf_layer.self_attn
    H, KH, D, hid = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden
    inter = spec.intermediate
    q_len = 1 if phase == "decode" else tokens
    ctx = context if phase == "decode" else tokens
    T = batch * q_len  # new tokens this step

    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    ids = torch.randint(0, spec.vocab, (batch, q_len), generator=g)
    x = rnd(batch, q_len, hid)
    x2 = x.view(T, hid)
    positions = torch.arange(ctx - q_len, ctx).repeat(batch, 1)
    cos, sin = model.model.rotary_emb(x, positions)  # [B, q_len, rotary_dim]
    q4, k4, v4 = rnd(batch, H, q_len, D), rnd(batch, KH, q_len, D), rnd(batch, KH, q_len, D)
    q3, k3, v3 = (t.transpose(1, 2).reshape(T, -1, D).contiguous() for t in (q4, k4, v4))
    cos2, sin2 = cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous()
    apply_rope = _hf_rope()
    sdpa = _sdpa()

    # The KV cache at this step: HF keeps [B, KH, ctx, D] and torch.cat's the new
    # token on; atb keeps a paged pool written in place through slot_mapping.
    block_size = 128
    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = batch * blocks_per_seq
    k_hist, v_hist = rnd(batch, KH, ctx - q_len, D), rnd(batch, KH, ctx - q_len, D)
    k_full, v_full = torch.cat([k_hist, k4], 2), torch.cat([v_hist, v4], 2)
    key_cache = torch.zeros(num_blocks, block_size, KH, D, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    block_tables = torch.arange(num_blocks, dtype=torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32)
    all_slots = torch.arange(ctx, dtype=torch.int32)
    for b in range(batch):  # fill the paged cache with the same history
        slots = (block_tables[b, all_slots // block_size] * block_size + all_slots % block_size).to(torch.int32)
        atb.kernels.reshape_and_cache(k_full[b].transpose(0, 1), v_full[b].transpose(0, 1), key_cache, value_cache, slots)
    new_pos = torch.arange(ctx - q_len, ctx, dtype=torch.int32)
    slot_mapping = torch.cat([block_tables[b, new_pos // block_size] * block_size + new_pos % block_size
                              for b in range(batch)]).to(torch.int32)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    attn_out = rnd(batch, q_len, H * D)
    residual = rnd(batch, q_len, hid)
    mlp_mid = rnd(T, inter)
    last = x[:, -1:, :]
    lm_w = adapter.lm_head(model)
    embed_w = adapter.embed_tokens(model)
    final_w = adapter.final_norm(model)
    eps = spec.rms_norm_eps
    decode = phase == "decode"
    res2 = residual.view(T, hid)

    def attention_atb():
        if decode:
            return atb.kernels.paged_attention(q3, key_cache, value_cache, block_tables, context_lens, soc_type=soc_type)
        return atb.kernels.flash_attention(q3, k3, v3, cu, soc_type=soc_type)

    stock_mask = None
    kv_bytes = 2 * batch * ctx * KH * D * esz
    W = lambda *ws: sum(w.numel() for w in ws) * esz  # noqa: E731
    rows = [
        # name, stock fn, atb fn, bytes, flops
        ("embedding", lambda: model.model.embed_tokens(ids), lambda: F.embedding(ids, embed_w),
         2 * T * hid * esz, 0),
        ("input_norm", lambda: hf_layer.input_layernorm(x), lambda: atb.kernels.rms_norm(x2, lw.input_norm, eps, soc_type=soc_type),
         2 * T * hid * esz + hid * esz, 0),
        ("qkv_proj", lambda: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
         lambda: routed.linear_multi(x2, (lw.q, lw.k, lw.v), (lw.q_bias, lw.k_bias, lw.v_bias), soc_type=soc_type),
         W(lw.q, lw.k, lw.v) + T * (hid + (H + 2 * KH) * D) * esz, 2 * T * hid * (H + 2 * KH) * D),
        ("rope", lambda: apply_rope(q4, k4, cos, sin), lambda: atb.kernels.rope(q3, k3, cos2, sin2, soc_type=soc_type),
         2 * T * (H + KH) * D * esz + 2 * cos2.numel() * esz, 0),
        ("kv_cache_write", lambda: (torch.cat([k_hist, k4], 2), torch.cat([v_hist, v4], 2)),
         lambda: atb.kernels.reshape_and_cache(k3, v3, key_cache, value_cache, slot_mapping),
         2 * T * KH * D * esz * 2, 0),
        ("attention", lambda: sdpa(attn, q4, k_full, v_full, stock_mask, scaling=attn.scaling, is_causal=not decode),
         attention_atb, kv_bytes + 2 * T * H * D * esz, 4 * batch * H * D * (q_len * ctx if decode else q_len * (q_len + 1) // 2)),
        ("o_proj_residual", lambda: residual + attn.o_proj(attn_out),
         lambda: decoder.o_proj(attn_out.view(T, -1), lw, res2, soc_type=soc_type),
         W(lw.o) + T * (H * D + 2 * hid) * esz, 2 * T * H * D * hid),
        ("post_norm", lambda: hf_layer.post_attention_layernorm(x),
         lambda: atb.kernels.rms_norm(x2, lw.post_attention_norm, eps, soc_type=soc_type),
         2 * T * hid * esz + hid * esz, 0),
        ("mlp_gate_up_swiglu", lambda: hf_layer.mlp.act_fn(hf_layer.mlp.gate_proj(x)) * hf_layer.mlp.up_proj(x),
         lambda: routed.swiglu(x2, lw.gate, lw.up, lw.gate_bias, lw.up_bias, soc_type=soc_type),
         W(lw.gate, lw.up) + T * (hid + inter) * esz, 4 * T * hid * inter),
        ("mlp_down_residual", lambda: residual + hf_layer.mlp.down_proj(mlp_mid),
         lambda: routed.linear(mlp_mid, lw.down, lw.down_bias, residual=res2, soc_type=soc_type),
         W(lw.down) + T * (inter + 2 * hid) * esz, 2 * T * inter * hid),
        ("final_norm", lambda: model.model.norm(x), lambda: atb.kernels.rms_norm(x2, final_w, eps, soc_type=soc_type),
         2 * T * hid * esz + hid * esz, 0),
        ("lm_head", lambda: model.lm_head(last), lambda: routed.linear(last.reshape(batch, hid), lm_w, soc_type=soc_type),
         W(lm_w) + batch * (hid + spec.vocab) * esz, 2 * batch * hid * spec.vocab),
    ]
    out = []
    with torch.inference_mode():
        for i, (name, stock, fused, nbytes, flops) in enumerate(rows):
            if progress:
                progress(f"{phase}: {name}", i, len(rows))
            t_stock = time_us(stock, repeat=repeat) * 1e-6
            t_atb = time_us(fused, repeat=repeat) * 1e-6
            t_floor = machine.floor_seconds(nbytes, flops)
            bound = machine.bound(nbytes, flops)
            shape = f"B={batch} T={T} ctx={ctx}" if decode else f"B={batch} S={q_len}"
            out.append(LayerRow(phase, name, shape, t_stock * 1e6, t_atb * 1e6, int(nbytes), int(flops),
                                nbytes / t_atb / 1e9, flops / t_atb / 1e9, t_floor / t_atb, bound))
    return out


def format_table(rows: list[LayerRow]) -> str:
    head = f"{'layer':<24}{'shape':<22}{'stock µs':>10}{'atb µs':>10}{'speedup':>9}{'MB':>9}{'GB/s':>8}{'GFLOP/s':>9}{'roofline':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<24}{r.shape:<22}{r.stock_us:>10.1f}{r.atb_us:>10.1f}{r.speedup:>8.2f}x"
                     f"{r.bytes / 1e6:>9.2f}{r.gbps:>8.1f}{r.gflops:>9.1f}{r.roofline * 100:>9.0f}%")
    tot_s = sum(r.stock_us for r in rows)
    tot_a = sum(r.atb_us for r in rows)
    lines.append(f"{'total (one layer + head)':<46}{tot_s:>10.1f}{tot_a:>10.1f}{tot_s / tot_a:>8.2f}x")
    return "\n".join(lines)
