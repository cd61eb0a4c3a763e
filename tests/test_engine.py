"""The request-level engine under TransformerInfer: add_request / step / abort / stats, threads, re-entrancy."""
import threading

import pytest
import torch

import atb
from atb.checkpoints import random_model
from atb.engine import RequestOutput, SamplingParams

CFG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, dtype=torch.float32, model_type="llama", seed=7)


def engine(model, **kw):
    kw = dict(dict(max_seq_len=64, max_batch_size=4, block_size=4), **kw)
    return atb.TransformerInfer(model, **kw)


def drain(infer) -> dict:
    """Steps until nothing is unfinished; the last output of every request."""
    last = {}
    while infer.has_unfinished():
        for o in infer.step():
            last[o.request_id] = o
    for o in infer.step():  # reports of requests finished outside a step (abort)
        last[o.request_id] = o
    return last


def solo(model, prompt, params, **kw) -> list[int]:
    infer = engine(model, max_batch_size=1, **kw)
    infer.add_request(prompt, params, request_id="x")
    return drain(infer)["x"].output_token_ids


def idle(infer) -> bool:
    s = infer.stats()
    return (s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0) and s["kv_blocks_free"] == s[
        "kv_blocks_total"]


PROMPTS = [[1, 5, 9], [3, 4, 4, 8, 2, 7], [17], [2, 90, 33, 6, 6], [11, 12, 13, 14, 15, 16, 17, 18], [40, 41]]


def params_of(i: int) -> SamplingParams:
    if i % 3 == 0:
        return SamplingParams(max_new_tokens=6 + i, ignore_eos=True)
    if i % 3 == 1:
        return SamplingParams(max_new_tokens=9, do_sample=True, temperature=1.3, top_p=0.9, seed=100 + i,
                              ignore_eos=True)
    return SamplingParams(max_new_tokens=7, repetition_penalty=1.5, ignore_eos=True)


