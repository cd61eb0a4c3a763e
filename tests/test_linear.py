"""linear and its fused forms (multi-weight, residual, SwiGLU) against float64 references; tiling; bad input."""
import pytest
import torch

import atb
from atb import _C
from atb.kernels._common import DTYPE_CODES
from atb.kernels.linear import pack_rows4, rows4_supported
from conftest import ALL_SOCS, forced_isa
from reference import DTYPES, assert_close, linear_ref, linear_residual_ref, linear_swiglu_ref

BF16_SOCS = [s for s in ALL_SOCS if atb.get_soc(s).supports_bf16]


def _scale(k: int) -> float:
    # fp32 accumulation error grows ~sqrt(K) ulp of the sum's magnitude; inputs are
    # randn so |y| ~ sqrt(K): compare against the tolerance scaled to that magnitude.
    return max(1.0, k ** 0.5 / 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(dtype, m, bias):
    k, n = 577, 1537
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    y = atb.kernels.linear(x, w, b)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_close(y, linear_ref(x, w, b), scale=_scale(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (2, 7, 5), (5, 8, 3), (3, 64, 4), (1, 4100, 9), (33, 100, 9), (40, 1030, 70)])
def test_linear_odd_and_edge_shapes(dtype, m, k, n):
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype)
    assert_close(atb.kernels.linear(x, w, b), linear_ref(x, w, b), scale=_scale(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_linear_multi_equals_separate_linears(dtype, m):
    k = 577
    x = torch.randn(m, k).to(dtype)
    ws = [torch.randn(n, k).to(dtype) for n in (576, 193, 193)]
    bs = [torch.randn(w.shape[0]).to(dtype) for w in ws]
    outs = atb.kernels.linear_multi(x, ws, bs)
    for out, w, b in zip(outs, ws, bs):
        assert torch.equal(out, atb.kernels.linear(x, w, b))  # same sums, same bits
        assert_close(out, linear_ref(x, w, b), scale=_scale(k))
    q, kk = atb.kernels.linear_multi(x, ws[:2])  # two segments, no bias
    assert torch.equal(q, atb.kernels.linear(x, ws[0])) and torch.equal(kk, atb.kernels.linear(x, ws[1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 16])
def test_linear_residual(dtype, m):
    k, n = 1537, 577
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    r = torch.randn(m, n).to(dtype)
    b = torch.randn(n).to(dtype)
    assert_close(atb.kernels.linear_residual(x, w, r), linear_residual_ref(x, w, r))
    assert_close(atb.kernels.linear_residual(x, w, r, b), linear_residual_ref(x, w, r, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_linear_swiglu(dtype, m):
    k, n = 577, 1537
    x = torch.randn(m, k).to(dtype)
    g = (torch.randn(n, k) / k ** 0.5).to(dtype)
    u = (torch.randn(n, k) / k ** 0.5).to(dtype)
    assert_close(atb.kernels.linear_swiglu(x, g, u), linear_swiglu_ref(x, g, u))


@pytest.mark.parametrize("soc", ALL_SOCS)
def test_every_soc_gives_the_same_bits(soc):
    # Ascend SoCs split N over 20-48 cores and K over a 192 KiB UB (x of 16 x 4100 fp32
    # does not fit): the per-lane accumulators make the bits independent of that.
    dtype = torch.bfloat16 if soc in BF16_SOCS else torch.float16
    x = torch.randn(16, 4100).to(dtype)
    w = torch.randn(301, 4100).to(dtype)
    b = torch.randn(301).to(dtype)
    assert torch.equal(atb.kernels.linear(x, w, b, soc_type=soc), atb.kernels.linear(x, w, b, soc_type="host"))
    g, u = w[:150], w[150:300]
    assert torch.equal(atb.kernels.linear_swiglu(x, g, u, soc_type=soc), atb.kernels.linear_swiglu(x, g, u, soc_type="host"))
    r = torch.randn(16, 301).to(dtype)
    assert torch.equal(atb.kernels.linear_residual(x, w, r, soc_type=soc),
                       atb.kernels.linear_residual(x, w, r, soc_type="host"))


def test_tiling_splits_rows_and_k():
    soc = atb.get_soc("Ascend910B4")  # 20 cube cores, 192 KiB UB
    t = _C.linear_tiling(15, 4096, [4096], 0, DTYPE_CODES[torch.float32], soc)  # the STREAM kernel's split
    assert t["tiling_key"] // 100 == 0 and t["block_dim"] == 20 and t["block_factor"] % 4 == 0
    assert (t["block_dim"] - 1) * t["block_factor"] < 4096 <= t["block_dim"] * t["block_factor"]
    assert t["k_tile"] < 4096 and t["k_tile"] % 64 == 0 and t["ub_bytes"] <= soc.ub_size
    t = _C.linear_tiling(1, 576, [576, 192, 192], 0, 0, soc)  # fused qkv: rows of all three segments split
    assert t["block_dim"] * t["block_factor"] >= 960 and t["k_tile"] == 576 and t["m_tile"] == 1
    host = atb.get_soc("host")
    t = _C.linear_tiling(1, 64, [64], 0, 0, host)  # 16 KiB of weight: not worth a second thread
    assert t["block_dim"] == 1
    t = _C.linear_tiling(1, 4096, [4096], 0, 2, host)
    assert t["block_dim"] == host.cube_core_num and t["k_tile"] == 4096
    t = _C.linear_tiling(512, 4096, [4096], 0, 0, soc)  # prefill-sized M: several passes of x rows
    assert t["m_tile"] < 512 and t["ub_bytes"] <= soc.ub_size


def test_linear_auto_routes_by_crossover():
    from atb.kernels.linear import LINEAR_CROSSOVER_M
    w = torch.randn(33, 65)
    for m in (1, LINEAR_CROSSOVER_M - 1):
        x = torch.randn(2, m, 65)[1]
        assert torch.equal(atb.kernels.linear_auto(x, w), atb.kernels.linear(x, w))
    x = torch.randn(3, LINEAR_CROSSOVER_M, 65)
    assert torch.equal(atb.kernels.linear_auto(x, w), torch.nn.functional.linear(x, w))
    # fp16/bf16 prefill shapes stay native (torch has no fast half-precision GEMM on AVX2).
    xb, wb = torch.randn(3 * LINEAR_CROSSOVER_M, 65).bfloat16(), w.bfloat16()
    assert torch.equal(atb.kernels.linear_auto(xb, wb), atb.kernels.linear(xb, wb))


# ---- the GEMM kernel (M >= 32 rows) ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(32, 64, 8), (33, 577, 193), (97, 1030, 70), (500, 100, 77), (64, 7, 3),
                                   (130, 2050, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_reference(dtype, m, k, n, bias):
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    t = _C.linear_tiling(m, k, [n], 0, DTYPE_CODES[dtype], atb.get_soc("host"))
    assert t["tiling_key"] // 100 == 1   # the GEMM kernel ran
    assert_close(atb.kernels.linear(x, w, b), linear_ref(x, w, b), scale=_scale(k))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_fused_epilogues(dtype):
    m, k = 101, 577
    x = torch.randn(m, k).to(dtype)
    ws = [(torch.randn(n, k) / k ** 0.5).to(dtype) for n in (576, 193, 41)]
    bs = [torch.randn(w.shape[0]).to(dtype) for w in ws]
    for out, w, b in zip(atb.kernels.linear_multi(x, ws, bs), ws, bs):
        assert torch.equal(out, atb.kernels.linear(x, w, b))   # a segment's tiles are the same sums
        assert_close(out, linear_ref(x, w, b))
    r = torch.randn(m, 193).to(dtype)
    assert_close(atb.kernels.linear_residual(x, ws[1], r, bs[1]), linear_residual_ref(x, ws[1], r, bs[1]))
    g, u = ws[0][:300], ws[0][276:]
    assert_close(atb.kernels.linear_swiglu(x, g, u), linear_swiglu_ref(x, g, u))


def test_gemm_rows_do_not_depend_on_m():
    # Each output element is one fma chain over K in order, whatever the M pass, tile or core. (bf16 with
    # vdpbf16ps switches micro-kernel at 128 rows, so each call is compared with one on its side of it.)
    x = torch.randn(700, 300).bfloat16()
    w = torch.randn(90, 300).bfloat16()
    full, first = atb.kernels.linear(x, w), atb.kernels.linear(x[:100], w)
    for lo, hi in [(0, 32), (5, 53), (333, 700), (100, 300)]:
        assert torch.equal(atb.kernels.linear(x[lo:hi], w), (first if hi <= 100 else full)[lo:hi])


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariant_rows_do_not_depend_on_m(isa, dtype):
    # row_invariant: the GEMM kernel at every M (by default 1..31 rows, 1..15 for bf16 with vdpbf16ps, run the
    # STREAM kernel, which rounds differently), so rows computed a few at a time, at any offset, are the bits
    # of one 300-row call: every fused epilogue, K and N with tails.
    k, n, host = 200, 70, atb.get_soc("host")
    code = DTYPE_CODES[dtype]
    assert _C.linear_tiling(1, k, [n], 0, code, host)["tiling_key"] // 100 == 0
    assert _C.linear_tiling(1, k, [n], 0, code, host, row_invariant=True)["tiling_key"] // 100 == 1
    x, r = torch.randn(300, k).to(dtype), torch.randn(300, n).to(dtype)
    w, w2, w3 = (torch.randn(n, k).to(dtype) for _ in range(3))
    b = torch.randn(n).to(dtype)
    K, kw = atb.kernels, dict(row_invariant=True)
    ops = {"linear": lambda i: K.linear(x[i], w, b, **kw),
           "multi": lambda i: torch.cat(K.linear_multi(x[i], [w, w2, w3[:20]], [b, None, None], **kw), 1),
           "residual": lambda i: K.linear_residual(x[i], w, r[i], b, **kw),
           "swiglu": lambda i: K.linear_swiglu(x[i], w, w2, **kw)}
    assert_close(ops["linear"](slice(0, 300)), linear_ref(x, w, b), scale=_scale(k))
    for name, op in ops.items():
        full = op(slice(0, 300))
        for lo, hi in [(0, 1), (7, 8), (3, 10), (100, 115), (290, 300), (31, 62), (5, 53)]:
            assert torch.equal(op(slice(lo, hi)), full[lo:hi]), (name, lo, hi)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stream_rows_do_not_depend_on_m(isa, dtype):
    # The STREAM kernel's lanes Mmad holds one fma chain per lane whatever block of (rows, weight rows) computes
    # it (AVX2: 2 x 4 blocks up to two rows, 4 x 3 from three on, and their row and column tails), so every row
    # of a 1..31-row call is the bits of the same row alone, on every table and epilogue (bf16 from 6 rows on
    # runs the GEMM kernel where the table has vdpbf16ps).
    k, n = 579, 77
    x, r = torch.randn(31, k).to(dtype), torch.randn(31, n).to(dtype)
    w, w2 = torch.randn(n, k).to(dtype), torch.randn(n, k).to(dtype)
    K = atb.kernels
    ops = {"linear": lambda i: K.linear(x[i], w), "residual": lambda i: K.linear_residual(x[i], w, r[i]),
           "swiglu": lambda i: K.linear_swiglu(x[i], w, w2)}
    host, code = atb.get_soc("host"), DTYPE_CODES[dtype]
    stream = [m for m in (2, 3, 4, 5, 6, 7, 9, 13, 16, 31)
              if _C.linear_tiling(m, k, [n], 0, code, host)["tiling_key"] // 100 == 0]
    assert stream[:6] == ([2, 3, 4, 5] if dtype == torch.bfloat16 and _has_dp(isa) else [2, 3, 4, 5, 6, 7])
    for name, op in ops.items():
        alone = [op(slice(i, i + 1)) for i in range(31)]
        for m in stream:
            got = op(slice(0, m))
            for i in range(m):
                assert torch.equal(got[i:i + 1], alone[i]), (name, m, i)


@pytest.mark.parametrize("m,k,n", [(16, 577, 49), (17, 31, 2), (31, 33, 1), (33, 1, 50), (100, 1030, 97),
                                   (16, 64, 3), (6, 577, 49), (7, 64, 5), (13, 1030, 97), (9, 40, 50),
                                   (12, 96, 2)])
def test_gemm_bf16_every_isa(isa, m, k, n):
    # bf16 from 6 rows on: the vdpbf16ps micro-kernel where the table has it (AVX512-BF16, and the SIMDe
    # table), odd M, N and K (tails of the 8-row, 3-column and 32-deep blocks; 9 to 16 rows walk the weight
    # panels first, with 1 or 2 columns left over), every fused epilogue.
    dp = _has_dp(isa)
    x = torch.randn(m, k).bfloat16()
    ws = [torch.randn(n, k).bfloat16() for _ in range(3)]
    b = torch.randn(n).bfloat16()
    y = atb.kernels.linear(x, ws[0], b)
    assert_close(y, linear_ref(x, ws[0], b), scale=_scale(k))
    if dp:  # from 6 rows on a dp micro-kernel (x packed in k pairs from 16 rows on, on AMX from 6): the same
        # sums whatever the rows around them, for any rows that take the same one
        kind = lambda rows: _C.linear_tiling(rows, k, [n], 0, DTYPE_CODES[torch.bfloat16],  # noqa: E731
                                             atb.get_soc("host"))
        assert kind(m)["tiling_key"] // 100 == 1
        assert kind(m)["form"] == ("packed_x" if m >= 16 or "amx" in isa else "rows")
        for rows in (6, 16):
            if rows <= m and kind(rows)["form"] == kind(m)["form"]:
                for lo, hi in [(0, rows), (m - rows, m)]:
                    assert torch.equal(atb.kernels.linear(x[lo:hi], ws[0], b), y[lo:hi])
    for out, w in zip(atb.kernels.linear_multi(x, ws, [b, None, b]), ws):
        assert torch.equal(out, atb.kernels.linear(x, w, b if w is not ws[1] else None))
    r = torch.randn(m, n).bfloat16()
    assert_close(atb.kernels.linear_residual(x, ws[1], r, b), linear_residual_ref(x, ws[1], r, b), scale=_scale(k))
    assert_close(atb.kernels.linear_swiglu(x, ws[1], ws[2]), linear_swiglu_ref(x, ws[1], ws[2]), scale=_scale(k))


def _has_dp(isa: str) -> bool:
    """Whether the table has the vdpbf16ps / AMX bf16 micro-kernels (AVX512-BF16 natively, SIMDe's always)."""
    return (isa == "avx512" and "avx512bf16" in _C.cpu_features()) or isa in ("avx512-amx", "avx512-simde",
                                                                               "avx512-amx-simde")


@pytest.mark.parametrize("m,k,n", [(128, 577, 70), (129, 1, 17), (200, 33, 1), (130, 64, 64), (300, 3001, 33),
                                   (128, 96, 60), (131, 40, 124)])
def test_gemm_bf16_packed_every_isa(isa, m, k, n):
    # bf16 from 128 rows on (and at every M under row_invariant): weight tiles packed in k pairs for vdpbf16ps
    # where the table has it. Odd K (the last pair half), N off the 16-row panel and the 64-row group (1 to 4
    # panels after the last whole group: 60 and 124 once came out wrong), K past
    # what the UB holds at once (chunks accumulate), every fused epilogue; the same bits whatever rows share
    # the call, and a row-invariant call of a few rows gives the rows of the big one.
    host, code = atb.get_soc("host"), DTYPE_CODES[torch.bfloat16]
    kind = _C.linear_tiling(m, k, [n], 0, code, host)["form"]
    assert kind == ("packed" if _has_dp(isa) else "f32_tiles")
    small = _C.linear_tiling(3, k, [n], 0, code, host, row_invariant=True)["form"]
    assert small == kind
    x = torch.randn(m, k).bfloat16()
    ws = [torch.randn(n, k).bfloat16() for _ in range(3)]
    b, r = torch.randn(n).bfloat16(), torch.randn(m, n).bfloat16()
    K = atb.kernels
    ops = {"linear": (lambda i, **kw: K.linear(x[i], ws[0], b, **kw), linear_ref(x, ws[0], b)),
           "residual": (lambda i, **kw: K.linear_residual(x[i], ws[1], r[i], b, **kw),
                        linear_residual_ref(x, ws[1], r, b)),
           "swiglu": (lambda i, **kw: K.linear_swiglu(x[i], ws[1], ws[2], **kw), linear_swiglu_ref(x, ws[1], ws[2]))}
    for name, (op, ref) in ops.items():
        full = op(slice(0, m))
        assert_close(full, ref, scale=_scale(k))
        assert torch.equal(op(slice(0, m), row_invariant=True), full), name
        for lo, hi in [(0, 1), (5, 12), (m - 7, m)]:
            assert torch.equal(op(slice(lo, hi), row_invariant=True), full[lo:hi]), (name, lo, hi)
    outs = K.linear_multi(x, ws, [b, None, b])
    for out, w, bias in zip(outs, ws, [b, None, b]):
        assert torch.equal(out, K.linear(x, w, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(16, 576, 48), (16, 577, 50), (17, 64, 17), (31, 1, 16), (16, 1536, 97),
                                   (31, 2, 33), (127, 95, 1), (33, 3, 16), (255, 131, 40), (300, 65, 19)])
def test_batch_decode_rows_have_the_prefill_bits(isa, dtype, m, k, n):
    # Batch decode and short prefills on x packed in panels of 16 rows (bf16 from 16 to 127 rows on the vector
    # dp tables: mmad_dp_bf16_packed_x; fp32 from 10 to 255 rows on every AVX-512 table, row-invariant calls
    # included: mmad_packed_x_f32): every element is the chain the packed GEMM computes (bf16: the
    # k-pair-packed kernel; fp32: MmadTN's fma chain), so those rows have the bits of a row-invariant call
    # (bf16: of any size; fp32: of fewer than 16 rows). Odd K (bf16: the lone last pair), N off the 16-row
    # weight block (its padded copy), M off the 16-row panel, every fused epilogue.
    if dtype == torch.bfloat16 and (not _has_dp(isa) or "amx" in isa):
        pytest.skip("bf16: the vector unit's vdpbf16ps tables only (AMX sums its 32-k chunks its own way)")
    if dtype == torch.float32 and not isa.startswith("avx512"):
        pytest.skip("fp32: the AVX-512 tables")
    if m >= (128 if dtype == torch.bfloat16 else 256):
        pytest.skip("bf16 from 128 rows on, fp32 from 256, is the packed GEMM itself")
    for row_invariant in (False, True) if dtype == torch.float32 else (False,):
        tiling = _C.linear_tiling(m, k, [n], 0, DTYPE_CODES[dtype], atb.get_soc("host"), row_invariant=row_invariant)
        assert tiling["form"] == "packed_x"
    x = torch.randn(m, k).to(dtype)
    ws = [torch.randn(n, k).to(dtype) for _ in range(3)]
    b, r = torch.randn(n).to(dtype), torch.randn(m, n).to(dtype)
    K = atb.kernels
    for name, op in {"linear": lambda **kw: K.linear(x, ws[0], b, **kw),
                     "residual": lambda **kw: K.linear_residual(x, ws[1], r, b, **kw),
                     "swiglu": lambda **kw: K.linear_swiglu(x, ws[1], ws[2], **kw)}.items():
        full = op()
        assert torch.equal(full, op(row_invariant=True)), name
        for lo, hi in [(0, 1), (3, 15), (m - 15, m)]:  # row-invariant calls of a few rows: the packed kernels
            rows = slice(lo, hi)
            few = {"linear": lambda: K.linear(x[rows], ws[0], b, row_invariant=True),
                   "residual": lambda: K.linear_residual(x[rows], ws[1], r[rows], b, row_invariant=True),
                   "swiglu": lambda: K.linear_swiglu(x[rows], ws[1], ws[2], row_invariant=True)}[name]()
            assert torch.equal(few, full[rows]), (name, lo, hi)
    assert_close(K.linear(x, ws[0], b), linear_ref(x, ws[0], b), scale=_scale(k))
    qkv = K.linear_multi(x, ws, [b, None, b])
    for out, w, bias in zip(qkv, ws, [b, None, b]):
        assert torch.equal(out, K.linear(x, w, bias, row_invariant=True))
    if m > 16:  # a row's bits do not depend on the rows around it
        assert torch.equal(K.linear(x[m - 16:], ws[0], b), K.linear(x, ws[0], b)[m - 16:])


def test_packed_x_leaves_weight_rows_4_kib_apart_to_the_other_kernels(isa):
    # 16 weight rows 4 KiB apart share one L1 set: the packed-x forms read them together, so those shapes keep
    # the row (bf16) and stream (fp32) kernels on the vector tables.
    host = atb.get_soc("host")
    kind = lambda m, k, dtype: _C.linear_tiling(m, k, [64], 0, DTYPE_CODES[dtype], host)  # noqa: E731
    if isa.startswith("avx512"):
        assert kind(16, 1536, torch.float32)["form"] == "packed_x"
        assert kind(16, 1024, torch.float32)["tiling_key"] // 100 == 0
    if _has_dp(isa) and "amx" not in isa:
        assert kind(16, 2048, torch.bfloat16)["form"] == "rows"
        assert kind(16, 2050, torch.bfloat16)["form"] == "packed_x"
    # Unless the weights come with rows4 copies that the form reads (4 runs, not 16 rows apart): bf16 on the
    # vector dp tables, fp32 on every AVX-512 table.
    copies = lambda m, k, dtype: _C.linear_tiling(m, k, [64], 0, DTYPE_CODES[dtype], host,  # noqa: E731
                                                   rows4_copies=True)
    if isa.startswith("avx512"):
        assert copies(16, 1024, torch.float32)["form"] == "packed_x"
        # fp32 takes the form from 10 rows (kLinearPackedXMinRows), from the copy too.
        assert copies(10, 1024, torch.float32)["form"] == "packed_x" == kind(10, 1536, torch.float32)["form"]
        assert copies(9, 1024, torch.float32)["tiling_key"] // 100 == 0 == kind(9, 1536, torch.float32)["tiling_key"] // 100
    else:
        assert copies(16, 1024, torch.float32) == kind(16, 1024, torch.float32)
    if _has_dp(isa):
        assert copies(16, 2048, torch.bfloat16)["form"] == "packed_x"  # AMX: its tiles, copies or not


def test_gemm_bf16_packed_splits_k_when_the_ub_is_small():
    # A modelled SoC's smaller UB splits K into chunks of whole 32-value blocks; the chunks accumulate in fp32
    # in order, so the bits are the host's (where all of K fits).
    table = "avx512" if "avx512bf16" in _C.cpu_features() else "avx512-simde"
    if table not in atb.available_isas():
        pytest.skip("no table with vdpbf16ps: neither AVX512-BF16 nor the SIMDe build")
    with forced_isa(table):
        code = DTYPE_CODES[torch.bfloat16]
        tilings = {s: _C.linear_tiling(256, 4099, [96], 0, code, atb.get_soc(s)) for s in BF16_SOCS + ["host"]}
        assert {t["form"] for t in tilings.values()} == {"packed"}
        assert any(t["k_tile"] < 4099 for t in tilings.values())
        x, w = torch.randn(256, 4099).bfloat16(), torch.randn(96, 4099).bfloat16()
        host = atb.kernels.linear(x, w, soc_type="host")
        assert_close(host, linear_ref(x, w), scale=_scale(4099))
        for soc in BF16_SOCS:
            assert torch.equal(atb.kernels.linear(x, w, soc_type=soc), host), soc


@pytest.mark.parametrize("soc", ALL_SOCS)
def test_gemm_every_soc_gives_the_same_bits_and_fits_ub(soc):
    dtype = torch.bfloat16 if soc in BF16_SOCS else torch.float16
    info = atb.get_soc(soc)
    x = torch.randn(200, 1100).to(dtype)
    w = torch.randn(301, 1100).to(dtype)
    b = torch.randn(301).to(dtype)
    assert torch.equal(atb.kernels.linear(x, w, b, soc_type=soc), atb.kernels.linear(x, w, b, soc_type="host"))
    g, u = w[:150], w[150:300]
    assert torch.equal(atb.kernels.linear_swiglu(x, g, u, soc_type=soc),
                       atb.kernels.linear_swiglu(x, g, u, soc_type="host"))
    for ep, segs in ((0, [4096, 1024, 1024]), (1, [4096]), (2, [11008, 11008])):
        t = _C.linear_tiling(4096, 4096, segs, ep, DTYPE_CODES[dtype], info)
        assert t["ub_bytes"] <= info.ub_size and t["m_tile"] % 6 == 0


def test_portable_isa_agrees():
    x = torch.randn(3, 203).bfloat16()
    w = torch.randn(37, 203).bfloat16()
    fast = atb.kernels.linear(x, w)
    with forced_isa("portable"):
        slow = atb.kernels.linear(x, w)
    assert_close(slow, fast.double())


def test_bad_inputs():
    x = torch.randn(2, 8)
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"linear: weight has shape \(4, 7\), expected \[N, 8\]"):
        atb.kernels.linear(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match="x must be 2-D"):
        atb.kernels.linear(torch.randn(8), w)
    with pytest.raises(TypeError, match="weight is torch.float16 but x is torch.float32"):
        atb.kernels.linear(x, w.half())
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        atb.kernels.linear(x.long(), w)
    with pytest.raises(ValueError, match=r"bias has shape \(5,\), expected \(4,\)"):
        atb.kernels.linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="bfloat16 is not supported on Ascend910"):
        atb.kernels.linear(x.bfloat16(), w.bfloat16(), soc_type="Ascend910")
    with pytest.raises(ValueError, match="residual has shape"):
        atb.kernels.linear_residual(x, w, torch.randn(2, 5))
    with pytest.raises(ValueError, match="gate_weight has shape"):
        atb.kernels.linear_swiglu(x, w, torch.randn(5, 8))
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        atb.kernels.linear_multi(x, [w] * 4)
    with pytest.raises(ValueError, match="unknown SoC"):
        atb.kernels.linear(x, w, soc_type="Ascend999")
    assert atb.kernels.linear(torch.randn(0, 8), w).shape == (0, 4)


def test_non_contiguous_inputs():
    x = torch.randn(3, 40)[:, ::2]
    w = torch.randn(20, 7).T
    assert_close(atb.kernels.linear(x, w), linear_ref(x, w), scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 40])   # STREAM and GEMM kernels
def test_swiglu_epilogue_adds_both_biases(dtype, m):
    # The decode graph hands gate and up biases to the SWIGLU epilogue (the Python wrapper has none).
    k, n = 129, 70
    x = torch.randn(m, k).to(dtype)
    g, u = (torch.randn(n, k) / k ** 0.5).to(dtype), (torch.randn(n, k) / k ** 0.5).to(dtype)
    gb, ub = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    segments = [(g.data_ptr(), gb.data_ptr(), out.data_ptr(), n, 0), (u.data_ptr(), ub.data_ptr(), 0, n, 0)]
    _C.linear(x.data_ptr(), m, k, segments,
              0, 2, DTYPE_CODES[dtype], atb.get_soc("host"))
    gate = atb.kernels.linear(x, g, gb).double()
    want = (torch.nn.functional.silu(gate) * atb.kernels.linear(x, u, ub).double())
    assert_close(out, want)


def test_zero_size_inputs():
    # M = 0 is an empty result; K = 0 or N = 0 is rejected with the op and argument named.
    w = torch.randn(5, 8)
    assert atb.kernels.linear(torch.empty(0, 8), w).shape == (0, 5)
    assert [t.shape for t in atb.kernels.linear_multi(torch.empty(0, 8), [w, w[:2]])] == [(0, 5), (0, 2)]
    assert atb.kernels.linear_residual(torch.empty(0, 8), w, torch.empty(0, 5)).shape == (0, 5)
    assert atb.kernels.linear_swiglu(torch.empty(0, 8), w, w).shape == (0, 5)
    with pytest.raises(ValueError, match="linear: x has K = 0 columns"):
        atb.kernels.linear(torch.empty(3, 0), torch.empty(5, 0))
    with pytest.raises(ValueError, match="linear: weight has N = 0 rows"):
        atb.kernels.linear(torch.randn(3, 8), torch.empty(0, 8))


def test_tiling_rejects_zero_work():
    host = atb.get_soc("host")
    with pytest.raises(ValueError, match="linear tiling: M and K must be >= 1"):
        _C.linear_tiling(0, 8, [4], 0, DTYPE_CODES[torch.float32], host)
    with pytest.raises(ValueError, match="linear tiling: segment 0 has N=0"):
        _C.linear_tiling(2, 8, [0], 0, DTYPE_CODES[torch.float32], host)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 13), (8, 16), (7, 30)])
def test_pack_rows4_layout(dtype, n, k):
    # csrc/kernels/linear/linear_rows4.h: groups of 4 rows, chunks of 8 k, zero padding past N and K.
    w = torch.randn(n, k).to(dtype)
    got = pack_rows4(w)
    kp = -(-k // 8) * 8
    want = torch.zeros(-(-n // 4) * 4 * kp, dtype=dtype)
    for i in range(n):
        for j in range(k):
            r = i % 4
            inner = r * 8 + j % 8 if dtype == torch.bfloat16 else (j % 8 // 4) * 16 + r * 4 + j % 4
            want[i // 4 * 4 * kp + j // 8 * 32 + inner] = w[i, j]
    assert got.numel() == _C.rows4_numel(n, k) and torch.equal(got, want)
    out = torch.full_like(want, 7)
    assert pack_rows4(w.T.contiguous().T, out=out) is out and torch.equal(out, want)  # strided weight: copied first


def test_pack_rows4_rejects_bad_input():
    with pytest.raises(TypeError, match="pack_rows4: weight must be a float32 or bfloat16 tensor, got torch.float16"):
        pack_rows4(torch.randn(4, 8).half())
    with pytest.raises(ValueError, match=r"pack_rows4: weight must be a non-empty \[N, K\] matrix, got shape \(8,\)"):
        pack_rows4(torch.randn(8))
    out = torch.full((10,), 3.0)
    with pytest.raises(ValueError, match="pack_rows4: out must be a contiguous torch.float32 tensor of 32 elements, "
                                         "got torch.float32 tensor of 10 elements"):
        pack_rows4(torch.randn(4, 8), out=out)
    assert torch.equal(out, torch.full((10,), 3.0))  # a rejected call writes nothing
