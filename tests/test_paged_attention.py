"""paged_attention against the float64 reference: block sizes, GQA, head dims, dtypes,
splits, multi-token queries, sliding window, SoCs; tiling; bad input."""
import pytest
import torch

import atb
from atb import _C
from atb.kernels._common import DTYPE_CODES
from conftest import ALL_SOCS
from reference import DTYPES, assert_close, gather_kv, paged_attention_ref


def _paged_cache(context_lens, block_size, kv_heads, head_dim, dtype, spare_blocks=3):
    """K/V caches holding every sequence, with a random non-monotonic block table."""
    batch = len(context_lens)
    max_blocks = (max(context_lens) + block_size - 1) // block_size
    num_blocks = batch * max_blocks + spare_blocks
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    bt = torch.randperm(num_blocks)[:batch * max_blocks].view(batch, max_blocks).int()
    return kc, vc, bt, torch.tensor(context_lens, dtype=torch.int32)


def _check(q, kc, vc, bt, ctx, dtype, **kw):
    out = atb.kernels.paged_attention(q, kc, vc, bt, ctx, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, paged_attention_ref(q, kc, vc, bt, ctx, kw.get("scale"), kw.get("q_lens"), kw.get("window")))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 80), (16, 4, 128), (8, 1, 64)])
def test_decode_matches_reference(dtype, block_size, heads, kv_heads, head_dim):
    # Lengths at block boundaries, one past, a single token, and one long enough to split.
    bs = block_size
    lens = [bs, bs + 1, 2 * bs, 1, 700]
    kc, vc, bt, ctx = _paged_cache(lens, bs, kv_heads, head_dim, dtype)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    _check(q, kc, vc, bt, ctx, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_with_very_different_lengths(dtype):
    lens = [1, 7, 63, 64, 65, 300, 1000, 2500]
    kc, vc, bt, ctx = _paged_cache(lens, 16, 2, 64, dtype)
    q = torch.randn(len(lens), 8, 64).to(dtype)
    _check(q, kc, vc, bt, ctx, dtype, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1, 37, 300])
def test_multi_token_queries_and_window(dtype, window):
    # Chunked prefill / speculative verification: q_lens[b] queries causal at the end of the context;
    # 100 queries x 3 heads need several q tiles, q_len 0 sequences contribute no rows.
    lens, q_lens = [5, 64, 130, 900, 40], [1, 64, 100, 7, 0]
    kc, vc, bt, ctx = _paged_cache(lens, 16, 2, 64, dtype)
    q = torch.randn(sum(q_lens), 6, 64).to(dtype)
    _check(q, kc, vc, bt, ctx, dtype, q_lens=torch.tensor(q_lens, dtype=torch.int32), window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 200])
def test_a_query_row_does_not_depend_on_the_other_rows(dtype, window):
    # Prefix caching prefills a prompt's suffix over its cached prefix: each query row must get the bits a
    # whole-prompt prefill gives it, whatever q tile it lands in, whether its tile's key range is split into
    # chunks (merged) or not, and whatever other sequence shares the call.
    lens = [1100, 300]
    kc, vc, bt, ctx = _paged_cache(lens, 16, 2, 64, dtype)
    q = torch.randn(lens[0], 6, 64).to(dtype)
    other = torch.randn(lens[1], 6, 64).to(dtype)

    def attend(n, c, with_other):
        rows, seqs = [q[c - n:c]], [0]
        if with_other:
            rows, seqs = rows + [other], seqs + [1]
        lens_now = torch.tensor([c, lens[1]][:len(seqs)], dtype=torch.int32)
        q_lens = torch.tensor([n, lens[1]][:len(seqs)], dtype=torch.int32)
        out = atb.kernels.paged_attention(torch.cat(rows), kc, vc, bt[seqs], lens_now, q_lens=q_lens, window=window)
        return out[:n]

    full = attend(lens[0], lens[0], False)
    for n, c, with_other in [(32, 1100, False), (1, 1100, True), (37, 1100, True), (300, 1100, False),
                             (20, 1024, True), (5, 260, False), (3, 256, True)]:
        assert torch.equal(attend(n, c, with_other), full[c - n:c]), (n, c, with_other)


@pytest.mark.parametrize("window", [1, 200, 5000])
def test_decode_window(window):
    lens = [1, 199, 200, 201, 3000]
    kc, vc, bt, ctx = _paged_cache(lens, 16, 4, 64, torch.float32)
    q = torch.randn(len(lens), 8, 64)
    _check(q, kc, vc, bt, ctx, torch.float32, window=window)


