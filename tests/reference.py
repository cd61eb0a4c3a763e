"""float64 torch references for every kernel, and the tolerance table.

References compute in float64 from the inputs as given (already rounded to
their dtype); a kernel's output, compared in float64, must be within
TOLERANCES[dtype] of the reference.
"""
from __future__ import annotations

import torch

# (atol, rtol) by dtype: fp32 accumulates in fp32 (error grows ~sqrt(K) ulp);
# fp16/bf16 outputs carry one final rounding (2^-11, 2^-8 relative) plus the
# intermediate roundings HF itself performs.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0):
    """Compares in float64 with the dtype's tolerance (times ``scale``)."""
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm in float64: normalize, round to x's dtype, scale by weight."""
    h = x.double()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    return weight.double() * normed


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """PRENORM: h = x + residual (rounded to the dtype, as HF adds in the dtype); (rms_norm(h), h)."""
    h = (x.double() + residual.double()).to(x.dtype)
    return rms_norm_ref(h, weight, eps), h.double()


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox") -> torch.Tensor:
    """RoPE in float64 on x [tokens, heads, head_dim]; cos/sin [tokens, rotary_dim], used as rounded to x's dtype.

    neox: x*cos + cat(-x2, x1)*sin over the first rotary_dim columns (x1, x2 its halves);
    interleave (GPT-J): pairs (2i, 2i+1) with rotate = (-x[2i+1], x[2i]). The tail passes through.
    Each product is rounded to x's dtype before the add, as HF's separate ops do (without that, a sum that
    cancels is off by more than the dtype's relative tolerance).
    """
    r = cos.shape[-1]
    c = cos.to(x.dtype).double()[:, None, :]
    s = sin.to(x.dtype).double()[:, None, :]
    xd = x.double()
    xr = xd[..., :r]
    if style == "neox":
        rot = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), dim=-1)
    else:
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat(((xr * c).to(x.dtype).double() + (rot * s).to(x.dtype).double(), xd[..., r:]), dim=-1)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64 (HF's act_fn(gate_proj(x)) * up_proj(x))."""
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :n]) * x[..., n:] in float64, n = x.shape[-1] // 2."""
    n = x.shape[-1] // 2
    return silu_mul_ref(x[..., :n], x[..., n:])
def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias in float64 (one rounding to x's dtype happens in the kernel's output)."""
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def linear_residual_ref(x, weight, residual, bias=None) -> torch.Tensor:
    """HF o_proj/down_proj then the residual add, each rounded to the dtype as HF's separate ops are."""
    return linear_ref(x, weight, bias).to(x.dtype).double() + residual.double()


def linear_swiglu_ref(x, gate_weight, up_weight) -> torch.Tensor:
    """LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) with HF's roundings between ops."""
    g = linear_ref(x, gate_weight).to(x.dtype).double()
    u = linear_ref(x, up_weight).to(x.dtype).double()
    return torch.nn.functional.silu(g).to(x.dtype).double() * u




