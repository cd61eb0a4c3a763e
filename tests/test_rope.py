"""rope against the float64 reference and HF's own apply_rotary_pos_emb; strided views; tiling; bad input."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import atb
from atb import _C
from atb.kernels._common import DTYPE_CODES
from conftest import ALL_SOCS, forced_isa
from reference import DTYPES, assert_close, rope_ref


def hf_cos_sin(tokens, head_dim, dtype, offset=0, rope_theta=10000.0):
    """cos/sin [tokens, head_dim] exactly as HF's LlamaRotaryEmbedding builds them."""
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_theta=rope_theta)
    emb = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(offset, offset + tokens)[None]
    cos, sin = emb(torch.empty(1, dtype=dtype), pos)
    return cos[0], sin[0]


def rand_qk(tokens, heads, kv_heads, head_dim, dtype):
    return torch.randn(tokens, heads, head_dim).to(dtype), torch.randn(tokens, kv_heads, head_dim).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "interleave"])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,rotary",
                         [(1, 9, 3, 64, 64), (7, 4, 1, 128, 128), (123, 3, 3, 70, 70), (4097, 2, 1, 8, 8),
                          (7, 5, 1, 64, 32), (7, 3, 2, 7, 6), (1, 1, 1, 2, 2)])
def test_rope_matches_reference(dtype, style, tokens, heads, kv_heads, head_dim, rotary):
    q, k = rand_qk(tokens, heads, kv_heads, head_dim, dtype)
    cos, sin = torch.randn(tokens, rotary).to(dtype), torch.randn(tokens, rotary).to(dtype)
    qo, ko = atb.kernels.rope(q, k, cos, sin, style=style)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    assert_close(qo, rope_ref(q, cos, sin, style), scale=2)
    assert_close(ko, rope_ref(k, cos, sin, style), scale=2)
    # Partial rotary: the tail is copied bit for bit.
    assert torch.equal(qo[..., rotary:], q[..., rotary:]) and torch.equal(ko[..., rotary:], k[..., rotary:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (37, 32, 8, 128)])
