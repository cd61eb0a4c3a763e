"""TransformerInfer: tokens identical to HF generate, continuous batching, limits, sampling, families, SoCs."""
import warnings

import pytest
import torch

import atb
from atb.checkpoints import random_model
from atb.kernels.linear import rows4_supported
from conftest import ALL_SOCS, family_model, family_names, fp32_decode_copy
from reference import assert_close

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "hi",
    "List three prime numbers and explain why each one is prime, in detail please.",
    "Translate 'good morning' into Spanish and German, then say which one is longer.",
]


def chat_ids(tok, text):
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"])


_HF = {}


def hf_greedy(model, prompt, n):
    """HF generate's new tokens for one unpadded prompt (cached per model/prompt/length)."""
    key = (id(model), tuple(prompt), n)
    if key not in _HF:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
        _HF[key] = out[0, len(prompt):].tolist()
    return _HF[key]


TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def tiny(model_type="llama", dtype=torch.float32, **kw):
    return random_model({**TINY, **kw}, dtype=dtype, model_type=model_type, seed=7)


def full(infer):
    return infer.cache.free_blocks == infer.cache.num_blocks


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny("llama")


# ---- the real checkpoint ----------------------------------------------------
@pytest.fixture(scope="module")
def smol_infer(smollm2_fp32):
    model, _ = smollm2_fp32
    return atb.TransformerInfer(model, max_seq_len=256, max_batch_size=8, block_size=16)


def test_greedy_single_prompts_identical_to_hf(smollm2_fp32, smol_infer):
    model, tok = smollm2_fp32
    for text in CHATS[:2]:
        p = chat_ids(tok, text)
        assert smol_infer.generate([p], 40) == [hf_greedy(model, p, 40)]
        assert full(smol_infer)
    assert smol_infer.last_stop_reasons in (["eos"], ["length"])


def test_greedy_batch_of_5_identical_to_unbatched_hf(smollm2_fp32, smol_infer):
    model, tok = smollm2_fp32
    prompts = [chat_ids(tok, t) for t in CHATS]
    assert len({len(p) for p in prompts}) == 5
    out = smol_infer.generate(prompts, 40)
    for p, o in zip(prompts, out):
        assert o == hf_greedy(model, p, 40)
    assert out[0][-1] == 2 and smol_infer.last_stop_reasons[0] == "eos"  # "... Paris.<|im_end|>"
    assert "Paris" in tok.decode(out[0])
    assert full(smol_infer)


def test_forward_logits_match_hf_with_left_padding(smollm2_fp32, smol_infer):
    model, tok = smollm2_fp32
    a, b = chat_ids(tok, CHATS[0]), chat_ids(tok, CHATS[3])
    S = max(len(a), len(b))
    ids = torch.full((2, S), 2, dtype=torch.long)
    mask = torch.zeros(2, S, dtype=torch.long)
    for i, p in enumerate((a, b)):
        ids[i, S - len(p):] = torch.tensor(p)
        mask[i, S - len(p):] = 1
    logits = smol_infer.forward(ids, attention_mask=mask)
    assert logits.shape == (2, S, model.config.vocab_size)
    for i, p in enumerate((a, b)):
        ref = model(torch.tensor([p])).logits[0]
        # 30 fp32 layers with a different summation order: ~1e-4 absolute on logits of magnitude ~20.
        assert_close(logits[i, S - len(p):], ref, scale=50)
        assert torch.count_nonzero(logits[i, :S - len(p)]) == 0
    assert full(smol_infer)


@pytest.mark.parametrize("graph_mode", [True, False])
def test_continuous_batching_12_prompts_same_as_one_at_a_time(tiny_llama, graph_mode):
    infer = atb.TransformerInfer(tiny_llama, max_seq_len=64, max_batch_size=4, block_size=4, graph_mode=graph_mode)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6, 5, 11, 2, 8, 4, 13, 7)]
    solo = [infer.generate([p], 12, eos_token_id=[])[0] for p in prompts]
    # An EOS that some sequences hit early and others never: finish times differ, so waiting prompts join mid-run.
    counts = {}
    for s in solo:
        for t in set(s[1:8]):
            counts[t] = counts.get(t, 0) + 1
    eos = max((t for t in counts if counts[t] < 12), key=counts.get)
    expected = [s[:s.index(eos) + 1] if eos in s else s for s in solo]
    assert len({len(e) for e in expected}) > 2
    streamed = {}
    out = infer.generate(prompts, 12, eos_token_id=eos, stream=lambda i, t: streamed.setdefault(i, []).append(t))
    assert out == expected
    assert [streamed.get(i, []) for i in range(12)] == out
    assert sorted(set(infer.last_stop_reasons)) == ["eos", "length"]
    assert full(infer)


