import os

import pytest
import torch

import atb


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=None,
                     help="cases for tests/test_fuzz.py (default: $ATB_FUZZ_CASES, else 300)")


@pytest.fixture
def fuzz_cases(request):
    n = request.config.getoption("--fuzz-cases")
    return n if n is not None else int(os.environ.get("ATB_FUZZ_CASES", "300"))


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, but reproducible from the test's name when it fails.
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
    yield
    atb.set_soc("host")


ALL_SOCS = atb.soc_names()


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
