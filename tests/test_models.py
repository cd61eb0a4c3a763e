"""Family adapters and the registry: specs, parameter sharing, dispatch, errors."""
import subprocess
import sys

import pytest
import torch

from atb.checkpoints import random_model
from atb.registry import get_adapter, supported_model_types

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=101, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _tiny(model_type, **extra):
    return random_model({**TINY, **extra}, torch.float32, model_type=model_type)


def test_supported_types():
    assert supported_model_types() == ["llama", "mistral", "qwen2", "qwen3"]


def test_unsupported_family_is_a_clear_error():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt2")
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*llama, mistral, qwen2, qwen3"):
        get_adapter(config)
    with pytest.raises(TypeError, match="expected an HF model or config"):
        get_adapter(42)


def test_atb_does_not_import_models_eagerly():
    code = "import sys, atb, atb.registry; assert 'atb.models' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# expect: spec fields, and which optional weights every layer has (q_bias means q/k/v bias, o_bias, gate_bias
# means the MLP's biases, q_norm means q/k norm).
@pytest.mark.parametrize("model_type,extra,expect", [
    ("llama", {}, dict(sliding_windows=(None,) * 3, weights=())),
    ("llama", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
     dict(num_kv_heads=4, weights=("q_bias", "o_bias", "gate_bias"))),
    ("mistral", dict(sliding_window=7), dict(sliding_windows=(7, 7, 7), weights=())),
    ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
     dict(sliding_windows=(None, 5, 5), weights=("q_bias",))),
    ("qwen3", dict(head_dim=24), dict(head_dim=24, sliding_windows=(None,) * 3, weights=("q_norm",))),
])
def test_spec_and_weights_are_the_hf_parameters(model_type, extra, expect):
    model = _tiny(model_type, **extra)
    adapter = get_adapter(model)
    spec = adapter.spec
    assert spec.model_type == model_type
    assert (spec.num_layers, spec.hidden, spec.num_heads, spec.intermediate, spec.vocab) == (3, 64, 4, 96, 101)
    assert spec.rms_norm_eps == 1e-5 and spec.rope.max_position_embeddings == 128
    optional = set(expect.pop("weights"))
    for key, value in expect.items():
        assert getattr(spec, key) == value, key
    assert spec.rope.rope_type == "default" and spec.rope.rotary_dim == spec.head_dim

    named = {id(p): n for n, p in model.named_parameters()}
    for i in range(spec.num_layers):
        w = adapter.layer_weights(model, i)
        layer = model.model.layers[i]
        assert w.q is layer.self_attn.q_proj.weight and w.down is layer.mlp.down_proj.weight
        assert w.input_norm is layer.input_layernorm.weight
        for name, t in w.tensors().items():
            assert id(t) in named, f"layer {i} {name} is not one of the model's parameters"
        groups = {"q_bias": ("q_bias", "k_bias", "v_bias"), "o_bias": ("o_bias",),
                  "gate_bias": ("gate_bias", "up_bias", "down_bias"), "q_norm": ("q_norm", "k_norm")}
        for group, names in groups.items():
            for n in names:
                assert (getattr(w, n) is not None) == (group in optional), f"layer {i} {n}"
        H, KH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        assert w.q.shape == (H * D, spec.hidden) and w.k.shape == (KH * D, spec.hidden)
    assert adapter.embed_tokens(model) is model.model.embed_tokens.weight
    assert adapter.final_norm(model) is model.model.norm.weight
    assert adapter.lm_head(model) is model.lm_head.weight
    roles = adapter.module_roles()
    classes = {type(m).__name__ for m in model.modules()}
    for role in ("rms_norm", "attention", "mlp", "rotary"):
        assert [c for c, r in roles.items() if r == role][0] in classes, role


def test_rope_scaling_spec():
    rp = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    spec = get_adapter(_tiny("llama", rope_parameters=rp)).spec
    assert spec.rope.rope_type == "llama3" and spec.rope.theta == 500000.0
    assert spec.rope.parameters["factor"] == 8.0


def test_unsupported_features_are_reported():
    adapter = get_adapter(_tiny("llama", hidden_act="gelu"))
    assert "hidden_act 'gelu'" in adapter.unsupported_reasons()["mlp"]
    assert "attention" not in adapter.unsupported_reasons()


def test_smollm2_spec(smollm2_fp32):
    model, _ = smollm2_fp32
    adapter = get_adapter(model)
    s = adapter.spec
    assert (s.num_layers, s.hidden, s.num_heads, s.num_kv_heads, s.head_dim) == (30, 576, 9, 3, 64)
    assert (s.intermediate, s.vocab) == (1536, 49152)
    assert adapter.lm_head(model).data_ptr() == adapter.embed_tokens(model).data_ptr()
    assert s.rope.theta == 100000.0 and s.sliding_windows == (None,) * 30
