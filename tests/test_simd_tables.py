"""Every kernel on every SIMD table this machine runs (the ``isa`` fixture: avx512 / avx2 / portable natively,
plus avx512-simde, the AVX-512 source built against SIMDe) against the float64 references; and the bit-level
promises simd.h makes across tables."""
import os
import subprocess
import sys

import pytest
import torch

import atb
from conftest import ISAS, forced_isa, fp32_decode_copy
from reference import (DTYPES, add_rms_norm_ref, assert_close, flash_attention_ref, linear_ref,
                       linear_swiglu_ref, paged_attention_ref, rms_norm_ref, rope_ref, silu_mul_ref)

K = atb.kernels


def _run_on(isa: str, fn):
    """fn() with the SIMD table forced to isa, then back to the one in use."""
    with forced_isa(isa):
        return fn()


def _scale(k: int) -> float:
    return max(1.0, k ** 0.5 / 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 577, 67), (3, 203, 37), (2, 71, 1030), (16, 576, 99), (40, 130, 45)])
def test_linear_forms(isa, dtype, m, k, n):
    # m = 16: the batch-16 decode shape (two 8-row passes); m = 40: the GEMM kernel; odd K and N: every tail.
    # n = 1030 at m = 2: each core's rows in one tile read as 4 runs (AVX-512), 2 rows past them on one core.
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    b, r = torch.randn(n).to(dtype), torch.randn(m, n).to(dtype)
    assert_close(K.linear(x, w, b), linear_ref(x, w, b), scale=_scale(k))
    # the residual epilogue is HF's separate add: exactly linear's output + r, rounded once
    assert torch.equal(K.linear_residual(x, w, r), (K.linear(x, w).double() + r.double()).to(dtype))
    g, u = (torch.randn(n, k) / k ** 0.5).to(dtype), (torch.randn(n, k) / k ** 0.5).to(dtype)  # unit-scale sums
    y = K.linear_swiglu(x, g, u)
    assert_close(y, linear_swiglu_ref(x, g, u))
    # the SwiGLU epilogue is HF's separate ops: silu_mul of the two linears' rounded outputs, bit for bit
    assert torch.equal(y, K.silu_mul(K.linear(x, g), K.linear(x, u)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1), (5, 31), (2, 577), (1, 4099)])
def test_norms(isa, dtype, shape):
    x, w, res = torch.randn(*shape).to(dtype), torch.randn(shape[-1]).to(dtype), torch.randn(*shape).to(dtype)
    assert_close(K.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    y, s = K.add_rms_norm(x, res, w, 1e-6)
    y_ref, s_ref = add_rms_norm_ref(x, res, w, 1e-6)
    assert_close(y, y_ref)
    assert_close(s, s_ref)
    # HF's roundings, bit for bit: with x from {+-0.5, +-1, +-1.5, +-2, +-3} every order sums the squares
    # exactly, so rstd is 1 / sqrt(mean + eps) in fp32 on every table, and y = T(w * T(x * rstd)).
    x = (torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0])[torch.randint(0, 5, shape)] *
         (torch.randint(0, 2, shape) * 2 - 1)).to(dtype)
    xf = x.float()
    # The square root through float64, rounded once: torch.sqrt on float32 is not correctly rounded on every
    # CPU (on a Zen 4, 15% of these results were 1 ulp off), std::sqrt is.
    mean = xf.square().sum(-1, keepdim=True) / shape[-1] + torch.tensor(1e-6, dtype=torch.float32)
    rstd = 1 / mean.double().sqrt().float()
    assert torch.equal(K.rms_norm(x, w, 1e-6), (w.float() * (xf * rstd).to(dtype).float()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "interleave"])
@pytest.mark.parametrize("head_dim,rotary", [(64, 64), (72, 72), (80, 48), (34, 34)])
def test_rope_same_bits_on_every_table(isa, dtype, style, head_dim, rotary):
    # HF's roundings make rope exact: every table gives the portable table's bits.
    q, k = torch.randn(9, 3, head_dim).to(dtype), torch.randn(9, 1, head_dim).to(dtype)
    cos, sin = torch.randn(9, rotary).to(dtype), torch.randn(9, rotary).to(dtype)
    out = K.rope(q, k, cos, sin, style=style)
    assert_close(out[0], rope_ref(q, cos, sin, style))
    atb.set_isa("portable")
    want = K.rope(q, k, cos, sin, style=style)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000])
