"""reshape_and_cache against the reference; validation before any write; bad input."""
import pytest
import torch

import atb
from conftest import ALL_SOCS
from reference import DTYPES, reshape_and_cache_ref


def _cache(num_blocks, block_size, kv_heads, head_dim, dtype):
    return (torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype),
            torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype))


def _slots(tokens, num_blocks, block_size, skip=0.2):
    slots = torch.randperm(num_blocks * block_size)[:tokens].int()
    slots[torch.rand(tokens) < skip] = -1
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 64), (3, 80), (2, 7)])
def test_matches_reference(dtype, block_size, kv_heads, head_dim):
    num_blocks = 300 // block_size + 2
    kc, vc = _cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    tokens = 123
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    slots = _slots(tokens, num_blocks, block_size)
    kc_ref, vc_ref = reshape_and_cache_ref(k, v, kc, vc, slots)
    assert atb.kernels.reshape_and_cache(k, v, kc, vc, slots) is None
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_fused_qkv_views_and_int64_slots():
    # k and v as views into one [tokens, (H + 2 KH) * D] projection output: a token stride, no copy needed.
    tokens, heads, kv_heads, d = 37, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    assert not k.is_contiguous()
    kc, vc = _cache(8, 16, kv_heads, d, torch.float32)
    slots = _slots(tokens, 8, 16)
    kc_ref, vc_ref = reshape_and_cache_ref(k, v, kc, vc, slots)
    atb.kernels.reshape_and_cache(k, v, kc, vc, slots.long())
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("soc", ALL_SOCS)
def test_every_soc_writes_the_same(soc):
    kc0, vc0 = _cache(20, 16, 2, 64, torch.float16)
    k, v = torch.randn(300, 2, 64).half(), torch.randn(300, 2, 64).half()
    slots = _slots(300, 20, 16)
    kc, vc = kc0.clone(), vc0.clone()
    atb.kernels.reshape_and_cache(k, v, kc, vc, slots, soc_type=soc)
    kc_ref, vc_ref = reshape_and_cache_ref(k, v, kc0, vc0, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_invalid_call_leaves_a_shared_cache_untouched():
    # A cache shared by 16 sequences; one call whose last slot is out of range (or
    # duplicated) must fail before the valid tokens ahead of it are written.
    num_blocks, bs = 64, 16
    kc, vc = _cache(num_blocks, bs, 2, 64, torch.bfloat16)
    kc0, vc0 = kc.clone(), vc.clone()
    k, v = torch.randn(16, 2, 64).bfloat16(), torch.randn(16, 2, 64).bfloat16()
    good = torch.arange(16, dtype=torch.int32) * (num_blocks * bs // 16)
    for bad_value, match in [(num_blocks * bs, "slot_mapping\\[15\\] = 1024 is out of range.*64 blocks x 16"),
                             (int(good[3]), "slot 192 appears twice.*tokens 3 and 15")]:
        slots = good.clone()
        slots[-1] = bad_value
        with pytest.raises(ValueError, match=match):
            atb.kernels.reshape_and_cache(k, v, kc, vc, slots)
        assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    atb.kernels.reshape_and_cache(k, v, kc, vc, good)  # the same call with valid slots works
    assert not torch.equal(kc, kc0)


def test_skips_and_empty_calls():
    kc, vc = _cache(4, 16, 1, 64, torch.float32)
    kc0, vc0 = kc.clone(), vc.clone()
    k = torch.randn(3, 1, 64)
    atb.kernels.reshape_and_cache(k, k, kc, vc, torch.full((3,), -1, dtype=torch.int32))
    atb.kernels.reshape_and_cache(k[:0], k[:0], kc, vc, torch.empty(0, dtype=torch.int32))
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_bad_inputs_raise_clear_errors():
    kc, vc = _cache(4, 16, 2, 64, torch.float32)
    k = torch.randn(3, 2, 64)
    s = torch.tensor([0, 1, 2], dtype=torch.int32)
    rc = atb.kernels.reshape_and_cache
    with pytest.raises(TypeError, match="key is torch.float16 but key_cache is torch.float32"):
        rc(k.half(), k, kc, vc, s)
    with pytest.raises(TypeError, match="slot_mapping must be int32 \\(or int64\\), got torch.float32"):
        rc(k, k, kc, vc, s.float())
    with pytest.raises(ValueError, match="key has shape \\(3, 4, 32\\), expected \\[tokens, 2, 64\\]"):
        rc(k.view(3, 4, 32), k, kc, vc, s)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries, key has 3 tokens"):
        rc(k, k, kc, vc, s[:2])
    with pytest.raises(ValueError, match="value_cache has shape"):
        rc(k, k, kc, vc[:2], s)
    with pytest.raises(ValueError, match="must be contiguous"):
        rc(k, k, kc.transpose(0, 1), vc.transpose(0, 1), s)
    with pytest.raises(ValueError, match="bfloat16 is not supported on Ascend910"):
        rc(k.bfloat16(), k.bfloat16(), kc.bfloat16(), vc.bfloat16(), s, soc_type="Ascend910")
    with pytest.raises(ValueError, match="slot_mapping\\[0\\] = 64 is out of range"):
        rc(k, k, kc, vc, torch.tensor([64, 1, 2]))


def test_zero_tokens_write_nothing():
    kc, vc = _cache(3, 4, 2, 8, torch.float32)
    kc0, vc0 = kc.clone(), vc.clone()
    e = torch.empty(0, 2, 8)
    atb.kernels.reshape_and_cache(e, e, kc, vc, torch.empty(0, dtype=torch.int32))
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_one_token_view_with_any_token_stride():
    # A 1-token view keeps whatever token stride it was cut with (here 4 < kv_heads * head_dim): found by
    # tests/test_fuzz.py, it was rejected although the call is valid.
    kc, vc = _cache(2, 4, 2, 8, torch.float32)
    key = torch.randn(2, 1, 8).transpose(0, 1)       # shape (1, 2, 8), token stride 8
    value = torch.randn(16, 1)[:, 0].view(1, 2, 8)
    slots = torch.tensor([5], dtype=torch.int32)
    ref_k, ref_v = reshape_and_cache_ref(key, value, kc, vc, slots)
    atb.kernels.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
