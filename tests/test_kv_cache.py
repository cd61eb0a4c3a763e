"""PagedKVCache: sizing, block accounting, slot mapping, all-or-nothing allocation."""
import pytest
import torch

from atb.layers.kv_cache import CacheFullError, PagedKVCache


def test_sized_up_front_for_capacity():
    c = PagedKVCache.for_capacity(3, 2, 8, max_batch_size=4, max_seq_len=100, block_size=16, dtype=torch.bfloat16)
    assert c.num_blocks == 4 * 7  # ceil(100 / 16) = 7 blocks per sequence
    assert c.free_blocks == c.num_blocks
    assert c.key_caches[0].shape == (28, 16, 2, 8) and c.value_caches[2].dtype == torch.bfloat16
    assert len(c.key_caches) == 3 and c.nbytes == 2 * 3 * 28 * 16 * 2 * 8 * 2
    # Layers are contiguous views of one pool.
    assert c.key_caches[1].data_ptr() == c.key_pool.data_ptr() + c.key_caches[0].nbytes
    assert c.key_caches[1].is_contiguous()


def test_allocate_extend_free_balance():
    c = PagedKVCache(1, 1, 4, num_blocks=10, block_size=4)
    t0 = c.allocate("a", 5)  # 2 blocks
    assert t0 == [0, 1] and c.free_blocks == 8
    t1 = c.allocate("b", 0)
    assert t1 == [] and c.free_blocks == 8
    c.extend("b", 1)
    c.extend("a", 8)  # still 2 blocks
    assert c.block_table("a") == [0, 1] and c.block_table("b") == [2]
    c.extend("a", 9)
    assert c.block_table("a") == [0, 1, 3] and c.free_blocks == 6
    c.extend("a", 3)  # never shrinks
    assert len(c.block_table("a")) == 3
    c.free("a")
    assert c.free_blocks == 9 and "a" not in c
    # Freed blocks are reused lowest id first.
    assert c.allocate("c", 12) == [0, 1, 3]
    c.free_all()
    assert c.free_blocks == 10 and c.sequences() == []


def test_slot_mapping_formula():
    c = PagedKVCache(1, 1, 4, num_blocks=8, block_size=4)
    c.allocate(0, 3)
    c.allocate(1, 6)
    c.extend(0, 7)  # sequence 0 gets blocks [0, 3]
    assert c.block_table(0) == [0, 3] and c.block_table(1) == [1, 2]
    assert c.slots(0, 0, 7) == [0, 1, 2, 3, 12, 13, 14]
    assert c.slots(1, 4, 6) == [8, 9]
    sm = c.slot_mapping([1, 0], [5, 6], [6, 7])
    assert sm.dtype == torch.int32 and sm.tolist() == [9, 14]
    bt = c.block_tables([0, 1], width=3)
    assert bt.dtype == torch.int32 and bt.tolist() == [[0, 3, 0], [1, 2, 0]]
    with pytest.raises(ValueError, match="outside"):
        c.slots(0, 0, 9)


def test_full_pool_raises_without_allocating():
    c = PagedKVCache(1, 1, 4, num_blocks=3, block_size=2)
    c.allocate("a", 4)
    with pytest.raises(CacheFullError, match="needs 2 more blocks, only 1"):
        c.allocate("b", 3)
    assert "b" not in c and c.free_blocks == 1
    with pytest.raises(CacheFullError):
        c.extend("a", 8)
    assert c.block_table("a") == [0, 1] and c.free_blocks == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache(1, 1, 4, num_blocks=3, block_size=12)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(1, 1, 4, num_blocks=0)
    c = PagedKVCache(1, 1, 4, num_blocks=3, block_size=2)
    c.allocate("a", 1)
    with pytest.raises(ValueError, match="already"):
        c.allocate("a", 1)
    with pytest.raises(KeyError, match="unknown sequence"):
        c.free("zz")
    with pytest.raises(KeyError):
        c.extend("zz", 1)
    assert c.free_blocks == 2