def test_silu_mul(isa, dtype, n):
    g, u = torch.randn(3, n).to(dtype) * 4, torch.randn(3, n).to(dtype)
    out = K.silu_mul(g, u)
    assert_close(out, silu_mul_ref(g, u).to(dtype))
    # a row's values do not depend on where it starts in the call (tails take the vector path)
    assert torch.equal(K.silu_mul(g[1:], u[1:]), out[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 72)])
def test_flash_attention(isa, dtype, heads, kv_heads, head_dim):
    lens = [1, 17, 70] if "simde" in isa else [1, 17, 70, 300]  # SIMDe emulates every intrinsic: keep it short
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1])
    q = torch.randn(t, heads, head_dim).to(dtype)
    k, v = torch.randn(t, kv_heads, head_dim).to(dtype), torch.randn(t, kv_heads, head_dim).to(dtype)
    for causal in (True, False):
        assert_close(K.flash_attention(q, k, v, cu, causal=causal), flash_attention_ref(q, k, v, cu, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (9, 3, 80), (2, 2, 40)])
def test_paged_attention_decode(isa, dtype, heads, kv_heads, head_dim):
    lens, bs = [1, 16, 33, 150], 16
    width = max((n + bs - 1) // bs for n in lens)
    blocks = len(lens) * width + 2
    kc, vc = torch.randn(blocks, bs, kv_heads, head_dim).to(dtype), torch.randn(blocks, bs, kv_heads, head_dim).to(dtype)
    bt = torch.randperm(blocks)[:len(lens) * width].view(len(lens), width).int()
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    assert_close(K.paged_attention(q, kc, vc, bt, ctx), paged_attention_ref(q, kc, vc, bt, ctx))


@pytest.mark.skipif(not {"avx512", "avx2"} <= set(ISAS), reason="needs a CPU with AVX-512 and AVX2")
@pytest.mark.parametrize("dtype", DTYPES)
def test_avx512_and_avx2_tables_give_the_same_bits(dtype):
    # simd.h's promise: the lanes Mmad (decode linears) keeps the same 8-lane sums, and the NN/TN cube tiles
    # (the GEMM kernel, flash attention) are one fma chain per element, on both tables. 9 rows: fp32 from 10
    # rows on runs AVX-512's packed-x GEMM (mmad_packed_x_f32, the GEMM kernel's chain), AVX2's lanes.
    x16, x64, w = torch.randn(9, 579).to(dtype), torch.randn(64, 579).to(dtype), torch.randn(75, 579).to(dtype)
    wide = torch.randn(1030, 579).to(dtype)  # 1 to 4 rows: AVX-512 reads a core's rows as 4 runs, AVX2 in order
    # 2 rows of bf16 take their own AVX-512 block (unpacked halves, k unrolled by 32: 603 and 4104 leave k tails)
    x603, wide603, w4104 = torch.randn(2, 603).to(dtype), torch.randn(517, 603).to(dtype), torch.randn(261, 4104).to(dtype)
    x4104 = torch.randn(2, 4104).to(dtype)
    cu = torch.tensor([0, 5, 133], dtype=torch.int32)
    q, kv = torch.randn(133, 4, 64).to(dtype), torch.randn(133, 2, 64).to(dtype)
    lanes_outputs = 8  # the first 8 results below are lanes linears (1 to 4 rows)

    def run():
        return (K.linear(x16[:1], w), K.linear(x16[:1], wide), K.linear(x16[:3], wide), K.linear_swiglu(x16[:4], wide, wide),
                K.linear(x16[:2], wide), K.linear(x16[:2], w), K.linear(x603, wide603), K.linear(x4104, w4104),
                K.linear(x16, w), K.linear(x64, w), K.linear_swiglu(x16, w, w), K.flash_attention(q, kv, kv, cu))

    want, got = _run_on("avx2", run), _run_on("avx512", run)
    # bf16 on AVX512-BF16: from 6 rows on the linears, and flash attention's scores and P . V, run vdpbf16ps
    # (mmad_nt_dp_bf16, its own pairwise-sum contract), so only the lanes linears of 1 to 4 rows keep AVX2's bits.
    dp = dtype == torch.bfloat16 and "avx512bf16" in atb.build_info()["cpu_features"].split()
    for i, (a, b) in enumerate(zip(got, want)):
        if dp and i >= lanes_outputs:
            assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        else:
            assert torch.equal(a, b)


@pytest.mark.skipif("avx512-amx" not in ISAS or "avx512-amx-simde" not in ISAS,
                    reason="needs AMX tiles and the build's emulation of them")
def test_the_amx_emulation_sums_as_the_tiles_do():
    # simd_amx.h: per 32-k chunk, tdpbf16ps sums the even k's products in order, the odd k's likewise, then
    # adds the two to the accumulator; the test-only table's emulation must give the tiles' bits exactly
    # (its earlier single chain over k differed in about one output in 10^4 after the bf16 rounding).
    # Values spread over a wide range make the last-bit differences between summation orders visible.
    x = (torch.randn(300, 2048) * torch.exp2(torch.randint(-12, 12, (300, 2048)).float())).bfloat16()
    w = torch.randn(96, 2048).bfloat16()
    shapes = [(300, 2048, 96), (200, 576, 64), (64, 1000, 33), (17, 70, 7)]

    def run():
        return [K.linear(x[:m, :k].contiguous(), w[:n, :k].contiguous()) for m, k, n in shapes]

    want, got = _run_on("avx512-amx", run), _run_on("avx512-amx-simde", run)
    for (m, k, n), a, b in zip(shapes, got, want):
        assert torch.equal(a, b), (m, k, n, int((a != b).sum()))


@pytest.mark.parametrize("words", [0, 1, 31, 32, 33, 4099, 4 * 4096 + 13, 1 << 18])
def test_streaming_read_sums_every_word(isa, words):
    # The benchmarks' bandwidth probe (read_sum in 4 interleaved runs, split over the threads) must read each
    # word exactly once: its checksum is the words' sum mod 2^64, whatever the size's remainders.
    from atb import _C
    w = torch.randint(-2 ** 62, 2 ** 62, (words + 1,), dtype=torch.int64)[1:]  # (+1: an 8-byte offset start)
    expected = int(w.sum()) % 2 ** 64 if words else 0
    assert _C.stream_read(w.data_ptr(), words * 8 + 7) == expected  # a trailing partial word is not read


def test_isa_selection_and_errors():
    isas, active = atb.available_isas(), atb.build_info()["isa"]
    with forced_isa("auto"):  # the fastest this CPU runs, whatever table the run forced
        assert "portable" in isas and atb.build_info()["isa"] == isas[0]
    features = atb.build_info()["cpu_features"].split()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(features):
        assert "avx512" in isas  # (unless the OS does not save zmm state; this machine does)
    if "amx-bf16" in features:  # (unless the kernel refuses the tile state; this one grants it)
        assert isas[0] == "avx512-amx"
    for name in isas:
        with forced_isa(name):
            assert atb.build_info()["isa"] == name
    with pytest.raises(ValueError, match="set_isa: unknown ISA 'avx1024'"):
        atb.set_isa("avx1024")
    with pytest.raises(TypeError, match="set_isa: isa must be a str"):
        atb.set_isa(512)
    assert atb.build_info()["isa"] == active  # a rejected call changes nothing


def test_forcing_an_isa_the_cpu_lacks_fails_at_import():
    missing = [i for i in ("avx512", "avx2") if i not in atb.available_isas()]
    env_isa = missing[0] if missing else "avx9000"
    proc = subprocess.run([sys.executable, "-c", "import atb"], capture_output=True, text=True,
                          env={**os.environ, "ATB_ISA": env_isa})
    assert proc.returncode != 0 and f"ATB_ISA={env_isa}" in proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import atb; print(atb.build_info()['isa'])"], capture_output=True,
                          text=True, env={**os.environ, "ATB_ISA": "portable"})
    assert proc.stdout.strip() == "portable"


