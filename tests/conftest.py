import pytest
import torch

import atb


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, but reproducible from the test's name when it fails.
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
    yield
    atb.set_soc("host")


ALL_SOCS = atb.soc_names()

# Every model family variant the tests run, listed once: name -> (model_type, config overrides applied on a
# test's own tiny base config). Adding a family = its adapter in models/ + its variants here.
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16, "rope_theta": 500000.0}
FAMILIES = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),                 # o/gate/up/down bias too
    "llama3-rope": ("llama", dict(rope_parameters=_LLAMA3)),
    "llama-dynamic-rope": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                         max_position_embeddings=16)),
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "qwen2-bias": ("qwen2", {}),                                                        # q/k/v bias
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=24)),                                              # q/k RMSNorm
}


def family_names(*without: str) -> list[str]:
    """FAMILIES' names, minus those a test cannot run (say why at the call)."""
    return [n for n in FAMILIES if n not in without]


def family_model(name: str, base: dict, dtype=torch.float32, seed: int = 0):
    """A random-weight model of one family variant on ``base``; biases made non-zero so they count."""
    from atb.checkpoints import random_model

    model_type, extra = FAMILIES[name]
    model = random_model({**base, **extra}, dtype, model_type=model_type, seed=seed)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith(".bias"):
                p.normal_(std=0.1)
    return model


_MODELS = {}


def load_smollm2(dtype=torch.float32):
    """The real SmolLM2-135M-Instruct checkpoint, loaded once per test session per dtype.

    Tests must not modify the returned model permanently (unpatch what you patch).
    """
    if dtype not in _MODELS:
        from atb.checkpoints import load_model

        _MODELS[dtype] = load_model(dtype=dtype)
    return _MODELS[dtype]


@pytest.fixture(scope="session")
def smollm2_fp32():
    return load_smollm2(torch.float32)


@pytest.fixture(scope="session")
def smollm2_bf16():
    return load_smollm2(torch.bfloat16)
