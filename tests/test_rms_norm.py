"""rms_norm and add_rms_norm against the float64 reference; tiling; bad input."""
import pytest
import torch

import atb
from atb import _C
from atb.kernels._common import DTYPE_CODES
from conftest import ALL_SOCS
from reference import DTYPES, add_rms_norm_ref, assert_close, rms_norm_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 576), (7, 7), (3, 123), (2, 4097), (300, 576), (2, 3, 64)])
def test_rms_norm_matches_reference(dtype, shape):
    x = torch.randn(shape).to(dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    assert_close(atb.kernels.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (5, 123), (129, 4097)])
def test_add_rms_norm_matches_reference(dtype, shape):
    x, r = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    y, h = atb.kernels.add_rms_norm(x, r, w, 1e-6)
    y_ref, h_ref = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(h.double(), h_ref)  # the sum is one rounding: exact
    assert_close(y, y_ref)


@pytest.mark.parametrize("soc", ALL_SOCS)
def test_every_soc_gives_the_same_numbers(soc):
    dtype = torch.float16  # every SoC supports it
    x = torch.randn(257, 1000).to(dtype)
    w = torch.randn(1000).to(dtype)
    assert torch.equal(atb.kernels.rms_norm(x, w, soc_type=soc), atb.kernels.rms_norm(x, w, soc_type="host"))
    y, h = atb.kernels.add_rms_norm(x, x, w, soc_type=soc)
    y0, h0 = atb.kernels.add_rms_norm(x, x, w, soc_type="host")
    assert torch.equal(y, y0) and torch.equal(h, h0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_d_variant(dtype):
    # 60000 columns cannot sit in a 192 KiB UB as one row: the split-D tiling kicks in.
    cols = 60001
    t = _C.rms_norm_tiling(3, cols, DTYPE_CODES[dtype], atb.get_soc("Ascend910B4"))
    assert t["split_d"] and t["col_tile"] < cols and t["ub_bytes"] <= 192 * 1024
    x = torch.randn(3, cols).to(dtype)
    w = torch.randn(cols).to(dtype)
    assert_close(atb.kernels.rms_norm(x, w, soc_type="Ascend910B4"), rms_norm_ref(x, w, 1e-6))
    r = torch.randn(3, cols).to(dtype)
    y, h = atb.kernels.add_rms_norm(x, r, w, soc_type="Ascend910B4")
    y_ref, h_ref = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(h.double(), h_ref)
    assert_close(y, y_ref)


def test_tiling_core_split_with_remainder():
    soc = atb.get_soc("Ascend910B4")  # 40 vector cores
    t = _C.rms_norm_tiling(2049, 576, 0, soc)
    assert t["block_dim"] == 40 and t["block_factor"] == 52  # 39 x 52 + 1 x 21
    assert (t["block_dim"] - 1) * t["block_factor"] < 2049 <= t["block_dim"] * t["block_factor"]
    t = _C.rms_norm_tiling(3, 576, 0, soc)
    assert t["block_dim"] == 3 and t["block_factor"] == 1
    t = _C.rms_norm_tiling(1, 576, 0, atb.get_soc("host"))
    assert t["block_dim"] == 1 and not t["split_d"]
    assert t["ub_bytes"] <= atb.get_soc("host").ub_size


def test_bf16_rejected_on_socs_without_it():
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    for soc in ("Ascend910", "Ascend310P3"):
        with pytest.raises(ValueError, match="bfloat16.*" + soc):
            atb.kernels.rms_norm(x, w, soc_type=soc)


def test_non_contiguous_and_empty_inputs():
    x = torch.randn(64, 10)[:, ::2]  # non-contiguous: handled by a copy
    w = torch.randn(5)
    assert_close(atb.kernels.rms_norm(x, w), rms_norm_ref(x, w, 1e-6))
    e = torch.empty(0, 5)
    assert atb.kernels.rms_norm(e, w).shape == (0, 5)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight has shape \\(7,\\).*\\(8,\\)"):
        atb.kernels.rms_norm(x, torch.randn(7))
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16, got torch.int64"):
        atb.kernels.rms_norm(torch.ones(4, 8, dtype=torch.long), torch.randn(8))
    with pytest.raises(TypeError, match="weight is torch.float16 but x is torch.float32"):
        atb.kernels.rms_norm(x, torch.randn(8).half())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        atb.kernels.rms_norm([1.0, 2.0], torch.randn(2))
    with pytest.raises(ValueError, match="residual has shape"):
        atb.kernels.add_rms_norm(x, torch.randn(4, 9), torch.randn(8))
    with pytest.raises(ValueError, match="unknown SoC"):
        atb.kernels.rms_norm(x, torch.randn(8), soc_type="Ascend000")


# ---- temporaries, argument checks, zero-size inputs ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_weight_is_kept_alive(dtype):
    # weight.contiguous() was a temporary freed before the kernel read it (garbage up to 1e28, or a segfault).
    x, r = torch.randn(4, 4096).to(dtype), torch.randn(4, 4096).to(dtype)
    w = torch.rand(8192).to(dtype)[::2]
    for _ in range(3):
        assert torch.equal(atb.kernels.rms_norm(x, w), atb.kernels.rms_norm(x, w.contiguous()))
        y, h = atb.kernels.add_rms_norm(x, r, w)
        y2, h2 = atb.kernels.add_rms_norm(x, r, w.contiguous())
        assert torch.equal(y, y2) and torch.equal(h, h2)
    assert_close(atb.kernels.rms_norm(x, w), rms_norm_ref(x, w, 1e-6))


def test_eps_is_checked_and_errors_name_the_op():
    import numpy as np

    x, w = torch.randn(3, 8), torch.ones(8)
    assert torch.equal(atb.kernels.rms_norm(x, w, np.float32(1e-5)), atb.kernels.rms_norm(x, w, float(np.float32(1e-5))))
    for op, call in (("rms_norm", lambda eps: atb.kernels.rms_norm(x, w, eps)),
                     ("add_rms_norm", lambda eps: atb.kernels.add_rms_norm(x, x, w, eps))):
        with pytest.raises(TypeError, match=f"^{op}: eps must be a real number, got str"):
            call("1e-6")
        for bad in (float("nan"), float("inf"), -1.0):
            with pytest.raises(ValueError, match=f"^{op}: eps must be a finite real number"):
                call(bad)
    with pytest.raises(ValueError, match="^add_rms_norm: bfloat16 is not supported on Ascend910"):
        xb = x.bfloat16()
        atb.kernels.add_rms_norm(xb, xb, w.bfloat16(), soc_type="Ascend910")
    with pytest.raises(ValueError, match="^add_rms_norm: weight has shape"):
        atb.kernels.add_rms_norm(x, x, torch.ones(7))


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0,), (2, 0, 5)])
def test_zero_size_inputs(shape):
    x = torch.randn(shape)
    w = torch.ones(shape[-1])
    assert atb.kernels.rms_norm(x, w).shape == x.shape
    y, h = atb.kernels.add_rms_norm(x, x, w)
    assert y.shape == h.shape == x.shape


@pytest.mark.parametrize("rows,cols", [(0, 8), (8, 0), (0, 0)])
def test_tiling_rejects_zero_work(rows, cols):
    # The wrappers never launch empty work; the tiling itself refuses it instead of dividing by zero.
    for residual, op in ((False, "rms_norm"), (True, "add_rms_norm")):
        with pytest.raises(ValueError, match=f"^{op} tiling: rows and cols must be >= 1"):
            _C.rms_norm_tiling(rows, cols, DTYPE_CODES[torch.float32], atb.get_soc("host"), residual)