def quant_dequant_ref(qw) -> torch.Tensor:
    """A QuantizedWeight's float64 [N, K] weight from its stored bytes: scale[g] * q (+ min[g]), g = k // group.

    w4: each 32-value chunk is 16 bytes, byte j = value j (low nibble) | value j + 16 (high nibble).
    """
    n, k = qw.shape
    kp = -(-k // 32) * 32
    if qw.bits == 8:
        q = qw.data.double()
    else:
        b = qw.data.reshape(n, kp // 32, 16).to(torch.int64)
        q = torch.cat((b & 15, b >> 4), dim=-1).reshape(n, kp).double()
    g = kp if qw.group_size == 0 else qw.group_size
    gi = torch.arange(kp) // g
    w = q * qw.scale.double()[:, gi]
    if qw.bits == 4:
        w = w + qw.min.double()[:, gi]
    return w[:, :k]


def quant_weight_ref(qw, x: torch.Tensor, launch=None, epilogue: int = 0, soc_type: str = "host") -> torch.Tensor:
    """The float64 [N, K] weight a quantized linear multiplies x by: ``quant_dequant_ref``, except under bf16 x
    in a launch that takes the k-pair-packed dp GEMM (``quant_linear_tiling``'s form "packed"), which
    multiplies by the dequantized weights rounded to bf16 (pack_q4/q8_pairs_dequant: dequantized in fp32,
    then to nearest even). ``launch``: every QuantizedWeight of the call (default: qw alone); ``epilogue``:
    0 plain / bias, 1 residual, 2 SwiGLU (gate and up both in ``launch``)."""
    import atb
    from atb import _C
    from atb.kernels._common import DTYPE_CODES

    w = quant_dequant_ref(qw)
    if x.dtype != torch.bfloat16 or x.numel() == 0:
        return w
    rows, k = x.reshape(-1, x.shape[-1]).shape
    segs = [(0, 0, 0, 0, 0, q.shape[0], q.bits, q.group_size, DTYPE_CODES[q.scale.dtype]) for q in (launch or [qw])]
    tiling = _C.quant_linear_tiling(rows, k, segs, epilogue, DTYPE_CODES[torch.bfloat16], atb.get_soc(soc_type))
    return w.float().bfloat16().double() if tiling["form"] == "packed" else w


def reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping):
    """New (key_cache, value_cache): token i's rows at slot slot_mapping[i] (negative = skipped)."""
    kc, vc = key_cache.clone(), value_cache.clone()
    nb, bs = kc.shape[:2]
    for i, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            kc[s // bs, s % bs] = key[i]
            vc[s // bs, s % bs] = value[i]
    return kc, vc


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, kv_heads, head_dim]: positions 0..length-1 of one sequence, read through its block table."""
    bs = cache.shape[1]
    pos = torch.arange(length)
    return cache[block_table.long()[pos // bs], pos % bs]


def paged_attention_ref(q, key_cache, value_cache, block_tables, context_lens, scale=None, q_lens=None, window=None):
    """float64 attention of each sequence's queries (the last q_lens[b] positions of its
    context, causal; one per sequence without q_lens) over its K/V read through block_tables."""
    rows, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    q_lens = [1] * len(context_lens) if q_lens is None else q_lens.tolist()
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    start = 0
    for b, (ctx, ql) in enumerate(zip(context_lens.tolist(), q_lens)):
        k = gather_kv(key_cache, block_tables[b], ctx).double().repeat_interleave(heads // kv_heads, dim=1)
        v = gather_kv(value_cache, block_tables[b], ctx).double().repeat_interleave(heads // kv_heads, dim=1)
        qb = q[start:start + ql].double()
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        p = torch.arange(ctx - ql, ctx)[:, None]
        j = torch.arange(ctx)[None, :]
        visible = j <= p
        if window is not None:
            visible &= j > p - window
        s = s.masked_fill(~visible, float("-inf"))
        out[start:start + ql] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
        start += ql
    return out


def flash_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, scale: float | None = None,
                        causal: bool = True, window: int | None = None) -> torch.Tensor:
    """Attention per packed sequence in float64: q [T, H, D], k/v [T, KH, D], GQA by repeating kv heads.

    Query i of a sequence sees key j when (not causal or j <= i) and, with a window,
    i - window < j (and j < i + window when not causal).
    """
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    cu = [int(x) for x in cu_seqlens]
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        qs = q[s:e].double().transpose(0, 1)                                    # [H, L, D]
        ks = k[s:e].double().transpose(0, 1).repeat_interleave(group, 0)        # [H, L, D]
        vs = v[s:e].double().transpose(0, 1).repeat_interleave(group, 0)
        scores = qs @ ks.transpose(1, 2) * scale                                # [H, L, L]
        i = torch.arange(e - s).view(-1, 1)
        j = torch.arange(e - s).view(1, -1)
        visible = torch.ones(e - s, e - s, dtype=torch.bool)
        if causal:
            visible &= j <= i
        if window is not None:
            visible &= i - window < j
            if not causal:
                visible &= j < i + window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[s:e] = (torch.softmax(scores, -1) @ vs).transpose(0, 1)
    return out
