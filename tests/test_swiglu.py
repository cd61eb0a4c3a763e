"""swiglu and silu_mul against the float64 reference and HF's own expression; strided views; tiling; bad input."""
import pytest
import torch
import torch.nn.functional as F

import atb
from atb import _C
from atb.kernels._common import DTYPE_CODES
from conftest import ALL_SOCS, forced_isa
from reference import DTYPES, assert_close, silu_mul_ref, swiglu_ref

SHAPES = [(1, 1), (1, 576), (7, 7), (3, 123), (2, 4097), (5, 11008), (300, 64), (2, 3, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_mul_matches_reference(dtype, shape):
    g, u = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    out = atb.kernels.silu_mul(g, u)
    assert out.shape == g.shape and out.dtype == dtype
    assert_close(out, silu_mul_ref(g, u))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_matches_reference(dtype, shape):
    x = torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)
    out = atb.kernels.swiglu(x)
    assert out.shape == (*shape[:-1], shape[-1])
    assert_close(out, swiglu_ref(x))
    g, u = x.chunk(2, dim=-1)
    assert torch.equal(out, atb.kernels.silu_mul(g, u))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_matches_hf_expression(dtype):
    # HF: act_fn(gate) * up in the dtype. Our silu's exp differs from torch's by an fp32 ulp at most, which
    # after rounding to 16 bits almost never shows: at most 1 element in 1000 may differ, by one ulp.
    g, u = (torch.randn(64, 1000) * 4).to(dtype), torch.randn(64, 1000).to(dtype)
    out, hf = atb.kernels.silu_mul(g, u), F.silu(g) * u
    diff = out != hf
    assert diff.float().mean() < 1e-3
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert torch.all((out.double() - hf.double()).abs()[diff] <= ulp * hf.double().abs()[diff] * 2)


def test_special_values():
    g = torch.tensor([0.0, -0.0, 100.0, -100.0, float("inf"), float("nan"), 1e-30, -88.0, 89.0])
    u = torch.ones_like(g)
    for dtype in DTYPES:
        gd = g.to(dtype)
        out = atb.kernels.silu_mul(gd, u.to(dtype))
        assert_close(out[:4], F.silu(gd[:4].double()))
        assert out[4] == float("inf") and out[5].isnan() and torch.isfinite(out[6:]).all()


def test_strided_views_are_read_in_place():
    gate_up = torch.randn(123, 2 * 576)
    g, u = gate_up[:, :576], gate_up[:, 576:]
    assert_close(atb.kernels.silu_mul(g, u), silu_mul_ref(g, u))
    x = torch.randn(2 * 576, 50).t()  # last dim not contiguous: copied
    assert_close(atb.kernels.swiglu(x), swiglu_ref(x))
    y = torch.randn(4, 10, 2 * 64)[:, ::3]  # leading dims that do not merge: copied
    assert_close(atb.kernels.swiglu(y), swiglu_ref(y))
    z = torch.randn(9, 2 * 100)[::2]  # row stride 400 elements, read through DataCopyPad strides
    assert_close(atb.kernels.swiglu(z), swiglu_ref(z))


@pytest.mark.parametrize("soc", ALL_SOCS)
def test_every_soc_gives_the_same_numbers(soc):
    for shape in [(257, 1000), (3, 20000)]:
        x = torch.randn(shape[0], 2 * shape[1]).half()
        assert torch.equal(atb.kernels.swiglu(x, soc_type=soc), atb.kernels.swiglu(x, soc_type="host"))
    g = torch.randn(33, 4097)
    assert torch.equal(atb.kernels.silu_mul(g, g, soc_type=soc), atb.kernels.silu_mul(g, g, soc_type="host"))


def test_portable_path_agrees():
    for dtype in DTYPES:
        g, u = torch.randn(17, 333).to(dtype), torch.randn(17, 333).to(dtype)
        fast = atb.kernels.silu_mul(g, u)
        with forced_isa("portable"):
            port = atb.kernels.silu_mul(g, u)
        assert_close(fast, port.double())


def test_tiling_core_split_with_remainder():
    soc = atb.get_soc("Ascend910B4")  # 40 vector cores
    t = _C.swiglu_tiling(2049, 576, DTYPE_CODES[torch.float32], soc)
    assert not t["col_tiles"] and t["block_dim"] == 40 and t["block_factor"] == 52  # 39 x 52 + 1 x 21
    assert 1 < t["rows_per_loop"] < 52 and 52 % t["rows_per_loop"] != 0  # a partial last tile per core
    t = _C.swiglu_tiling(3, 576, 0, soc)
    assert t["block_dim"] == 3 and t["block_factor"] == 1
    t = _C.swiglu_tiling(1, 576, 2, atb.get_soc("host"))
    assert t["block_dim"] == 1 and t["ub_bytes"] <= atb.get_soc("host").ub_size
    x = torch.randn(2049, 2 * 576)
    assert_close(atb.kernels.swiglu(x, soc_type="Ascend910B4"), swiglu_ref(x))


def test_tiling_long_rows_walk_column_tiles():
    soc = atb.get_soc("Ascend910B4")
    t = _C.swiglu_tiling(3, 11008, DTYPE_CODES[torch.bfloat16], soc)
    # 11008 = 2 x 4096 + 2816: three column tiles per row, nine units over nine cores.
    assert t["col_tiles"] and t["col_tile"] == 4096 and t["col_chunks"] == 3 and t["units"] == 9
    assert t["block_dim"] == 9 and t["ub_bytes"] <= soc.ub_size and t["col_tile"] % 64 == 0
    x = torch.randn(3, 2 * 11008).bfloat16()
    assert_close(atb.kernels.swiglu(x, soc_type="Ascend910B4"), swiglu_ref(x))


def test_bf16_rejected_on_socs_without_it():
    x = torch.randn(2, 64).bfloat16()
    for soc in ("Ascend910", "Ascend310P3"):
        with pytest.raises(ValueError, match="bfloat16.*" + soc):
            atb.kernels.swiglu(x, soc_type=soc)


def test_empty_inputs():
    assert atb.kernels.swiglu(torch.empty(0, 8)).shape == (0, 4)
    assert atb.kernels.silu_mul(torch.empty(3, 0), torch.empty(3, 0)).shape == (3, 0)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="last dim must be even.*got 7"):
        atb.kernels.swiglu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="up has shape \\(2, 5\\), gate has \\(2, 4\\)"):
        atb.kernels.silu_mul(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(TypeError, match="up is torch.float16 but gate is torch.float32"):
        atb.kernels.silu_mul(torch.randn(2, 4), torch.randn(2, 4).half())
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16, got torch.int32"):
        atb.kernels.swiglu(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="gate must be a torch.Tensor, got list"):
        atb.kernels.silu_mul([1.0], torch.randn(1))
    with pytest.raises(ValueError, match="scalar"):
        atb.kernels.swiglu(torch.tensor(1.0))
    with pytest.raises(ValueError, match="unknown SoC"):
        atb.kernels.swiglu(torch.randn(2, 8), soc_type="Ascend000")


@pytest.mark.parametrize("isa", ["auto", "portable"])
def test_non_finite_gate_matches_torch(isa):
    # silu(-inf) = -inf * sigmoid(-inf) = -inf * 0 = nan in torch; the AVX2 exp clamp once gave -inf.
    g = torch.tensor([-float("inf"), float("inf"), float("nan"), -1e30, 1e30, 0.0] * 3)
    u = torch.tensor([2.0, -3.0, 1.0, 1.0, 0.5, float("inf")] * 3)
    with forced_isa(isa):
        for dtype in DTYPES:
            gd, ud = g.to(dtype), u.to(dtype)
            out = atb.kernels.silu_mul(gd, ud)
            expected = (F.silu(gd) * ud)
            assert torch.equal(torch.isnan(out), torch.isnan(expected)), (dtype, out, expected)
            finite = ~torch.isnan(expected)
            assert_close(out[finite], expected[finite])
            assert torch.isnan(atb.kernels.swiglu(torch.cat([gd, ud]))[0])


def test_errors_name_the_op_called():
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(ValueError, match="^silu_mul: bfloat16 is not supported on Ascend910"):
        atb.kernels.silu_mul(x, x, soc_type="Ascend910")
    with pytest.raises(ValueError, match="^swiglu: bfloat16 is not supported on Ascend910"):
        atb.kernels.swiglu(x, soc_type="Ascend910")
    with pytest.raises(ValueError, match="^silu_mul: up has shape"):
        atb.kernels.silu_mul(x, x[:, :4])


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0,), (2, 0, 6)])
def test_zero_size_inputs(shape):
    g = torch.randn(shape)
    assert atb.kernels.silu_mul(g, g).shape == g.shape
    assert atb.kernels.swiglu(g).shape == (*shape[:-1], shape[-1] // 2)


def test_tiling_rejects_zero_work():
    for rows, cols in ((0, 8), (8, 0)):
        with pytest.raises(ValueError, match="rows and cols must be >= 1"):
            _C.swiglu_tiling(rows, cols, DTYPE_CODES[torch.float32], atb.get_soc("host"))