def test_step_api_outputs_and_finish_reasons(model):
    infer = engine(model)
    assert not infer.has_unfinished() and idle(infer)
    rid = infer.add_request([1, 5, 9], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert infer.has_unfinished() and infer.stats()["waiting"] == 1
    seen = []
    while infer.has_unfinished():
        for o in infer.step():
            assert isinstance(o, RequestOutput) and o.request_id == rid and o.prompt_len == 3
            seen += o.new_token_ids
            assert o.output_token_ids == seen
            last = o
    assert last.finished and last.finish_reason == "length" and len(seen) == 3
    assert seen == infer.generate([[1, 5, 9]], 3, eos_token_id=[])[0]
    # eos, max_seq_len, max_new_tokens=0 and a prompt that fills max_seq_len
    eos = seen[1]
    a = infer.add_request([1, 5, 9], SamplingParams(max_new_tokens=10, eos_token_id=eos))
    b = infer.add_request(list(range(60)), SamplingParams(max_new_tokens=10, ignore_eos=True))
    c = infer.add_request([1, 2], SamplingParams(max_new_tokens=0))
    d = infer.add_request(list(range(64)), SamplingParams(max_new_tokens=5))
    out = drain(infer)
    assert out[a].finish_reason == "eos" and out[a].output_token_ids == seen[:2]
    assert out[b].finish_reason == "max_seq_len" and len(out[b].output_token_ids) == 4
    assert (out[c].finish_reason, out[c].output_token_ids) == ("length", [])
    assert (out[d].finish_reason, out[d].output_token_ids) == ("max_seq_len", [])
    assert idle(infer)


def test_add_request_validates_before_allocating(model):
    infer = engine(model)
    infer.add_request([1, 2], request_id="dup")
    with pytest.raises(ValueError, match="'dup' is already in use"):
        infer.add_request([1, 2], request_id="dup")
    for bad, err, msg in [([], ValueError, "prompt_ids is empty"), ([1, 128], ValueError, "token id 128"),
                          ([1] * 65, ValueError, "max_seq_len=64"), ([1, "a"], TypeError, "list of int")]:
        with pytest.raises(err, match=msg):
            infer.add_request(bad)
    with pytest.raises(TypeError, match="sampling_params must be"):
        infer.add_request([1], {"max_new_tokens": 3})
    assert infer.stats()["waiting"] == 1 and infer.stats()["kv_blocks_used"] == 0
    assert infer.abort("dup") and idle(infer)
    for kw, msg in [(dict(max_new_tokens=-1), "max_new_tokens"), (dict(temperature=0.0), "temperature"),
                    (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"), (dict(repetition_penalty=0), "repetition"),
                    (dict(eos_token_id="x"), "eos_token_id"), (dict(seed=1.5), "seed"), (dict(do_sample=1), "do_sample")]:
        with pytest.raises((ValueError, TypeError), match=f"SamplingParams: {msg}"):
            SamplingParams(**kw)


def test_abort_returns_blocks_at_once(model):
    infer = engine(model)
    rid = infer.add_request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=20, ignore_eos=True))
    keep = infer.add_request([7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
    infer.step()
    used = infer.stats()["kv_blocks_used"]
    assert infer.stats()["running"] == 2 and used > 0
    assert infer.abort(rid)
    assert infer.stats()["running"] == 1 and infer.stats()["kv_blocks_used"] < used
    assert not infer.abort(rid) and not infer.abort("nope")
    out = drain(infer)
    assert out[rid].finished and out[rid].finish_reason == "abort" and len(out[rid].output_token_ids) == 2
    assert out[keep].output_token_ids == solo(model, [7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
    # Aborting a waiting request
    w = infer.add_request([1, 2])
    assert infer.abort(w) and idle(infer)


def test_prefill_budget_lets_running_decodes_continue(model):
    infer = engine(model, max_prefill_tokens=8)
    first = infer.add_request([1] * 6, SamplingParams(max_new_tokens=8, ignore_eos=True))
    infer.step()
    for _ in range(3):
        infer.add_request([2] * 6, SamplingParams(max_new_tokens=4, ignore_eos=True))
    outs = {o.request_id for o in infer.step()}
    # 8 prompt tokens per step: one whole 6-token prompt and 2 tokens of the next; the running request
    # decoded anyway, and the split prompt holds a batch slot without a token yet.
    s = infer.stats()
    assert first in outs and "req-2" not in outs and (s["waiting"], s["prefilling"], s["running"]) == (1, 1, 3)
    drain(infer)
    assert idle(infer)


@pytest.mark.parametrize("graph_mode", [True, False])
def test_chunked_prefill_gives_the_unchunked_tokens_and_decodes_every_step(model, graph_mode):
    """A prompt longer than the budget is prefilled over several steps, each chunk attending to the K/V of the
    ones before it (across block boundaries: block_size 4), while a running request decodes every step."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    long = [(7 * i + 3) % 120 + 1 for i in range(23)]
    infer = engine(model, max_prefill_tokens=5, graph_mode=graph_mode)
    run = infer.add_request([1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True))
    infer.step()
    big = infer.add_request(long, params)
    steps = 0
    while big in infer.scheduler.requests and not infer.scheduler.requests[big].out:
        outs = {o.request_id: o for o in infer.step()}
        assert run in outs, "the running request decodes while the long prompt is prefilled"
        steps += 1
    assert steps == 5  # ceil(23 / 5) chunks; the last one also gives the first token
    out = drain(infer)
    assert out[big].output_token_ids == solo(model, long, params, graph_mode=graph_mode)
    assert idle(infer)


def test_abort_while_prefilling_frees_the_blocks(model):
    infer = engine(model, max_prefill_tokens=4)
    rid = infer.add_request(list(range(1, 15)), SamplingParams(max_new_tokens=3))
    infer.step()
    assert infer.stats()["prefilling"] == 1 and infer.stats()["kv_blocks_used"] > 0
    assert infer.abort(rid)
    out = drain(infer)
    assert out[rid].finish_reason == "abort" and out[rid].output_token_ids == []
    assert idle(infer)


def test_requests_do_not_depend_on_batch_mates(model):
    infer = engine(model, max_batch_size=6)
    ids = [infer.add_request(p, params_of(i)) for i, p in enumerate(PROMPTS)]
    out = drain(infer)
    for i, (rid, p) in enumerate(zip(ids, PROMPTS)):
        assert out[rid].output_token_ids == solo(model, p, params_of(i)), i


@pytest.mark.parametrize("graph_mode", [True, False])
def test_three_threads_add_abort_step_get_single_threaded_tokens(model, graph_mode):
    expected = {i: solo(model, p, params_of(i), graph_mode=graph_mode) for i, p in enumerate(PROMPTS)}
    infer = engine(model, max_batch_size=3, graph_mode=graph_mode)
    results: dict = {}
    errors: list = []
    mu = threading.Lock()

    def record(outs):
        with mu:
            for o in outs:
                results[o.request_id] = o

    def worker(t):
        try:
            mine = []
            for rep in range(2):
                for i in range(t, len(PROMPTS), 3):
                    mine.append(infer.add_request(PROMPTS[i], params_of(i), request_id=f"{t}-{rep}-{i}"))
                    record(infer.step())
                victim = infer.add_request([5, 6, 7], SamplingParams(max_new_tokens=30, ignore_eos=True),
                                           request_id=f"{t}-{rep}-victim")
                record(infer.step())
                infer.abort(victim)
            while any(not (r in results and results[r].finished) for r in mine):
                record(infer.step())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    assert not any(th.is_alive() for th in threads) and not errors, errors
    record(infer.step())
    for rid, o in results.items():
        t, rep, i = rid.split("-")
        if i == "victim":
            assert o.finish_reason == "abort"
        else:
            assert o.finished and o.output_token_ids == expected[int(i)], rid
    assert len([r for r in results if not r.endswith("victim")]) == 2 * len(PROMPTS)
    assert idle(infer)


def test_concurrent_generate_calls_match_sequential(model):
    infer = engine(model, max_batch_size=4)
    jobs = [([[1, 5, 9], [3, 4]], {}), ([[17, 2, 2, 90]], dict(do_sample=True, seed=3, top_k=20)),
            ([[8, 8, 8], [9], [10, 11]], dict(repetition_penalty=1.4)), ([[4, 4]], {})]
    expected = [infer.generate(p, 10, eos_token_id=[], **kw) for p, kw in jobs]
    got = [None] * len(jobs)
    reasons = [None] * len(jobs)

    def run(j):
        p, kw = jobs[j]
        for _ in range(3):
            got[j] = infer.generate(p, 10, eos_token_id=[], **kw)
            reasons[j] = infer.last_stop_reasons
            assert got[j] == expected[j]

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    assert not any(th.is_alive() for th in threads)
    assert got == expected
    assert all(r == ["length"] * len(jobs[j][0]) for j, r in enumerate(reasons))
    assert idle(infer)


def test_generate_leaves_other_sequences_alone(model):
    infer = engine(model)
    infer.cache.allocate("mine", 16)
    other = infer.add_request([3, 1, 4], SamplingParams(max_new_tokens=12, ignore_eos=True))
    out = infer.generate([[1, 2, 3]], 2)
    assert len(out[0]) <= 2 and "mine" in infer.cache
    assert infer.has_unfinished()  # generate stepped the other request, never finished or freed it
    last = drain(infer)
    assert last[other].output_token_ids == solo(model, [3, 1, 4], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert "mine" in infer.cache
    infer.cache.free("mine")
    assert idle(infer)


def test_reentrant_calls_from_a_stream_callback_raise(model):
    infer = engine(model)
    expected = infer.generate([[1, 2, 3]], 4)

    for call in (lambda: infer.generate([[4, 5]], 2), infer.step, lambda: infer.forward(torch.tensor([[1, 2]]))):
        def cb(i, t, call=call):
            call()

        with pytest.raises(RuntimeError, match="inside a generate\\(\\) stream callback"):
            infer.generate([[1, 2, 3]], 4, stream=cb)
        assert idle(infer)
    # abort and stats are fine from a callback (the engine lock is not held while it runs)
    infer.add_request([9, 9], request_id="bg")
    assert infer.generate([[1, 2, 3]], 4, stream=lambda i, t: (infer.stats(), infer.abort("bg"))) == expected
    assert not infer.has_unfinished()
    infer.step()
    assert idle(infer) and infer.generate([[1, 2, 3]], 4) == expected


def test_forward_rejects_a_meta_attention_mask():
    # A meta-device mask used to fail inside .item() instead of with a clear error naming the argument.
    model = random_model("tiny")
    infer = atb.TransformerInfer(model, max_seq_len=32, max_batch_size=2)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="forward: attention_mask must be a CPU tensor"):
        infer.forward(ids, torch.ones(1, 3, dtype=torch.long, device="meta"))


def test_generate_multi_step_decode_gives_the_single_step_tokens(model, monkeypatch):
    """generate's native multi-step decode (TransformerInfer.generate_decode_steps) against one step at a
    time: the same tokens and stop reasons when a sequence stops at EOS mid-call, at max_new_tokens that is not
    a multiple of the step count, and at max_seq_len; every block is free afterwards."""
    prompts = [[1, 5, 9], [3, 4, 4, 8, 2, 7], [17], [7] * 58]
    one = engine(model, graph_mode=True)
    one.generate_decode_steps = 1
    free_run = one.generate(prompts, 13, eos_token_id=[])
    eos = free_run[1][5]  # sequence 1 stops at its 6th token (or earlier if the token came before)
    expected = one.generate(prompts, 13, eos_token_id=eos)
    expected_reasons = one.last_stop_reasons
    assert "eos" in expected_reasons and "max_seq_len" in expected_reasons and "length" in expected_reasons

    multi = engine(model, graph_mode=True)
    calls = []
    decode_greedy = multi.runner.decode_greedy
    monkeypatch.setattr(multi.runner, "decode_greedy", lambda steps, *a: calls.append(steps) or decode_greedy(steps, *a))
    assert multi.generate(prompts, 13, eos_token_id=eos) == expected
    assert multi.last_stop_reasons == expected_reasons
    assert calls and all(1 < s <= multi.generate_decode_steps for s in calls)
    assert idle(one) and idle(multi)


@pytest.mark.parametrize("graph_mode", [True, False])
def test_logprobs_are_the_models_and_change_no_token(model, graph_mode):
    """SamplingParams(logprobs=k): each generated token's log-probability and the k most likely tokens, from
    the model's own logits (HF forward, float64 log-softmax), one per output token in step order; asking for
    them changes no token, greedy or sampled, alone or batched."""
    plain = [params_of(i) for i in range(3)]
    asked = [SamplingParams(**{**p.__dict__, "logprobs": k}) for p, k in zip(plain, (0, 3, 5))]
    infer = engine(model, max_batch_size=3, graph_mode=graph_mode)
    ids = [infer.add_request(PROMPTS[i], asked[i]) for i in range(3)]
    steps = {}
    while infer.has_unfinished():
        for o in infer.step():
            assert len(o.new_logprobs) == len(o.new_token_ids)
            steps.setdefault(o.request_id, []).extend(o.new_logprobs)
    for i, rid in enumerate(ids):
        toks = solo(model, PROMPTS[i], plain[i], graph_mode=graph_mode)
        lps = steps[rid]
        assert [lp.token_id for lp in lps] == toks
        with torch.no_grad():
            logits = model(torch.tensor([PROMPTS[i] + toks])).logits[0, len(PROMPTS[i]) - 1:-1]
        ref = logits.double().log_softmax(-1)
        for j, (lp, t) in enumerate(zip(lps, toks)):
            assert lp.logprob == pytest.approx(ref[j, t].item(), abs=1e-4)
            top = ref[j].topk(asked[i].logprobs)
            assert [a for a, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert all(o.new_logprobs is None for o in drain_one(engine(model), PROMPTS[0], plain[0]))


def check_prompt_logprobs(model, prompt, lps, k):
    """``lps`` are ``prompt``'s log-probabilities under the model (HF forward, float64 log-softmax)."""
    assert len(lps) == len(prompt) and lps[0] is None
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, :-1].double().log_softmax(-1)
    for j, lp in enumerate(lps[1:]):
        assert lp.token_id == prompt[j + 1]
        assert lp.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=1e-4)
        top = ref[j].topk(k)
        assert [a for a, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


LONG = [(7 * i + 3) % 128 for i in range(37)]


@pytest.mark.parametrize("kw", [{}, dict(max_prefill_tokens=8), dict(enable_prefix_caching=True)],
                         ids=["whole", "chunked", "prefix-cached"])
def test_prompt_logprobs_score_the_prompt_and_change_no_token(model, kw):
    """SamplingParams(prompt_logprobs=k): each prompt token's log-probability given the tokens before it, with
    the k most likely, reported once the prompt is prefilled: whole, split into chunks, or after the same
    prompt was cached (its tokens are recomputed, not read from the cache). The generated tokens are those of
    the same request without it, batched with others."""
    infer = engine(model, **kw)
    if kw.get("enable_prefix_caching"):
        infer.add_request(LONG, SamplingParams(max_new_tokens=2))
        drain(infer)
        assert infer.stats()["kv_blocks_cached"] > 0
    plain = SamplingParams(max_new_tokens=5, ignore_eos=True)
    ids = [infer.add_request(LONG, SamplingParams(max_new_tokens=5, ignore_eos=True, prompt_logprobs=3)),
           infer.add_request(PROMPTS[1], params_of(1)),
           infer.add_request(PROMPTS[3], SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=0))]
    firsts = {}
    while infer.has_unfinished():
        for o in infer.step():
            if o.new_token_ids and o.request_id not in firsts:
                firsts[o.request_id] = o
            if o.request_id == ids[1]:
                assert o.prompt_logprobs is None   # not asked for
            elif o.request_id not in firsts:
                assert o.prompt_logprobs is None   # the prompt is not done yet
    check_prompt_logprobs(model, LONG, firsts[ids[0]].prompt_logprobs, 3)
    check_prompt_logprobs(model, PROMPTS[3], firsts[ids[2]].prompt_logprobs, 0)
    s = infer.stats()
    assert (s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0)
    if kw.get("enable_prefix_caching"):
        assert s["prefix_cache_hits"] == 0   # the scoring requests did not read the cached prompt
    infer = engine(model, **kw)
    rid = infer.add_request(LONG, SamplingParams(max_new_tokens=5, ignore_eos=True, prompt_logprobs=1))
    assert drain(infer)[rid].output_token_ids == solo(model, LONG, plain)


def test_prompt_logprobs_with_no_token_to_generate(model):
    """max_new_tokens=0 (and a prompt that fills max_seq_len) with prompt_logprobs: the prompt is prefilled
    and scored, the request finishes with no token; without prompt_logprobs it finishes at once."""
    infer = engine(model)
    a = infer.add_request(LONG, SamplingParams(max_new_tokens=0, prompt_logprobs=2))
    full = [(5 * i + 1) % 128 for i in range(64)]
    b = infer.add_request(full, SamplingParams(max_new_tokens=4, prompt_logprobs=0))
    c = infer.add_request(LONG, SamplingParams(max_new_tokens=0))
    out = drain(infer)
    assert (out[a].finish_reason, out[a].output_token_ids) == ("length", [])
    assert (out[b].finish_reason, out[b].output_token_ids) == ("max_seq_len", [])
    assert (out[c].finish_reason, out[c].prompt_logprobs) == ("length", None)
    check_prompt_logprobs(model, LONG, out[a].prompt_logprobs, 2)
    check_prompt_logprobs(model, full, out[b].prompt_logprobs, 0)
    assert idle(infer)


def drain_one(infer, prompt, params) -> list[RequestOutput]:
    infer.add_request(prompt, params)
    outs = []
    while infer.has_unfinished():
        outs.extend(infer.step())
    return outs


def test_logprobs_validation():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, 21, 2.0, True, "3"):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: bad})
    assert not SamplingParams(logprobs=0).greedy_only


