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