def test_bf16_first_tokens_agree_with_hf(smollm2_bf16):
    model, tok = smollm2_bf16
    infer = atb.TransformerInfer(model, max_seq_len=128, max_batch_size=2, block_size=16)
    assert infer.dtype == torch.bfloat16
    for text in CHATS[1:2]:
        p = chat_ids(tok, text)
        ours, ref = infer.generate([p], 32)[0], hf_greedy(model, p, 32)
        n = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), None)
        if n is not None:
            # A divergence is only acceptable at a near-tie of HF's own top two logits (bf16 rounding).
            logits = model(torch.tensor([p + ref[:n]])).logits[0, -1].float()
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] < 0.25, f"diverged at token {n} with a clear HF margin {top2.tolist()}"
        assert full(infer)


# ---- limits and errors ------------------------------------------------------
def test_limits_raise_before_allocating_and_engine_stays_usable(tiny_llama):
    infer = atb.TransformerInfer(tiny_llama, max_seq_len=64, max_batch_size=2, block_size=8)
    good = [[1, 5, 9], [3, 4]]
    before = infer.generate(good, 6)
    bad_calls = [
        (lambda: infer.generate([[1, 2], []], 4), "prompt 1 is empty"),
        (lambda: infer.generate([[1] * 65], 4), "more than max_seq_len=64"),
        (lambda: infer.generate([[1, 128]], 4), "token id 128, outside the vocabulary"),
        (lambda: infer.generate([[-1, 3]], 4), "token id -1"),
        (lambda: infer.generate(good, -1), "max_new_tokens"),
        (lambda: infer.generate(good, 4, do_sample=True, temperature=0), "temperature"),
        (lambda: infer.generate(good, 4, top_p=1.5), "top_p"),
        (lambda: infer.forward(torch.tensor([[1, 200]])), "token id 200"),
        (lambda: infer.forward(torch.ones(1, 65, dtype=torch.long)), "exceeds max_seq_len"),
        (lambda: infer.forward(torch.ones(2, 3)), "2-D integer"),
    ]
    for call, msg in bad_calls:
        with pytest.raises(ValueError, match=msg):
            call()
        assert full(infer)
    with pytest.raises(TypeError, match="list of int"):
        infer.generate([[1, "a"]], 3)

    def boom(i, t):
        if i == 1 and t is not None:
            raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        infer.generate(good, 6, stream=boom)
    assert full(infer)
    assert infer.generate(good, 6) == before and full(infer)


def test_max_seq_len_stops_only_that_sequence(tiny_llama):
    infer = atb.TransformerInfer(tiny_llama, max_seq_len=40, max_batch_size=3, block_size=8)
    long_p, short_p = list(range(3, 33)), [7, 8, 9]
    solo_short = infer.generate([short_p], 20, eos_token_id=[])[0]
    out = infer.generate([long_p, short_p, list(range(40))], 20, eos_token_id=[])
    assert len(out[0]) == 10 and out[1] == solo_short and out[2] == []
    assert infer.last_stop_reasons == ["max_seq_len", "length", "max_seq_len"]
    # The truncated sequence's tokens are the ones an unconstrained engine produces.
    roomy = atb.TransformerInfer(tiny_llama, max_seq_len=64, max_batch_size=1, block_size=8)
    assert roomy.generate([long_p], 10, eos_token_id=[])[0] == out[0]
    assert full(infer)


