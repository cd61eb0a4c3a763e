"""Weights in transparent huge pages (atb.hugepages): the arena, the in-place move of a model's parameters, and
the engine's own copies."""
import io

import pytest
import torch

import atb
from atb.hugepages import HUGE_PAGE_BYTES, HugePageArena, huge_pages_enabled, move_parameters_to_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages_enabled(), reason="transparent huge pages are off on this machine")


def _vm_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping holding address ``ptr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_arena_carves_aligned_tensors_each_its_own_storage():
    arena = HugePageArena(3 * HUGE_PAGE_BYTES)
    a = arena.copy(torch.arange(1000, dtype=torch.float32).view(10, 100))
    b = arena.empty((7, 3), torch.bfloat16).fill_(2)
    assert a.data_ptr() % HUGE_PAGE_BYTES == 0  # the first tensor starts the first huge page
    assert b.data_ptr() % 64 == 0 and b.data_ptr() >= a.data_ptr() + a.nbytes
    assert torch.equal(a, torch.arange(1000, dtype=torch.float32).view(10, 100)) and a.is_contiguous()
    assert a.untyped_storage().nbytes() == 4000 and b.untyped_storage().nbytes() == 42
    buf = io.BytesIO()
    torch.save(b, buf)  # one carved tensor saves its own bytes, not the arena's
    assert len(buf.getvalue()) < 4096
    del arena  # the tensors keep the mapping alive
    assert torch.equal(b, torch.full((7, 3), 2, dtype=torch.bfloat16))


def test_arena_errors():
    with pytest.raises(ValueError, match="HugePageArena: nbytes must be a positive int, got 0"):
        HugePageArena(0)
    arena = HugePageArena(100)
    arena.empty((16,), torch.float32)
    with pytest.raises(ValueError, match="HugePageArena: 64 bytes asked, 36 left"):
        arena.empty((16,), torch.float32)
    assert arena.empty((0, 5), torch.float32).shape == (0, 5)


@needs_thp
def test_arena_is_madvised_for_huge_pages():
    t = HugePageArena(HUGE_PAGE_BYTES).empty((1024,), torch.float32)
    assert "hg" in _vm_flags(t.data_ptr())


def _tied_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@needs_thp
def test_move_parameters_in_place_keeps_values_ties_and_outputs():
    model = _tied_model()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
    values = {n: p.clone() for n, p in model.named_parameters()}
    objects = {n: p for n, p in model.named_parameters()}
    moved = move_parameters_to_huge_pages(model)
    assert moved == sum(p.nbytes for p in model.parameters())  # the tied table once
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for n, p in model.named_parameters():
        assert p is objects[n] and torch.equal(p, values[n]) and "hg" in _vm_flags(p.data_ptr()), n
    assert move_parameters_to_huge_pages(model) == 0  # already there
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


@needs_thp
def test_parameters_sharing_a_storage_stay_tied():
    lin = torch.nn.Linear(8, 8, bias=False)
    other = torch.nn.Linear(8, 8, bias=False)
    other.weight = torch.nn.Parameter(lin.weight.data[:4])  # a distinct Parameter over lin's storage
    holder = torch.nn.ModuleList([lin, other, torch.nn.Linear(4, 4)])
    before = lin.weight.data_ptr()
    assert move_parameters_to_huge_pages(holder) == sum(p.nbytes for p in holder[2].parameters())
    assert lin.weight.data_ptr() == before and other.weight.data_ptr() == before


def test_switched_off_moves_nothing(monkeypatch):
    monkeypatch.setenv("ATB_HUGE_PAGES", "0")
    assert not huge_pages_enabled()
    model = _tied_model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert move_parameters_to_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs


@needs_thp
def test_engine_copies_go_to_huge_pages_and_decode_the_same(monkeypatch):
    model = _tied_model()
    prompt = [[5, 17, 33, 2, 80]]

    def placement():  # where each parameter lies, and whether its mapping asks for huge pages
        return [(p.data_ptr(), "hg" in _vm_flags(p.data_ptr())) for p in model.parameters()]

    with monkeypatch.context() as m:
        m.setenv("ATB_HUGE_PAGES", "0")
        # Switched off, the engine neither moves the parameters nor advises their memory. (The heap they come
        # from may already lie in a mapping some earlier code advised, so the flag is compared, not assumed.)
        before = placement()
        ref = atb.TransformerInfer(model, max_seq_len=32, max_batch_size=1, block_size=8).generate(prompt,
                                                                                                   max_new_tokens=6)
        assert placement() == before
    # A converted dtype: the engine's own copies, tied table still one tensor, in huge pages.
    half = atb.TransformerInfer(model, max_seq_len=32, max_batch_size=1, block_size=8, dtype=torch.bfloat16)
    assert half.runner.lm_head is half.runner.embed
    for t in half.runner.weight_tensors():
        assert "hg" in _vm_flags(t.data_ptr())
    q = atb.TransformerInfer(model, max_seq_len=32, max_batch_size=1, block_size=8, quantize="w8a16")
    assert all("hg" in _vm_flags(t.data_ptr()) for t in q.runner.weight_tensors())
    # Shared weights: the model's own, moved in place, same tokens as before the move.
    same = atb.TransformerInfer(model, max_seq_len=32, max_batch_size=1, block_size=8)
    assert same.runner.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert same.generate(prompt, max_new_tokens=6) == ref


@needs_thp
def test_kv_cache_pool_in_huge_pages():
    from atb.layers.kv_cache import PagedKVCache

    c = PagedKVCache(2, 3, 16, num_blocks=5, block_size=8, dtype=torch.bfloat16)
    assert c.key_pool.shape == (2, 5, 8, 3, 16) and c.key_pool.dtype == torch.bfloat16
    assert "hg" in _vm_flags(c.key_pool.data_ptr()) and "hg" in _vm_flags(c.value_pool.data_ptr())
    assert c.key_caches[1].data_ptr() == c.key_pool.data_ptr() + c.key_caches[0].nbytes


@needs_thp
def test_a_callers_quantized_weights_are_not_copied():
    model = _tied_model()
    q = atb.quantize(model, "w8a16")
    infer = atb.TransformerInfer(model, max_seq_len=32, max_batch_size=1, block_size=8, quantize=q)
    assert infer.runner.layers[0].q.data.data_ptr() == q.layers[0].q.data.data_ptr()
