"""flash_attention against the float64 reference; tiling; layouts; bad input."""
import itertools

import pytest
import torch

import atb
from atb.kernels.flash_attention import flash_attention_tiling
from conftest import ALL_SOCS, forced_isa
from reference import DTYPES, assert_close, flash_attention_ref

fa = atb.kernels.flash_attention


def make(lens, heads, kv_heads, head_dim, dtype):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1])
    q = torch.randn(t, heads, head_dim).to(dtype)
    k = torch.randn(t, kv_heads, head_dim).to(dtype)
    v = torch.randn(t, kv_heads, head_dim).to(dtype)
    return q, k, v, cu


MIXED = [1, 7, 63, 64, 65, 300, 1000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 80), (8, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gqa_matches_reference(dtype, heads, kv_heads, head_dim, causal):
    q, k, v, cu = make(MIXED[:-1], heads, kv_heads, head_dim, dtype)
    assert_close(fa(q, k, v, cu, causal=causal), flash_attention_ref(q, k, v, cu, causal=causal))


@pytest.mark.parametrize("dtype,causal", [(torch.float32, True), (torch.float16, True), (torch.bfloat16, True),
                                          (torch.float32, False)])
def test_long_sequence_in_a_mixed_batch(dtype, causal):
    # The 1000-token sequence spans 16 K/V tiles; few heads keep the float64 reference quick.
    q, k, v, cu = make(MIXED, 4, 1, 64, dtype)
    assert_close(fa(q, k, v, cu, causal=causal), flash_attention_ref(q, k, v, cu, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dim_256_and_odd_head_dims(dtype):
    for heads, kv_heads, head_dim in [(4, 2, 256), (3, 1, 7), (2, 2, 1), (6, 3, 40)]:
        q, k, v, cu = make([5, 70, 1], heads, kv_heads, head_dim, dtype)
        assert_close(fa(q, k, v, cu), flash_attention_ref(q, k, v, cu))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 16, 100])
def test_sliding_window(dtype, causal, window):
    q, k, v, cu = make([1, 63, 300, 129], 6, 2, 64, dtype)
    out = fa(q, k, v, cu, causal=causal, window=window)
    assert_close(out, flash_attention_ref(q, k, v, cu, causal=causal, window=window))


def test_scale_and_large_logits():
    # fp32 logits L are only good to ~L * 2^-24 * sqrt(D) (rounding of a D-term dot
    # product), and outputs move by as much: the tolerance scales with max |L|.
    # scale=3: logits up to ~100, errors seen up to 2.4e-5 (the table's fp32 atol is 2e-5).
    q, k, v, cu = make([200, 33], 4, 2, 64, torch.float32)
    assert_close(fa(q, k, v, cu, scale=3.0), flash_attention_ref(q, k, v, cu, scale=3.0), scale=4)
    # Logits up to ~400 (exp would overflow without the running max): errors up
    # to ~6e-5 over 30 seeds; 400 * 2^-24 * 32 = 8e-4 bounds them.
    q, k, v, cu = make([150], 2, 1, 32, torch.float32)
    q, k = q * 6, k * 6
    assert_close(fa(q, k, v, cu, scale=0.5), flash_attention_ref(q, k, v, cu, scale=0.5), scale=25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [None, 0.03, 2.0])
def test_running_max_that_keeps_climbing_or_falling(dtype, scale):
    # Scores that grow (or shrink) with the key's position, by far more than e^8 over the sequence: the online
    # softmax's reference max must move on many tiles (the bf16 path moves it only past ln 256), and every
    # rescale of acc and l must be right. scale 2 is past what the bf16 path folds into its exp (it scales the
    # scores first there); 0.03 folds.
    q, k, v, cu = make([700, 300], 4, 2, 32, dtype)
    ramp = torch.linspace(0.0, 3.0, 1000).view(-1, 1, 1)
    q = q.abs().to(dtype)
    for sign in (1.0, -1.0):
        ks = (k.float().abs() * ramp * sign).to(dtype)
        want = flash_attention_ref(q, ks, v, cu, scale=scale)
        assert_close(fa(q, ks, v, cu, scale=scale), want, scale=2.0 if scale == 2.0 else 1.0)


@pytest.mark.parametrize("soc", ALL_SOCS)
def test_every_soc_gives_the_same_numbers(soc):
    # UB size changes the query block height and group split, never a row's arithmetic.
    for dtype in (torch.float16, torch.float32):
        q, k, v, cu = make([1, 65, 300, 17], 32, 4, 128, dtype)
        ref = fa(q, k, v, cu, soc_type="host")
        assert torch.equal(fa(q, k, v, cu, soc_type=soc), ref)
        ref = fa(q, k, v, cu, causal=False, window=40, soc_type="host")
        assert torch.equal(fa(q, k, v, cu, causal=False, window=40, soc_type=soc), ref)
    if atb.get_soc(soc).supports_bf16:
        q, k, v, cu = make([70, 9], 8, 8, 256, torch.bfloat16)
        assert torch.equal(fa(q, k, v, cu, soc_type=soc), fa(q, k, v, cu, soc_type="host"))


def test_portable_isa_agrees():
    q, k, v, cu = make([3, 100, 64], 6, 2, 72, torch.float32)
    want = flash_attention_ref(q, k, v, cu)
    with forced_isa("portable"):
        assert_close(fa(q, k, v, cu), want)
    assert_close(fa(q, k, v, cu), want)


def test_masked_keys_contribute_exactly_zero():
    # Causality: changing the future leaves every earlier output bit-identical,
    # even with huge keys/values there (a leaked exp(masked) would show).
    q, k, v, cu = make([200], 4, 2, 64, torch.float32)
    base = fa(q, k, v, cu)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[130:], k2[130:], v2[130:] = 1e4, 1e4, 1e30
    assert torch.equal(fa(q2, k2, v2, cu)[:130], base[:130])
    # Sliding window: keys older than the window are as invisible as the future.
    base = fa(q, k, v, cu, window=20)
    k2, v2 = k.clone(), v.clone()
    k2[:100], v2[:100] = 1e4, 1e30
    assert torch.equal(fa(q, k2, v2, cu, window=20)[119:], base[119:])


def test_packing_does_not_change_a_sequence():
    # Sequences never see each other, and a sequence's result does not depend on its batch-mates.
    q, k, v, cu = make([37, 300, 5], 8, 2, 64, torch.bfloat16)
    packed = fa(q, k, v, cu)
    for b in range(3):
        s, e = int(cu[b]), int(cu[b + 1])
        alone = fa(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], dtype=torch.int32))
        assert torch.equal(packed[s:e], alone)