def test_stream_prefetch_setting():
    # Default by CPU vendor, ATB_STREAM_PREFETCH_KB at import, set_stream_prefetch_kb at run time; bad values are
    # rejected naming the setting, and a rejected call changes nothing.
    default = atb.stream_prefetch_kb()
    intel = "GenuineIntel" in open("/proc/cpuinfo").read() if sys.platform == "linux" else None
    if intel is not None and "ATB_STREAM_PREFETCH_KB" not in os.environ:
        assert default == (16 if intel else 0)
    assert atb.build_info()["stream_prefetch_kb"] == default
    try:
        atb.set_stream_prefetch_kb(5)
        assert atb.stream_prefetch_kb() == 5
        for bad in (-1, 1.5, True, "4", (1 << 20) + 1):
            with pytest.raises(ValueError, match="set_stream_prefetch_kb: kb must be an int in"):
                atb.set_stream_prefetch_kb(bad)
        assert atb.stream_prefetch_kb() == 5
    finally:
        atb.set_stream_prefetch_kb(None)
    assert atb.stream_prefetch_kb() == default
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", "import atb; print(atb.stream_prefetch_kb())"], capture_output=True,
                          text=True, env={**env, "ATB_STREAM_PREFETCH_KB": "7"})
    assert proc.stdout.strip() == "7"
    proc = subprocess.run([sys.executable, "-c", "import atb"], capture_output=True, text=True,
                          env={**env, "ATB_STREAM_PREFETCH_KB": "-3"})
    assert proc.returncode != 0 and "ATB_STREAM_PREFETCH_KB='-3': expected an int in [0, 1048576]" in proc.stderr


