"""Carving UB past a SoC's size fails loudly, as the hardware would; within it works."""
import pytest

import atb
from atb import _C


@pytest.mark.parametrize("soc", atb.soc_names())
def test_ub_carve_past_the_soc_raises(soc):
    info = atb.get_soc(soc)
    _C._ub_carve_probe(info.ub_size, info)  # exactly the UB: fine
    with pytest.raises(ValueError, match=f"UB overflow.*> {info.ub_size} bytes of UB"):
        _C._ub_carve_probe(info.ub_size + 1, info)


def test_ub_probe_rejects_nonsense():
    with pytest.raises(ValueError, match="bad num=1 bytes=0"):
        _C._ub_carve_probe(0, atb.get_soc("Ascend910B4"))
