"""atb.layers: rotary tables against HF's own rotary modules, RMSNorm sharing the HF weight."""
import pytest
import torch
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from atb.layers.norm import RMSNorm
from atb.layers.rotary import RotaryEmbedding
from reference import assert_close, rms_norm_ref, DTYPES, add_rms_norm_ref

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


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_layer_shares_the_hf_weight(dtype):
    hf = LlamaRMSNorm(77, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.normal_()
    norm = RMSNorm.from_hf(hf)
    assert norm.weight is hf.weight and norm.eps == 1e-5
    x, r = torch.randn(5, 77, dtype=dtype), torch.randn(5, 77, dtype=dtype)
    assert_close(norm(x), rms_norm_ref(x, hf.weight, 1e-5))
    y, h = norm(x, r)
    ey, eh = add_rms_norm_ref(x, r, hf.weight, 1e-5)
    assert_close(y, ey)
    assert_close(h, eh)
