"""Automatic prefix caching: shared blocks, suffix-only prefill, eviction, accounting, aborts; tokens as with it off."""
import pytest
import torch

import atb
from atb.checkpoints import random_model
from atb.engine import SamplingParams
from atb.engine.block_manager import BlockManager
from atb.layers.kv_cache import CacheFullError

CFG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny():
    return random_model(CFG, dtype=torch.float32, model_type="llama", seed=11)


def rand_tokens(n: int, seed: int, vocab: int = 128, low: int = 0) -> list[int]:
    return torch.randint(low, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- checks ----------------------------------------------------------------------------------------
def balanced(infer) -> None:
    s = infer.stats()
    assert s["kv_blocks_used"] + s["kv_blocks_free"] + s["kv_blocks_cached"] == s["kv_blocks_total"]
    assert min(s["kv_blocks_used"], s["kv_blocks_free"], s["kv_blocks_cached"]) >= 0
    c = infer.cache
    held = {b for seq in c.sequences() for b in c.block_table(seq)}
    assert c.used_blocks == len(held)
    for b in range(c.num_blocks):
        assert (c.ref_count(b) > 0) == (b in held)


def table(infer, rid: str) -> list[int]:
    return list(infer.scheduler.requests[rid].table)


def released(infer) -> None:
    """Nothing held: every reference dropped, every block free or cached."""
    balanced(infer)
    c = infer.cache
    assert c.sequences() == [] and c.used_blocks == 0
    assert all(c.ref_count(b) == 0 for b in range(c.num_blocks))
    assert infer.stats()["running"] == infer.stats()["waiting"] == 0


def checked_step(infer) -> list:
    """One step, asserting that no block cached before it (committed content) was written by it."""
    c = infer.cache
    keyed = {b: c.block_key(b) for b in range(c.num_blocks) if c.block_key(b) is not None}
    before = {b: (c.key_pool[:, b].clone(), c.value_pool[:, b].clone()) for b in keyed}
    outs = infer.step()
    for b, key in keyed.items():
        if c.block_key(b) == key:   # not evicted and reused for other content in this step
            assert torch.equal(c.key_pool[:, b], before[b][0]) and torch.equal(c.value_pool[:, b], before[b][1])
    balanced(infer)
    return outs


def run(infer, prompts, params, together: bool = True, ids=None) -> list[list[int]]:
    """Each prompt's tokens: all added at once, or each after the previous finished."""
    ids = ids or [f"p{i}" for i in range(len(prompts))]
    got = {}

    def drain():
        while infer.has_unfinished():
            for o in checked_step(infer):
                if o.finished:
                    got[o.request_id] = o.output_token_ids

    for rid, p in zip(ids, prompts):
        infer.add_request(p, params, request_id=rid)
        if not together:
            drain()
    drain()
    return [got[r] for r in ids]


def engine(model, caching, **kw):
    kw = dict(dict(max_seq_len=384, max_batch_size=8, block_size=16), **kw)
    return atb.TransformerInfer(model, enable_prefix_caching=caching, **kw)


GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


# ---- the block manager alone ------------------------------------------------------------------------
def manager(num_blocks=8, block_size=4) -> BlockManager:
    return BlockManager(1, 1, 4, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)


def counts(c):
    assert c.used_blocks + c.cached_blocks + c.free_blocks == c.num_blocks
    return c.used_blocks, c.cached_blocks, c.free_blocks


def test_keys_chain_the_whole_prefix():
    c = manager()
    a = list(range(10))
    b = [99] + a[1:]                     # differs only in its first token
    ka, kb = c.block_keys(a), c.block_keys(b)
    assert len(ka) == 2                  # full blocks only
    assert not set(ka) & set(kb)         # every later block's key differs too
    assert c.block_keys(a[:8] + [5, 5]) == ka[:2] and c.block_keys(a[:7]) == ka[:1]
    # The same tokens at another position (after another prefix) are another key.
    assert c.block_keys(a[4:8] + a[4:8])[1] != ka[1]


def test_share_release_cache_evict():
    c = manager(num_blocks=8, block_size=4)
    p = list(range(10))                                    # 2 full blocks + 2 tokens
    keys = c.block_keys(p)
    ta, hit = c.allocate_prompt("a", p, keys, 12)          # 3 blocks, nothing cached yet
    assert hit == 0 and len(ta) == 3 and counts(c) == (3, 0, 5)
    c.commit()
    tb, hit = c.allocate_prompt("b", p, keys, 16)          # shares the 2 full blocks, 2 private
    assert hit == 8 and tb[:2] == ta[:2] and not set(tb[2:]) & set(ta)
    assert [c.ref_count(x) for x in ta] == [2, 2, 1] and counts(c) == (5, 0, 3)
    c.free("a")
    assert [c.ref_count(x) for x in ta] == [1, 1, 0] and counts(c) == (4, 0, 4)
    c.free("b")                                            # keyed blocks stay cached, the rest is free
    assert counts(c) == (0, 2, 6) and all(c.block_key(x) is not None for x in ta[:2])
    _, hit = c.allocate_prompt("c", p[:9], c.block_keys(p[:9]), 9)  # revives both cached blocks
    assert hit == 8 and counts(c) == (3, 0, 5)
    c.free("c")
    # A request needing more than the free list evicts cached blocks, least recently freed first: the tail
    # block of the prefix (freed first) goes before its head.
    other = [50 + i for i in range(28)]
    td, _ = c.allocate_prompt("d", other, c.block_keys(other), 28)
    assert counts(c) == (7, 1, 0) and ta[1] in td and ta[0] not in td
    assert c.cached_prefix(keys) == [ta[0]]
    with pytest.raises(CacheFullError, match="needs 2 more blocks"):
        c.allocate_prompt("e", [1] * 5, c.block_keys([1] * 5), 5)   # all or nothing
    assert "e" not in c and counts(c) == (7, 1, 0)
    c.free("d")
    assert c.clear_cached() == 8 and counts(c) == (0, 0, 8) and c.cached_prefix(keys) == []
    assert c.query_tokens == 10 + 10 + 9 + 28 and c.hit_tokens == 16


def test_pending_keys_are_dropped_when_the_prefill_fails():
    c = manager()
    p = list(range(8))
    keys = c.block_keys(p)
    c.allocate_prompt("a", p, keys, 9)
    assert c.cached_prefix(keys) == c.block_table("a")[:2]   # visible to requests admitted in the same step
    c.discard_pending()
    assert c.cached_prefix(keys) == []
    c.free("a")
    assert counts(c) == (0, 0, 8)


def test_disabled_is_a_plain_pool():
    c = BlockManager(1, 1, 4, num_blocks=6, block_size=4)
    p = list(range(8))
    c.allocate_prompt("a", p, c.block_keys(p), 8)
    c.commit()
    _, hit = c.allocate_prompt("b", p, c.block_keys(p), 8)
    assert hit == 0 and counts(c) == (4, 0, 2)
    c.free_all()
    assert counts(c) == (0, 0, 6) and c.query_tokens == 0


def test_switch_is_validated(tiny):
    with pytest.raises(TypeError, match="enable_prefix_caching must be a bool"):
        atb.TransformerInfer(tiny, max_seq_len=64, enable_prefix_caching=1)
    infer = atb.TransformerInfer(tiny, max_seq_len=64, max_batch_size=2, block_size=16)
    assert not infer.enable_prefix_caching
    s = infer.stats()
    assert s["kv_blocks_cached"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
    m = infer.memory_summary()
    assert m["kv_blocks_used"] + m["kv_blocks_cached"] + m["kv_blocks_free"] == m["kv_blocks"]


def test_a_block_filled_later_is_keyed_like_a_prompt_block():
    c = manager(num_blocks=8, block_size=4)
    p = list(range(6))                                     # 1 full block + 2 tokens; decode fills the second
    keys = c.block_keys(p)
    t, _ = c.allocate_prompt("a", p, keys, 12)
    c.commit()
    seq = p + [7, 8]
    k1 = c.chain_key(keys[0], seq[4:8])
    assert c.block_keys(seq) == keys + [k1]                # the same chain as a prompt of those tokens
    assert c.key_block("a", 1, k1) and c.block_key(t[1]) == k1
    assert not c.key_block("a", 1, k1)                     # already keyed: unchanged
    c.free("a")
    assert counts(c) == (0, 2, 6)
    tb, hit = c.allocate_prompt("b", seq + [9], c.block_keys(seq + [9]), 12)
    assert hit == 8 and tb[:2] == t[:2]
    off = BlockManager(1, 1, 4, num_blocks=4, block_size=4)
    off.allocate_prompt("a", p, [], 8)
    assert not off.key_block("a", 1, k1) and off.block_key(off.block_table("a")[1]) is None


# ---- the engine, tiny llama ---------------------------------------------------------------------------
def shared_prompts(n=8, prefix=300, seed=0):
    pre = rand_tokens(prefix, seed)
    return [pre + rand_tokens(3 + 5 * i, seed + 1 + i) for i in range(n)]


@pytest.mark.parametrize("together", [True, False], ids=["together", "one_after_another"])
def test_shared_prefix_same_tokens_as_off(tiny, together):
    prompts = shared_prompts()
    ref = run(engine(tiny, False), prompts, GREEDY, together)
    infer = engine(tiny, True)
    assert run(infer, prompts, GREEDY, together) == ref
    released(infer)
    s = infer.stats()
    # 300 // 16 = 18 full prefix blocks, found by the 7 later requests (together: in the step that fills them).
    assert s["prefix_cache_hits"] == 7 * 18 * 16 and s["kv_blocks_cached"] > 0
    # Again, warm: every prompt now starts from the cache.
    assert run(infer, prompts, GREEDY, together) == ref
    released(infer)


@pytest.mark.parametrize("budget", [40, 77])
def test_chunked_prefill_keys_a_block_only_when_its_chunk_writes_it(tiny, budget):
    """Prompts of a 300-token shared prefix, prefilled budget tokens per step: a later request admitted while
    an earlier one is halfway through the prefix shares only the blocks already written (or written in that
    step), computes the rest itself, and every request gets the tokens of an unchunked run with caching off."""
    prompts = shared_prompts(n=4)
    ref = run(engine(tiny, False), prompts, GREEDY)
    infer = engine(tiny, True, max_prefill_tokens=budget)
    assert run(infer, prompts, GREEDY) == ref
    released(infer)
    assert infer.stats()["prefix_cache_hits"] > 0


def test_a_prompt_aborted_mid_prefill_caches_only_the_blocks_it_wrote(tiny):
    prompt = shared_prompts(n=1)[0]
    ref = run(engine(tiny, False), [prompt], GREEDY)
    infer = engine(tiny, True, max_prefill_tokens=40)
    infer.add_request(prompt, GREEDY, request_id="cut")
    for _ in range(3):   # 120 of 303 prompt tokens: 7 full blocks written
        checked_step(infer)
    infer.abort("cut")
    infer.step()
    released(infer)
    assert infer.stats()["kv_blocks_cached"] == 7
    assert run(infer, [prompt], GREEDY) == ref
    assert infer.stats()["prefix_cache_hits"] == 7 * 16


def test_sampling_and_penalties_same_as_off(tiny):
    prompts = shared_prompts(4, 40, seed=3)
    params = [SamplingParams(max_new_tokens=8, do_sample=True, temperature=1.2, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_new_tokens=8, repetition_penalty=1.4, ignore_eos=True)]
    for p in params:
        ref = run(engine(tiny, False), prompts, p)
        infer = engine(tiny, True)
        assert run(infer, prompts, p) == ref == run(infer, prompts, p, together=False)
        released(infer)


def test_whole_prompt_cached_recomputes_only_the_last_token(tiny):
    pre = rand_tokens(64, 21)                 # 4 whole blocks
    prompts = [pre, pre[:32], pre + [7]]
    ref = run(engine(tiny, False), prompts, GREEDY, together=False)
    infer = engine(tiny, True)
    assert run(infer, prompts[:1], GREEDY) == ref[:1]
    rid = infer.add_request(pre[:32], GREEDY)
    infer.step()
    req = next(r for r in infer.scheduler.running if r.request_id == rid)
    assert req.cached == 32                  # nothing left to prefill but the logits of token 31
    infer.abort(rid)
    infer.step()
    assert run(infer, prompts, GREEDY, together=False) == ref
    assert run(infer, prompts, GREEDY) == ref
    released(infer)


def test_prefixes_differing_in_the_first_token_share_nothing(tiny):
    a = rand_tokens(100, 31)
    b = [(a[0] + 1) % 128] + a[1:]
    infer = engine(tiny, True)
    infer.add_request(a, GREEDY, request_id="a")
    infer.add_request(b, GREEDY, request_id="b")
    checked_step(infer)
    c = infer.cache
    ta, tb = table(infer, "a"), table(infer, "b")
    assert not set(ta) & set(tb)
    assert [r.cached for r in infer.scheduler.running] == [0, 0] and infer.stats()["prefix_cache_hits"] == 0
    while infer.has_unfinished():
        checked_step(infer)
    infer.add_request(b, GREEDY, request_id="b2")    # both are cached now: b2 finds b's blocks, none of a's
    checked_step(infer)
    assert infer.scheduler.running[0].cached == 96
    assert table(infer, "b2")[:6] == tb[:6] and not set(table(infer, "b2")) & set(ta)
    infer.abort("b2")
    infer.step()
    released(infer)


def test_eviction_under_a_small_pool(tiny):
    # 2 sequences of 128 tokens: 16 blocks of 16. Four prefixes of 80 tokens (5 blocks), each used by two
    # pairs of prompts (a pair shares its prefix in the step that fills it): 20 keyed prefix blocks do not fit
    # in 16, so cached blocks are evicted along the way.
    pres = [rand_tokens(80, 40 + i) for i in range(4)]
    prompts = [pres[(i // 2) % 4] + rand_tokens(4 + i, 60 + i) for i in range(16)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ref = run(engine(tiny, False, max_seq_len=128, max_batch_size=2), prompts, params)
    infer = engine(tiny, True, max_seq_len=128, max_batch_size=2)
    assert infer.cache.num_blocks == 16
    assert run(infer, prompts, params) == ref
    released(infer)
    s = infer.stats()
    assert 0 < s["prefix_cache_hits"] < s["prefix_cache_queries"]
    assert s["kv_blocks_cached"] <= s["kv_blocks_total"]
    assert run(infer, prompts[::-1], params) == ref[::-1]
    released(infer)


def test_abort_of_the_request_that_fills_the_shared_prefix(tiny):
    prompts = shared_prompts(2, 120, seed=7)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ref = run(engine(tiny, False), prompts[1:], params)
    infer = engine(tiny, True)
    infer.add_request(prompts[0], params, request_id="a")
    infer.add_request(prompts[1], params, request_id="b")
    outs = {o.request_id: o for o in checked_step(infer)}   # one prefill: b read the blocks a filled
    assert table(infer, "a")[:7] == table(infer, "b")[:7]
    assert infer.abort("a")
    got = list(outs["b"].output_token_ids)
    while infer.has_unfinished():
        for o in checked_step(infer):
            if o.request_id == "b":
                got = o.output_token_ids
            else:
                assert o.finish_reason == "abort"
    assert got == ref[0]
    released(infer)


def test_a_failed_prefill_caches_nothing_and_releases_on_abort(tiny, monkeypatch):
    prompts = shared_prompts(3, 120, seed=9)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    ref = run(engine(tiny, False), prompts, params)
    infer = engine(tiny, True)
    calls = []
    real = atb.kernels.paged_attention

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:                 # the second layer of the first prefill
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(atb.kernels, "paged_attention", flaky)
    for i, p in enumerate(prompts[:2]):
        infer.add_request(p, params, request_id=f"x{i}")
    with pytest.raises(KeyboardInterrupt):
        infer.step()
    monkeypatch.setattr(atb.kernels, "paged_attention", real)
    # Half-written blocks were never committed: nothing is matchable.
    assert infer.cache.cached_prefix(infer.cache.block_keys(prompts[0])) == []
    assert infer.abort("x0") and infer.abort("x1")
    infer.step()
    released(infer)
    assert infer.stats()["kv_blocks_cached"] == 0
    assert run(infer, prompts, params) == ref
    released(infer)


# ---- the real checkpoint ------------------------------------------------------------------------------
SYSTEM = ("You are a careful assistant for a small public library. You answer questions about opening hours, "
          "borrowing rules, late fees, the reading room, the children's corner, printing and scanning, and "
          "events. Opening hours: Monday to Friday 9:00 to 19:00, Saturday 10:00 to 16:00, closed on Sunday and "
          "public holidays. A reader may borrow up to eight items at once for three weeks; items can be renewed "
          "twice online unless someone has reserved them. Late fees are twenty cents per item per day, capped at "
          "five euros per item. Printing costs ten cents a page in black and white and fifty cents in colour; "
          "scanning to a USB stick is free. The reading room is silent; phone calls are not allowed there. The "
          "children's corner hosts a story hour every Wednesday at 16:00 and a craft workshop on the first "
          "Saturday of each month. Lost cards are replaced for two euros. Answer briefly and politely, and if "
          "you do not know something, say so and suggest asking at the front desk. Never invent rules, prices "
          "or dates that are not listed here. When a question is about another library, explain that you only "
          "know this one. The library also lends e-readers, board games and a small collection of tools such as "
          "a drill and a sewing machine; these are lent for one week only and cannot be renewed. Group visits "
          "for schools are free but must be booked at least two weeks ahead by phone or email.")
QUESTIONS = ["When are you open on Saturday?", "How many books can I borrow?", "What does colour printing cost?",
             "Is there a story hour for kids?", "I lost my card, what now?", "Can I make a phone call inside?",
             "How much is the late fee for two books, five days late?", "Are you open on Sunday?"]


@pytest.fixture(scope="module")
def smol_prompts(smollm2_fp32):
    _, tok = smollm2_fp32

    def chat(q):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])

    prompts = [chat(q) for q in QUESTIONS]
    n = next(i for i in range(len(prompts[0])) if any(p[i] != prompts[0][i] for p in prompts))
    assert n >= 300    # the shared prefix
    return prompts


def test_smollm2_shared_system_prompt_same_tokens_as_off(smollm2_fp32, smol_prompts):
    model, _ = smollm2_fp32
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    kw = dict(max_seq_len=448, max_batch_size=8, block_size=32)
    ref = run(atb.TransformerInfer(model, **kw), smol_prompts, params)
    infer = atb.TransformerInfer(model, enable_prefix_caching=True, **kw)
    assert run(infer, smol_prompts, params) == ref
    released(infer)
    assert run(infer, smol_prompts, params, together=False) == ref
    released(infer)
    s = infer.stats()
    assert s["prefix_cache_hits"] >= (7 + 8) * 288


def test_smollm2_bf16_cached_suffix_computes_the_rows_a_whole_prompt_prefill_does(smollm2_bf16):
    # One after another, each later request prefills only its last 3..14 tokens over the cached 256-token
    # prefix, while with caching off every prompt is one prefill of 260+ rows. Each projection's rows went to
    # the kernel M chose (in bf16 the STREAM kernel below 6 rows, the vdpbf16ps GEMM above), which round
    # differently, and on SmolLM2's near ties that flipped greedy tokens of two of these prompts; the engine's
    # prefill now runs every projection on the row-invariant GEMM (paged attention's rows are invariant too).
    # The reference runs one after another too: batched decode steps (8 rows) take other kernels than single
    # ones (1 row), which round differently, so only the prefill may differ between the two runs here (an AMX
    # CPU's 8-row GEMM flipped a near tie of prompt 4 when the reference decoded the 8 together).
    model, _ = smollm2_bf16
    g = torch.Generator().manual_seed(0)
    ordinary = lambda n: torch.randint(17, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    prefix = ordinary(256)
    prompts = [prefix + ordinary(int(torch.randint(3, 15, (1,), generator=g))) for _ in range(8)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    kw = dict(max_seq_len=288, max_batch_size=8, block_size=32)
    ref = run(atb.TransformerInfer(model, **kw), prompts, params, together=False)
    infer = atb.TransformerInfer(model, enable_prefix_caching=True, **kw)
    assert run(infer, prompts, params, together=False) == ref
    released(infer)
    assert infer.stats()["prefix_cache_hits"] == 7 * 256


# ---- blocks filled by decode ----------------------------------------------------------------------------
def test_a_follow_up_turn_reuses_the_blocks_its_answer_filled(tiny):
    """Turn 2 = turn 1's prompt + its answer + a new message: the answer's full blocks come from the cache."""
    bs = 16
    first = rand_tokens(40, 70)
    params = SamplingParams(max_new_tokens=45, ignore_eos=True)
    off, on = engine(tiny, False), engine(tiny, True)
    [ans] = run(on, [first], params)
    assert run(off, [first], params) == [ans]
    second = first + ans + rand_tokens(7, 71)
    before = on.stats()
    got = run(on, [second], params, ids=["t2"])
    s = on.stats()
    # Every block whose K/V turn 1 wrote (all its tokens but the last answer token) is a hit: 5 blocks, where
    # prompt blocks alone would be 2.
    written = len(first) + len(ans) - 1
    assert s["prefix_cache_hits"] - before["prefix_cache_hits"] == written // bs * bs == 80
    assert s["prefix_cache_queries"] - before["prefix_cache_queries"] == len(second)
    assert got == run(off, [second], params, ids=["t2"])
    released(on)


def test_a_prompt_repeating_a_running_answer_shares_its_filled_blocks(tiny):
    """Keyed while the first request still decodes: the second reads them (never writes them) and both
    requests get their caching-off tokens."""
    first = rand_tokens(20, 72)
    p1 = SamplingParams(max_new_tokens=60, ignore_eos=True)
    on = engine(tiny, True)
    on.add_request(first, p1, request_id="a")
    out = []
    while len(out) < 30:
        for o in checked_step(on):
            out = o.output_token_ids
    second = first + out[:28] + rand_tokens(5, 73)          # 48 tokens of the running sequence: 3 blocks
    p2 = SamplingParams(max_new_tokens=12, ignore_eos=True)
    on.add_request(second, p2, request_id="b")
    got = {}
    while on.has_unfinished():
        for o in checked_step(on):
            if o.request_id == "b" and on.scheduler.requests.get("b") is not None and not got:
                assert table(on, "b")[:3] == table(on, "a")[:3]
            if o.finished:
                got[o.request_id] = o.output_token_ids
    off = engine(tiny, False)
    assert got["a"] == run(off, [first], p1)[0] and got["b"] == run(off, [second], p2)[0]
    released(on)


def test_conversations_under_a_small_pool_evict_exactly(tiny):
    """Three-turn conversations whose answers fill blocks, in a pool that cannot keep them all: the same tokens
    as caching off, nothing leaks, and the accounting adds up after every step."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)

    def talk(infer):
        convs = [rand_tokens(20 + 3 * i, 80 + i) for i in range(4)]
        outs = []
        for turn in range(3):
            prompts = [c + rand_tokens(5, 90 + 10 * turn + i) for i, c in enumerate(convs)]
            answers = run(infer, prompts, params, ids=[f"c{i}t{turn}" for i in range(4)])
            outs.append(answers)
            convs = [p + a for p, a in zip(prompts, answers)]
        return outs

    on = engine(tiny, True, max_seq_len=128, max_batch_size=2)
    assert on.cache.num_blocks == 16
    assert talk(on) == talk(engine(tiny, False, max_seq_len=128, max_batch_size=2))
    released(on)
    s = on.stats()
    assert 0 < s["prefix_cache_hits"] < s["prefix_cache_queries"]