def test_rope_is_bit_exact_with_hf(dtype, tokens, heads, kv_heads, head_dim):
    q, k = rand_qk(tokens, heads, kv_heads, head_dim, dtype)
    cos, sin = hf_cos_sin(tokens, head_dim, dtype, offset=5)
    qo, ko = atb.kernels.rope(q, k, cos, sin)
    # HF's layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim].
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(qo, qh[0].transpose(0, 1)) and torch.equal(ko, kh[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleave_is_bit_exact_with_gptj(dtype):
    tokens, heads, head_dim, rotary = 11, 4, 64, 32
    q, k = rand_qk(tokens, heads, 2, head_dim, dtype)
    freqs = torch.randn(tokens, rotary // 2)
    sin_h, cos_h = freqs.sin().to(dtype), freqs.cos().to(dtype)
    cos, sin = cos_h.repeat_interleave(2, -1), sin_h.repeat_interleave(2, -1)  # the layout rope expects
    qo, _ = atb.kernels.rope(q, k, cos, sin, style="interleave")
    expected = gptj_apply_rotary_pos_emb(q[None, ..., :rotary], sin_h[None], cos_h[None])[0]
    assert torch.equal(qo[..., :rotary], expected) and torch.equal(qo[..., rotary:], q[..., rotary:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_tables_are_rounded_like_hf(dtype):
    q, k = rand_qk(5, 3, 1, 64, dtype)
    cos, sin = hf_cos_sin(5, 64, torch.float32, offset=1000)
    qa, ka = atb.kernels.rope(q, k, cos, sin)
    qb, kb = atb.kernels.rope(q, k, cos.to(dtype), sin.to(dtype))
    assert torch.equal(qa, qb) and torch.equal(ka, kb)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_views_of_fused_qkv(dtype, inplace):
    tokens, heads, kv_heads, d = 123, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    original = qkv.clone()
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d: (heads + kv_heads) * d].view(tokens, kv_heads, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = hf_cos_sin(tokens, d, dtype)
    qr = rope_ref(q.clone(), cos, sin)
    kr = rope_ref(k.clone(), cos, sin)
    qo, ko = atb.kernels.rope(q, k, cos, sin, inplace=inplace)
    assert_close(qo, qr, scale=2)
    assert_close(ko, kr, scale=2)
    if inplace:
        assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()
        assert torch.equal(qkv[:, (heads + kv_heads) * d:], original[:, (heads + kv_heads) * d:])  # v untouched
    else:
        assert torch.equal(qkv, original) and qo.is_contiguous()


@pytest.mark.parametrize("inplace", [False, True])
def test_head_strided_and_copied_views(inplace):
    # Heads not adjacent (stride 2*D between heads) go through per-head UB rows.
    base = torch.randn(7, 6, 64)
    q = base[:, ::2]
    k = torch.randn(7, 64, 2).transpose(1, 2)  # last dim not contiguous: copied (rejected in place)
    cos, sin = torch.randn(7, 48), torch.randn(7, 48)
    qr, kr = rope_ref(q.clone(), cos, sin), rope_ref(k.clone(), cos, sin)
    if inplace:
        with pytest.raises(ValueError, match="k's last dim contiguous"):
            atb.kernels.rope(q, k, cos, sin, inplace=True)
        k = k.contiguous()
    other = base[:, 1::2].clone()
    qo, ko = atb.kernels.rope(q, k, cos, sin, inplace=inplace)
    assert_close(qo, qr)
    assert_close(ko, kr)
    assert torch.equal(base[:, 1::2], other)  # the rows between q's heads are never written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "interleave"])
def test_interleaved_head_views_in_place(dtype, style):
    # q = even heads, k = heads 1, 5, 9 of one buffer; head_dim 6 pads each UB row to 32 bytes.
    base = torch.randn(37, 10, 6).to(dtype)
    q, k = base[:, ::2], base[:, 1::4]
    cos, sin = torch.randn(37, 4).to(dtype), torch.randn(37, 4).to(dtype)
    soc = "Ascend910B4" if dtype != torch.bfloat16 else "Ascend910B1"
    qo, ko = atb.kernels.rope(q, k, cos, sin, style=style, soc_type=soc)
    assert_close(qo, rope_ref(q, cos, sin, style), scale=2)
    assert_close(ko, rope_ref(k, cos, sin, style), scale=2)
    b2 = base.clone()
    atb.kernels.rope(b2[:, ::2], b2[:, 1::4], cos, sin, style=style, inplace=True, soc_type=soc)
    assert torch.equal(b2[:, ::2], qo) and torch.equal(b2[:, 1::4], ko)
    untouched = [3, 7]  # heads in neither view
    assert torch.equal(b2[:, untouched], base[:, untouched])


@pytest.mark.parametrize("soc", ALL_SOCS)
def test_every_soc_gives_the_same_numbers(soc):
    q, k = rand_qk(300, 12, 4, 64, torch.float16)
    cos, sin = torch.randn(300, 64).half(), torch.randn(300, 64).half()
    a = atb.kernels.rope(q, k, cos, sin, soc_type=soc)
    b = atb.kernels.rope(q, k, cos, sin, soc_type="host")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_portable_path_agrees():
    q, k = rand_qk(33, 5, 1, 72, torch.bfloat16)
    cos, sin = torch.randn(33, 72).bfloat16(), torch.randn(33, 72).bfloat16()
    fast = atb.kernels.rope(q, k, cos, sin, style="interleave")
    with forced_isa("portable"):
        port = atb.kernels.rope(q, k, cos, sin, style="interleave")
    assert torch.equal(fast[0], port[0]) and torch.equal(fast[1], port[1])


def test_tiling_core_split_with_remainder():
    soc = atb.get_soc("Ascend910B4")  # 40 vector cores
    t = _C.rope_tiling(2049, 32, 8, 128, 128, DTYPE_CODES[torch.float16], soc)
    assert t["block_dim"] == 40 and t["block_factor"] == 52  # 39 x 52 + 1 x 21
    assert t["heads_per_loop"] == 32 and t["ub_bytes"] <= soc.ub_size
    # SmolLM2's 9 + 3 heads x 64 fp16: 52 tokens per core do not split evenly into tiles (a partial last tile).
    t = _C.rope_tiling(2049, 9, 3, 64, 64, DTYPE_CODES[torch.float16], soc)
    assert t["block_factor"] == 52 and 1 < t["tokens_per_loop"] < 52 and 52 % t["tokens_per_loop"] != 0
    q, k = rand_qk(2049, 9, 3, 64, torch.float16)
    cos, sin = hf_cos_sin(2049, 64, torch.float16)
    qo, ko = atb.kernels.rope(q, k, cos, sin, soc_type="Ascend910B4")
    assert_close(qo, rope_ref(q, cos, sin), scale=2)
    assert_close(ko, rope_ref(k, cos, sin), scale=2)
    t = _C.rope_tiling(3, 9, 3, 64, 64, 0, soc)
    assert t["block_dim"] == 3 and t["block_factor"] == 1 and t["tokens_per_loop"] == 1
    t = _C.rope_tiling(1, 9, 3, 64, 64, 2, atb.get_soc("host"))
    assert t["block_dim"] == 1 and t["tiling_key"] == 2 * 100 + 2 * 10 + 0


def test_tiling_ub_fit_and_head_chunks():
    soc = atb.get_soc("Ascend910B4")  # 192 KiB UB
    # 128 heads x 512 fp32 = 256 KiB per token: heads are walked in chunks.
    t = _C.rope_tiling(5, 128, 8, 512, 512, 0, soc)
    assert t["tokens_per_loop"] == 1 and 1 <= t["heads_per_loop"] < 128 and t["ub_bytes"] <= soc.ub_size
    assert t["head_pitch"] == 512
    t = _C.rope_tiling(5, 4, 4, 7, 6, DTYPE_CODES[torch.float16], soc)
    assert t["head_pitch"] == 16  # 7 fp16 = 14 bytes, padded to one 32-byte block
    q, k = rand_qk(5, 128, 8, 512, torch.float32)
    cos, sin = torch.randn(5, 512), torch.randn(5, 512)
    qo, ko = atb.kernels.rope(q, k, cos, sin, soc_type="Ascend910B4")
    assert_close(qo, rope_ref(q, cos, sin))
    assert_close(ko, rope_ref(k, cos, sin))
    with pytest.raises(ValueError, match="bytes of UB"):
        _C.rope_tiling(1, 1, 1, 40000, 40000, 0, soc)  # one fp32 head of 160 KB cannot double-buffer in 192 KiB


def test_bf16_rejected_on_socs_without_it():
    q, k = rand_qk(2, 2, 1, 64, torch.bfloat16)
    cos = torch.randn(2, 64).bfloat16()
    for soc in ("Ascend910", "Ascend310P3"):
        with pytest.raises(ValueError, match="bfloat16.*" + soc):
            atb.kernels.rope(q, k, cos, cos, soc_type=soc)


def test_empty_tokens():
    q, k = rand_qk(0, 4, 2, 64, torch.float32)
    cos = torch.empty(0, 64)
    qo, ko = atb.kernels.rope(q, k, cos, cos)
    assert qo.shape == (0, 4, 64) and ko.shape == (0, 2, 64)


def test_bad_inputs_raise_clear_errors():
    q, k = rand_qk(4, 4, 2, 64, torch.float32)
    cos, sin = torch.randn(4, 64), torch.randn(4, 64)
    rope = atb.kernels.rope
    with pytest.raises(ValueError, match="q must be 3-D"):
        rope(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="k has shape \\(3, 2, 64\\)"):
        rope(q, k[:3], cos, sin)
    with pytest.raises(ValueError, match="cos has shape \\(5, 64\\), expected \\[4, rotary_dim\\]"):
        rope(q, k, torch.randn(5, 64), sin)
    with pytest.raises(ValueError, match="sin has shape"):
        rope(q, k, cos, sin[:, :32])
    with pytest.raises(ValueError, match="rotary_dim.*even.*got 33"):
        rope(q, k, cos[:, :33], sin[:, :33])
    with pytest.raises(ValueError, match="head_dim=64\\], got 66"):
        rope(q, k, torch.randn(4, 66), torch.randn(4, 66))
    with pytest.raises(TypeError, match="k is torch.float16 but q is torch.float32"):
        rope(q, k.half(), cos, sin)
    with pytest.raises(TypeError, match="cos/sin must be torch.float16.*or torch.float32, got torch.bfloat16"):
        rope(q.half(), k.half(), cos.bfloat16(), sin.bfloat16())
    with pytest.raises(TypeError, match="sin is torch.float16 but cos is torch.float32"):
        rope(q, k, cos, sin.half())
    with pytest.raises(TypeError, match="cos must be float32, float16 or bfloat16, got torch.int64"):
        rope(q, k, torch.ones(4, 64, dtype=torch.long), sin)
    with pytest.raises(ValueError, match="style must be 'neox' or 'interleave', got 'gptj'"):
        rope(q, k, cos, sin, style="gptj")
    with pytest.raises(ValueError, match="rows not to overlap"):
        rope(q[:1].expand(4, 4, 64), k, cos, sin, inplace=True)
    with pytest.raises(ValueError, match="at least one head"):
        rope(q[:, :0], k, cos, sin)
    with pytest.raises(ValueError, match="unknown SoC"):
        rope(q, k, cos, sin, soc_type="Ascend000")


# ---- in place with q and k sharing memory ------------------------------------------------------------------------


def test_inplace_rejects_k_overlapping_q():
    cos, sin = hf_cos_sin(5, 16, torch.float32)
    buf = torch.randn(5, 6, 16)
    q, k = buf[:, :4], buf[:, 2:6]             # heads 2 and 3 are in both
    before = buf.clone()
    with pytest.raises(ValueError, match="rope: inplace=True needs q and k not to overlap in memory"):
        atb.kernels.rope(q, k, cos, sin, inplace=True)
    assert torch.equal(buf, before)            # rejected before anything was written
    with pytest.raises(ValueError, match="q and k not to overlap"):
        atb.kernels.rope(buf, buf, cos, sin, inplace=True)
    # the same views out of place are fine: inputs are only read
    qo, ko = atb.kernels.rope(q, k, cos, sin)
    assert_close(qo, rope_ref(q, cos, sin))
    assert_close(ko, rope_ref(k, cos, sin))


def test_inplace_rejects_interleaved_overlap_and_cos_in_q():
    cos, sin = hf_cos_sin(4, 8, torch.float32)
    buf = torch.randn(4 * 3 * 8 + 8)
    q = buf[:96].view(4, 3, 8)
    k = buf[8:104].view(4, 3, 8)[:, :1]        # token t's k row is q's head 1 of token t
    with pytest.raises(ValueError, match="q and k not to overlap"):
        atb.kernels.rope(q, k, cos, sin, inplace=True)
    qq = torch.randn(4, 2, 8)
    before = qq.clone()
    with pytest.raises(ValueError, match="rope: inplace=True needs cos/sin not to overlap q or k"):
        atb.kernels.rope(qq, torch.randn(4, 1, 8), qq.view(-1)[:32].view(4, 8), sin, inplace=True)
    assert torch.equal(qq, before)
    # a strided cos is copied before the kernel runs, so it may alias q
    q_ref = rope_ref(qq, qq[:, 0].clone(), sin)
    atb.kernels.rope(qq, torch.randn(4, 1, 8), qq[:, 0], sin, inplace=True)
    assert_close(qq, q_ref)


@pytest.mark.parametrize("tokens", [1, 5])
def test_inplace_on_fused_qkv_views_is_allowed(tokens):
    # q, k, v sliced from one QKV projection output share storage but never an element.
    heads, kv, d = 4, 2, 16
    cos, sin = hf_cos_sin(tokens, d, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv) * d)
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv) * d].view(tokens, kv, d)
    q_ref, k_ref = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
    v_before = qkv[:, (heads + kv) * d:].clone()
    atb.kernels.rope(q, k, cos, sin, inplace=True)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(qkv[:, (heads + kv) * d:], v_before)
    # k before q in the row, and q's heads with gaps between them, go through the exact check
    qkv = torch.randn(tokens, 2, 3, d)
    q, k = qkv[:, 0, ::2], qkv[:, 0, 1:2]
    q_ref, k_ref = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
    atb.kernels.rope(q, k, cos, sin, inplace=True)
    assert_close(q, q_ref)
    assert_close(k, k_ref)


def test_zero_tokens():
    cos, sin = hf_cos_sin(0, 8, torch.float32)
    q, k = torch.randn(0, 2, 8), torch.randn(0, 1, 8)
    for inplace in (False, True):
        qo, ko = atb.kernels.rope(q, k, cos, sin, inplace=inplace)
        assert qo.shape == q.shape and ko.shape == k.shape


def test_tiling_rejects_zero_work():
    for tokens, heads, kv in ((0, 2, 1), (3, 0, 1), (3, 2, 0)):
        with pytest.raises(ValueError, match="rope tiling: tokens, heads, kv_heads and"):
            _C.rope_tiling(tokens, heads, kv, 8, 8, DTYPE_CODES[torch.float32], atb.get_soc("host"), -1, False)