def test_tensor_prompts_with_mask_and_stream(tiny_llama):
    infer = atb.TransformerInfer(tiny_llama, max_seq_len=64, max_batch_size=4, block_size=8)
    prompts = [[1, 5, 9, 11], [3, 4]]
    ids = torch.tensor([[1, 5, 9, 11], [0, 0, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    events = []
    out = infer.generate(ids, 5, attention_mask=mask, stream=lambda i, t: events.append((i, t)))
    assert out == infer.generate(prompts, 5)
    assert [t for i, t in events if i == 0] == out[0] and [t for i, t in events if i == 1] == out[1]


# ---- sampling ---------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(temperature=0.6), dict(top_k=5), dict(top_p=0.8), dict(top_p=0.3, top_k=20),
                                dict(temperature=1.7, top_k=50, top_p=0.9), dict(min_p=0.1),
                                dict(temperature=0.5, min_p=0.05), dict(temperature=1.4, top_k=40, top_p=0.95, min_p=0.2),
                                dict(min_p=1.0)])
def test_warp_matches_hf_logits_processors(kw):
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from atb.engine import SamplingParams
    from atb.engine.sampling import warp

    params = SamplingParams(do_sample=True, **kw)
    hf = LogitsProcessorList()
    if params.temperature != 1.0:
        hf.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        hf.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        hf.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        hf.append(MinPLogitsWarper(params.min_p))
    logits = torch.randn(3, 100) * 3
    ours, ref = warp(logits, params), hf(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1))


def test_draw_follows_the_distribution_and_never_draws_zero_probability():
    from atb.engine.sampling import draw, generator

    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.2])
    g = generator(3)
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(6000)]), minlength=5).double() / 6000
    assert counts[1] == counts[3] == 0
    assert (counts - probs.double()).abs().max() < 0.03   # ~5 sigma of 6000 draws
    one_hot = torch.zeros(49152)
    one_hot[49151] = 1.0
    assert {draw(one_hot, g) for _ in range(50)} == {49151}
    a, b = generator(9), generator(9)
    wide = torch.rand(49152).softmax(-1)
    assert [draw(wide, a) for _ in range(20)] == [draw(wide, b) for _ in range(20)]   # seeded: reproducible


def test_sampling_seeded_and_top_k_1_is_greedy(tiny_llama):
    infer = atb.TransformerInfer(tiny_llama, max_seq_len=64, max_batch_size=4, block_size=8)
    prompts = [[1, 5, 9], [3, 4], [17, 2, 2, 90]]
    kw = dict(do_sample=True, temperature=1.5, top_p=0.95, eos_token_id=[])
    a = infer.generate(prompts, 12, seed=123, **kw)
    assert a == infer.generate(prompts, 12, seed=123, **kw)
    assert a != infer.generate(prompts, 12, seed=124, **kw)
    # Each sequence has its own generator: running one at a time does not change its draws.
    one = atb.TransformerInfer(tiny_llama, max_seq_len=64, max_batch_size=1, block_size=8)
    assert one.generate(prompts, 12, seed=123, **kw) == a
    assert infer.generate(prompts, 12, do_sample=True, top_k=1, seed=5) == infer.generate(prompts, 12)
    assert infer.generate(prompts, 12, do_sample=True, min_p=1.0, seed=5) == infer.generate(prompts, 12)
    assert full(infer)


def test_repetition_penalty_matches_hf(tiny_llama):
    infer = atb.TransformerInfer(tiny_llama, max_seq_len=64, max_batch_size=2, block_size=8)
    p = [1, 5, 9, 11, 5]
    ref = tiny_llama.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.8)
    assert infer.generate([p], 12, repetition_penalty=1.8) == [ref[0, len(p):].tolist()]