def test_strided_views_are_read_in_place():
    t, heads, kv_heads, d = 150, 6, 2, 64
    cu = torch.tensor([0, 50, 150], dtype=torch.int32)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).bfloat16()  # a fused QKV projection's output
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    assert not q.is_contiguous()
    want = fa(q.contiguous(), k.contiguous(), v.contiguous(), cu)
    assert torch.equal(fa(q, k, v, cu), want)
    # Head-major storage ([heads, tokens, d] transposed) and a non-unit last stride (copied).
    qh = q.transpose(0, 1).contiguous().transpose(0, 1)
    kl = torch.stack([k, k], -1)[..., 0]
    assert kl.stride(-1) == 2
    assert torch.equal(fa(qh, kl, v, cu), want)


def test_empty_and_zero_length_sequences():
    q, k, v, cu = make([0, 5, 0, 3, 0], 2, 1, 16, torch.float32)
    assert_close(fa(q, k, v, cu), flash_attention_ref(q, k, v, cu))
    e = torch.empty(0, 2, 16)
    assert fa(e, e[:, :1], e[:, :1], torch.zeros(1, dtype=torch.int32)).shape == (0, 2, 16)
    # int64 cu_seqlens are accepted.
    assert_close(fa(q, k, v, cu.long()), flash_attention_ref(q, k, v, cu))


def test_16k_tokens_stay_in_tiles():
    # One 16384-token sequence (sliding window, to keep the test quick): UB use is
    # that of a 1k sequence, and outputs match the reference computed piecewise
    # (a query only depends on keys within the window before it).
    s, w = 16384, 64
    for soc in ("host", "Ascend910B4"):
        big = flash_attention_tiling([0, s], 32, 8, 128, causal=True, soc_type=soc)
        small = flash_attention_tiling([0, 1024], 32, 8, 128, causal=True, soc_type=soc)
        assert big["ub_bytes"] == small["ub_bytes"] <= atb.get_soc(soc).ub_size
    q, k, v, cu = make([s], 1, 1, 64, torch.float32)
    out = fa(q, k, v, cu, window=w)
    for a in (0, 7000, s - 300):
        lo = max(0, a - w + 1)
        part = flash_attention_ref(q[lo:a + 300], k[lo:a + 300], v[lo:a + 300], [0, a + 300 - lo], window=w)
        assert_close(out[a:a + 300], part[a - lo:])


