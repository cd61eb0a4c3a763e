"""`atb serve` end to end: the real server on 127.0.0.1, the official `openai` client, the real SmolLM2.

Greedy outputs are compared with `TransformerInfer.generate` run alone on a second engine over the same
weights; KV accounting is read back from /metrics.
"""
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import atb  # noqa: E402
from atb.serve.app import create_app, make_server  # noqa: E402
from atb.serve.metrics import parse as parse_metrics  # noqa: E402
from conftest import wait_health  # noqa: E402

MODEL = "smollm2-test"
MAX_SEQ_LEN = 256
MAX_BATCH = 16


def _free_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class Served:
    def __init__(self, model, tok, api_key=None, speculative=None):
        self.tok = tok
        # A small prefill budget, so concurrent prompts are chunked over steps (as the CLI's 512 does with long
        # prompts) and every test below checks chunked prefill through HTTP too.
        self.infer = atb.TransformerInfer(model, max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH,
                                          max_prefill_tokens=24, speculative_config=speculative)
        self.app = create_app(self.infer, tok, model_name=MODEL, max_waiting=64, api_key=api_key)
        self.state = self.app.state.atb
        sock = _free_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = make_server(self.app, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "unused", max_retries=0,
                                    timeout=120)
        self.aclient = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key or "unused", max_retries=0,
                                          timeout=120)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def metrics(self) -> dict:
        r = self.http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return parse_metrics(r.text)

    def wait_idle(self, timeout=30.0) -> dict:
        """/metrics once nothing runs or waits and every KV block is free."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if (m["atb_requests_running"], m["atb_requests_prefilling"], m["atb_requests_waiting"],
                    m["atb_kv_blocks_used"]) == (0, 0, 0, 0):
                assert m["atb_kv_blocks_free"] == m["atb_kv_blocks_total"]
                return m
            assert time.time() < deadline, f"server not idle: {m}"
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def model_tok(smollm2_fp32):
    return smollm2_fp32  # loaded once per test session (conftest)


@pytest.fixture(scope="module")
def served(model_tok):
    s = Served(*model_tok)
    yield s
    s.close()


@pytest.fixture(scope="module")
def solo(model_tok):
    """Greedy tokens of one prompt generated alone (batch of one, separate engine, same weights)."""
    ref = atb.TransformerInfer(model_tok[0], max_seq_len=MAX_SEQ_LEN, max_batch_size=1)
    cache = {}

    def run(ids, n):
        key = (tuple(ids), n)
        if key not in cache:
            cache[key] = ref.generate([ids], max_new_tokens=n)[0]
        return cache[key]
    return run


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _chat_ids(tok, content):
    enc = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


# ---------------------------------------------------------------- text pieces
def test_incremental_detokenizer_matches_full_decode(model_tok):
    from atb.serve.detokenize import IncrementalDetokenizer

    tok = model_tok[1]
    prompt = tok("Say it:")["input_ids"]
    # Multi-byte characters split across byte-level tokens, and a special token (skipped).
    out = tok("naïve café — 北京 🙂 done")["input_ids"] + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push([t]) for t in out] + [detok.flush()]
    assert "".join(pieces) == tok.decode(out, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)  # never a half character


def test_stop_strings_hold_back_possible_prefixes():
    from atb.serve.detokenize import StopStrings

    s = StopStrings(["END", "x\n"])
    assert [s.feed(p) for p in ("abcE", "N", "d, xy", "zx")] == ["abc", "", "ENd, xy", "z"]
    assert s.feed("\nafter") == "" and s.stopped and s.text == "abcENd, xyz"
    s = StopStrings(["lo w"])
    assert s.feed("hel") == "he" and s.feed("lo world") == "l" and s.stopped
    s = StopStrings(None)
    assert s.feed("anything") == "anything" and not s.stopped
    # min_tokens: no stop string may end in a held-off piece; one that begins there and ends later stops.
    s = StopStrings(["ab"])
    assert s.feed("xab", may_stop=False) == "xab" and not s.stopped
    assert s.feed("yab") == "y" and s.stopped and s.text == "xaby"
    s = StopStrings(["ab"])
    assert s.feed("xa", may_stop=False) == "x" and s.feed("bz") == "" and s.stopped and s.text == "x"


# ---------------------------------------------------------------- happy paths
def test_models_health_metrics(served):
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    assert served.http.get("/health").json() == {"status": "ok"}
    m = served.wait_idle()
    for name in ("atb_time_to_first_token_seconds_count", "atb_time_per_output_token_seconds_count",
                 "atb_prompt_tokens_total", "atb_generation_tokens_total"):
        assert name in m


def test_completion_greedy_matches_generate(served, solo):
    prompt = "The capital of France is"
    ids = served.tok(prompt)["input_ids"]
    want = solo(ids, 12)
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == _text(served.tok, want)
    assert r.choices[0].finish_reason == ("stop" if want[-1] == served.tok.eos_token_id else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    # Token ids as the prompt give the same answer.
    r2 = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == r.choices[0].text


def test_completion_stream_matches_generate(served, solo):
    prompt = "Once upon a time, in a small village,"
    ids = served.tok(prompt)["input_ids"]
    want = solo(ids, 16)
    chunks = list(served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == len(want) and chunks[-1].usage.prompt_tokens == len(ids)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _text(served.tok, want)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_chat_matches_generate(served, solo):
    question = "What is the capital of France?"
    ids = _chat_ids(served.tok, question)
    want = solo(ids, 24)
    msgs = [{"role": "user", "content": question}]
    r = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _text(served.tok, want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                                        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def _model_logprobs(model, ids: list[int], out: list[int]) -> torch.Tensor:
    """HF's log-softmax at each generated position: [len(out), vocab], float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
    return logits.double().log_softmax(-1)


