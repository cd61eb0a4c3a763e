import os

import pytest
import torch

# Linear routing is measured per machine by default; the suite pins the fixed policy so every run takes the
# same paths (tests/test_routing.py tests the measurement itself). ATB_ROUTING=measure runs it measured.
os.environ.setdefault("ATB_ROUTING", "crossover")

import atb  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, but reproducible from the test's name when it fails.
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
    yield
    atb.set_soc("host")


ALL_SOCS = atb.soc_names()

# Every SIMD table this machine can run (natively: avx512 / avx2 / portable), plus "avx512-simde" (the
# AVX-512 source built against SIMDe) when the build has it: a CPU without AVX-512 still tests that code.
ISAS = atb.available_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test with each SIMD table forced in turn."""
    atb.set_isa(request.param)
    yield request.param
    atb.set_isa("auto")


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
