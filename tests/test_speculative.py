"""Speculative decoding by prompt lookup: the drafter, the config, and the engine's tokens against plain decoding."""
import random

import pytest
import torch

import atb
from atb.checkpoints import random_model
from atb.engine import SamplingParams, SpeculativeConfig
from atb.engine.speculative import NgramDrafter

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


# ---- the config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an int >= 1"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min .3. is larger than prompt_lookup_max"),
    ({"max_step_rows": 1}, "max_step_rows must be >= 2"),
    ({"method": "eagle"}, "method must be 'ngram'"),
    ({"num_speculative": 3}, "unknown key 'num_speculative'"),
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


def test_other_requests_decode_as_without_it(tiny):
    """Sampled, logprob and penalized requests are not speculated; in their batches nobody is."""
    prompts = [looping_prompt(s) for s in range(4)]
    params = [SamplingParams(max_new_tokens=70, ignore_eos=True),
              SamplingParams(max_new_tokens=24, do_sample=True, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_new_tokens=30, logprobs=2, ignore_eos=True),
              SamplingParams(max_new_tokens=12, repetition_penalty=1.3, ignore_eos=True)]

    def run(speculative):
        infer = engine(tiny, speculative)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            infer.add_request(p, sp, request_id=f"r{i}")
        out = drain(infer)
        assert idle(infer)
        return {k: (o.output_token_ids, o.output_logprobs) for k, o in out.items()}, infer.stats()

    plain, _ = run(None)
    spec, stats = run(SPEC)
    assert spec == plain
    # The greedy request speculates once the others have finished.
    assert stats["spec_accepted_tokens"] > 0


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