def test_completion_logprobs_are_the_models(served, solo, model_tok):
    """logprobs=k: each generated token's log-probability under the model and the k most likely tokens, as
    HF computes them, in OpenAI's legacy format; streamed chunks carry the same entries, text offsets
    counting through the completion."""
    prompt = "The capital of France is"
    ids = served.tok(prompt)["input_ids"]
    want = solo(ids, 8)
    ref = _model_logprobs(model_tok[0], ids, want)
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == _text(served.tok, want)
    assert lp.tokens == [served.tok.decode([t]) for t in want]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(want))]
    for i, t in enumerate(want):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-3)
        top = ref[i].topk(3)
        assert list(lp.top_logprobs[i]) == [served.tok.decode([j]) for j in top.indices.tolist()]
        assert list(lp.top_logprobs[i].values()) == pytest.approx(top.values.tolist(), abs=1e-3)
    chunks = list(served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                   logprobs=3, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((c.tokens for c in streamed), []) == lp.tokens
    assert sum((c.token_logprobs for c in streamed), []) == lp.token_logprobs
    assert sum((c.text_offset for c in streamed), []) == lp.text_offset
    # logprobs=0: the chosen tokens only.
    r0 = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    assert r0.choices[0].logprobs.top_logprobs == [{}, {}, {}]
    assert served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3).choices[0].logprobs is None


def test_chat_logprobs_are_the_models(served, solo, model_tok):
    question = "What is the capital of France?"
    ids = _chat_ids(served.tok, question)
    want = solo(ids, 6)
    ref = _model_logprobs(model_tok[0], ids, want)
    msgs = [{"role": "user", "content": question}]
    r = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [served.tok.decode([t]) for t in want]
    for i, (c, t) in enumerate(zip(content, want)):
        assert c.logprob == pytest.approx(ref[i, t].item(), abs=1e-3)
        assert bytes(c.bytes).decode() == c.token
        assert [a.token for a in c.top_logprobs] == [served.tok.decode([j]) for j in ref[i].topk(2).indices.tolist()]
    # Sampling does not change what is reported: the model's distribution, not the warped one.
    rs = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=1.5, extra_body={"top_k": 5},
                                               seed=3, logprobs=True)
    first = rs.choices[0].logprobs.content[0]
    top5 = ref[0].topk(5)  # top_k=5 draws among these
    assert any(served.tok.decode([j]) == first.token and v == pytest.approx(first.logprob, abs=1e-3)
               for j, v in zip(top5.indices.tolist(), top5.values.tolist()))
    assert first.top_logprobs == []
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                        logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    served.wait_idle()