def test_fp32_decode_copy_setting():
    # Default by CPU vendor, ATB_FP32_DECODE_COPY at import, set_fp32_decode_copy at run time; bad values are
    # rejected naming the setting, and a rejected call changes nothing.
    default = atb.fp32_decode_copy()
    intel = "GenuineIntel" in open("/proc/cpuinfo").read() if sys.platform == "linux" else None
    if intel is not None and "ATB_FP32_DECODE_COPY" not in os.environ:
        assert default is (not intel)
    assert atb.build_info()["fp32_decode_copy"] is default
    try:
        atb.set_fp32_decode_copy(not default)
        assert atb.fp32_decode_copy() is (not default)
        for bad in (0, 1, "1", 1.0):
            with pytest.raises(ValueError, match="set_fp32_decode_copy: on must be True, False or None"):
                atb.set_fp32_decode_copy(bad)
        assert atb.fp32_decode_copy() is (not default)
    finally:
        atb.set_fp32_decode_copy(None)
    assert atb.fp32_decode_copy() is default
    env = dict(os.environ)
    for value in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", "import atb; print(atb.fp32_decode_copy())"],
                              capture_output=True, text=True, env={**env, "ATB_FP32_DECODE_COPY": value})
        assert proc.stdout.strip() == str(value == "1")
    proc = subprocess.run([sys.executable, "-c", "import atb"], capture_output=True, text=True,
                          env={**env, "ATB_FP32_DECODE_COPY": "yes"})
    assert proc.returncode != 0 and "ATB_FP32_DECODE_COPY='yes': expected 0" in proc.stderr


def _launch_linear(x, segments, epilogue, residual=None, soc="host"):
    """atb._C.linear over (weight, bias, rows4 copy or None) segments; the outputs (SWIGLU: the one output)."""
    from atb import _C
    from atb.kernels._common import DTYPE_CODES

    m, k = x.shape
    outs = [torch.empty(m, w.shape[0], dtype=x.dtype) for w, _, _ in segments]
    if epilogue == 2:
        outs = outs[:1]
    segs = [(w.data_ptr(), 0 if b is None else b.data_ptr(), outs[i].data_ptr() if i < len(outs) else 0, w.shape[0],
             0 if r4 is None else r4.data_ptr()) for i, (w, b, r4) in enumerate(segments)]
    _C.linear(x.data_ptr(), m, k, segs, 0 if residual is None else residual.data_ptr(), epilogue, DTYPE_CODES[x.dtype],
              atb.get_soc(soc))
    return outs


@pytest.mark.parametrize("dtype,m,k,n", [
    (torch.bfloat16, 16, 576, 1030), (torch.bfloat16, 17, 2048, 70), (torch.bfloat16, 33, 13, 5),
    (torch.bfloat16, 16, 1, 37), (torch.bfloat16, 31, 603, 16),
    (torch.float32, 16, 1024, 261), (torch.float32, 20, 2048, 19), (torch.float32, 16, 576, 40),
    (torch.float32, 10, 1024, 100)])
