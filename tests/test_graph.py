"""The native decode graph against HF: greedy tokens, logits, every family's options; metadata validation; profiling.

The graph only decodes, so these tests feed prompts through it one token per
step (each a decode step at its position) and then generate greedily. Greedy
identity with HF is checked by teacher forcing: one HF forward over prompt +
generated tokens must pick, at every generated position, the token the graph
picked (so HF greedy decoding from the prompt would produce the same sequence).
"""
import pytest
import torch

import atb
from atb.checkpoints import random_model
from atb.graph import DecodeGraph
from atb.kernels.linear import rows4_supported
from conftest import family_model, family_names, fp32_batch_copy, fp32_decode_copy

BLOCK = 16


def _caches(model, num_blocks, dtype):
    cfg = model.config
    kh = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, num_blocks, BLOCK, kh, d)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _graph(model, max_batch, max_seq_len=256, num_blocks=None, soc_type=None, repack=None):
    dtype = next(model.parameters()).dtype
    num_blocks = num_blocks or max_batch * (max_seq_len // BLOCK)
    kc, vc = _caches(model, num_blocks, dtype)
    g = DecodeGraph.from_model(model, key_caches=list(kc.unbind(0)), value_caches=list(vc.unbind(0)),
                               max_batch=max_batch, max_seq_len=max_seq_len, soc_type=soc_type, repack=repack)
    return g, kc, vc


def _run(g, prompts, new_tokens, blocks_per_seq):
    """Prompts through the graph (one token per step), then greedy decoding; sequences drop out
    of the batch as they finish (continuous batching). Block ids interleave across sequences."""
    n = len(prompts)
    seqs = [list(p) for p in prompts]
    targets = [len(p) + new_tokens for p in prompts]
    tables = torch.tensor([[b + n * j for j in range(blocks_per_seq)] for b in range(n)], dtype=torch.int32)
    pos = [0] * n
    step_logits = [[] for _ in range(n)]
    while True:
        live = [b for b in range(n) if pos[b] < targets[b] - 1]
        if not live:
            break
        toks = torch.tensor([seqs[b][pos[b]] for b in live])
        positions = torch.tensor([pos[b] for b in live])
        slots = torch.tensor([int(tables[b, pos[b] // BLOCK]) * BLOCK + pos[b] % BLOCK for b in live])
        logits = g.step(toks, positions, tables[live], positions + 1, slots)
        for i, b in enumerate(live):
            if pos[b] >= len(prompts[b]) - 1:
                seqs[b].append(int(logits[i].float().argmax()))
                step_logits[b].append(logits[i].float().clone())
            pos[b] += 1
    return seqs, step_logits


def _hf_teacher_forced(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def _assert_greedy_matches_hf(model, prompt, seq, logits=None, atol=None):
    hf = _hf_teacher_forced(model, seq)
    start = len(prompt) - 1
    hf_choice = hf[start:len(seq) - 1].argmax(-1).tolist()
    assert seq[len(prompt):] == hf_choice
    if logits is not None:
        got = torch.stack(logits)
        torch.testing.assert_close(got, hf[start:start + len(logits)], atol=atol, rtol=0)


def test_smollm2_fp32_batch1_equals_hf_generate(smollm2_fp32):
    model, tok = smollm2_fp32
    prompt = tok("The capital of France is", return_tensors="pt").input_ids[0].tolist()
    g, _, _ = _graph(model, max_batch=1, max_seq_len=128)
    seqs, logits = _run(g, [prompt], 64, 128 // BLOCK)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0].tolist()
    assert seqs[0][:len(hf)] == hf  # HF stops at EOS; the graph runs on (and is checked by teacher forcing)
    _assert_greedy_matches_hf(model, prompt, seqs[0], logits[0], atol=2e-3)


def test_smollm2_fp32_batch5_different_lengths(smollm2_fp32):
    model, tok = smollm2_fp32
    texts = ["Hi", "The capital of France is", "Write a haiku about the sea. It should be calm and",
             "1, 2, 3, 4,", "def fibonacci(n):\n    "]
    prompts = [tok(t).input_ids for t in texts]
    g, _, _ = _graph(model, max_batch=5, max_seq_len=96)
    seqs, _ = _run(g, prompts, 64, 96 // BLOCK)
    for p, s in zip(prompts, seqs):
        assert len(s) == len(p) + 64
        _assert_greedy_matches_hf(model, p, s)


def test_smollm2_bf16_close_to_hf(smollm2_bf16):
    model, tok = smollm2_bf16
    prompt = tok("The capital of France is", return_tensors="pt").input_ids[0].tolist()
    g, _, _ = _graph(model, max_batch=1, max_seq_len=64)
    seqs, logits = _run(g, [prompt], 8, 64 // BLOCK)
    hf = _hf_teacher_forced(model, seqs[0])
    # bf16 rounds every activation (2^-8 relative): logits of magnitude ~20 differ by a few tenths
    # between two summation orders (up to 0.625, 5 bf16 ulps there, where HF's GEMMs run on AMX); the greedy
    # choice on this prompt is far from a tie.
    torch.testing.assert_close(logits[0][0], hf[len(prompt) - 1], atol=1.0, rtol=0)
    assert seqs[0][len(prompt)] == int(hf[len(prompt) - 1].argmax())


# dynamic rope: its max_position_embeddings (16) is below this test's max_seq_len.
@pytest.mark.parametrize("family", family_names("llama-dynamic-rope"))
def test_families_match_hf(family):
    model = family_model(family, atb.checkpoints.PRESETS["tiny"])
    prompts = [[5, 17, 300, 2, 9, 44, 1000, 3], [7, 7]]
    g, _, _ = _graph(model, max_batch=2, max_seq_len=48)
    seqs, logits = _run(g, prompts, 12, 48 // BLOCK)
    for p, s, lg in zip(prompts, seqs, logits):
        _assert_greedy_matches_hf(model, p, s, lg, atol=1e-4)


@pytest.mark.parametrize("soc", ["Ascend910B4", "Ascend310P3"])
def test_every_soc_gives_the_same_logits(soc):
    model = random_model("tiny", torch.float16)
    prompts = [[5, 17, 300, 2], [9]]
    g0, _, _ = _graph(model, max_batch=2, max_seq_len=32)
    g1, _, _ = _graph(model, max_batch=2, max_seq_len=32, soc_type=soc)
    _, l0 = _run(g0, prompts, 4, 2)
    _, l1 = _run(g1, prompts, 4, 2)
    for a, b in zip(l0, l1):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype,copy", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_repacked_weights_decode_the_same_bits(dtype, copy):
    # repack: the projections' and LM head's rows4 copies, read by steps of 1-4 rows (5 here until one finishes);
    # fp32 without the copy setting (atb.set_fp32_decode_copy) reads the weights as they lie in the AVX2 rows.
    if not rows4_supported(dtype):
        pytest.skip(f"the {atb.build_info()['isa']} SIMD table has no rows4 kernel for {dtype}")
    model = random_model("tiny", dtype)
    prompts = [[5, 17, 300, 2], [9], [7, 7, 7], [1, 2, 3, 4, 5, 6], [11, 12]]
    _, plain = _run(_graph(model, max_batch=5, max_seq_len=32, repack=False)[0], prompts, 5, 2)
    with fp32_decode_copy(copy):
        _, packed = _run(_graph(model, max_batch=5, max_seq_len=32, repack=True)[0], prompts, 5, 2)
    for a, b in zip(plain, packed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _steps_before_and_after_nan_weights(g, model, args):
    """The logits of a step, then of the same step after the projections' and LM head's weights as they lie
    were overwritten by NaN (finite: whatever the graph read, it was not those)."""
    before = g.step(*args).clone()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                p.fill_(float("nan"))
    after = g.step(*args)
    assert torch.isfinite(after).all()
    return before, after


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 1)])
def test_few_row_steps_read_the_repacked_copies(dtype, rows):
    # At 1 row (fp32: 1 or 2) every projection and the LM head are read from their rows4 copies alone: with the
    # weights as they lie overwritten by NaN after the graph is built, a step still gives the same logits. (The
    # layers' copies once went into the layer descriptions after the native graph had taken its own copy of
    # them, so only the LM head's was read.) The tiny model's K (128, 344) are multiples of 8: no scalar tail
    # reads the weights as they lie.
    if not rows4_supported(dtype):
        pytest.skip(f"the {atb.build_info()['isa']} SIMD table has no rows4 kernel for {dtype}")
    model = random_model("tiny", dtype)
    with fp32_decode_copy(True):
        g, _, _ = _graph(model, max_batch=2, max_seq_len=32, repack=True)
        args = (torch.tensor([17, 40][:rows]), torch.tensor([0, 0][:rows]),
                torch.tensor([[0, 1], [2, 3]][:rows], dtype=torch.int32), torch.tensor([1, 1][:rows]),
                torch.tensor([0, 2 * BLOCK][:rows]))
        before, after = _steps_before_and_after_nan_weights(g, model, args)
    assert torch.equal(before, after)


@pytest.mark.parametrize("batch_copy", [False, True])
def test_fp32_copies_only_where_a_step_reads_them(batch_copy):
    # With the fp32 copy setting off the few-row steps read the weights as they lie, so a graph keeps copies only
    # of the weights its batch GEMM reads from one: none where no step has its kLinearPackedXMinRows (10) rows,
    # else those of _C.rows4_packed_x's K (rows under 16 KiB with the batch copy setting on, Intel's default;
    # otherwise K * 4 a multiple of 4 KiB: here the hidden size 1024's q/k/v, gate/up and LM head, not the down
    # projection's K = 344). Its steps give the bits of a graph without copies, and so they do with the setting
    # turned on after the build (steps read the weights as they lie where there is no copy).
    from atb import _C
    from atb.kernels._common import DTYPE_CODES

    if not rows4_supported(torch.float32):
        pytest.skip(f"the {atb.build_info()['isa']} SIMD table has no rows4 kernel for torch.float32")
    tiny = dict(hidden_size=1024, intermediate_size=344, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False)
    model = random_model(tiny, torch.float32)
    prompts = [[5, 17, 200, 2], [9], [7, 7, 7]]
    plain_graph = _graph(model, max_batch=3, max_seq_len=32, repack=False)[0]
    _, plain = _run(plain_graph, prompts, 4, 2)
    with fp32_decode_copy(True):
        everything = _graph(model, max_batch=3, max_seq_len=32, repack=True)[0].repacked_bytes
    with fp32_decode_copy(False), fp32_batch_copy(batch_copy):
        assert _graph(model, max_batch=3, max_seq_len=32, repack=True)[0].repacked_bytes == 0
        g = _graph(model, max_batch=16, max_seq_len=32, repack=True)[0]
        _, off = _run(g, prompts, 4, 2)
        fp32 = DTYPE_CODES[torch.float32]
        some, every = _C.rows4_packed_x(fp32, 1024), _C.rows4_packed_x(fp32, 344)
    if every:
        assert g.repacked_bytes == everything
    elif some:
        assert 0 < g.repacked_bytes < everything
    else:
        assert g.repacked_bytes == 0
    with fp32_decode_copy(True):
        _, on = _run(g, prompts, 4, 2)
    for a, b, c in zip(plain, off, on):
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))


def test_fp32_batch_copy_reads_rows_under_16_kib():
    # Where the table has the kernel, fp32 rows that alias in L1 (K * 4 a multiple of 4 KiB) always read the
    # copy; with the batch copy setting on, so does every row shorter than 16 KiB; longer ones stream as they lie.
    from atb import _C
    from atb.kernels._common import DTYPE_CODES

    fp32 = DTYPE_CODES[torch.float32]
    has = _C.rows4_packed_x(fp32, 1024)
    ks = (576, 4095, 4096, 4100, 5632, 8192)
    with fp32_batch_copy(True):
        assert [_C.rows4_packed_x(fp32, k) for k in ks] == [has, has, has, False, False, has]
    with fp32_batch_copy(False):
        assert [_C.rows4_packed_x(fp32, k) for k in ks] == [False, False, has, False, False, has]
    assert atb.build_info()["fp32_batch_copy"] == bool(_C.fp32_batch_copy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_steps_read_the_repacked_copies(dtype):
    # From 16 rows the batch GEMM reads the per-core rows4 pieces too where it can (_C.rows4_packed_x: bf16, and
    # fp32 rows under 16 KiB with the batch copy setting on): a batch-16 step gives the same logits with the
    # weights as they lie overwritten by NaN, and the same logits as a graph without copies (fp32: with the
    # few-row steps reading the weights as they lie, the copies are there for the batch steps alone).
    from atb import _C
    from atb.kernels._common import DTYPE_CODES

    with fp32_batch_copy(True), fp32_decode_copy(False):
        model = random_model("tiny", dtype)
        if not all(_C.rows4_packed_x(DTYPE_CODES[dtype], k) for k in (model.config.hidden_size,
                                                                       model.config.intermediate_size)):
            pytest.skip(f"the {atb.build_info()['isa']} SIMD table's batch GEMM reads no {dtype} rows4 copies")
        n = 16
        args = (torch.arange(17, 17 + n), torch.zeros(n, dtype=torch.int32),
                torch.arange(2 * n, dtype=torch.int32).reshape(n, 2), torch.ones(n, dtype=torch.int32),
                torch.arange(n, dtype=torch.int32) * 2 * BLOCK)
        plain = _graph(model, max_batch=n, max_seq_len=32, repack=False)[0].step(*args).clone()
        g = _graph(model, max_batch=n, max_seq_len=32, repack=True)[0]
        assert g.repacked_bytes > 0
        before, after = _steps_before_and_after_nan_weights(g, model, args)
    assert torch.equal(before, plain) and torch.equal(before, after)


def test_rows4_streams_reject_a_wrong_buffer():
    # The native packing checks the buffer against its plan and writes nothing into a rejected one.
    if not rows4_supported(torch.float32):
        pytest.skip(f"the {atb.build_info()['isa']} SIMD table has no rows4 kernel for torch.float32")
    with fp32_decode_copy(True):
        g, _, _ = _graph(random_model("tiny", torch.float32), max_batch=1, max_seq_len=32, repack=True)
        native = g._g
        planned = native.plan_rows4_streams()
    assert planned == g.repacked_bytes > 0
    buf = torch.full((planned + 128,), 7, dtype=torch.uint8)
    base = buf.data_ptr() + (-buf.data_ptr()) % 64
    with pytest.raises(ValueError, match=f"DecodeGraph.pack_rows4_streams: the plan takes {planned} bytes "
                                         rf"\(plan_rows4_streams\), got a buffer of {planned - 1}"):
        native.pack_rows4_streams(base, planned - 1)
    with pytest.raises(ValueError, match="DecodeGraph.pack_rows4_streams: the buffer must be 64-byte aligned"):
        native.pack_rows4_streams(base + 8, planned)
    assert torch.equal(buf, torch.full_like(buf, 7))


def test_repack_needs_the_kernel():
    model = random_model("tiny", torch.float16)
    with pytest.raises(ValueError, match="DecodeGraph: repack=True needs the rows4 kernel for torch.float16"):
        _graph(model, max_batch=1, max_seq_len=32, repack=True)
    with pytest.raises(TypeError, match="DecodeGraph: repack must be None, True or False, got 'yes'"):
        _graph(model, max_batch=1, max_seq_len=32, repack="yes")
    assert _graph(model, max_batch=1, max_seq_len=32)[0].repacked_bytes == 0  # fp16: no rows4 kernel


def _graph_over_noise():
    """A tiny graph for 2 sequences of up to 32 positions over 8 blocks whose caches hold noise, with copies of
    the caches (to check that a rejected call wrote nothing)."""
    g, kc, vc = _graph(random_model("tiny", torch.float32), max_batch=2, max_seq_len=32, num_blocks=8)
    kc.normal_()
    vc.normal_()
    return g, kc, vc, kc.clone(), vc.clone()


def _valid_meta():
    return dict(token_ids=torch.tensor([3, 4]), positions=torch.tensor([0, 5]),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), context_lens=torch.tensor([1, 6]),
                slot_mapping=torch.tensor([0, 2 * BLOCK + 5]))


@pytest.mark.parametrize("field,value,match", [
    ("block_tables", torch.tensor([[0, 1], [2, 99]], dtype=torch.int32), None),  # unused column: allowed
    ("block_tables", torch.tensor([[0, 1], [99, 3]], dtype=torch.int32), r"block_tables\[1\]\[0\] = 99"),
    ("block_tables", torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32), r"block_tables\[0\]\[0\] = -1"),
    ("positions", torch.tensor([0, 32]), r"positions\[1\] = 32 is outside \[0, max_seq_len=32\)"),
    ("token_ids", torch.tensor([3, 1024]), r"token_ids\[1\] = 1024 is outside the vocabulary"),
    ("context_lens", torch.tensor([1, 33]), r"context_lens\[1\] = 33"),
    ("slot_mapping", torch.tensor([0, 8 * BLOCK]), r"slot_mapping\[1\] = 128 is outside"),
    ("slot_mapping", torch.tensor([7, 7]), r"slot_mapping\[0\] and slot_mapping\[1\] are both 7"),
])
def test_invalid_metadata_raises_before_writing(field, value, match):
    g, kc, vc, k0, v0 = _graph_over_noise()
    meta = _valid_meta()
    meta[field] = value
    if match is None:
        g.step(**meta)
        assert not torch.equal(kc, k0)
        return
    with pytest.raises(ValueError, match=match):
        g.step(**meta)
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


def test_bad_arguments():
    model = random_model("tiny", torch.float32)
    g, _, _ = _graph(model, max_batch=2, max_seq_len=32, num_blocks=8)
    meta = _valid_meta()
    with pytest.raises(ValueError, match="positions has 1 entries, token_ids has 2"):
        g.step(**dict(meta, positions=torch.tensor([0])))
    with pytest.raises(ValueError, match=r"batch 3 is outside \[1, max_batch=2\]"):
        g.step(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), torch.zeros(3, 1, dtype=torch.int32),
               torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="slot_mapping must be int32"):
        g.step(**dict(meta, slot_mapping=meta["slot_mapping"].float()))
    with pytest.raises(ValueError, match="logits_out must be"):
        g.step(**meta, logits_out=torch.empty(2, 5))
    kc, vc = _caches(model, 8, torch.float32)
    with pytest.raises(TypeError, match="key_caches\\[0\\] is torch.float16"):
        DecodeGraph.from_model(model, key_caches=list(kc.half().unbind(0)), value_caches=list(vc.unbind(0)),
                               max_batch=1, max_seq_len=32)
    from atb.registry import get_adapter

    lw = get_adapter(model).layer_weights(model, 0)
    with pytest.raises(TypeError, match=r"layers\[0\] must be a LayerWeights, got dict"):
        DecodeGraph.from_weights({"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "eps": 1e-5},
                                 [lw.tensors()], embed=model.model.embed_tokens.weight.detach(),
                                 final_norm=model.model.norm.weight.detach(), lm_head=model.lm_head.weight.detach(),
                                 cos=torch.ones(32, 32), sin=torch.ones(32, 32), key_caches=list(kc.unbind(0))[:1],
                                 value_caches=list(vc.unbind(0))[:1], max_batch=1)
    with pytest.raises(ValueError, match="bfloat16 is not supported on Ascend910"):
        mb = random_model("tiny", torch.bfloat16)
        kb, vb = _caches(mb, 8, torch.bfloat16)
        DecodeGraph.from_model(mb, key_caches=list(kb.unbind(0)), value_caches=list(vb.unbind(0)), max_batch=1,
                               max_seq_len=32, soc_type="Ascend910")


def test_argmax_and_logits_out():
    model = random_model("tiny", torch.float32)
    g, _, _ = _graph(model, max_batch=2, max_seq_len=32, num_blocks=8)
    out = torch.empty(2, 1024)
    am = torch.empty(2, dtype=torch.int32)
    logits = g.step(**_valid_meta(), logits_out=out, argmax_out=am)
    assert logits is out and torch.equal(am.long(), out.argmax(-1))


def test_profiling():
    model = random_model("tiny", torch.float32)
    g, _, _ = _graph(model, max_batch=2, max_seq_len=32, num_blocks=8)
    g.step(**_valid_meta())
    assert g.profile()["steps"] == 0 and all(e["calls"] == 0 for e in g.profile()["nodes"].values())
    g.profiling = True
    g.step(**_valid_meta())
    g.step(**_valid_meta())
    p = g.profile()
    assert p["steps"] == 2
    assert set(p["nodes"]) == {"embed", "norm", "qkv", "rope", "cache_write", "attention", "o_proj", "mlp", "lm_head"}
    assert p["nodes"]["attention"]["calls"] == 2 * 2 and p["nodes"]["lm_head"]["calls"] == 2
    assert all(e["ms"] > 0 for e in p["nodes"].values())
    g.reset_profile()
    assert g.profile()["steps"] == 0


@pytest.mark.skipif(not hasattr(atb.kernels, "flash_attention"), reason="TransformerInfer prefill needs flash_attention")
def test_transformer_infer_graph_mode_equals_python_path_and_hf(smollm2_fp32):
    model, tok = smollm2_fp32
    texts = ["What is the capital of France?", "hi", "Write a haiku about the sea.", "1, 2, 3,",
             "List three prime numbers."]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"])
               for t in texts]
    fast = atb.TransformerInfer(model, max_seq_len=192, max_batch_size=5, block_size=16, graph_mode=True)
    slow = atb.TransformerInfer(model, max_seq_len=192, max_batch_size=5, block_size=16, graph_mode=False)
    assert fast.graph_mode and not slow.graph_mode and fast.decode_graph is not None
    one = fast.generate([prompts[0]], max_new_tokens=64)
    assert one == slow.generate([prompts[0]], max_new_tokens=64)
    outs = fast.generate(prompts, max_new_tokens=64)
    assert outs == slow.generate(prompts, max_new_tokens=64)
    assert outs[0] == one[0]
    for p, out in zip(prompts, outs):
        _assert_greedy_matches_hf(model, p, p + out)


def test_step_greedy_equals_single_greedy_steps():
    """n native steps give the tokens and the KV caches of n single steps fed their own argmax, across a block
    boundary (sequence 1 goes from position 13 into its second block)."""
    model = random_model("tiny", torch.float32)
    multi, kc_m, vc_m = _graph(model, max_batch=2, max_seq_len=32, num_blocks=8)
    single, kc_s, vc_s = _graph(model, max_batch=2, max_seq_len=32, num_blocks=8)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    tok, pos = torch.tensor([3, 4], dtype=torch.int32), torch.tensor([2, 13], dtype=torch.int32)
    for kc, vc in ((kc_m, vc_m), (kc_s, vc_s)):  # the same earlier context in both caches
        torch.manual_seed(0)
        kc.normal_()
        vc.normal_()
    slots = lambda p: torch.stack([tables[b, p[b] // BLOCK] * BLOCK + p[b] % BLOCK for b in range(2)])
    n = 6
    tokens = multi.step_greedy(n, tok, pos, tables, pos + 1, slots(pos))
    assert tokens.dtype == torch.int32 and tuple(tokens.shape) == (n, 2)
    expected = []
    am = torch.empty(2, dtype=torch.int32)
    for s in range(n):
        p = pos + s
        single.step(tok, p, tables, p + 1, slots(p), argmax_out=am)
        expected.append(am.clone())
        tok = am.clone()
    assert torch.equal(tokens, torch.stack(expected))
    assert torch.equal(kc_m, kc_s) and torch.equal(vc_m, vc_s)
    # Stop tokens: the call ends after the step by which every row has produced one (a row's later tokens
    # still run until then), never before; tokens not produced change nothing.
    kc_m.copy_(kc_s)
    vc_m.copy_(vc_s)
    tok = torch.tensor([3, 4], dtype=torch.int32)
    a, b = int(tokens[1, 0]), int(tokens[4, 1])
    want = max(min(s for s in range(n) if int(tokens[s, r]) in (a, b)) for r in (0, 1)) + 1
    got = multi.step_greedy(n, tok, pos, tables, pos + 1, slots(pos), stop_tokens=[a, b])
    assert torch.equal(got, tokens[:want]) and want < n
    unseen = sorted(set(range(model.config.vocab_size)) - set(tokens.flatten().tolist()))[:3]
    assert torch.equal(multi.step_greedy(n, tok, pos, tables, pos + 1, slots(pos), stop_tokens=unseen), tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q_lens_rows_equal_rows_decoded_one_sequence_each(dtype):
    """q_lens (speculative verification): consecutive tokens of a sequence as rows of one step, its K/V read
    once, give bit for bit the logits and caches of the same rows stepped as one-token sequences (each with
    its own context), across a block boundary and with a one-row sequence between."""
    model = random_model("tiny", dtype)
    multi, kc_m, vc_m = _graph(model, max_batch=8, max_seq_len=64, num_blocks=12)
    rows, kc_r, vc_r = _graph(model, max_batch=8, max_seq_len=64, num_blocks=12)
    torch.manual_seed(1)
    kc_m.normal_()
    vc_m.normal_()
    kc_r.copy_(kc_m)
    vc_r.copy_(vc_m)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    q_lens = torch.tensor([4, 1, 3], dtype=torch.int32)
    ctx = torch.tensor([18, 9, 40], dtype=torch.int32)     # sequence 0's rows cross from block 0 into block 1
    owner = torch.repeat_interleave(torch.arange(3), q_lens.long())
    positions = torch.cat([torch.arange(c - q, c) for c, q in zip(ctx.tolist(), q_lens.tolist())]).to(torch.int32)
    slots = tables[owner, positions // BLOCK] * BLOCK + positions % BLOCK
    tokens = torch.randint(0, model.config.vocab_size, (int(q_lens.sum()),), dtype=torch.int32)
    am_m, am_r = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int32)
    got = multi.step(tokens, positions, tables, ctx, slots, argmax_out=am_m, q_lens=q_lens).clone()
    want = rows.step(tokens, positions, tables[owner], positions + 1, slots, argmax_out=am_r)
    assert torch.equal(got, want) and torch.equal(am_m, am_r)
    assert torch.equal(kc_m, kc_r) and torch.equal(vc_m, vc_r)


@pytest.mark.parametrize("change,match", [
    (dict(q_lens=[2, 2]), r"q_lens\[1\] = 2 is outside \[1, context_lens\[1\] = 6\] or past the 3 token rows"),
    (dict(q_lens=[2]), r"context_lens has 2 entries, q_lens has 1"),
    (dict(q_lens=[3, 1], context_lens=[2, 6]), r"q_lens\[0\] = 3 is outside \[1, context_lens\[0\] = 2\]"),
    (dict(positions=[0, 2, 5]), r"positions\[1\] = 2, but sequence 0's row 1 of 2 with context_lens 2 is at "
                                r"position 1"),
    (dict(q_lens=[1, 1], positions=[1, 5, 5]), r"q_lens sum to 2, token_ids has 3 rows"),
])
def test_q_lens_metadata_is_checked_before_writing(change, match):
    g, kc, vc = _graph(random_model("tiny", torch.float32), max_batch=4, max_seq_len=32, num_blocks=8)
    kc.normal_()
    vc.normal_()
    k0, v0 = kc.clone(), vc.clone()
    meta = dict(token_ids=torch.tensor([3, 4, 5]), positions=torch.tensor([0, 1, 5]),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), context_lens=torch.tensor([2, 6]),
                slot_mapping=torch.tensor([0, 1, 2 * BLOCK + 5]), q_lens=torch.tensor([2, 1]))
    meta.update({k: torch.tensor(v) for k, v in change.items()})
    with pytest.raises(ValueError, match=match):
        g.step(**meta)
    assert torch.equal(kc, k0) and torch.equal(vc, v0)
    g.step(**_valid_meta())   # the graph still steps


@pytest.mark.parametrize("steps,tables,match", [
    (0, [[0, 1], [2, 3]], "steps must be an int >= 1"),
    # sequence 1 starts at position 5: 27 steps reach position 31 (allowed), 28 reach max_seq_len = 32
    (28, [[0, 1], [2, 3]], r"step 27 of sequence 1 is at position 32, past max_seq_len=32"),
    # step 11 of sequence 1 (position 16) is the first in its second block, which is outside the pool
    (12, [[0, 1], [2, 99]], r"block_tables\[1\]\[1\] = 99"),
    (12, [[0], [2]], r"step 11 of sequence 1 is at position 16, past .* block table's 1 blocks"),
])
def test_step_greedy_checks_every_step_before_writing(steps, tables, match):
    g, kc, vc, k0, v0 = _graph_over_noise()
    meta = dict(_valid_meta(), block_tables=torch.tensor(tables, dtype=torch.int32))
    with pytest.raises(ValueError, match=match):
        g.step_greedy(steps, **meta)
    assert torch.equal(kc, k0) and torch.equal(vc, v0)
    g.step_greedy(2, **_valid_meta())  # the graph still steps