def test_frequency_penalty_reaches_the_sampler(served, model_tok):
    """frequency_penalty / presence_penalty are applied (greedy: the same tokens as the engine's own request
    with those values), not just accepted."""
    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    ids = served.tok(prompt)["input_ids"]
    ref = atb.TransformerInfer(model_tok[0], max_seq_len=MAX_SEQ_LEN, max_batch_size=1)
    texts = []
    for kw in ({}, {"frequency_penalty": 2.0, "presence_penalty": 1.0}):
        rid = ref.add_request(ids, atb.engine.SamplingParams(max_new_tokens=12, ignore_eos=True, **kw))
        last = None
        while ref.has_unfinished():
            for o in ref.step():
                last = o
        r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True}, **kw)
        assert r.choices[0].text == _text(served.tok, last.output_token_ids), (kw, rid)
        texts.append(r.choices[0].text)
    assert texts[0] != texts[1]  # the penalties changed the answer
    served.wait_idle()


def test_logit_bias_forces_and_bans_tokens(served, solo):
    prompt = "The capital of France is"
    ids = served.tok(prompt)["input_ids"]
    first = solo(ids, 1)[0]
    forced = served.tok(" Berlin", add_special_tokens=False)["input_ids"][0]
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                         logit_bias={str(forced): 100})
    assert r.choices[0].text == served.tok.decode([forced, forced])
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                         logit_bias={str(first): -100}, logprobs=1)
    assert r.choices[0].text != served.tok.decode([first])
    # logprobs stay the model's: the banned token is still the most likely there.
    assert list(r.choices[0].logprobs.top_logprobs[0]) == [served.tok.decode([first])]
    served.wait_idle()


def test_n_choices_are_seeded_engine_requests(served, model_tok):
    """n > 1: n engine requests under one response; with a seed, choice i samples from request_seed(seed, i)
    (the choices differ, each reproducible); streamed chunks carry each choice's index; usage counts the
    prompt once."""
    from atb.engine.sampling import request_seed

    prompt = "Once upon a time"
    ids = served.tok(prompt)["input_ids"]
    ref = atb.TransformerInfer(model_tok[0], max_seq_len=MAX_SEQ_LEN, max_batch_size=1)

    def engine_text(seed):
        rid = ref.add_request(ids, atb.engine.SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.9,
                                                             seed=seed, ignore_eos=True))
        last = None
        while ref.has_unfinished():
            last = next((o for o in ref.step() if o.request_id == rid), last)
        return _text(served.tok, last.output_token_ids)

    want = [engine_text(request_seed(11, i)) for i in range(3)]
    assert len(set(want)) == 3
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.9, seed=11, n=3,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 30)
    chunks = list(served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.9,
                                                   seed=11, n=3, stream=True, extra_body={"ignore_eos": True},
                                                   stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert texts == want and finished == {0, 1, 2} and chunks[-1].usage.completion_tokens == 30
    # Chat, greedy: every choice is the one greedy answer.
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    one = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    two = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, n=2)
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    streamed = list(served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                          n=2, stream=True))
    by_index = ["", ""]
    for c in streamed:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
    assert by_index == [one.choices[0].message.content] * 2
    served.wait_idle()


def _prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at each prompt position but the last: row j predicts ids[j + 1]; float64."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)