def test_sampling_distribution_matches_softmax():
    model = tiny("llama", vocab_size=16)
    infer = atb.TransformerInfer(model, max_seq_len=16, max_batch_size=64, block_size=8)
    p = [3, 1, 4, 1, 5]
    logits = infer.forward(torch.tensor([p]))[0, -1].double()
    n = 600
    for kw, t in ((dict(), 1.0), (dict(temperature=0.7), 0.7)):
        draws = [o[0] for o in infer.generate([p] * n, 1, do_sample=True, seed=11, eos_token_id=[], **kw)]
        freq = torch.bincount(torch.tensor(draws), minlength=16).double() / n
        probs = (logits / t).softmax(-1)
        # Total variation of 600 draws over 16 outcomes: sampling noise ~0.05; a wrong distribution is far off.
        assert 0.5 * (freq - probs).abs().sum() < 0.12
    top = logits.topk(3).indices.tolist()
    draws = {o[0] for o in infer.generate([p] * 64, 1, do_sample=True, top_k=3, seed=2, eos_token_id=[])}
    assert draws <= set(top)
    nucleus = logits.softmax(-1).sort(descending=True)
    keep = int((nucleus.values.cumsum(0) < 0.5).sum()) + 1
    draws = {o[0] for o in infer.generate([p] * 64, 1, do_sample=True, top_p=0.5, seed=3, eos_token_id=[])}
    assert draws <= set(nucleus.indices[:keep].tolist())
    # min_p between the 2nd and 3rd most likely tokens' probabilities (relative to the top): those two remain.
    ratio = nucleus.values / nucleus.values[0]
    min_p = float(ratio[1] + ratio[2]) / 2
    draws = {o[0] for o in infer.generate([p] * 64, 1, do_sample=True, min_p=min_p, seed=4, eos_token_id=[])}
    assert draws == set(nucleus.indices[:2].tolist())
    assert full(infer)


# ---- families, SoCs, dtypes, construction ------------------------------------
@pytest.mark.parametrize("graph_mode", [True, False])
# dynamic rope: its max_position_embeddings (16) is below this test's max_seq_len.
@pytest.mark.parametrize("family", family_names("llama-dynamic-rope"))
def test_random_family_matches_hf(family, graph_mode):
    model = family_model(family, TINY, seed=7)
    if family == "qwen2-bias":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    infer = atb.TransformerInfer(model, max_seq_len=64, max_batch_size=2, block_size=4, graph_mode=graph_mode)
    assert infer.graph_mode == graph_mode
    prompts = [[1, 5, 9, 11, 20, 7, 7, 3, 44], [3, 4, 8]]  # longer than the mistral window
    out = infer.generate(prompts, 8, eos_token_id=[])
    for p, o in zip(prompts, out):
        ref = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             min_new_tokens=8)
        assert o == ref[0, len(p):].tolist()
    ids = torch.tensor([prompts[0]])
    assert_close(infer.forward(ids), model(ids).logits, scale=5)
    assert full(infer)


def test_wide_batch_decode_matches_narrow(tiny_llama):
    # 34 sequences decode through the GEMM path (batch >= the linear crossover), 4 through the fused kernels.
    prompts = [[1 + i % 7, 5 + i, 9, 2 * i % 100] for i in range(34)]
    wide = atb.TransformerInfer(tiny_llama, max_seq_len=16, max_batch_size=34, block_size=4, graph_mode=False)
    narrow = atb.TransformerInfer(tiny_llama, max_seq_len=16, max_batch_size=4, block_size=4, graph_mode=False)
    assert wide.generate(prompts, 5, eos_token_id=[]) == narrow.generate(prompts, 5, eos_token_id=[])
    assert full(wide) and full(narrow)


def test_wide_bf16_batch_runs_the_native_gemm_in_both_modes():
    # bf16 batches of 32+ stay on the native kernels (GEMM mode) in the Python step and in the native graph:
    # the same kernels, so the same tokens.
    model = tiny(dtype=torch.bfloat16)
    prompts = [[1 + i % 7, 5 + i, 9, 2 * i % 100] for i in range(34)]
    runs = [atb.TransformerInfer(model, max_seq_len=16, max_batch_size=34, block_size=4, graph_mode=g)
            .generate(prompts, 5, eos_token_id=[]) for g in (False, True)]
    assert runs[0] == runs[1]


def test_every_soc_gives_the_same_greedy_tokens(tiny_llama):
    prompts = [[1, 5, 9, 11], [3, 4]]
    results = {soc: atb.TransformerInfer(tiny_llama, max_seq_len=32, soc_type=soc, max_batch_size=2,
                                         block_size=8).generate(prompts, 8, eos_token_id=[]) for soc in ALL_SOCS}
    assert all(r == results["host"] for r in results.values())