def test_tiling_splits_work_evenly_and_fits_the_ub():
    for soc in ALL_SOCS:
        info = atb.get_soc(soc)
        for (heads, kv_heads, d), dtype in itertools.product([(9, 3, 64), (32, 8, 128), (64, 1, 256), (1, 1, 1)],
                                                             [torch.float16, torch.bfloat16]):
            if dtype == torch.bfloat16 and not info.supports_bf16:
                continue
            t = flash_attention_tiling([0, 2048, 2100], heads, kv_heads, d, dtype, soc_type=soc)
            assert t["ub_bytes"] <= info.ub_size
            assert t["group_size"] % t["group_split"] == 0
            # SoC-independent (it fixes the rounding): by head_dim on the fp32 cube path, 128 on the bf16 GEMM one
            # (bf16 where the SIMD table has the bf16 GEMM: every AMX table has).
            if dtype == torch.float16 or atb.build_info()["isa"].startswith("avx512-amx"):
                assert t["dp_bf16"] == (dtype == torch.bfloat16)
            assert t["block_kv"] == (128 if t["dp_bf16"] else 64 if d <= 128 else 32)
            assert t["block_dim"] <= info.cube_core_num * (4 if info.is_host else 1)
            costs = t["core_cost"]
            assert len(costs) == t["block_dim"]
            if t["num_units"] >= 8 * t["block_dim"]:  # causal units differ ~30x in cost; LPT evens them out
                assert max(costs) <= 1.15 * (sum(costs) / len(costs))
    # MQA with 128 heads of 256 does not fit a 192 KiB UB as one group (one position's fp32 qT and acc are
    # 256 KiB): it is split.
    t = flash_attention_tiling([0, 100], 128, 1, 256, torch.float32, soc_type="Ascend910B4")
    assert t["group_split"] < 128 and t["ub_bytes"] <= 192 * 1024
    t = flash_attention_tiling([0, 100], 9, 3, 64, torch.float32, soc_type="host")
    assert t["group_split"] == 3 and t["max_rows"] == t["block_q"] * 3


