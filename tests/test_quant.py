"""Weight-only quantization: formats (round trip), the quantized linear kernels against float64
references on every SIMD path this CPU runs, tiling, GGUF blocks bit for bit, bad input."""
import numpy as np
import pytest
import torch

import atb
import atb.kernels as K
from atb import _C
from atb.kernels._common import DTYPE_CODES
from atb.quant import QuantizedWeight, quantize_weight
from conftest import ALL_SOCS, forced_isa
from reference import (DTYPES, assert_close, linear_ref, linear_residual_ref, linear_swiglu_ref,
                       quant_dequant_ref, quant_weight_ref)

ISAS = atb.quant.isa_paths()
FORMATS = [("w8a16", 0), ("w8a16", 16), ("w8a16", 32), ("w8a16", 128), ("w4a16", 32), ("w4a16", 64), ("w4a16", 128)]


@pytest.fixture(params=ISAS)
def isa(request):
    before = atb.quant.isa()  # restored after, as conftest.forced_isa restores the float table
    atb.quant.set_isa(request.param)
    yield request.param
    atb.quant.set_isa(before)


def _scale(k: int) -> float:
    return max(1.0, k ** 0.5 / 4)


# ---- formats ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 31), (37, 100), (64, 576), (13, 577), (5, 4097)])
@pytest.mark.parametrize("scale_dtype", [None, torch.float32, torch.bfloat16])
def test_round_trip(fmt, group, n, k, scale_dtype, isa):
    w = torch.randn(n, k) * torch.rand(n, 1) * 3  # rows of different ranges
    q = quantize_weight(w, fmt, group, scale_dtype)
    assert q.shape == (n, k) and q.format == fmt and q.group_size == group
    ref = quant_dequant_ref(q)
    # The native dequantization is scale * q (+ min) with one rounding: the float64 value rounded to fp32.
    assert torch.equal(q.dequantize(), ref.float())
    # Every value within half a step of the grid (the step uses the stored scale; +2 ulp of the scale's dtype).
    kp = q.k_pad
    g = kp if group == 0 else group
    step = q.scale.double()[:, torch.arange(k) // g]
    eps = torch.finfo(q.scale.dtype).eps
    assert ((ref - w.double()).abs() <= step * (0.5 + 4 * eps) + w.abs().double() * 4 * eps + 1e-30).all()
    for dt in DTYPES:
        assert torch.equal(q.dequantize(dt), ref.float().to(dt))


@pytest.mark.parametrize("fmt,group", [f for f in FORMATS if f[1]])
def test_round_trip_tiny_groups_fp16_scales(fmt, group):
    # Groups from 1e-7 to 1: fp16 scales of the small ones are subnormal. A scale rounded down pushed the
    # extreme codes past the grid's end (clamped: error above half a step); it is rounded up instead.
    w = torch.randn(64, 577) * torch.logspace(-7, 0, 64)[:, None]
    q = quantize_weight(w, fmt, group)
    assert q.scale.dtype == torch.float16
    ref = quant_dequant_ref(q)
    step = q.scale.double()[:, torch.arange(577) // group]
    eps, quantum = torch.finfo(torch.float16).eps, 2.0**-24  # the min is fp16 too: subnormal below 6e-5
    assert ((ref - w.double()).abs() <= step * (0.5 + 4 * eps) + w.abs().double() * 4 * eps + quantum).all()


def test_quantize_tail_group_uses_real_values_only():
    # K = 576 with G = 128: the 5th group holds 64 real values; padding must not widen its range.
    w = torch.randn(4, 576)
    w[:, 512:] = torch.linspace(10, 11, 64)
    q = quantize_weight(w, "w4a16", 128, torch.float32)
    assert torch.allclose(q.min[:, 4], torch.full((4,), 10.0)) and torch.allclose(q.scale[:, 4] * 15, torch.ones(4))


def test_storage_layout_and_bytes():
    w = torch.randn(3, 64)
    q = quantize_weight(w, "w4a16", 32)
    assert q.data.dtype == torch.uint8 and q.data.shape == (3, 32) and q.scale.shape == (3, 2)
    assert q.nbytes == 3 * 32 + 2 * 3 * 2 * 2  # 4 bits per value + fp16 scale and min per 32
    assert q.contiguous() is q and q.dim() == 2  # tensor-like where the linear entries treat weights alike
    lo, hi = q.data[:, :16] & 15, q.data[:, :16] >> 4  # chunk 0: values 0..15 low nibbles, 16..31 high
    qq = atb.quant.unpack_int4(q.data)
    assert torch.equal(qq[:, :16], lo) and torch.equal(qq[:, 16:32], hi)
    assert torch.equal(atb.quant.pack_int4(qq), q.data)
    q8 = quantize_weight(w, "w8a16")
    assert q8.data.dtype == torch.int8 and q8.scale.shape == (3, 1) and q8.scale.dtype == torch.float32
    assert q8.data.abs().max() == 127


# ---- the kernels ------------------------------------------------------------------------------------------------

def _qw(n, k, fmt, group, scale_dtype=None, std=1.0):
    return quantize_weight(torch.randn(n, k) * std, fmt, group, scale_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("fmt,group", FORMATS)
def test_linear_matches_reference(dtype, m, fmt, group, isa):
    k, n = 577, 131
    x = torch.randn(m, k).to(dtype)
    q = _qw(n, k, fmt, group)
    b = torch.randn(n).to(dtype)
    y = K.linear(x, q, b)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_close(y, linear_ref(x, quant_weight_ref(q, x), b), scale=_scale(k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,group", [("w8a16", 0), ("w8a16", 16), ("w8a16", 32), ("w4a16", 32), ("w4a16", 128)])
@pytest.mark.parametrize("scale_dtype", [None, torch.bfloat16, torch.float32])
def test_half_width_x_error_bound(dtype, fmt, group, scale_dtype, isa):
    # 16-bit x against the same values as fp32 x (the fp32 route). On AVX2 16-bit x takes the int16 route:
    # per 32-value chunk a power-of-two scale 2^(e-14) (2^e <= the chunk's largest |x| < 2^(e+1)), so a
    # value is off by at most half that, |x|max * 2^-15, and the products are exact. Output n may then
    # differ by sum_k |w(n, k)| * |x|max(chunk of k) * 2^-15, plus one ulp of its own rounding and fp32 sums.
    # Chunks here mix magnitudes 2^12 apart, so small values really are rounded. The int16 route widens
    # 16-bit scales itself, row block by row block (tails of 1-3 rows at N = 67); the fp32 route per tile.
    k, n = 577, 67
    x = (torch.randn(5, k) * 2.0 ** torch.randint(-6, 7, (5, k)).float()).to(dtype)
    q = _qw(n, k, fmt, group, scale_dtype)
    w = quant_dequant_ref(q).double().abs()
    xpad = torch.nn.functional.pad(x.double().abs(), (0, (-k) % 32))
    chunk_max = xpad.view(5, -1, 32).amax(-1).repeat_interleave(32, -1)[:, :k]
    bound = (chunk_max * 2.0 ** -15) @ w.T
    for m in (1, 2, 5):
        got = K.linear(x[:m], q).double()
        want = K.linear(x[:m].float(), q).double()
        slack = bound[:m] + want.abs() * torch.finfo(dtype).eps + 1e-5 * want.abs().max()
        assert ((got - want).abs() <= slack).all(), (m, ((got - want).abs() - slack).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,group", [("w8a16", 0), ("w4a16", 32)])
def test_nonfinite_x_reaches_the_output(dtype, fmt, group, isa):
    # A NaN or an infinity in x makes that row's outputs non-finite on every route (the int16 route marks
    # its chunk with a NaN scale); the other rows stay finite.
    k, n = 100, 9
    q = _qw(n, k, fmt, group)
    x = torch.randn(3, k).to(dtype)
    x[1, 40] = float("nan")
    x[2, 99] = float("inf")
    y = K.linear(x, q)
    assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()
    for i in range(3):  # one row at a time: the GEMV, where W4 G32 folds x's chunk scales into the group scales
        assert torch.equal(torch.isfinite(K.linear(x[i:i + 1], q)), torch.isfinite(y[i:i + 1]))
    z = torch.zeros(2, k).to(dtype)   # all-zero chunks: exact zeros (scale 0)
    assert torch.equal(K.linear(z, q), torch.zeros(2, n).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
def test_linear_multi_mixed_formats(dtype, m, isa):
    # Fused q/k/v where each segment has its own format (as GGUF files mix Q8_0 / Q4_0 / Q4_1).
    k = 200
    x = torch.randn(m, k).to(dtype)
    ws = [_qw(96, k, "w4a16", 32), _qw(33, k, "w8a16", 0), _qw(33, k, "w4a16", 128, torch.float32)]
    bs = [torch.randn(w.shape[0]).to(dtype) for w in ws]
    outs = K.linear_multi(x, ws, bs)
    for out, w, b in zip(outs, ws, bs):
        assert torch.equal(out, K.linear(x, w, b))  # same sums whatever the launch
        assert_close(out, linear_ref(x, quant_weight_ref(w, x, ws), b), scale=_scale(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("fmt,group", [("w8a16", 0), ("w8a16", 16), ("w4a16", 64)])
def test_linear_residual(dtype, m, fmt, group, isa):
    k, n = 1000, 77
    x, r = torch.randn(m, k).to(dtype), torch.randn(m, n).to(dtype)
    q = _qw(n, k, fmt, group)
    b = torch.randn(n).to(dtype)
    assert_close(K.linear_residual(x, q, r, b), linear_residual_ref(x, quant_weight_ref(q, x, epilogue=1), r, b),
                 scale=_scale(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("fmt,group", [("w8a16", 16), ("w8a16", 32), ("w4a16", 32), ("w4a16", 128)])
def test_linear_swiglu(dtype, m, fmt, group, isa):
    k, n = 576, 150
    x = torch.randn(m, k).to(dtype)
    # Weights of std 1/sqrt(K) keep gate and up near 1, so the product's error stays at the dtype's scale.
    g, u = _qw(n, k, fmt, group, std=k ** -0.5), _qw(n, k, fmt, group, std=k ** -0.5)
    assert_close(K.linear_swiglu(x, g, u), linear_swiglu_ref(x, quant_weight_ref(g, x, [g, u], 2),
                                                            quant_weight_ref(u, x, [g, u], 2)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("soc", ["host", "Ascend910B1"])
def test_gemm_many_passes_and_k_chunks(dtype, soc, isa):
    # Rows past one M pass of the prefill GEMM and a K its tiling cuts into chunks (Ascend910B1's UB), W4
    # segments of two group sizes and a W8 one in one launch: each pass's rows (and, under bf16 x, each pass's
    # dequantized tiles) at their own rows, and each K chunk's groups (scales and mins) at the chunk's offset.
    m, k = 777, 4133
    segs = [(40, "w4a16", 32), (24, "w8a16", 0), (33, "w4a16", 128)]
    t = _C.quant_linear_tiling(m, k, [_seg(n, 4 if f == "w4a16" else 8, g) for n, f, g in segs], 0,
                               DTYPE_CODES[dtype], atb.get_soc(soc))
    assert t["gemm"] and t["m_pass"] < m
    if soc != "host":
        assert t["k_tile"] < t["k_pad"]
    x = torch.randn(m, k).to(dtype)
    ws = [_qw(n, k, f, g) for n, f, g in segs]
    for y, w in zip(K.linear_multi(x, ws, soc_type=soc), ws):
        assert_close(y, linear_ref(x, quant_weight_ref(w, x, ws, soc_type=soc)), scale=_scale(k))


@pytest.mark.parametrize("m", [1, 5, 40])
def test_long_k_is_chunked(m, isa):
    # K large enough that the STREAM tiling splits K (chunks of a multiple of 128), odd tail.
    k, n = 70001, 9
    x = torch.randn(m, k)
    q = _qw(n, k, "w4a16", 128)
    # fp32 sums of 70001 terms of size ~1 drift like a random walk of |partial sum| * eps steps: ~1e-3 here,
    # past _scale(k)'s bound about once in 25 runs. 8x that bound still fails a dropped or doubled chunk (~1).
    assert_close(K.linear(x, q), linear_ref(x, quant_weight_ref(q, x)), scale=8 * _scale(k))


def test_linear_auto_routes_quantized_to_native():
    x = torch.randn(2, 5, 64)
    q = _qw(16, 64, "w8a16", 0)
    assert_close(K.linear_auto(x, q).reshape(10, 16), linear_ref(x.reshape(10, 64), quant_weight_ref(q, x)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows(dtype, isa):
    q = _qw(50, 70, "w4a16", 64)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    e = q.rows(ids, dtype)
    assert e.shape == (2, 3, 70) and e.dtype == dtype
    assert torch.equal(e, quant_dequant_ref(q).float().to(dtype)[ids])


# ---- tiling -----------------------------------------------------------------------------------------------------

def _seg(n, bits, group, sdt=torch.float16):
    return (0, 0, 0, 0, 0, n, bits, group, DTYPE_CODES[sdt])


@pytest.mark.parametrize("soc", ALL_SOCS)
@pytest.mark.parametrize("m,k", [(1, 576), (16, 576), (31, 5632), (32, 576), (300, 2048), (1, 70001)])
@pytest.mark.parametrize("ep", [0, 1, 2])
@pytest.mark.parametrize("bits,group", [(4, 0), (8, 16)])  # 4-bit: G 32 (SWIGLU) / 128; W8 G16: two scales a chunk
def test_tiling_fits_ub(soc, m, k, ep, bits, group):
    info = atb.get_soc(soc)
    segs = [_seg(1536, bits, group or 32)] * 2 if ep == 2 else [_seg(576, bits, group or 128)]
    t = _C.quant_linear_tiling(m, k, segs, ep, 0, info)
    assert t["ub_bytes"] <= info.ub_size
    assert t["k_pad"] == -(-k // 32) * 32
    assert t["gemm"] == (m >= 32)
    # Below all of K, a chunk is a multiple of the largest group so no group straddles two chunks.
    assert t["k_tile"] >= t["k_pad"] or t["k_tile"] % 128 == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(13, 64), (131, 576), (9, 608), (40, 1000), (17, 4127)])
def test_w4_decode_16bit_x_loads_and_tails(dtype, m, group, n, k, isa):
    # 16-bit x takes an int16 GEMV where the table has one (the 256-bit vpmaddwd one reads chunk pairs, the
    # AVX512-VNNI one four chunks per load, with 2 weight rows per block at M = 1 once a row passes 2 KiB:
    # K = 4127), else with bf16 x on an AVX512-BF16 CPU the vdpbf16ps route (chunk pairs). Here: a last
    # load of 1-3 chunks, groups of one, two or four chunks and short last groups, blocks of 1, 2 and 4 x rows
    # and of 8, 4, 2 and 1 weight rows with their tails.
    x = torch.randn(m, k).to(dtype)
    q = _qw(n, k, "w4a16", group)
    b = torch.randn(n).to(dtype)
    assert_close(K.linear(x, q, b), linear_ref(x, quant_weight_ref(q, x), b), scale=_scale(k))


@pytest.mark.parametrize("fmt_bits,group", [(8, 0), (4, 32), (4, 128)])
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (64, 64), (2048, 5632)])
def test_decode_splits_over_cores_as_bf16(fmt_bits, group, n, k):
    # A quantized row's cost is its unpacking (per value), so decode uses as many cores as the bf16 layer.
    host = atb.get_soc("host")
    bf16 = DTYPE_CODES[torch.bfloat16]
    t = _C.quant_linear_tiling(1, k, [_seg(n, fmt_bits, group)], 0, bf16, host)
    assert t["block_dim"] == _C.linear_tiling(1, k, [n], 0, bf16, host)["block_dim"]


def test_tiling_rejects_bad_formats():
    info = atb.get_soc("host")
    with pytest.raises(ValueError, match="bits"):
        _C.quant_linear_tiling(1, 64, [_seg(8, 3, 32)], 0, 0, info)
    with pytest.raises(ValueError, match="group"):
        _C.quant_linear_tiling(1, 64, [_seg(8, 4, 48)], 0, 0, info)
    with pytest.raises(ValueError, match="4-bit"):
        _C.quant_linear_tiling(1, 64, [_seg(8, 4, 0)], 0, 0, info)
    with pytest.raises(ValueError, match=r"has group 16, expected 0 \(per channel\), 32, 64 or 128$"):
        _C.quant_linear_tiling(1, 64, [_seg(8, 4, 16)], 0, 0, info)  # groups of 16: 8 bits only


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_bad_input_errors():
    q = _qw(8, 64, "w4a16", 32)
    with pytest.raises(ValueError, match=r"linear: weight has shape \(8, 64\), expected \[N, 65\]"):
        K.linear(torch.randn(2, 65), q)
    with pytest.raises(TypeError, match=r"linear_multi: weights\[1\] must be a QuantizedWeight"):
        K.linear_multi(torch.randn(2, 64), [q, torch.randn(8, 64)])
    with pytest.raises(TypeError, match="linear: x must be"):
        K.linear(torch.randn(2, 64).to(torch.int32), q)
    with pytest.raises(TypeError, match="linear: bias is torch.float16 but x is torch.float32"):
        K.linear(torch.randn(2, 64), q, torch.randn(8).half())
    with pytest.raises(ValueError, match="linear_swiglu: gate_weight has shape"):
        K.linear_swiglu(torch.randn(1, 64), q, _qw(9, 64, "w4a16", 32))
    with pytest.raises(ValueError, match="linear_residual: residual has shape"):
        K.linear_residual(torch.randn(2, 64), q, torch.randn(2, 9))
    with pytest.raises(ValueError, match="group_size for w4a16 must be 32, 64 or 128, got 0"):
        quantize_weight(torch.randn(4, 4), "w4a16", 0)
    with pytest.raises(ValueError, match="group_size for w4a16 must be 32, 64 or 128, got 16"):
        quantize_weight(torch.randn(4, 4), "w4a16", 16)
    with pytest.raises(ValueError, match="group_size for w8a16 must be 0 \\(per channel\\), 16, 32, 64 or 128, got 8"):
        quantize_weight(torch.randn(4, 4), "w8a16", 8)
    with pytest.raises(ValueError, match="4-bit weights need a group size of 32, 64 or 128, got 16"):
        QuantizedWeight(q.data, q.scale, q.min, (8, 64), 4, 16)
    with pytest.raises(ValueError, match="format must be one of"):
        quantize_weight(torch.randn(4, 4), "w3a16")
    with pytest.raises(TypeError, match="quantize: weight must be"):
        quantize_weight(torch.zeros(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"rows: ids must be in \[0, 8\)"):
        q.rows(torch.tensor([8]))
    with pytest.raises(ValueError, match="data must be torch.uint8"):
        QuantizedWeight(q.data[:, :-1].contiguous(), q.scale, q.min, (8, 64), 4, 32)
    with pytest.raises(ValueError, match="need min"):
        QuantizedWeight(q.data, q.scale, None, (8, 64), 4, 32)
    with pytest.raises(ValueError, match="^linear: bfloat16 is not supported on Ascend310P3"):
        K.linear(torch.randn(1, 64).bfloat16(), q, soc_type="Ascend310P3")
    # The SoC is resolved as for float weights: errors name the entry.
    with pytest.raises(ValueError, match="^linear_swiglu: soc_type: unknown SoC 'nope'"):
        K.linear_swiglu(torch.randn(1, 64), q, q, soc_type="nope")
    with pytest.raises(TypeError, match=r"linear_swiglu: up_weight must be a QuantizedWeight"):
        K.linear_swiglu(torch.randn(1, 64), q, torch.randn(8, 64))
    with pytest.raises(TypeError, match="linear_residual: residual must be"):
        K.linear_residual(torch.randn(2, 64), q, None)
    with pytest.raises(ValueError, match="quant.set_isa"):
        atb.quant.set_isa("sse9")


def test_zero_rows_and_all_zero_weights():
    q = quantize_weight(torch.zeros(5, 40), "w4a16", 32)
    assert torch.equal(q.dequantize(), torch.zeros(5, 40))
    assert K.linear(torch.randn(0, 40), q).shape == (0, 5)
    assert torch.equal(K.linear(torch.randn(3, 40), q), torch.zeros(3, 5))


# ---- GGUF -----------------------------------------------------------------------------------------------------

gguf = pytest.importorskip("gguf")
import atb.quant.gguf as qgguf  # noqa: E402


class _FakeTensor:
    """The fields of gguf.ReaderTensor the loader reads, for blocks made by gguf's own quantizer."""

    def __init__(self, name, kind, w):
        self.name, self.tensor_type = name, gguf.GGMLQuantizationType[kind]
        self.data = gguf.quants.quantize(w.numpy(), self.tensor_type)
        self.shape = np.array([w.shape[1], w.shape[0]])

    @classmethod
    def of_blocks(cls, name, kind, blocks, n, k):
        t = cls.__new__(cls)
        t.name, t.tensor_type, t.data, t.shape = name, gguf.GGMLQuantizationType[kind], blocks, np.array([k, n])
        return t


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_bit_exact(kind, isa):
    w = torch.randn(37, 96) * 0.1
    t = _FakeTensor("blk.0.attn_q.weight", kind, w)
    q = qgguf.tensor_to_quantized(t)
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(37, 96)
    assert torch.equal(q.dequantize(), want)
    assert q.source == f"gguf:{kind}" and q.group_size == 32 and q.bits == (8 if kind in ("Q8_0", "Q5_0") else 4)
    x = torch.randn(3, 96)
    assert_close(K.linear(x, q), linear_ref(x, want.double()), scale=_scale(96))


# K-quants, random super-blocks: Q4_K (every 6-bit scale and min, every nibble) as w4a16 group 32 with fp32 scale
# d * sc and min -dmin * m; Q6_K (every int8 scale, every 6-bit value, d of either sign) as w8a16 with groups of
# 16, int8 q - 32 and fp32 scale d * sc. Every product is exact in fp32, so both give gguf's own dequantization bit
# for bit.
_K_QUANTS = {"Q4_K": ("random_q4_k", (4, 32, torch.float32, torch.float32)),
             "Q6_K": ("random_q6_k", (8, 16, torch.float32, None))}


@pytest.mark.parametrize("kind", sorted(_K_QUANTS))
@pytest.mark.parametrize("n,k", [(5, 256), (37, 768), (3, 1536)])
def test_gguf_k_quant_blocks_bit_exact(kind, n, k, isa):
    import gguf_blocks

    writer, form = _K_QUANTS[kind]
    blocks = getattr(gguf_blocks, writer)(n, k, np.random.default_rng(n))
    t = _FakeTensor.of_blocks("blk.0.ffn_down.weight", kind, blocks, n, k)
    q = qgguf.tensor_to_quantized(t)
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(n, k)
    assert torch.equal(q.dequantize(), want)
    assert q.source == f"gguf:{kind}"
    assert (q.bits, q.group_size, q.scale.dtype, None if q.min is None else q.min.dtype) == form
    assert torch.equal(q.rows(torch.tensor([n - 1, 0])), want[[n - 1, 0]])  # the embedding lookup
    for m in (1, 3, 40):  # the decode GEMV and the prefill GEMM
        for dtype in DTYPES:
            x = torch.randn(m, k).to(dtype)
            assert_close(K.linear(x, q), linear_ref(x, quant_weight_ref(q, x)), scale=_scale(k))


def test_gguf_q6_k_quantizer_of_the_tests():
    # The tests' Q6_K writer (gguf has no Q6_K quantizer): each 16-value sub-block's values within half a step of
    # the weight (plus the int8 scale grid's rounding), the step being the sub-block's largest |w| over 31.
    from gguf_blocks import quantize_q6_k

    w = np.random.default_rng(0).standard_normal((7, 512)).astype(np.float32) * 0.05
    back = gguf.quants.dequantize(quantize_q6_k(w), gguf.GGMLQuantizationType.Q6_K).reshape(7, 512)
    sub = lambda a: a.reshape(7, 2, 16, 16)  # noqa: E731
    step = np.abs(sub(w)).max(-1) / 31
    assert (np.abs(sub(back - w)).max(-1) <= 0.6 * step).all()


def test_gguf_q4_k_quantizer_of_the_tests():
    # The tests' Q4_K writer (gguf has no Q4_K quantizer): each sub-block's values within half a step of the
    # weight, where the step is the sub-block's range over 15 levels (plus the 6-bit grids' rounding).
    from gguf_blocks import quantize_q4_k

    w = torch.randn(16, 512) * 0.05
    deq = gguf.quants.dequantize(quantize_q4_k(w.numpy()), gguf.GGMLQuantizationType.Q4_K).reshape(16, 512)
    sub = w.reshape(16, 2, 8, 32)
    step = (sub.amax(-1) - sub.amin(-1).clamp(max=0)) / 15
    err = (torch.from_numpy(deq.copy()) - w).abs().reshape(16, 2, 8, 32).amax(-1)
    assert (err <= 0.75 * step + 1e-4).all(), float((err / step).max())


def test_gguf_embedded_smollm2_tensors_bit_exact():
    from atb.checkpoints import default_model_path
    reader = gguf.GGUFReader(default_model_path())
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in ("Q8_0", "Q4_1") and (kind not in seen or t.name.startswith("blk.29")):
            seen.add(kind)
            q = qgguf.tensor_to_quantized(t)
            want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
            assert torch.equal(q.dequantize(), want.reshape(q.shape)), t.name
    assert seen == {"Q8_0", "Q4_1"}


def test_gguf_load_native_matches_hf_weights(smollm2_fp32):
    model, _ = smollm2_fp32
    w = qgguf.load_native(model)
    assert isinstance(w.embed, QuantizedWeight) and w.embed.source == "gguf:Q8_0" and w.lm_head is w.embed
    for i in (0, 29):
        lw = w.layers[i]
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        for name, hf in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
                         ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)):
            q = getattr(lw, name)
            assert q.source == "gguf:Q4_1"
            # HF dequantized the same blocks with gguf (and un-permuted q/k rows): equal bit for bit.
            assert torch.equal(q.dequantize(), hf.weight.detach()), (i, name)
    assert torch.equal(w.embed.dequantize(), model.model.embed_tokens.weight.detach())


def _dp_tables() -> list[str]:
    """The float SIMD tables with the bf16 dot-product GEMM: the native AVX-512 one on an AVX512-BF16 CPU (vdpbf16ps)
    and its AMX form where the CPU has AMX-BF16; the SIMDe ones (the AMX form over the tiles' emulation)."""
    native = ["avx512"] if "avx512bf16" in _C.cpu_features() else []
    return native + [t for t in ("avx512-amx", "avx512-simde", "avx512-amx-simde") if t in atb.available_isas()]


@pytest.mark.parametrize("table", _dp_tables())
@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("scale_dtype", [None, torch.float32])
def test_gemm_bf16_x_on_vdpbf16ps(table, fmt, group, scale_dtype):
    # bf16 x from 32 rows on, where the float table has vdpbf16ps: each weight tile dequantized to bf16 and
    # packed in k pairs, then the bf16 GEMM (quant_weight_ref: the weights rounded to bf16). Against float64 at odd
    # K (the last pair and group short), N off the 16-row panel, row tails of the 3-row tile, every epilogue;
    # a SoC whose UB splits K gives the host's bits.
    with forced_isa(table):
        host = atb.get_soc("host")
        # K's last 32-value chunk holding 1, 21 (all of a K below 32) and 31 values: the packing reads only
        # the bytes of values below K (a W4 byte holds values j and j + 16).
        # N = 124: 4 panels after the last 64-row group.
        for m, k, n in [(32, 577, 131), (301, 96, 17), (45, 4127, 40), (33, 21, 16), (130, 96, 124)]:
            x = torch.randn(m, k).bfloat16()
            q, q2 = _qw(n, k, fmt, group, scale_dtype), _qw(n, k, fmt, group, scale_dtype)
            b, r = torch.randn(n).bfloat16(), torch.randn(m, n).bfloat16()
            seg = _seg(n, 4 if fmt == "w4a16" else 8, group)
            assert _C.quant_linear_tiling(m, k, [seg], 0, DTYPE_CODES[torch.bfloat16], host)["form"] == "packed"
            y = K.linear(x, q, b)
            assert_close(y, linear_ref(x, quant_weight_ref(q, x), b), scale=_scale(k))
            assert_close(K.linear_residual(x, q, r, b), linear_residual_ref(x, quant_weight_ref(q, x, epilogue=1), r, b),
                         scale=_scale(k))
            assert_close(K.linear_swiglu(x, q, q2), linear_swiglu_ref(x, quant_weight_ref(q, x, [q, q2], 2),
                                                                      quant_weight_ref(q2, x, [q, q2], 2)),
                         scale=_scale(k))
            for soc in ALL_SOCS:
                if atb.get_soc(soc).supports_bf16:
                    assert torch.equal(K.linear(x, q, b, soc_type=soc), y), soc


@pytest.mark.parametrize("table", _dp_tables())
def test_dp_starts_at_6_rows_for_w4_and_16_for_w8_8_on_amx(table):
    # Where the dp GEMM takes over from the stream GEMV: W4 from 6 rows, W8 (and any launch with a W8 segment)
    # from 16, or 8 on the AMX tables. Each side of both boundaries against float64, with the fused epilogues.
    with forced_isa(table):
        host, bf16 = atb.get_soc("host"), DTYPE_CODES[torch.bfloat16]
        w4, w8 = _seg(96, 4, 32), _seg(96, 8, 0)
        w8_from = 8 if "amx" in table else 16
        kind = lambda m, segs, ep=0: _C.quant_linear_tiling(m, 577, segs, ep, bf16, host)["form"]  # noqa: E731
        assert kind(5, [w4]) != "packed" and kind(6, [w4]) == "packed"
        assert kind(w8_from - 1, [w8]) != "packed" and kind(w8_from, [w8]) == "packed"
        assert kind(6, [w4, w4], 2) == "packed" and kind(w8_from - 1, [w4, w8, w4]) != "packed"
        for m, fmt, group in [(5, "w4a16", 32), (6, "w4a16", 128), (w8_from - 1, "w8a16", 0), (w8_from, "w8a16", 0)]:
            x = torch.randn(m, 577).bfloat16()
            q, q2 = _qw(96, 577, fmt, group), _qw(96, 577, fmt, group)
            r = torch.randn(m, 96).bfloat16()
            assert_close(K.linear(x, q), linear_ref(x, quant_weight_ref(q, x)), scale=_scale(577))
            assert_close(K.linear_residual(x, q, r), linear_residual_ref(x, quant_weight_ref(q, x, epilogue=1), r),
                         scale=_scale(577))
            assert_close(K.linear_swiglu(x, q, q2), linear_swiglu_ref(x, quant_weight_ref(q, x, [q, q2], 2),
                                                                      quant_weight_ref(q2, x, [q, q2], 2)),
                         scale=_scale(577))


@pytest.mark.parametrize("soc", [s for s in ALL_SOCS if atb.get_soc(s).supports_bf16])
def test_gemm_bf16_dp_tiling_fits_ub(soc):
    info = atb.get_soc(soc)
    bf16 = DTYPE_CODES[torch.bfloat16]
    for m, k in [(32, 576), (300, 2048), (64, 70001)]:
        for ep, segs in ((0, [_seg(576, 4, 128)]), (2, [_seg(1536, 4, 32), _seg(1536, 4, 32)]), (1, [_seg(576, 8, 0)])):
            t = _C.quant_linear_tiling(m, k, segs, ep, bf16, info)
            assert t["ub_bytes"] <= info.ub_size
            assert t["k_tile"] >= t["k_pad"] or t["k_tile"] % 128 == 0