def test_batch_rows_read_rows4_copies(isa, dtype, m, k, n):
    # From 16 rows of x the GEMM's packed-x form reads a weight's rows4 copy where the table has the kernel
    # (_C.rows4_packed_x: bf16; fp32 where rows as they lie alias in L1, K * 4 a multiple of 4 KiB): with the
    # weights overwritten by NaN after packing, the output is unchanged (the copy alone was read). Where the copy
    # leaves the form as it was, the bits are those of the weights as they lie; where it lifts the aliasing rule
    # (K = 2048 bf16, 1024 and 2048 fp32), the launch takes the packed-x form instead of the row kernels, whose
    # sums run in another order: within the dtype's bound of the float64 reference, as those are. N % 16 != 0:
    # a short last block of rows; K odd (bf16): a last k pair whose partner is the copy's padding; a row tile
    # that does not start a group of 4 (segments of fewer than 48 rows) reads the weights as they lie.
    from atb import _C
    from atb.kernels._common import DTYPE_CODES
    from atb.kernels.linear import pack_rows4

    def rand(*shape):
        return (torch.randn(*shape) / k ** 0.5).to(dtype)

    def tiling(rows, epilogue, copies):
        return _C.linear_tiling(m, k, rows, epilogue, DTYPE_CODES[dtype], atb.get_soc("host"), rows4_copies=copies)

    def form(copies):
        return tiling([n], 0, copies)["form"]

    x, r = torch.randn(m, k).to(dtype), torch.randn(m, n).to(dtype)
    q, kk, gate, up = rand(n, k), rand(n // 4 + 1, k), rand(n, k), rand(n, k)
    qb = torch.randn(n).to(dtype)
    for epilogue, segments, residual in ((0, [(q, qb), (kk, None)], None), (1, [(q, qb)], r),
                                         (2, [(gate, None), (up, None)], None)):
        # Tiles of rows that start a group of 4 read the copy (n_tile below 48 only with a segment that short).
        t = tiling([w.shape[0] for w, _ in segments], epilogue, True)
        reads_copy = _C.rows4_packed_x(DTYPE_CODES[dtype], k) and t["form"] == "packed_x" and t["n_tile"] % 4 == 0
        plain = _launch_linear(x, [(w, b, None) for w, b in segments], epilogue, residual)
        copies = [pack_rows4(w) for w, _ in segments]
        got = _launch_linear(x, [(w, b, c) for (w, b), c in zip(segments, copies)], epilogue, residual)
        for a, b in zip(got, plain):
            if form(True) == form(False):
                assert torch.equal(a, b)
            else:
                assert_close(a, b, scale=2 * _scale(k))
        if reads_copy:
            nan = [torch.full_like(w, float("nan")) for w, _ in segments]
            for a, b in zip(_launch_linear(x, [(w, b, c) for w, (_, b), c in zip(nan, segments, copies)], epilogue,
                                           residual), got):
                assert torch.equal(a, b)
    assert_close(_launch_linear(x, [(q, qb, pack_rows4(q))], 0)[0], linear_ref(x, q, qb), scale=_scale(k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 576, 1030), (2, 603, 517), (3, 64, 7), (4, 4104, 261), (1, 13, 5), (5, 96, 70)])
def test_rows4_copies_give_the_lanes_bits(isa, dtype, m, k, n):
    # The decode graph's repacked weights (pack_rows4): the STREAM kernel reads them at 1 row of x (fp32: 1 or 2)
    # where the table has the kernel (AVX-512; bf16 on AVX2), with the lanes kernel's bits; elsewhere (other tables, more rows)
    # it reads the weights as they lie. N % 4 != 0: a last group with padding rows; K % 8 != 0: the tail from the weight.
    from atb.kernels.linear import pack_rows4

    def rand(*shape):
        return (torch.randn(*shape) / k ** 0.5).to(dtype)

    x, r = torch.randn(m, k).to(dtype), torch.randn(m, n).to(dtype)
    q, kk, v, gate, up = rand(n, k), rand(n // 4 + 1, k), rand(n // 4 + 1, k), rand(n, k), rand(n, k)
    qb, kb, vb = torch.randn(n).to(dtype), torch.randn(n // 4 + 1).to(dtype), None
    for epilogue, segments, residual in ((0, [(q, qb), (kk, kb), (v, vb)], None), (1, [(q, qb)], r),
                                         (2, [(gate, None), (up, None)], None)):
        plain = _launch_linear(x, [(w, b, None) for w, b in segments], epilogue, residual)
        # fp32 reads the copy, or the weights as they lie in the AVX2 table's rows (atb.set_fp32_decode_copy), and
        # the copy's stream is prefetched ahead or not (atb.set_stream_prefetch_kb): the bits never change.
        for copy in ((True, False) if dtype == torch.float32 else (True,)):
            with fp32_decode_copy(copy):
                for a, b in zip(_launch_linear(x, [(w, b, None) for w, b in segments], epilogue, residual), plain):
                    assert torch.equal(a, b)
                for ahead_kb in (0, 1, 16):
                    atb.set_stream_prefetch_kb(ahead_kb)
                    try:
                        got = _launch_linear(x, [(w, b, pack_rows4(w)) for w, b in segments], epilogue, residual)
                    finally:
                        atb.set_stream_prefetch_kb(None)
                    for a, b in zip(got, plain):
                        assert torch.equal(a, b)
    for a, (w, b) in zip(_launch_linear(x, [(w, b, pack_rows4(w)) for w, b in ((q, qb), (kk, kb))], 0),
                         ((q, qb), (kk, kb))):
        assert_close(a, linear_ref(x, w, b), scale=_scale(k))