def test_batch_one_long_context_splits_over_every_core():
    # Flash-decoding: one sequence, 2 KV heads; the key range is cut into 256-key chunks that the
    # cores share, and the merge stage combines their partials. 20 chunks are enough items for the
    # cores, so each item holds both KV heads (whole cache rows) and one merge group covers them.
    kc, vc, bt, ctx = _paged_cache([5000], 128, 2, 128, torch.float32)
    soc = atb.get_soc("Ascend910B4")
    t = _C.paged_attention_tiling(1, 8, 2, 128, kc.shape[0], 128, bt.shape[1], ctx.data_ptr(), 0, 1, 0,
                                  DTYPE_CODES[torch.float32], soc)
    assert t["num_items"] == 20 and t["num_merge_groups"] == 1 and t["block_dim"] == soc.cube_core_num
    assert {i[3] for i in t["items"]} == {8}  # all 8 query heads of the token in every item
    assert t["ub_bytes"] <= 192 * 1024 and not t["gather"]
    q = torch.randn(1, 8, 128)
    out = _check(q, kc, vc, bt, ctx, torch.float32, soc_type="Ascend910B4")
    assert torch.equal(out, atb.kernels.paged_attention(q, kc, vc, bt, ctx, soc_type="host"))


def test_tiling_variants_and_gqa_rows():
    ctx = torch.tensor([100], dtype=torch.int32)
    host = atb.get_soc("host")
    t = _C.paged_attention_tiling(1, 32, 8, 128, 200, 1, 100, ctx.data_ptr(), 0, 1, 0, 2, host)
    assert t["gather"] and t["heads_per_tile"] == 4 and t["num_items"] == 8 and t["num_merge_groups"] == 0
    t = _C.paged_attention_tiling(1, 32, 8, 128, 200, 16, 7, ctx.data_ptr(), 0, 1, 0, 2, host)
    assert not t["gather"]
    # All 4 query heads of a KV head sit in one item: each K/V row is read once for them.
    assert sorted((i[1], i[3]) for i in t["items"]) == [(h, 4) for h in range(8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 100])
def test_decode_batch_items_cover_every_kv_head_with_the_same_sums(isa, dtype, window):
    # A decode batch of at least as many sequences as cores gets one item per (sequence, chunk) holding
    # all KV heads, so each cache row is read whole; every row's sums are those of the one-head items
    # that the same sequence gets alone (batch 1), split (600 keys) or not.
    lens = [600, 1, 130, 257]
    kc, vc, bt, ctx = _paged_cache(lens, 16, 3, 64, dtype)
    q = torch.randn(len(lens), 9, 64).to(dtype)
    host = atb.get_soc("host")
    t = _C.paged_attention_tiling(len(lens), 9, 3, 64, kc.shape[0], 16, bt.shape[1], ctx.data_ptr(), 0, len(lens),
                                  window or 0, DTYPE_CODES[dtype], host)
    if host.cube_core_num <= len(lens):
        assert {i[3] for i in t["items"]} == {9}  # one item per 256-key chunk of each sequence's keys
        assert t["num_items"] == (3 + 1 + 1 + 2 if window is None else 2 + 1 + 1 + 2)
    out = _check(q, kc, vc, bt, ctx, dtype, window=window)
    for b in range(len(lens)):
        alone = atb.kernels.paged_attention(q[b:b + 1], kc, vc, bt[b:b + 1], ctx[b:b + 1], window=window)
        assert torch.equal(out[b:b + 1], alone)
    ones = torch.ones(len(lens), dtype=torch.int32)  # q_lens of all 1 is decode too
    assert torch.equal(out, atb.kernels.paged_attention(q, kc, vc, bt, ctx, q_lens=ones, window=window))


@pytest.mark.parametrize("soc", ALL_SOCS)
def test_every_soc_and_thread_count_gives_the_same_numbers(soc):
    lens, q_lens = [3000, 17, 600], [1, 5, 1]
    kc, vc, bt, ctx = _paged_cache(lens, 16, 2, 80, torch.float16)
    q = torch.randn(sum(q_lens), 6, 80).half()
    ql = torch.tensor(q_lens, dtype=torch.int32)
    out = atb.kernels.paged_attention(q, kc, vc, bt, ctx, q_lens=ql, soc_type=soc)
    assert torch.equal(out, atb.kernels.paged_attention(q, kc, vc, bt, ctx, q_lens=ql, soc_type="host"))
    n = atb.get_num_threads()
    try:
        atb.set_num_threads(1)
        assert torch.equal(out, atb.kernels.paged_attention(q, kc, vc, bt, ctx, q_lens=ql, soc_type="host"))
    finally:
        atb.set_num_threads(n)