def test_dtype_rule_for_socs_without_bf16():
    model = tiny("llama", dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="no bfloat16.*float16"):
        infer = atb.TransformerInfer(model, max_seq_len=32, soc_type="Ascend910", max_batch_size=1, block_size=8)
    assert infer.dtype == torch.float16 and infer.cache.key_caches[0].dtype == torch.float16
    assert not infer.memory_summary()["weights_shared_with_model"]
    assert len(infer.generate([[1, 2, 3]], 4, eos_token_id=[])[0]) == 4
    with pytest.raises(ValueError, match="bfloat16 requested but Ascend910"):
        atb.TransformerInfer(model, max_seq_len=32, soc_type="Ascend910", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = atb.TransformerInfer(model, max_seq_len=32, soc_type="Ascend910B4", max_batch_size=1, block_size=8)
    assert same.dtype == torch.bfloat16


def test_weights_shared_and_memory_summary(tiny_llama):
    with fp32_decode_copy(True):
        infer = atb.TransformerInfer(tiny_llama, max_seq_len=40, max_batch_size=3, block_size=16)
    layer = tiny_llama.model.layers[1]
    assert infer.layers[1].q.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
    assert infer.embed.data_ptr() == tiny_llama.model.embed_tokens.weight.data_ptr()
    m = infer.memory_summary()
    params = sum(p.numel() for p in tiny_llama.parameters()) * 4
    assert m["weights_shared_with_model"] and m["weights_bytes"] == params
    assert m["kv_blocks"] == 3 * 3 and m["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert m["kv_cache_bytes"] == 9 * 16 * m["kv_bytes_per_token"]
    assert m["total_bytes"] == (m["weights_bytes"] + m["kv_cache_bytes"] + m["scratch_bytes"]
                                + m["decode_repacked_bytes"])
    # fp32 projections and LM head get a rows4 copy where the SIMD table has the kernel, in pieces (one per core
    # tile, each padded to whole groups of 4 rows and 64 bytes): at least one whole copy, little more.
    whole = sum(atb._C.rows4_numel(*t.shape) * 4 for t in [infer.lm_head] + [
        w for lw in infer.layers for n, w in lw.tensors().items() if n in ("q", "k", "v", "o", "gate", "up", "down")])
    if rows4_supported(torch.float32):
        assert whole <= m["decode_repacked_bytes"] <= 1.25 * whole
    else:
        assert m["decode_repacked_bytes"] == 0
    # Reading fp32 weights as they lie (atb.set_fp32_decode_copy(False)), the engine keeps no copy of weights
    # whose K no batch step reads a copy of (the tiny model's K * 4 are not multiples of 4 KiB).
    with fp32_decode_copy(False):
        lean = atb.TransformerInfer(tiny_llama, max_seq_len=40, max_batch_size=3, block_size=16)
    assert lean.memory_summary()["decode_repacked_bytes"] == 0
    half = atb.TransformerInfer(tiny_llama, max_seq_len=40, dtype=torch.float16)
    assert half.memory_summary()["weights_bytes"] == params // 2 and half.embed.dtype == torch.float16


def test_construction_errors(tiny_llama):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(ValueError, match="gpt2"):
        atb.TransformerInfer(gpt2, max_seq_len=32)
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        atb.TransformerInfer(tiny_llama, max_seq_len=257)
    with pytest.raises(ValueError, match="power of two"):
        atb.TransformerInfer(tiny_llama, max_seq_len=32, block_size=24)
    with pytest.raises(ValueError, match="max_batch_size"):
        atb.TransformerInfer(tiny_llama, max_seq_len=32, max_batch_size=0)
    with pytest.raises(ValueError, match="Ascend910B4"):
        atb.TransformerInfer(tiny_llama, max_seq_len=32, soc_type="Ascend999")
    with pytest.raises(ValueError, match="dtype must be"):
        atb.TransformerInfer(tiny_llama, max_seq_len=32, dtype=torch.float64)
    with pytest.raises(TypeError, match="model"):
        atb.TransformerInfer(object())


def test_repr_names_the_engine_settings():
    infer = atb.TransformerInfer(random_model("tiny", torch.float32), max_seq_len=64, max_batch_size=2, block_size=16)
    assert repr(infer) == ("TransformerInfer(llama, layers=2, dtype=torch.float32, soc=host, max_seq_len=64, "
                           "max_batch_size=2, block_size=16, graph_mode=True)")
