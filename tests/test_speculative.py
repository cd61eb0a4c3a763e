"""Speculative decoding by prompt lookup: the drafter, the config, and the engine's tokens against plain decoding."""
import random

import pytest
import torch

import atb
from atb.checkpoints import random_model
from atb.engine import SamplingParams, SpeculativeConfig
from atb.engine.speculative import LookupHistory, NgramDrafter

CFG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request):
    return random_model(CFG, dtype=request.param, model_type="llama", seed=5)


def engine(model, speculative=None, **kw):
    kw = dict(dict(max_seq_len=160, max_batch_size=4, block_size=8), **kw)
    return atb.TransformerInfer(model, speculative_config=speculative, **kw)


def drain(infer) -> dict:
    last = {}
    while infer.has_unfinished():
        for o in infer.step():
            last[o.request_id] = o
    for o in infer.step():
        last[o.request_id] = o
    return last


def idle(infer) -> bool:
    s = infer.stats()
    return (s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0)


def looping_prompt(seed: int, n: int = 24) -> list[int]:
    """A prompt that repeats a short random phrase, so its continuation finds n-grams to copy."""
    g = random.Random(seed)
    phrase = [g.randrange(2, 128) for _ in range(g.randint(3, 6))]
    return (phrase * (n // len(phrase) + 1))[:n] + [g.randrange(2, 128)]


# ---- the drafter ---------------------------------------------------------------------------------
def naive_draft(seq: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix n-gram (n in [lo, hi]), the
    copy continuing into itself."""
    L = len(seq)
    for n in range(min(hi, L), lo - 1, -1):
        for e in range(L - 2, n - 2, -1):
            if seq[e - n + 1:e + 1] == seq[L - n:]:
                ext = list(seq)
                for j in range(k):
                    ext.append(ext[e + 1 + j])
                return ext[L:]
    return []


def test_drafter_matches_a_naive_search():
    g = random.Random(0)
    for _ in range(300):
        vocab = g.choice([2, 3, 5, 20])
        prompt = [g.randrange(vocab) for _ in range(g.randint(1, 30))]
        lo = g.randint(1, 3)
        hi = g.randint(lo, 6)
        k = g.randint(1, 6)
        d = NgramDrafter(prompt, lo, hi)
        out = []
        for _ in range(15):
            assert d.propose(out, k) == naive_draft(prompt + out, lo, hi, k)
            out += [g.randrange(vocab) for _ in range(g.randint(1, 3))]


def test_drafter_copies_a_loop_past_its_end_and_prefers_the_longest_match():
    d = NgramDrafter([7, 1, 2, 1, 2], 1, 3)
    assert d.propose([], 5) == [1, 2, 1, 2, 1]          # period 2, continued into the copy
    d = NgramDrafter([5, 9, 3, 4, 9, 3, 8, 5, 9, 3], 1, 3)
    assert d.propose([], 2) == [4, 9]                   # "5 9 3" (n = 3) beats the later "9 3" (n = 2)
    assert NgramDrafter([1, 2, 3], 2, 2).propose([], 3) == []   # nothing repeats


def test_drafter_backs_off_after_rejections_and_resets_on_acceptance():
    d = NgramDrafter([1, 2, 1, 2], 1, 2)
    assert d.propose([], 2)
    d.accepted(2, 0)                     # wait 1 step
    assert d.propose([1], 2) == []
    assert d.propose([1], 2)
    d.accepted(2, 0)                     # wait 2 steps
    assert d.propose([1], 2) == [] and d.propose([1], 2) == []
    assert d.propose([1], 2)
    d.accepted(2, 1)                     # accepted: no pause after the next rejection's 1
    d.accepted(2, 0)
    assert d.propose([1], 2) == []
    assert d.propose([1], 2)


def test_lookup_history_drafts_what_followed_in_the_most_recent_kept_request():
    h = LookupHistory(max_requests=2, lo=2, hi=4)
    h.add([1, 2, 3, 4, 5, 6])
    assert h.draft([9, 9, 2, 3], 3) == [4, 5, 6]          # the longest suffix found: (2, 3) -> 4 5 6
    assert h.draft([7, 8], 3) == [] and h.draft([5, 6], 3) == []  # nothing followed 5 6
    h.add([0, 2, 3, 7, 7])
    assert h.draft([2, 3], 2) == [7, 7]                   # the most recent occurrence wins
    assert h.draft([1, 2, 3], 2) == [4, 5]                # ... unless a longer n-gram matches an older one
    h.add([8, 8, 8])
    assert len(h) == 2 and h.draft([1, 2, 3], 2) == [7, 7]  # the first request is gone: its entries skipped
    for i in range(20):                                    # stale entries are cleared as requests come and go
        h.add([100 + i, 200 + i, 300 + i])
    assert sum(len(t) for t in h._tables) <= 2 * sum(len(q) for q in h._seqs.values()) * len(h._tables)
    assert h.draft([119, 219], 1) == [319] and h.draft([2, 3], 1) == []
    h.add([5])                                             # too short to hold an n-gram with a successor
    assert len(h) == 2


def test_drafter_looks_up_the_history_only_when_its_own_tokens_give_nothing():
    h = LookupHistory(max_requests=4, lo=2, hi=3)
    h.add([40, 41, 42, 43, 44])
    d = NgramDrafter([1, 2, 3, 1, 2], lo=2, hi=3)
    assert d.propose([], 2, h) == [3, 1]                   # its own (1, 2) -> 3 1
    d = NgramDrafter([5, 6, 40, 41], lo=2, hi=3)
    assert d.propose([], 2, h) == [42, 43] and d.propose([42], 2, None) == []


# ---- the config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an int >= 1"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min .3. is larger than prompt_lookup_max"),
    ({"max_step_rows": 1}, "max_step_rows must be >= 2"),
    ({"method": "eagle"}, "method must be 'ngram'"),
    ({"num_speculative": 3}, "unknown key 'num_speculative'"),
    ({"lookup_history": -1}, "lookup_history must be an int >= 0"),
    ({"lookup_history": True}, "lookup_history must be an int >= 0"),
])
def test_config_errors_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.resolve(bad)


def test_engine_rejects_a_bad_config(tiny):
    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        engine(tiny, speculative=3)
    with pytest.raises(ValueError, match="speculative_config: num_speculative_tokens"):
        engine(tiny, speculative={"num_speculative_tokens": -1})


# ---- the engine -----------------------------------------------------------------------------------
@pytest.mark.parametrize("graph_mode", [True, False], ids=["graph", "python"])
def test_greedy_tokens_equal_plain_decoding_and_drafts_are_accepted(tiny, graph_mode):
    prompts = [looping_prompt(s) for s in range(6)] + [[3, 9, 27, 81 % 128, 115]]
    plain = engine(tiny, graph_mode=graph_mode, max_batch_size=1).generate(prompts, 48)
    spec = engine(tiny, SPEC, graph_mode=graph_mode, max_batch_size=1)
    assert spec.generate(prompts, 48) == plain
    s = spec.stats()
    assert s["spec_decode_steps"] > 0 and 0 < s["spec_accepted_tokens"] <= s["spec_draft_tokens"]
    assert idle(spec)


@pytest.mark.parametrize("k, rows", [(1, 2), (3, 8), (5, 6), (7, 16)])
def test_batches_share_the_row_budget_and_keep_their_tokens(tiny, k, rows):
    prompts = [looping_prompt(10 + s, n=8 + 5 * s) for s in range(5)]
    plain = engine(tiny).generate(prompts, 40)
    spec = engine(tiny, dict(SPEC, num_speculative_tokens=k, max_step_rows=rows))
    assert spec.generate(prompts, 40) == plain
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert idle(spec)


def test_max_new_tokens_eos_and_max_seq_len_stop_exactly(tiny):
    prompt = looping_prompt(3)
    plain = engine(tiny).generate([prompt], 60)[0]
    # Every length (a draft may not run past max_new_tokens).
    for n in (1, 2, 3, 5, 17):
        assert engine(tiny, SPEC).generate([prompt], n)[0] == plain[:n]
    # An EOS inside an accepted draft ends the request there.
    eos = plain[20]
    want = plain[:plain.index(eos) + 1]
    spec = engine(tiny, SPEC)
    assert spec.generate([prompt], 60, eos_token_id=eos)[0] == want
    assert spec.last_stop_reasons == ["eos"]
    # max_seq_len: the sequence ends at the pool's last position.
    short = engine(tiny, SPEC, max_seq_len=len(prompt) + 11)
    assert short.generate([prompt], 60)[0] == plain[:11]
    assert short.last_stop_reasons == ["max_seq_len"]
    assert idle(short)


def test_deterministic_requests_keep_their_tokens_and_logprobs(tiny):
    """Greedy requests with logprobs or penalties verify row by row (each row shaped from the tokens before it):
    their tokens and logprobs are plain decoding's, batched with a sampled request."""
    prompts = [looping_prompt(s) for s in range(4)]
    params = [SamplingParams(max_new_tokens=70, ignore_eos=True),
              SamplingParams(max_new_tokens=40, logprobs=2, ignore_eos=True),
              SamplingParams(max_new_tokens=30, repetition_penalty=1.05, ignore_eos=True),
              SamplingParams(max_new_tokens=24, presence_penalty=0.2, frequency_penalty=0.1, ignore_eos=True)]

    def run(speculative, extra=()):
        infer = engine(tiny, speculative)
        for i, (p, sp) in enumerate(list(zip(prompts, params)) + list(extra)):
            infer.add_request(p, sp, request_id=f"r{i}")
        out = drain(infer)
        assert idle(infer)
        return {k: (o.output_token_ids, o.output_logprobs) for k, o in out.items() if int(k[1:]) < 4}, infer.stats()

    plain, _ = run(None)
    sampled = [(looping_prompt(9), SamplingParams(max_new_tokens=20, do_sample=True, temperature=0.7, seed=1))]
    for extra in ((), sampled):
        spec, stats = run(SPEC, extra)
        assert spec == plain
        assert stats["spec_accepted_tokens"] > 0
    alone = {}
    for i in (1, 2, 3):   # each alone, so their own drafts are verified (penalties reject more of them)
        infer = engine(tiny, SPEC)
        infer.add_request(prompts[i], params[i], request_id=f"r{i}")
        o = drain(infer)[f"r{i}"]
        alone[f"r{i}"] = (o.output_token_ids, o.output_logprobs)
        assert infer.stats()["spec_accepted_tokens" if i < 3 else "spec_draft_tokens"] > 0, i
    assert alone == {k: v for k, v in plain.items() if k != "r0"}


class _Req:
    """What verify_draft reads of a request."""

    def __init__(self, params, seed):
        from atb.engine.sampling import generator

        self.params, self.gen = params, generator(seed)
        self.out, self.eos, self.constraint, self.bias, self.seen = [], frozenset(), None, None, None


@pytest.mark.parametrize("draft", [0, 3, 5, None], ids=["likely", "unlikely", "removed_by_top_k", "no_draft"])
def test_verify_draft_emits_the_target_distribution(draft):
    """Whatever the draft, the token emitted is distributed as the shaped p (accept with p(draft), else draw
    from p without it): 20000 seeded draws against p, and a draft p gives 0 is never accepted."""
    from atb.engine.sampling import verify_draft, warp

    logits = torch.tensor([2.0, 1.5, 1.0, -0.5, 0.3, -3.0])
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=5, max_new_tokens=1)
    p = warp(logits.unsqueeze(0), params).softmax(-1)[0]
    req = _Req(params, seed=17)
    counts = torch.zeros(6)
    accepted = 0
    n = 20000
    for _ in range(n):
        t, ok = verify_draft(logits.clone(), req, draft)
        counts[t] += 1
        accepted += ok
        assert not ok or t == draft
    assert (counts / n - p).abs().max() < 0.012, (counts / n, p)
    assert counts[5] == 0
    if draft is None or p[draft] == 0:
        assert accepted == 0
    else:
        assert abs(accepted / n - float(p[draft])) < 0.012


def cycle_model(scale: float):
    """A model whose next token is mostly the current one's successor in cycles of 4 (t -> 4 (t // 4) +
    (t + 1) % 4): the attention and MLP outputs are zeroed, so the last hidden state is the token's embedding,
    and the LM head row of each successor is that embedding scaled by ``scale`` (sharper as it grows). Its
    sampled text repeats, so drafts are verified, and some rejected, at temperature 1."""
    m = random_model(CFG, dtype=torch.float32, model_type="llama", seed=5)
    succ = torch.tensor([4 * (t // 4) + (t + 1) % 4 for t in range(CFG["vocab_size"])])
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = m.model.embed_tokens.weight
        head = torch.empty_like(m.lm_head.weight)
        head[succ] = e / e.norm(dim=1, keepdim=True) * scale
        m.lm_head.weight.copy_(head)
    return m


def test_sampled_requests_speculate_reproducibly_with_the_plain_distribution():
    """Sampling with speculation: seeded runs repeat, drafts are accepted and rejected, and the tokens follow
    the distribution of plain sampling (each of 12 positions over 400 seeded runs: total variation)."""
    model = cycle_model(0.8)
    prompt, n, runs = [3, 7, 11], 12, 400
    spec = engine(model, SPEC, max_batch_size=1)
    a = [spec.generate([prompt], n, do_sample=True, seed=s, eos_token_id=[])[0] for s in range(runs)]
    st = spec.stats()
    assert 0.2 * st["spec_draft_tokens"] < st["spec_accepted_tokens"] < 0.9 * st["spec_draft_tokens"], st
    assert a[:20] == [spec.generate([prompt], n, do_sample=True, seed=s, eos_token_id=[])[0] for s in range(20)]
    plain = engine(model, max_batch_size=1)
    b = [plain.generate([prompt], n, do_sample=True, seed=10_000 + s, eos_token_id=[])[0] for s in range(runs)]
    for pos in range(n):
        fa = torch.bincount(torch.tensor([x[pos] for x in a]), minlength=128).double() / runs
        fb = torch.bincount(torch.tensor([x[pos] for x in b]), minlength=128).double() / runs
        # Tokens under 2% in both runs pooled into one bin (400 draws cannot resolve them one by one).
        common = (fa + fb) / 2 >= 0.02
        fa = torch.cat([fa[common], fa[~common].sum(0, keepdim=True)])
        fb = torch.cat([fb[common], fb[~common].sum(0, keepdim=True)])
        assert 0.5 * float((fa - fb).abs().sum()) < 0.08, pos

    def follows(outs):   # how often a token is its predecessor's successor (p ~ 0.7 under this model)
        pairs = [(x, y) for o in outs for x, y in zip([prompt[-1]] + o, o)]
        return sum(y == 4 * (x // 4) + (x + 1) % 4 for x, y in pairs) / len(pairs)
    assert abs(follows(a) - follows(b)) < 0.03
    # A sharper head: text more predictable, more drafts accepted, same rule.
    sharp = engine(cycle_model(1.5), SPEC, max_batch_size=1)
    sharp.generate([prompt], 40, do_sample=True, seed=0)
    assert sharp.stats()["spec_accepted_tokens"] > 0.9 * sharp.stats()["spec_draft_tokens"]


def test_abort_mid_generation_returns_the_blocks(tiny):
    spec = engine(tiny, SPEC)
    rid = spec.add_request(looping_prompt(1), SamplingParams(max_new_tokens=100, ignore_eos=True))
    while spec.stats()["spec_decode_steps"] < 2:
        spec.step()
    assert spec.abort(rid)
    assert drain(spec)[rid].finish_reason == "abort"
    assert idle(spec)


def test_prefix_caching_sees_only_accepted_tokens(tiny):
    """Blocks keyed from decode hold accepted tokens only: a follow-up turn over the answer gets the tokens a
    cold engine gives."""
    prompt = looping_prompt(2, n=30)
    spec = engine(tiny, SPEC, enable_prefix_caching=True)
    answer = spec.generate([prompt], 50)[0]
    follow = prompt + answer + [5, 6, 7]
    assert spec.generate([follow], 30) == engine(tiny).generate([follow], 30)
    assert spec.stats()["prefix_cache_hits"] > 0


def test_smollm2_chat_copy_task_tokens_equal_plain_and_hf(smollm2_fp32):
    model, tok = smollm2_fp32
    code = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
            "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n")
    text = tok.apply_chat_template([{"role": "user", "content": "Add docstrings to this Python class:\n\n" + code}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    plain = atb.TransformerInfer(model, max_seq_len=512, max_batch_size=1).generate([ids], 64)[0]
    spec = atb.TransformerInfer(model, max_seq_len=512, max_batch_size=1, speculative_config={})
    assert spec.generate([ids], 64)[0] == plain
    s = spec.stats()
    assert s["spec_accepted_tokens"] >= 16, s
    with torch.no_grad():
        x = torch.tensor([ids])
        hf = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False,
                            pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    assert plain == hf


def test_smollm2_requests_of_one_shape_draft_from_each_other(smollm2_fp32):
    # JSON records of one schema for other people: prompt lookup finds little in a request's own tokens, the
    # finished records hold the keys and punctuation. The tokens stay plain decoding's.
    model, tok = smollm2_fp32
    people = [("Alice", 30, "Paris"), ("Bob", 25, "Berlin"), ("Carol", 41, "Madrid"), ("Dave", 35, "Rome")]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a JSON object with the keys name, age "
                                         f"and city for this person: {n} is {a} and lives in {c}."}],
                                       add_generation_prompt=True) for n, a, c in people]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    runs = {}
    for label, cfg in (("plain", None), ("own", {}), ("history", {"lookup_history": 8})):
        infer = atb.TransformerInfer(model, max_seq_len=256, max_batch_size=1, speculative_config=cfg)
        runs[label] = ([infer.generate([p], 48)[0] for p in prompts], infer.stats())
    assert runs["own"][0] == runs["plain"][0] and runs["history"][0] == runs["plain"][0]
    own, hist = runs["own"][1], runs["history"][1]
    assert hist["spec_accepted_tokens"] > own["spec_accepted_tokens"] + 10, (own, hist)


def test_smollm2_structured_output_verifies_each_row_under_its_grammar(smollm2_fp32):
    """A JSON-schema request verifies its drafts row by row, each row masked by the grammar state after the
    tokens before it: greedy and seeded-sampled outputs parse and follow the schema, greedy's tokens are those
    of plain decoding, and the repeated keys of a list of objects are drafted and accepted."""
    pytest.importorskip("llguidance")
    import json

    model, tok = smollm2_fp32
    schema = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
        "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                       "population": {"type": "integer"}}}}
    text = tok.apply_chat_template([{"role": "user", "content": "List four big cities as JSON."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(max_new_tokens=160, json_schema=schema)
    sampled = SamplingParams(max_new_tokens=160, json_schema=schema, do_sample=True, temperature=0.7, seed=4)

    def run(speculative):
        infer = atb.TransformerInfer(model, max_seq_len=512, max_batch_size=2, tokenizer=tok,
                                     speculative_config=speculative)
        for i, sp in enumerate((greedy, sampled)):
            infer.add_request(ids, sp, request_id=f"r{i}")
        return drain(infer), infer.stats()

    plain, _ = run(None)
    spec, stats = run({})
    assert spec["r0"].output_token_ids == plain["r0"].output_token_ids
    for o in spec.values():
        assert o.finish_reason == "grammar"
        value = json.loads(tok.decode(o.output_token_ids))
        assert len(value) == 4 and all(set(v) == {"city", "country", "population"} for v in value)
    assert stats["spec_accepted_tokens"] >= 8, stats