def test_int64_indices_fused_q_view_and_unused_table_entries():
    lens = [33, 70]
    kc, vc, bt, ctx = _paged_cache(lens, 16, 2, 64, torch.float32)
    bt[0, 3:] = -7  # past ceil(33 / 16) = 3 blocks: never read, so never checked
    qkv = torch.randn(2, (8 + 4) * 64)
    q = qkv[:, :8 * 64].view(2, 8, 64)
    out = _check(q, kc, vc, bt, ctx, torch.float32)
    assert torch.equal(out, atb.kernels.paged_attention(q.contiguous(), kc, vc, bt.long(), ctx.long()))


def test_invalid_call_leaves_the_cache_untouched():
    kc, vc, bt, ctx = _paged_cache([40] * 16, 16, 2, 64, torch.bfloat16)
    kc0, vc0 = kc.clone(), vc.clone()
    q = torch.randn(16, 4, 64).bfloat16()
    bt[9, 1] = kc.shape[0]
    with pytest.raises(ValueError, match="block_tables\\[9, 1\\] = 51 is out of range"):
        atb.kernels.paged_attention(q, kc, vc, bt, ctx)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_bad_inputs_raise_clear_errors():
    kc, vc, bt, ctx = _paged_cache([20, 30], 16, 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    pa = atb.kernels.paged_attention
    with pytest.raises(TypeError, match="q must be float32, float16 or bfloat16, got torch.float64"):
        pa(q.double(), kc, vc, bt, ctx)
    with pytest.raises(TypeError, match="key_cache is torch.float16 but q is torch.float32"):
        pa(q, kc.half(), vc, bt, ctx)
    with pytest.raises(TypeError, match="block_tables must be int32 \\(or int64\\), got torch.float32"):
        pa(q, kc, vc, bt.float(), ctx)
    with pytest.raises(ValueError, match="num_heads \\(3\\) must be a multiple of the cache's num_kv_heads \\(2\\)"):
        pa(torch.randn(2, 3, 64), kc, vc, bt, ctx)
    with pytest.raises(ValueError, match="q's head_dim is 32, the cache's is 64"):
        pa(torch.randn(2, 4, 32), kc, vc, bt, ctx)
    with pytest.raises(ValueError, match="context_lens\\[1\\] = 33 must be in \\[1, max_blocks \\* block_size\\].*\\[1, 32\\]"):
        pa(q, kc, vc, bt, torch.tensor([20, 33]))
    with pytest.raises(ValueError, match="context_lens\\[0\\] = 0 must be in"):
        pa(q, kc, vc, bt, torch.tensor([0, 3]))
    bad = bt.clone()
    bad[1, 0] = -1
    with pytest.raises(ValueError, match="block_tables\\[1, 0\\] = -1 is out of range: the cache has 7 blocks"):
        pa(q, kc, vc, bad, ctx)
    with pytest.raises(ValueError, match="q has 2 rows but batch is 1"):
        pa(q, kc, vc, bt[:1], ctx[:1])
    with pytest.raises(ValueError, match="block_tables has 2 rows, context_lens has 1"):
        pa(q, kc, vc, bt, ctx[:1])
    with pytest.raises(ValueError, match="q_lens\\[0\\] = 21 must be in \\[0, context_lens\\[0\\]\\]"):
        pa(torch.randn(22, 4, 64), kc, vc, bt, ctx, q_lens=torch.tensor([21, 1]))
    with pytest.raises(ValueError, match="q has 5 query rows but sum\\(q_lens\\) is 4"):
        pa(torch.randn(5, 4, 64), kc, vc, bt, ctx, q_lens=torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="window must be None or an int >= 1, got 0"):
        pa(q, kc, vc, bt, ctx, window=0)
    with pytest.raises(ValueError, match="bfloat16 is not supported on Ascend310P3"):
        pa(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), bt, ctx, soc_type="Ascend310P3")
    with pytest.raises(ValueError, match="key_cache must be 4-D"):
        pa(q, kc[0], vc[0], bt, ctx)


# ---- bad input never kills the process; NaN propagates as in SDPA ----------------------------------------------


