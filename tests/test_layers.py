"""atb.layers: rotary tables against HF's own rotary modules, the HF-layout attention core, the executor's MLP and
attention pieces against HF."""
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from atb import kernels as K
from atb.layers.decoder import lm_head
from atb.layers.linear import ROUTE_ROW_INVARIANT
from atb.layers.rotary import RotaryEmbedding
from atb.quant import quantize_weight
from conftest import family_model, family_names
from reference import assert_close

BASE = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=1,
            max_position_embeddings=64, vocab_size=100)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_hf_exactly(rope, dtype):
    config = AutoConfig.for_model("llama", rope_parameters=ROPES[rope], **BASE)
    hf, ours = LlamaRotaryEmbedding(config), RotaryEmbedding(config, max_positions=8)
    x = torch.zeros(1, dtype=dtype)
    # Within the table, past it (growth), and for dynamic: scaled (>64), still scaled (70 < cached 100), reset (<64).
    calls = [torch.arange(10)[None], torch.tensor([[40, 3]]), torch.arange(100).view(2, 50), torch.tensor([[70]]),
             torch.tensor([[5]]), torch.randint(0, 63, (3, 7))]
    for pos in calls:
        hc, hs = hf(x, pos)
        oc, os_ = ours.cos_sin(pos, dtype)
        assert oc.shape == hc.shape and oc.dtype == dtype
        assert torch.equal(oc, hc) and torch.equal(os_, hs), f"{rope} differs at positions {pos.tolist()}"


# A fresh process: kernels run on the OpenMP team (its threads stay awake), then the process's first rope table.
_FIRST_TABLE_AFTER_KERNELS = """
import torch, atb
from transformers import AutoConfig
from atb.layers.rotary import RotaryEmbedding
x, w = torch.randn(8, 576, dtype=torch.bfloat16), torch.randn(1536, 576, dtype=torch.bfloat16)
for _ in range(20):
    atb.kernels.linear(x, w)
config = AutoConfig.for_model("llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                              intermediate_size=64, num_hidden_layers=1, max_position_embeddings=8192, vocab_size=100,
                              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
rotary = RotaryEmbedding(config, max_positions=128)
cos, sin = rotary.table(torch.float32)
args = torch.arange(128)[:, None].float() * rotary.inv_freq
args = torch.cat((args, args), -1).double()
print(max((cos - args.cos()).abs().max().item(), (sin - args.sin()).abs().max().item()))
"""