@pytest.mark.parametrize("presence,frequency", [(0.0, 1.5), (1.0, 0.0), (-0.5, 0.7)])
def test_presence_and_frequency_penalties_follow_their_definition(model, presence, frequency):
    """Greedy with OpenAI's penalties: each step's argmax of logits - presence * [n > 0] - frequency * n over
    the tokens generated so far (the prompt's not counted), against a loop over the model's own logits; a
    request beside others gets the same tokens."""
    prompt, n = PROMPTS[1], 12
    params = SamplingParams(max_new_tokens=n, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.numel()).double()
            out.append(int((logits - presence * (counts > 0) - frequency * counts).argmax()))
    assert solo(model, prompt, params) == out
    assert out != solo(model, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))  # the penalty mattered
    infer = engine(model, max_batch_size=3)
    rid = infer.add_request(prompt, params)
    for i in (0, 2):
        infer.add_request(PROMPTS[i], params_of(i))
    assert drain(infer)[rid].output_token_ids == out


def test_min_tokens_hold_off_eos(model):
    """min_tokens (vLLM's): the EOS tokens are not picked before that many tokens; past it they stop the
    request as usual. Against a greedy loop over the model's own logits with EOS masked for those steps."""
    prompt = PROMPTS[3]
    free = solo(model, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    # A token that greedy first produces at step j < 6, as EOS: a plain request stops there.
    j = next(i for i in range(1, 6) if free[i] not in free[:i])
    eos = free[j]
    assert solo(model, prompt, SamplingParams(max_new_tokens=12, eos_token_id=eos)) == free[:j + 1]
    out = []
    with torch.no_grad():
        while len(out) < 12:
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            if len(out) < 6:
                logits[eos] = float("-inf")
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
    params = SamplingParams(max_new_tokens=12, eos_token_id=eos, min_tokens=6)
    got = solo(model, prompt, params)
    assert got == out and len(got) >= 6 and eos not in got[:6]
    infer = engine(model, max_batch_size=3)
    rid = infer.add_request(prompt, params)
    infer.add_request(PROMPTS[0], params_of(0))
    assert drain(infer)[rid].output_token_ids == out
    for bad in (-1, 13, True, 2.0):
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(max_new_tokens=12, min_tokens=bad)


def test_min_p_validation():
    for bad in (-0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)


def test_penalty_validation():
    for name in ("presence_penalty", "frequency_penalty"):
        for bad in (2.5, -3, float("nan"), True, "1"):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: bad})
    assert not SamplingParams(frequency_penalty=0.1).greedy_only


def test_logit_bias_is_added_before_selection(model):
    """logit_bias: greedy picks argmax(logits + bias) at every step (a loop over the model's own logits); a
    large bias forces its token; ids past the vocabulary are refused by add_request before anything runs."""
    prompt, n = PROMPTS[3], 8
    plain = solo(model, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    bias = {plain[0]: -100.0, 7: 3.5, 50: -2.0}
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
            for t, b in bias.items():
                logits[t] += b
            out.append(int(logits.argmax()))
    got = solo(model, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True, logit_bias=bias))
    assert got == out and got[0] != plain[0]
    forced = solo(model, prompt, SamplingParams(max_new_tokens=3, ignore_eos=True, logit_bias={42: 100}))
    assert forced == [42, 42, 42]
    infer = engine(model)
    with pytest.raises(ValueError, match="logit_bias names token id 128"):
        infer.add_request(prompt, SamplingParams(logit_bias={128: 1.0}))
    assert idle(infer)
    for bad in ({-1: 1.0}, {3: 101.0}, {3: float("nan")}, {"3": 1.0}, {True: 1.0}, [(3,)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