def test_bad_inputs_raise_clear_errors():
    q, k, v, cu = make([4, 6], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"heads \(4\) must be a positive multiple of k/v's kv_heads \(3\)"):
        fa(q, k[:, :1].expand(10, 3, 16), v[:, :1].expand(10, 3, 16), cu)
    with pytest.raises(ValueError, match="non-decreasing.*cu_seqlens\\[2\\]=3 < cu_seqlens\\[1\\]=7"):
        fa(q, k, v, torch.tensor([0, 7, 3, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the number of tokens \(10\), got 9"):
        fa(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0, got 1"):
        fa(q, k, v, torch.tensor([1, 4, 10], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens must be int32 \\(or int64\\), got torch.float32"):
        fa(q, k, v, torch.tensor([0.0, 4.0, 10.0]))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        fa(q, k, v, torch.tensor([[0, 4, 10]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\], got 320"):
        fa(*make([3], 2, 1, 320, torch.float32))
    with pytest.raises(ValueError, match="bfloat16 is not supported on Ascend910"):
        fa(*make([3], 2, 1, 64, torch.bfloat16), soc_type="Ascend910")
    with pytest.raises(TypeError, match="k is torch.float16 but q is torch.float32"):
        fa(q, k.half(), v, cu)
    with pytest.raises(ValueError, match=r"k has shape \(10, 2, 16\) but v has \(10, 2, 8\)"):
        fa(q, k, v[..., :8], cu)
    with pytest.raises(ValueError, match=r"k has shape \(9, 2, 16\), expected \(10, kv_heads, 16\)"):
        fa(q, k[:9], v[:9], cu)
    with pytest.raises(ValueError, match="q must be 3-D"):
        fa(q[0], k, v, cu)
    with pytest.raises(ValueError, match="window must be None or an int >= 1, got 0"):
        fa(q, k, v, cu, window=0)
    with pytest.raises(ValueError, match="scale must be a finite real number"):
        fa(q, k, v, cu, scale=float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        fa(q, k, v, cu, causal=1)
    with pytest.raises(TypeError, match="q must be float32, float16 or bfloat16, got torch.int64"):
        fa(q.long(), k, v, cu)
    with pytest.raises(ValueError, match="unknown SoC"):
        fa(q, k, v, cu, soc_type="Ascend000")


# ---- zero-size inputs and NaN propagation (as in SDPA) -----------------------------------------------------------


@pytest.mark.parametrize("lens", [[], [0], [0, 0, 0], [0, 5, 0]])
def test_zero_length_sequences(lens):
    q, k, v, cu = make(lens, 4, 2, 16, torch.float32)
    out = atb.kernels.flash_attention(q, k, v, cu)
    assert out.shape == q.shape
    assert_close(out, flash_attention_ref(q, k, v, cu))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_nan_in_q_or_k_propagates_like_sdpa(dtype, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lens = [70, 9]
    q, k, v, cu = make(lens, 4, 2, 16, dtype)
    q[3, 1, 0] = float("nan")      # sequence 0, position 3, head 1: only that output row
    k[70 + 4, 0, 5] = float("nan")  # sequence 1, position 4, kv head 0: heads 0, 1 of the rows that see it
    out = atb.kernels.flash_attention(q, k, v, cu, causal=causal)
    ref = flash_attention_ref(q, k, v, cu, causal=causal)
    expected = torch.zeros(79, 4, dtype=torch.bool)
    expected[3, 1] = True
    expected[70 + (4 if causal else 0):, :2] = True
    assert torch.equal(torch.isnan(out).any(-1), expected) and torch.equal(torch.isnan(ref).any(-1), expected)
    assert_close(out[~expected], ref[~expected], dtype)
    # SDPA on the same inputs: its math path for NaN in q, and for a NaN key the rows that can see it.
    def sdpa(s, e, backend):
        qs, ks, vs = (t[s:e].float().transpose(0, 1)[None] for t in (q, k, v))
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1),
                                               is_causal=causal)
        return torch.isnan(o[0].transpose(0, 1)).any(-1)
    assert torch.equal(sdpa(0, 70, SDPBackend.MATH), expected[:70])
    assert torch.equal(sdpa(70, 79, SDPBackend.FLASH_ATTENTION), expected[70:])


def test_nan_key_outside_the_window_is_not_read():
    q, k, v, cu = make([40], 2, 1, 8, torch.float32)
    k[2, 0, 0] = float("nan")
    out = atb.kernels.flash_attention(q, k, v, cu, window=8)
    assert torch.isnan(out[2:10]).any(-1).all() and torch.isfinite(out[10:]).all() and torch.isfinite(out[:2]).all()


def test_inf_score_gives_nan_like_softmax():
    q, k, v, cu = make([20], 1, 1, 8, torch.float32)
    q[:] = 1.0
    k[4] = float("inf")
    out = atb.kernels.flash_attention(q, k, v, cu)
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(flash_attention_ref(q, k, v, cu)).any(-1))
    assert torch.isnan(out[4:]).all() and torch.isfinite(out[:4]).all()


def test_numpy_window_and_scale_and_non_numeric_scale():
    import numpy as np

    q, k, v, cu = make([12], 2, 1, 8, torch.float32)
    ref = atb.kernels.flash_attention(q, k, v, cu, window=3, scale=0.25)
    assert torch.equal(atb.kernels.flash_attention(q, k, v, cu, window=np.int32(3), scale=np.float64(0.25)), ref)
    with pytest.raises(TypeError, match="flash_attention: scale must be a real number, got str"):
        atb.kernels.flash_attention(q, k, v, cu, scale="0.25")


def test_tiling_of_zero_work_has_no_units():
    for cu in ([0], [0, 0, 0]):
        t = flash_attention_tiling(cu, 4, 2, 16)
        assert t["num_units"] == 0 and t["block_dim"] == 1
    with pytest.raises(ValueError, match="flash_attention: cu_seqlens must have at least one entry"):
        flash_attention_tiling([], 4, 2, 16)