def test_first_rotary_table_is_accurate_after_kernels_ran():
    # Without atb.layers.rotary._set_up_vector_math, half of this table's cos came out ~12 bits accurate (errors
    # ~1.5e-4) in 3 of 20 fresh processes on an AMX Xeon, so five catch a regression about half the time;
    # cos/sin rounded to float32 are within 6e-8.
    for attempt in range(5):
        run = subprocess.run([sys.executable, "-c", _FIRST_TABLE_AFTER_KERNELS], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        err = float(run.stdout.split()[-1])
        assert err < 1e-6, f"attempt {attempt}: the first rope table is off by {err:.1e}"


def test_rotary_from_hf_module_and_partial_rotary():
    config = AutoConfig.for_model("llama", rope_parameters=ROPES["default"], **BASE)
    hf = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding.from_hf(hf)
    assert ours.rotary_dim == 24 and torch.equal(ours.inv_freq, hf.inv_freq)
    rp = dict(ROPES["yarn"], partial_rotary_factor=0.5)
    partial = RotaryEmbedding(AutoConfig.for_model("llama", rope_parameters=rp, **BASE))
    assert partial.rotary_dim == 12
    cos, sin = partial.cos_sin(torch.arange(5), torch.float32)
    assert cos.shape == (5, 12) and torch.equal(cos[:, :6], cos[:, 6:])


def test_rotary_errors():
    config = AutoConfig.for_model("llama", rope_parameters=ROPES["default"], **BASE)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        RotaryEmbedding(config).cos_sin(torch.tensor([-1, 2]))
    bad = AutoConfig.for_model("llama", **BASE)
    bad.rope_parameters = {"rope_type": "longrope", "rope_theta": 1.0}
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported; supported: default"):
        RotaryEmbedding(bad)


def _sdpa_reference(q, k, v, mask2d, scale, window, q_positions=None):
    """float64 causal attention in HF layout: q [B,H,S,D] at the last S of L positions, k/v [B,KH,L,D]."""
    B, H, S, D = q.shape
    KH, L = k.shape[1], k.shape[2]
    k = k.double().repeat_interleave(H // KH, 1)
    v = v.double().repeat_interleave(H // KH, 1)
    i = torch.arange(L - S, L)[:, None]
    j = torch.arange(L)[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (j > i - window)
    allowed = allowed[None].expand(B, S, L)
    if mask2d is not None:
        allowed = allowed & mask2d[:, None, :]
    scores = torch.einsum("bhsd,bhld->bhsl", q.double(), k) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhsl,bhld->bshd", scores.softmax(-1).nan_to_num(0.0), v)
    return out


@pytest.mark.parametrize("S,L,window,pad", [(9, 9, None, None), (9, 9, 4, "left"), (7, 7, None, "holes"),
                                            (1, 13, None, None), (1, 13, 5, "left"), (1, 10, None, "holes"),
                                            (3, 11, None, "left"), (3, 11, 4, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_attention_against_reference(S, L, window, pad, dtype):
    from atb.layers.attention import hf_attention

    B, H, KH, D = 3, 6, 2, 16
    q = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)    # token-major view, as the patched forward makes it
    k, v = torch.randn(B, KH, L, D, dtype=dtype), torch.randn(B, KH, L, D, dtype=dtype)
    mask = None
    if pad == "left":
        mask = torch.ones(B, L, dtype=torch.bool)
        mask[1, :2] = False
        mask[2, :L - S - 1 if L > S else 4] = False
    elif pad == "holes":
        mask = torch.ones(B, L, dtype=torch.bool)
        mask[0, 2] = mask[2, 1:4] = False
    out = hf_attention(q, k, v, padding_mask=mask, scale=D ** -0.5, window=window)
    expect = _sdpa_reference(q, k, v, mask, D ** -0.5, window)
    if mask is not None and S == L:
        keep = mask[:, :, None, None].expand_as(expect)
        out, expect = out[keep], expect[keep]      # padded query rows carry no meaning
    assert_close(out, expect, dtype)


def test_hf_attention_packed_positions_and_errors():
    from atb.layers.attention import hf_attention

    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    out = hf_attention(q, k, v, position_ids=pos, scale=8 ** -0.5)
    for s, e in [(0, 4), (4, 7), (7, 10)]:
        part = hf_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale=8 ** -0.5)
        assert_close(out[:, s:e], part.double())
    holes = torch.ones(1, 10, dtype=torch.bool)
    holes[0, 4] = False
    with pytest.raises(ValueError, match="holes inside a row"):
        hf_attention(q, k, v, padding_mask=holes, window=3)
    with pytest.raises(ValueError, match="padding mask must be bool"):
        hf_attention(q, k, v, padding_mask=torch.ones(1, 1, 10, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="do not fit"):
        hf_attention(q, k[:, :, :5], v[:, :, :5])


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_executor_mlp_matches_hf(rows, bias):
    from transformers.models.llama.modeling_llama import LlamaMLP

    from atb.layers import decoder
    from atb.registry import get_adapter

    config = AutoConfig.for_model("llama", mlp_bias=bias, **BASE)
    hf = LlamaMLP(config)
    w = SimpleNamespace(**get_adapter(config).mlp_weights(hf))
    assert w.gate is hf.gate_proj.weight and w.down is hf.down_proj.weight
    x, res = torch.randn(rows, 96), torch.randn(rows, 96)
    with torch.no_grad():
        assert_close(decoder.mlp(x, w), hf(x).double(), torch.float32, scale=4.0)
        assert_close(decoder.mlp(x, w, res), (res + hf(x)).double(), torch.float32, scale=4.0)


# mistral-window: HF's attention module called alone (no mask) applies no window to compare with.
@pytest.mark.parametrize("family", family_names("mistral-window"))
def test_executor_attention_over_the_paged_cache_matches_hf(family):
    # The engine's attention pieces (qkv_rope, flash prefill, paged decode, o_proj) against HF's attention module.
    from transformers import DynamicCache

    from atb import kernels
    from atb.layers import decoder
    from atb.layers.kv_cache import PagedKVCache
    from atb.registry import get_adapter

    model = family_model(family, BASE)
    adapter = get_adapter(model)
    spec = adapter.spec
    hf_attn = model.model.layers[0].self_attn
    rotary = RotaryEmbedding.from_hf(model.model.rotary_emb)
    w = adapter.layer_weights(model, 0)
    shape = decoder.AttentionShape.from_spec(spec, hf_attn.scaling)
    lens = [7, 4]
    xs = [torch.randn(1, n, 96) for n in lens]
    with torch.no_grad():
        expect = []
        for x in xs:
            pos = torch.arange(x.shape[1])[None]
            out, _ = hf_attn(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None,
                             cache=DynamicCache(config=model.config))
            expect.append(out[0])
        cache = PagedKVCache(1, spec.num_kv_heads, spec.head_dim, num_blocks=8, block_size=2)
        kc, vc = cache.key_caches[0], cache.value_caches[0]
        # Prefill both sequences but their last 2 tokens (flash), then one batched decode step per token (paged).
        pre = [n - 2 for n in lens]
        for i, n in enumerate(lens):
            cache.allocate(i, n)
        x = torch.cat([xs[i][0, :n] for i, n in enumerate(pre)])
        positions = torch.cat([torch.arange(n) for n in pre])
        cos, sin = rotary.cos_sin(positions)
        q, k, v = decoder.qkv_rope(x, w, shape, cos, sin)
        kernels.reshape_and_cache(k, v, kc, vc, cache.slot_mapping([0, 1], [0, 0], pre))
        cu = torch.tensor([0, pre[0], sum(pre)], dtype=torch.int32)
        o = kernels.flash_attention(q, k, v, cu, scale=shape.scale, causal=True)
        outs = [[g] for g in decoder.o_proj(o.view(x.shape[0], -1), w).split(pre)]
        tables = cache.block_tables([0, 1])
        for step in range(2):
            x = torch.stack([xs[i][0, n + step] for i, n in enumerate(pre)])
            cos, sin = rotary.cos_sin(torch.tensor([n + step for n in pre]))
            q, k, v = decoder.qkv_rope(x, w, shape, cos, sin)
            kernels.reshape_and_cache(k, v, kc, vc, cache.slot_mapping([0, 1], [n + step for n in pre],
                                                                       [n + step + 1 for n in pre]))
            ctx = torch.tensor([n + step + 1 for n in pre], dtype=torch.int32)
            o = kernels.paged_attention(q, kc, vc, tables, ctx, scale=shape.scale)
            got = decoder.o_proj(o.view(2, -1), w)
            for i in range(2):
                outs[i].append(got[i:i + 1])
    for i in range(2):
        assert_close(torch.cat(outs[i]), expect[i].double(), torch.float32, scale=4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 6, 11, 17])
def test_row_invariant_lm_head_rows_do_not_depend_on_their_mates(rows, dtype):
    # The engine prefill's LM head (one row per prompt) runs several rows per native call: each row must come
    # out exactly as alone, and close to the float64 product.
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    norm = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    head = (0.1 * torch.randn(333, 96, generator=g)).to(dtype)
    for w in (head, quantize_weight(head, "w8a16")):
        out = lm_head(x, norm, w, 1e-5, route=ROUTE_ROW_INVARIANT)
        alone = torch.cat([lm_head(x[i:i + 1], norm, w, 1e-5, route=ROUTE_ROW_INVARIANT) for i in range(rows)])
        assert out.shape == (rows, 333) and torch.equal(out, alone)
    h = K.rms_norm(x, norm, 1e-5)
    assert_close(lm_head(x, norm, head, 1e-5, route=ROUTE_ROW_INVARIANT), (h.double() @ head.double().T).to(dtype),
                 dtype)