def test_echo_scores_the_prompt(served, solo, model_tok):
    """echo: the choice's text starts with the prompt; with logprobs=k its logprobs start with the prompt's
    tokens, each scored given the ones before it as HF computes it (the first null), then the generated
    ones, text offsets running through both. max_tokens=0 with echo scores the prompt alone. Streamed, the
    echo comes first and the entries are the same."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = served.tok(prompt)["input_ids"]
    ref = _prompt_logprobs(model_tok[0], ids)
    want = solo(ids, 5)
    plain = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                         echo=True)
    c = r.choices[0]
    assert c.text == prompt + _text(served.tok, want) == prompt + plain.choices[0].text
    lp = c.logprobs
    n = len(ids)
    assert lp.tokens[:n] == [served.tok.decode([t]) for t in ids] and lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, n):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-3)
        top = ref[j - 1].topk(2)
        assert list(lp.top_logprobs[j]) == [served.tok.decode([t]) for t in top.indices.tolist()]
        assert list(lp.top_logprobs[j].values()) == pytest.approx(top.values.tolist(), abs=1e-3)
    assert lp.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 5)
    chunks = list(served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                                   logprobs=2, echo=True, stream=True))
    assert chunks[0].choices[0].text == prompt
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert sum((x.token_logprobs for x in streamed), []) == lp.token_logprobs
    assert sum((x.text_offset for x in streamed), []) == lp.text_offset
    # Scoring alone: nothing generated.
    only = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == served.tok.decode(ids) and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert only.choices[0].logprobs.top_logprobs[1:] == [{}] * (n - 1)
    assert only.usage.completion_tokens == 0
    bare = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert bare.choices[0].text == prompt and bare.choices[0].logprobs is None
    served.wait_idle()


def test_batched_prompts_loglikelihood_requests(served, solo, model_tok):
    """OpenAI's batch form, as evaluation harnesses send it to score continuations: several token-id prompts
    with echo, max_tokens=1 and logprobs=1. Choice p is prompt p's; the continuation's log-likelihood summed
    from its echoed entries equals HF's, and greedy choices of text prompts are each prompt's solo tokens."""
    context = served.tok("Question: What is the capital of France?\nAnswer:")["input_ids"]
    conts = [served.tok(" Paris")["input_ids"], served.tok(" a large green frog")["input_ids"]]
    body = {"model": MODEL, "prompt": [context + c for c in conts], "echo": True, "max_tokens": 1, "logprobs": 1,
            "temperature": 0, "seed": 1234}
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == [0, 1]
    scores = []
    for ch, cont in zip(choices, conts):
        ids = context + cont
        ref = _prompt_logprobs(model_tok[0], ids)
        got = sum(ch["logprobs"]["token_logprobs"][len(context):-1])
        want = sum(ref[j - 1, ids[j]].item() for j in range(len(context), len(ids)))
        assert got == pytest.approx(want, abs=1e-3)
        scores.append(got)
    assert scores[0] > scores[1]
    texts = ["Once upon a time", "The capital of France is", "def fib(n):"]
    r = served.client.completions.create(model=MODEL, prompt=texts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, t in zip(r.choices, texts):
        assert c.text == _text(served.tok, solo(served.tok(t)["input_ids"], 6))
    assert r.usage.prompt_tokens == sum(len(served.tok(t)["input_ids"]) for t in texts)
    # n choices per prompt: prompt p's i-th is choice p * n + i, each seeded as its own request would be.
    two = served.client.completions.create(model=MODEL, prompt=texts[:2], max_tokens=6, temperature=0.8, seed=5,
                                           n=2)
    alone = [served.client.completions.create(model=MODEL, prompt=t, max_tokens=6, temperature=0.8, seed=5, n=2)
             for t in texts[:2]]
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [c.text for c in two.choices] == [c.text for a in alone for c in a.choices]
    served.wait_idle()


def test_api_key_guards_the_v1_routes(model_tok, solo):
    """create_app(api_key=...): /v1/* needs 'Authorization: Bearer <key>' (none or a wrong one: 401 with
    OpenAI's error JSON, which the openai client raises as AuthenticationError, and nothing reaches the
    engine); /health and /metrics stay open; the right key is served as usual."""
    s = Served(*model_tok, api_key="s3cret-key")
    try:
        ids = s.tok("The capital of France is")["input_ids"]
        r = s.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
        assert r.choices[0].text == _text(s.tok, solo(ids, 4))
        for key in ("wrong", "s3cret-key-and-more"):
            bad = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=MODEL, prompt=ids, max_tokens=4)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        r = s.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key" and "no API key" in r.json()["error"]["message"]
        assert s.http.get("/health").status_code == 200
        m = s.metrics()
        assert m["atb_prompt_tokens_total"] == len(ids)   # only the authorised request reached the engine
    finally:
        s.close()
    with pytest.raises(ValueError, match="api_key"):
        create_app(s.infer, s.tok, model_name=MODEL, api_key="")


def test_speculative_decoding_serves_the_plain_tokens(model_tok, solo):
    """A server whose engine speculates: greedy replies (streamed or not, alone or 4 at once, with a stop string)
    are those of plain decoding, and /metrics counts the drafts."""
    s = Served(*model_tok, speculative={"num_speculative_tokens": 3})
    try:
        code = "def area(width, height):\n    return width * height\n"
        prompts = [_chat_ids(s.tok, f"Copy this code exactly, {k} times:\n\n{code}") for k in ("two", "three")]
        prompts += [s.tok(f"{i}, {i + 1}, {i + 2}, {i + 3}, {i + 4}, ")["input_ids"] for i in (1, 40)]
        want = [solo(ids, 48) for ids in prompts]
        r = s.client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=48, temperature=0)
        assert r.choices[0].text == _text(s.tok, want[0]) and r.usage.completion_tokens == len(want[0])
        stream = s.client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=48, temperature=0,
                                             stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == _text(s.tok, want[2])

        async def one(ids):
            r = await s.aclient.completions.create(model=MODEL, prompt=ids, max_tokens=48, temperature=0)
            return r.choices[0].text

        async def all_():
            return await asyncio.gather(*[one(ids) for ids in prompts])

        assert asyncio.run(all_()) == [_text(s.tok, w) for w in want]
        text = _text(s.tok, want[3])
        stop = text[len(text) // 2:len(text) // 2 + 3]
        r = s.client.completions.create(model=MODEL, prompt=prompts[3], max_tokens=48, temperature=0, stop=[stop])
        assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
        m = s.wait_idle()
        assert 0 < m["atb_spec_decode_accepted_tokens_total"] <= m["atb_spec_decode_draft_tokens_total"]
        assert m["atb_spec_decode_steps_total"] > 0
    finally:
        s.close()


def test_tokenize_and_detokenize(served):
    """vLLM's /tokenize (a text prompt, or chat messages through the template) and /detokenize: the
    tokenizer's own ids and text, the round trip exact; bad requests answer 400/404 naming the field."""
    text = "Hello there, how are you?"
    r = served.http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == served.tok(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_SEQ_LEN
    back = served.http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = served.http.post("/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == _chat_ids(served.tok, msgs[0]["content"])
    bare = served.http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    assert served.http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    for path, body, status, param in (
            ("/tokenize", {"prompt": "a", "messages": msgs}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"prompt": 5}, 400, "prompt"),
            ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
            ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens")):
        r = served.http.post(path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)


def test_response_format_json(served):
    """response_format json_schema / json_object (llguidance's grammar masks): the content parses and follows
    the schema, finish_reason "stop" when the JSON is complete; streamed chunks add up to the same text; the
    same schema on the legacy endpoint."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
              "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                             "population": {"type": "integer", "minimum": 0, "maximum": 10**9}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Tell me about Paris."}]
    r = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0,
                                              response_format=fmt)
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "country", "population"} and isinstance(value["population"], int)
    assert r.choices[0].finish_reason == "stop"
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0,
                                                        response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    obj = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0.7, seed=3,
                                                response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.lstrip().startswith("{")
    legacy = served.client.completions.create(model=MODEL, prompt="Facts about Paris as JSON:\n", max_tokens=80,
                                              temperature=0, extra_body={"response_format": fmt})
    assert set(json.loads(legacy.choices[0].text)) == {"city", "country", "population"}
    served.wait_idle()


def test_vllm_extensions_min_tokens_stop_token_ids_guided(served, solo, model_tok):
    """vLLM's extensions: stop_token_ids end the output at a token of the greedy answer (kept in the token
    count, as vLLM does); min_tokens holds that token (and EOS) off for that many tokens, the rest following
    a greedy loop with it masked; guided_choice answers one of its strings, guided_regex matches."""
    pytest.importorskip("llguidance")
    prompt = "The capital of France is"
    ids = served.tok(prompt)["input_ids"]
    want = solo(ids, 12)
    j = next(i for i in range(2, 12) if want[i] not in want[:i])
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"stop_token_ids": [want[j]], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == j + 1
    out = []
    with torch.no_grad():
        while len(out) < 12:
            logits = model_tok[0](torch.tensor([ids + out])).logits[0, -1]
            if len(out) < j + 2:
                logits[[want[j], *served.infer.runner.default_eos]] = float("-inf")
            out.append(int(logits.argmax()))
            if out[-1] == want[j] or out[-1] in served.infer.runner.default_eos:
                break
    held = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"stop_token_ids": [want[j]], "min_tokens": j + 2})
    assert held.usage.completion_tokens == len(out)
    assert held.choices[0].text == served.tok.decode(out, skip_special_tokens=True)
    # A stop string that the first min_tokens tokens complete does not stop the text (vLLM's rule); its next
    # occurrence past them does.
    text = _text(served.tok, want)
    stop = next(c for c in text if c.isalpha() and text.count(c) >= 2)
    first_end = text.index(stop) + len(stop)
    k = next(i for i in range(1, 13) if len(_text(served.tok, want[:i])) >= first_end)
    cut = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    late = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                            extra_body={"min_tokens": k, "ignore_eos": True})
    second = text.index(stop, first_end)
    assert late.choices[0].text == text[:second] and late.choices[0].finish_reason == "stop"
    choices = ["Paris", "London", "C++ (a language)"]
    pick = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=10,
        temperature=0, extra_body={"guided_choice": choices})
    assert pick.choices[0].message.content in choices and pick.choices[0].finish_reason == "stop"
    date = served.client.completions.create(model=MODEL, prompt="Today's date:", max_tokens=16, temperature=0,
                                            extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date.choices[0].text)
    lark = 'start: "The capital is " CITY "."\nCITY: /[A-Z][a-z]{2,10}/\n'
    city = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
        temperature=0, extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"The capital is [A-Z][a-z]{2,10}\.", city.choices[0].message.content)
    assert city.choices[0].finish_reason == "stop"
    for bad, param in (({"guided_grammar": "start: nowhere"}, "guided_grammar"),
                       ({"guided_grammar": lark, "guided_regex": "a"}, "guided_grammar")):
        r = served.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    served.wait_idle()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                                       "properties": {"timezone": {"type": "string", "maxLength": 40}}}}}


def test_forced_tool_calls(served):
    """tool_choice naming a function, or "required": the answer is a tool call whose arguments follow the
    function's parameter schema (constrained decoding), finish_reason "stop" / "tool_calls"; streamed, the
    call comes whole in one delta; a conversation carrying the call and its result is answered as text."""
    pytest.importorskip("llguidance")
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = served.client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice=named,
                                              max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("call_")
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    req = served.client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                                tool_choice="required", max_tokens=60, temperature=0)
    rc = req.choices[0]
    assert rc.finish_reason == "tool_calls" and rc.message.tool_calls[0].function.name in ("get_weather", "get_time")
    json.loads(rc.message.tool_calls[0].function.arguments)
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                                        tool_choice=named, max_tokens=60, temperature=0, stream=True))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == args and chunks[-1].choices[0].finish_reason == "stop"
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    reply = served.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                                  max_tokens=12, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    for body, param in (({"messages": msgs, "tools": [WEATHER]}, "tool_choice"),
                        ({"messages": msgs, "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
                        ({"messages": msgs, "tool_choice": "required"}, "tool_choice"),
                        ({"messages": msgs, "tools": [WEATHER],
                          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                        ({"messages": msgs, "tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
                        ({"messages": msgs, "tools": [WEATHER], "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "tool_choice"),
                        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
                        ({"messages": [{"role": "user"}]}, "messages")):
        r = served.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    served.wait_idle()


def test_stop_string_mid_token(served, solo):
    """A stop string that spans tokens and ends inside one cuts the text there; the blocks are freed."""
    prompt = "The capital of France is"
    ids = served.tok(prompt)["input_ids"]
    out = solo(ids, 12)
    full = _text(served.tok, out)
    ends = [len(_text(served.tok, out[:j])) for j in range(len(out) + 1)]  # text offsets of token boundaries
    # The stop string ends one character into a token at least two characters long and starts three
    # characters earlier, in the tokens before it; it must not occur earlier in the text.
    cut = next(lo + 1 for lo, hi in zip(ends, ends[1:]) if hi - lo >= 2 and lo >= 3
               and full.find(full[lo - 2:lo + 1]) == lo - 2)
    stop = full[cut - 3:cut]
    assert cut not in ends
    for stream in (False, True):
        r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                             stream=stream)
        if stream:
            chunks = list(r)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (full[:cut - 3], "stop"), stop
    served.wait_idle()


def test_sampling_is_reproducible_with_seed(served):
    kw = dict(model=MODEL, prompt="My favourite colour is", max_tokens=8, temperature=0.9, top_p=0.9, seed=1234,
              extra_body={"top_k": 40})
    a = served.client.completions.create(**kw).choices[0].text
    b = served.client.completions.create(**kw).choices[0].text
    assert a == b
    # vLLM's min_p reaches the sampler: at 1 only the most likely token survives, so sampling is greedy.
    greedy = served.client.completions.create(model=MODEL, prompt=kw["prompt"], max_tokens=8, temperature=0)
    hot = dict(kw, temperature=1.8, extra_body={"min_p": 1.0})
    assert served.client.completions.create(**hot).choices[0].text == greedy.choices[0].text


# ---------------------------------------------------------------- continuous batching
def test_16_concurrent_streams_get_their_solo_tokens(served, solo):
    words = ("the quick brown fox jumps over the lazy dog while a small bird sings on the old oak tree near "
             "the river bank and children play").split()
    cases = []
    for i in range(16):
        prompt = " ".join(words[:3 + (i * 7) % len(words)])
        cases.append((prompt, 4 + (i * 5) % 17))
    want = [solo(served.tok(p)["input_ids"], n) for p, n in cases]

    async def one(prompt, n):
        text, usage = "", None
        stream = await served.aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                         stream=True, stream_options={"include_usage": True})
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
            if c.usage:
                usage = c.usage
        return text, usage.completion_tokens

    async def all_():
        return await asyncio.gather(*[one(p, n) for p, n in cases])

    got = asyncio.run(all_())
    for (prompt, n), w, (text, count) in zip(cases, want, got):
        assert (text, count) == (_text(served.tok, w), len(w)), prompt
    served.wait_idle()


def test_disconnect_after_3_chunks_frees_blocks(served, solo):
    before = served.metrics()
    others = ["Water boils at", "The largest planet is", "Python is a"]
    want = [_text(served.tok, solo(served.tok(p)["input_ids"], 10)) for p in others]
    result = {}

    def quitter():
        body = {"model": MODEL, "prompt": "Tell me a very long story:", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=served.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if chunks == 3:
                        break
        result["chunks"] = chunks

    def other(i):
        result[i] = served.client.completions.create(model=MODEL, prompt=others[i], max_tokens=10,
                                                     temperature=0).choices[0].text

    threads = [threading.Thread(target=quitter)] + [threading.Thread(target=other, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert result["chunks"] == 3
    assert [result[i] for i in range(3)] == want
    after = served.wait_idle()
    aborted = 'atb_requests_finished_total{finish_reason="abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    # The quitter was stopped early: far fewer than its 200 tokens were generated.
    assert after["atb_generation_tokens_total"] - before["atb_generation_tokens_total"] < 30 + 60


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(served):
    before = served.metrics()
    body = {"model": MODEL, "prompt": "Tell me a very long story:", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    after = served.wait_idle()
    aborted = 'atb_requests_finished_total{finish_reason="abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    assert after["atb_generation_tokens_total"] - before["atb_generation_tokens_total"] < 200


# ---------------------------------------------------------------- bad requests
BAD = [
    ("malformed JSON", b'{"model": "x", "prompt": "hi"', 400, None),
    ("not an object", b'[1, 2]', 400, None),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("wrong type", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("bool as int", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("unknown field", {"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("temperature < 0", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p > 1", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k < 0", {"model": MODEL, "prompt": "hi", "top_k": -3}, 400, "top_k"),
    ("min_p > 1", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("min_tokens > max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("min_tokens past the context", {"model": MODEL, "prompt": [42] * 200, "max_tokens": None, "min_tokens": 60}, 400,
     "min_tokens"),
    ("stop_token_ids id", {"model": MODEL, "prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("two constraints", {"model": MODEL, "prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "guided_choice"),
    ("guided_json not a schema", {"model": MODEL, "prompt": "hi", "guided_json": "[1]"}, 400, "guided_json"),
    ("guided_regex unusable", {"model": MODEL, "prompt": "hi", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("guided_choice empty", {"model": MODEL, "prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("max_tokens 0", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("n > 16", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ("best_of != n", {"model": MODEL, "prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ("stop not strings", {"model": MODEL, "prompt": "hi", "stop": [1]}, 400, "stop"),
    ("65 prompts", {"model": MODEL, "prompt": ["a"] * 65}, 400, "prompt"),
    ("prompts of mixed kinds", {"model": MODEL, "prompt": ["a", 3]}, 400, "prompt"),
    ("empty prompt list", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("empty prompt in a batch", {"model": MODEL, "prompt": ["a", []]}, 400, "prompt"),
    ("token out of vocab", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("prompt too long", {"model": MODEL, "prompt": [42] * MAX_SEQ_LEN}, 400, "prompt"),
    ("no room for max_tokens", {"model": MODEL, "prompt": [42] * 200, "max_tokens": 100}, 400, "max_tokens"),
    ("echo max_tokens < 0", {"model": MODEL, "prompt": "hi", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("second prompt too long", {"model": MODEL, "prompt": [[42], [42] * MAX_SEQ_LEN]}, 400, "prompt"),
    ("unknown model", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("logprobs > 20", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("presence_penalty > 2", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("logit_bias key", {"model": MODEL, "prompt": "hi", "logit_bias": {"the": 1}}, 400, "logit_bias"),
    ("logit_bias > 100", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias id", {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("frequency_penalty < -2", {"model": MODEL, "prompt": "hi", "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("logprobs < 0", {"model": MODEL, "prompt": "hi", "logprobs": -1}, 400, "logprobs"),
]


@pytest.mark.parametrize("what,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_request(served, what, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = served.http.post("/v1/completions", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    if param:
        assert param in err["message"] or status == 404


def test_bad_chat_requests_and_server_keeps_serving(served):
    for body, param in (({"model": MODEL, "messages": []}, "messages"),
                        ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
                         "top_logprobs"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema"}}, "response_format"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "xml"}}, "response_format"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
                         "response_format"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs")):
        r = served.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError):
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=0)
    r = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, temperature=0, response_format={"type": "text"})
    assert r.usage.completion_tokens >= 1
    served.wait_idle()


def test_full_waiting_queue_answers_429(served):
    limit = served.state.loop.max_waiting
    served.state.loop.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError) as e:
            served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    finally:
        served.state.loop.max_waiting = limit
    assert served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    # n choices are queued all or none: with room for 2 of 3 the request is refused and nothing stays queued.
    before = served.wait_idle()
    served.state.loop.max_waiting = 2
    try:
        with pytest.raises(openai.RateLimitError):
            served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=3)
    finally:
        served.state.loop.max_waiting = limit
    after = served.wait_idle()
    assert served.state.loop.queued == 0 and after["atb_kv_blocks_free"] == after["atb_kv_blocks_total"]
    aborted = 'atb_requests_finished_total{finish_reason="abort"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) == 2  # the two queued choices, aborted


def test_engine_failures_fail_only_their_requests(served, monkeypatch):
    infer = served.infer
    real_add, real_step = infer.add_request, infer.step

    def add_request(ids, params=None, request_id=None):
        if ids[:1] == [777]:
            raise ValueError("injected failure")
        return real_add(ids, params, request_id=request_id)

    monkeypatch.setattr(infer, "add_request", add_request)
    with pytest.raises(openai.InternalServerError):
        served.client.completions.create(model=MODEL, prompt=[777, 1000], max_tokens=4)
    assert served.client.completions.create(model=MODEL, prompt=[778, 1000], max_tokens=4).usage.completion_tokens

    # A step that raises fails the requests in the batch; the engine thread carries on.
    failed = []

    def step():
        if not failed:
            failed.append(True)
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(infer, "step", step)
    r = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    assert served.client.completions.create(model=MODEL, prompt="hi", max_tokens=4).usage.completion_tokens
    served.wait_idle()


# ---------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, model_tok):
    """A random 2-layer llama with SmolLM2's tokenizer, saved as an HF directory (loads in a second)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(model_tok[1]), max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(path)
    model_tok[1].save_pretrained(path)
    return path


@contextlib.contextmanager
def _cli_server(*args, timeout: float = 120):
    """`python -m atb serve ARGS` on a free port of 127.0.0.1, healthy: yields (process, base url); killed if it
    is still running at the end."""
    port = _free_socket().getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "atb", "serve", *args, "--port", str(port), "--max-seq-len", "512",
                             "--quiet", "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_health(url, [proc], timeout=timeout)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_serves_and_shuts_down_gracefully(tiny_checkpoint, sig):
    with _cli_server("--model", str(tiny_checkpoint)) as (proc, url):
        body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        proc.send_signal(sig)
        # The running request was aborted: an error event, then the end of the stream.
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
        assert len(lines) < 400
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "finish=abort" in err and "Traceback" not in err


def test_cli_serves_quantized_weights(model_tok):
    """`atb serve --quantize native`: the embedded checkpoint's Q4_1 tensors as shipped, the same greedy reply
    as TransformerInfer with quantize="native" in-process, and the startup line says what is served."""
    model, tok = model_tok
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = _chat_ids(tok, messages[0]["content"])
    ref = atb.TransformerInfer(model, max_seq_len=512, max_batch_size=1, quantize="native")
    want = ref.generate([ids], max_new_tokens=16)[0]
    with _cli_server("--quantize", "native", timeout=180) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                           temperature=0)
        assert r.choices[0].message.content == _text(tok, want)
        assert "Paris" in r.choices[0].message.content
        assert r.usage.completion_tokens == len(want)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "serving SmolLM2-135M-Instruct: dtype float32, weights native" in err, err
        assert "Traceback" not in err