@pytest.mark.parametrize("soc", ["host", "Ascend910B4"])
def test_all_q_lens_zero_is_an_empty_result(soc):
    # Zero work items once gave blockFactor 0 and a division by it (SIGFPE).
    kc = torch.randn(1, 4, 1, 8)
    bt, ctx = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    out = atb.kernels.paged_attention(torch.empty(0, 2, 8), kc, kc, bt, ctx, q_lens=torch.tensor([0], dtype=torch.int32),
                                      soc_type=soc)
    assert out.shape == (0, 2, 8)
    ql = torch.tensor([0], dtype=torch.int32)
    t = _C.paged_attention_tiling(1, 2, 1, 8, 1, 4, 1, ctx.data_ptr(), ql.data_ptr(), 0, 0, DTYPE_CODES[torch.float32],
                                  atb.get_soc(soc))
    assert t["num_items"] == 0 and t["block_dim"] == 1


def test_some_q_lens_zero():
    kc, vc, bt, ctx = _paged_cache([5, 9, 3], 4, 2, 16, torch.float32)
    ql = torch.tensor([0, 3, 0], dtype=torch.int32)
    _check(torch.randn(3, 4, 16), kc, vc, bt, ctx, torch.float32, q_lens=ql)


def _nan_rows(out):
    return torch.isnan(out).any(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_nan_in_q_or_k_propagates_like_sdpa(dtype, block_size):
    # 600 keys: the key range is split over cores (flash-decoding) and merged, so both paths carry NaN.
    ctx_lens = [600, 37]
    kc, vc, bt, ctx = _paged_cache(ctx_lens, block_size, 2, 16, dtype)
    q = torch.randn(2, 4, 16).to(dtype)
    q[1, 3, 5] = float("nan")                     # sequence 1, head 3 (kv head 1)
    pos = 100                                     # a key of sequence 0, kv head 0, visible to its query
    kc[bt[0, pos // block_size], pos % block_size, 0, 7] = float("nan")
    out = atb.kernels.paged_attention(q, kc, vc, bt, ctx)
    ref = paged_attention_ref(q, kc, vc, bt, ctx)
    expected = torch.zeros(2, 4, dtype=torch.bool)
    expected[1, 3] = True
    expected[0, :2] = True                        # heads 0 and 1 read kv head 0
    assert torch.equal(_nan_rows(out), expected) and torch.equal(_nan_rows(ref), expected)
    assert_close(out[~expected], ref[~expected], dtype)
    # SDPA on the same inputs: the rows that see the NaN key are NaN there too.
    k0 = gather_kv(kc, bt[0], 600).transpose(0, 1).repeat_interleave(2, 0).float()
    v0 = gather_kv(vc, bt[0], 600).transpose(0, 1).repeat_interleave(2, 0).float()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[0].float()[:, None], k0, v0)
    assert torch.equal(_nan_rows(sdpa[:, 0]), expected[0])


def test_nan_key_outside_the_window_or_context_is_not_read():
    kc, vc, bt, ctx = _paged_cache([40], 16, 1, 8, torch.float32)
    kc[bt[0, 0], 2, 0, 0] = float("nan")          # position 2: outside a window of 8 at position 39
    kc[bt[0, 2], 15, 0, 0] = float("nan")         # position 47: past the context
    out = _check(torch.randn(1, 2, 8), kc, vc, bt, ctx, torch.float32, window=8)
    assert torch.isfinite(out).all()


def test_inf_score_gives_nan_like_softmax():
    kc, vc, bt, ctx = _paged_cache([20], 16, 1, 8, torch.float32)
    kc[bt[0, 0], 4, 0] = float("inf")
    q = torch.ones(1, 1, 8)
    out = atb.kernels.paged_attention(q, kc, vc, bt, ctx)
    assert torch.isnan(out).all() and torch.isnan(paged_attention_ref(q, kc, vc, bt, ctx)).all()


def test_scale_and_window_arguments_are_validated_like_flash_attention():
    import numpy as np

    kc, vc, bt, ctx = _paged_cache([6], 4, 1, 8, torch.float32)
    q = torch.randn(1, 2, 8)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="paged_attention: scale must be a finite real number"):
            atb.kernels.paged_attention(q, kc, vc, bt, ctx, scale=bad)
    with pytest.raises(TypeError, match="paged_attention: scale must be a real number, got str"):
        atb.kernels.paged_attention(q, kc, vc, bt, ctx, scale="0.5")
    _check(q, kc, vc, bt, ctx, torch.float32, window=3)
    out = atb.kernels.paged_attention(q, kc, vc, bt, ctx, window=np.int64(3), scale=np.float32(0.3))
    assert torch.equal(out, atb.kernels.paged_attention(q, kc, vc, bt, ctx, window=3, scale=float(np.float32(0.3))))
    for bad in (0, True, 2.5, "3"):
        with pytest.raises(ValueError, match="paged_attention: window must be None or an int >= 1"):
            atb.kernels.paged_attention(q, kc, vc, bt, ctx, window=bad)
