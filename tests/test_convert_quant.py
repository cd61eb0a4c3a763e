"""`atb convert --quantize`: atb's W8A16 / W4A16 formats on disk, loaded and run as stored, refused by stock HF."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import atb
from atb import checkpoints, cli, convert
from atb.quant.formats import QuantizedWeight

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def same_codes(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    return (isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight) and a.shape == b.shape
            and a.bits == b.bits and a.group_size == b.group_size and torch.equal(a.data, b.data)
            and a.scale.dtype == b.scale.dtype and torch.equal(a.scale, b.scale)
            and (a.min is None) == (b.min is None) and (a.min is None or torch.equal(a.min, b.min)))


def assert_same_weights(loaded, ref):
    """Every quantized tensor of ``loaded`` (read from DST) equals ``ref`` (quantized in memory), bit for bit."""
    for i, (a, b) in enumerate(zip(loaded.layers, ref.layers)):
        for f in ("q", "k", "v", "o", "gate", "up", "down"):
            assert same_codes(getattr(a, f), getattr(b, f)), (i, f, getattr(a, f), getattr(b, f))
    assert len(loaded.layers) == len(ref.layers)
    assert same_codes(loaded.embed, ref.embed)
    assert loaded.tied == ref.tied
    assert same_codes(loaded.lm_head, ref.lm_head)


def greedy(model, ids, quantize=None, n=12):
    infer = atb.TransformerInfer(model, max_seq_len=128, quantize=quantize)
    return infer.generate([ids], max_new_tokens=n)[0]


def smollm2_float_dir():
    """The embedded SmolLM2 as fp32 safetensors (atb's cache of the GGUF: stock HF loads it)."""
    checkpoints.load_model(progress=False)  # makes the cache on first use
    return os.path.join(checkpoints.cache_dir(), checkpoints._file_hash(checkpoints.default_model_path()))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random untied llama in 4 safetensors shards, with SmolLM2's tokenizer (hence its vocabulary size).
    K = 96 and 200 are not multiples of 64 / 128: the groups have tails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                                         max_position_embeddings=256, tie_word_embeddings=False)).eval()
    src = tmp_path_factory.mktemp("tiny") / "src"
    model.save_pretrained(src, max_shard_size="12MB")
    assert len(list(src.glob("*.safetensors"))) >= 3
    for f in glob.glob(os.path.join(smollm2_float_dir(), "tokenizer*")):
        shutil.copy(f, src)
    return model, src


@pytest.mark.parametrize("fmt, group", [("w8a16", None), ("w4a16", None), ("w4a16", 128), ("w8a16", 64)])
def test_tiny_llama_runs_as_stored(tiny, tmp_path, fmt, group):
    model, src = tiny
    dst = tmp_path / "q"
    argv = ["convert", str(src), str(dst), "--quantize", fmt, "--quiet"]
    assert cli.main(argv + ([] if group is None else ["--group-size", str(group)])) == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "atb" and qc["format"] == fmt
    assert qc["group_size"] == (group if group is not None else (0 if fmt == "w8a16" else 32))
    assert not (dst / "model.safetensors.index.json").exists()

    loaded, tok = checkpoints.load_model(str(dst), progress=False)
    ref = atb.quantize(model, fmt, group)
    assert_same_weights(loaded.atb_quantized, ref)
    # No float copy of a quantized weight: those parameters are zero-stride placeholders; the rest are real.
    for name, p in loaded.named_parameters():
        placeholder = name.endswith("_proj.weight") or "embed_tokens" in name or name == "lm_head.weight"
        assert (p.untyped_storage().nbytes() == p.element_size()) == placeholder, name
    assert not any(b.is_meta for b in loaded.buffers())
    ids = tok("The capital of France is")["input_ids"]
    want = greedy(model, ids, ref)
    assert greedy(loaded, ids) == want
    assert greedy(loaded, ids, "native") == want  # "native" on a converted model: its stored weights
    with pytest.raises(ValueError, match="stored quantized"):
        atb.TransformerInfer(loaded, max_seq_len=64, quantize="w8a16")
    # The stock forward of a weightless module names the way to run it; patch_hf_model runs it.
    with pytest.raises(RuntimeError, match="stored atb-quantized"), torch.no_grad():
        loaded(torch.tensor([ids]))
    atb.patch_hf_model(loaded)
    ref_model = type(model)(model.config).eval()
    ref_model.load_state_dict(model.state_dict())
    atb.patch_hf_model(ref_model, quantize=ref)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ref_model(x).logits)
        out = loaded.generate(x, max_new_tokens=6, do_sample=False)
        assert torch.equal(out, ref_model.generate(x, max_new_tokens=6, do_sample=False))


def test_stored_layout_and_float_tensors(tiny, tmp_path):
    from safetensors import safe_open

    model, src = tiny
    dst = tmp_path / "q"
    convert.convert(str(src), str(dst), "bfloat16", quantize="w4a16", group_size=64, progress=False,
                    max_shard_size="2MB")
    index = json.loads((dst / convert.QUANT_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(s.startswith("atb-model-") for s in shards)
    seen = {}
    for s in shards:
        with safe_open(str(dst / s), "pt") as f:
            described = json.loads(f.metadata()["atb_quant"]) if "atb_quant" in f.metadata() else {}
            for key in f.keys():
                seen[key] = f.get_tensor(key)
            for prefix, d in described.items():
                assert {f"{prefix}.qweight", f"{prefix}.scales"} <= set(f.keys())
                assert d["shape"] == list(model.get_submodule(prefix).weight.shape)
    q = "model.layers.1.mlp.down_proj"  # K = 200: k_pad 224, groups of 64 -> 4 (the last one short)
    assert seen[f"{q}.qweight"].dtype == torch.uint8 and list(seen[f"{q}.qweight"].shape) == [96, 112]
    assert list(seen[f"{q}.scales"].shape) == [96, 4] and seen[f"{q}.mins"].dtype == torch.float16
    emb = "model.embed_tokens"  # the table at 8 bits per channel by default, fp32 scales
    assert seen[f"{emb}.qweight"].dtype == torch.int8 and list(seen[f"{emb}.scales"].shape) == [49152, 1]
    assert "model.embed_tokens.mins" not in seen
    # Norms are stored in --dtype, under their own names.
    assert seen["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(seen["model.norm.weight"], model.model.norm.weight.detach().to(torch.bfloat16))
    assert sum(t.numel() * t.element_size() for t in seen.values()) == index["metadata"]["total_size"]


def test_embed_format_float_keeps_the_tables(tiny, tmp_path):
    model, src = tiny
    dst = tmp_path / "q"
    convert.convert(str(src), str(dst), "float32", quantize="w8a16", embed_format="float", progress=False)
    loaded, tok = checkpoints.load_model(str(dst), progress=False)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ref = atb.quantize(model, "w8a16", embed_format=None)
    ids = tok("Hello")["input_ids"]
    assert greedy(loaded, ids) == greedy(model, ids, ref)


def test_smollm2_w8a16_and_w4a16_match_in_memory_quantize(tmp_path):
    """SmolLM2 (tied table) from its float checkpoint: the converted DST holds atb.quantize's codes and
    answers the capital-of-France prompt with the same greedy tokens."""
    src = smollm2_float_dir()
    model, tok = checkpoints.load_model(src, progress=False)
    ids = cli._token_ids(tok.apply_chat_template(PROMPT, add_generation_prompt=True))
    for fmt in ("w8a16", "w4a16"):
        dst = tmp_path / fmt
        convert.convert(src, str(dst), "float32", quantize=fmt, progress=False)
        loaded, _ = checkpoints.load_model(str(dst), progress=False)
        ref = atb.quantize(model, fmt)
        assert_same_weights(loaded.atb_quantized, ref)
        assert loaded.atb_quantized.tied and loaded.atb_quantized.lm_head is loaded.atb_quantized.embed
        got = greedy(loaded, ids, n=16)
        assert got == greedy(model, ids, ref, n=16)
        assert "Paris" in tok.decode(got)
        stored = sum(os.path.getsize(p) for p in glob.glob(str(dst / "*.safetensors")))
        assert stored < 0.4 * 4 * sum(p.numel() for p in model.parameters())


def test_gguf_source_keeps_q4_1_and_q8_0_blocks(tmp_path):
    """The embedded GGUF is Q4_1 with a Q8_0 table: --quantize w4a16 stores those blocks as they are (the
    tensors quantize='native' runs), with no float round trip; --group-size 128 re-quantizes the layers."""
    from atb.quant.gguf import load_native

    gguf_path = checkpoints.default_model_path()
    dst = tmp_path / "w4"
    assert cli.main(["convert", gguf_path, str(dst), "--quantize", "w4a16", "--quiet"]) == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["kept_gguf_blocks"] == ["Q4_1", "Q8_0"] and qc["group_size"] == 32
    loaded, tok = checkpoints.load_model(str(dst), progress=False)
    model, _ = checkpoints.load_model(progress=False)
    native = load_native(model, gguf_path)
    assert_same_weights(loaded.atb_quantized, native)
    assert loaded.atb_quantized.layers[0].q.source.endswith("gguf:Q4_1")
    ids = cli._token_ids(tok.apply_chat_template(PROMPT, add_generation_prompt=True))
    got = greedy(loaded, ids, n=16)
    assert got == greedy(model, ids, "native", n=16) and "Paris" in tok.decode(got)

    dst = tmp_path / "w4g128"
    convert.convert(gguf_path, str(dst), "float32", quantize="w4a16", group_size=128, progress=False)
    loaded, _ = checkpoints.load_model(str(dst), progress=False)
    ref = atb.quantize(model, "w4a16", 128)
    assert all(same_codes(getattr(a, f), getattr(b, f)) for a, b in zip(loaded.atb_quantized.layers, ref.layers)
               for f in ("q", "k", "down"))
    assert same_codes(loaded.atb_quantized.embed, native.embed)  # Q8_0 table kept: 8 bits either way


def test_gguf_source_keeps_q4_k_blocks(smollm2_q4_k, tmp_path):
    """Q4_K tensors (fp32 scales: d * sc is not exact in fp16) are kept as their blocks too, beside Q4_1 and Q8_0
    ones; Q5_0 and Q6_K ones (8-bit, as w8a16) and Q5_1 ones (no native form) are re-quantized to the 4-bit
    target like any float."""
    from atb.quant.gguf import load_native

    model, _, path = smollm2_q4_k
    dst = tmp_path / "w4"
    assert cli.main(["convert", path, str(dst), "--quantize", "w4a16", "--quiet"]) == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["kept_gguf_blocks"] == ["Q4_1", "Q4_K", "Q8_0"]
    stored = checkpoints.load_model(str(dst), progress=False)[0].atb_quantized
    native, requantized = load_native(model, path), atb.quantize(model, "w4a16")
    for i, (a, b, c) in enumerate(zip(stored.layers, native.layers, requantized.layers)):
        assert all(same_codes(getattr(a, f), getattr(b, f)) for f in ("q", "k", "gate", "up"))
        assert same_codes(a.down, (b if i % 2 == 0 else c).down)  # Q4_K kept; Q6_K (8-bit) re-quantized
        assert same_codes(a.v, c.v) and same_codes(a.o, c.o)  # Q5_0 (8-bit) and Q5_1 (no native form)
    assert stored.layers[0].down.source.endswith("gguf:Q4_K") and stored.layers[0].down.scale.dtype == torch.float32
    assert same_codes(stored.embed, native.embed)


def test_gguf_native_conversion_keeps_every_native_tensor(smollm2_q4_k, tmp_path):
    """--quantize native: every Q8_0 / Q5_0 / Q4_1 / Q4_K / Q6_K tensor as its blocks whatever its width, the others
    (the fixture's Q5_1 attn_output) float; native+w8a16-g32 quantizes those as atb.quantize would."""
    from atb.quant.gguf import load_native

    model, _, path = smollm2_q4_k
    native = load_native(model, path)
    for spec in ("native", "native+w8a16-g32"):
        dst = tmp_path / spec
        assert cli.main(["convert", path, str(dst), "--quantize", spec, "--quiet"]) == 0
        qc = json.loads((dst / "config.json").read_text())["quantization_config"]
        assert (qc["format"], qc["kept_gguf_blocks"]) == (spec, ["Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0"])
        stored = checkpoints.load_model(str(dst), progress=False)[0].atb_quantized
        for a, b in zip(stored.layers, native.layers):
            assert all(same_codes(getattr(a, f), getattr(b, f)) for f in ("q", "k", "v", "gate", "up", "down"))
        o, hf_o = stored.layers[3].o, model.model.layers[3].self_attn.o_proj.weight.detach()
        if spec == "native":
            assert torch.equal(o, hf_o)  # float, as transformers dequantized it
        else:
            assert same_codes(o, atb.quantize(hf_o, "w8a16", 32))


def test_gguf_native_load_reads_blocks_once_and_caches(smollm2_q4_k, tmp_path, monkeypatch):
    """load_model(gguf, quantize="native"): the model carries the file's own blocks (no float copy of them), the
    conversion is cached by file and spec, and it runs to the tokens of the float model with the same weights."""
    from atb.quant.gguf import load_native

    model, tok, path = smollm2_q4_k
    monkeypatch.setenv("ATB_CACHE_DIR", str(tmp_path / "cache"))
    first, _ = checkpoints.load_model(path, progress=False, quantize="native")
    assert len(os.listdir(tmp_path / "cache")) == 1 and os.listdir(tmp_path / "cache")[0].endswith("-native")
    loaded, tok2 = checkpoints.load_model(path, progress=False, quantize="native")  # from the cache
    assert loaded.atb_source_path == os.path.abspath(path)
    alias, _ = checkpoints.load_model(path, progress=False, quantize="gguf")  # the alias: the same cache entry
    assert alias.atb_quantization_config["format"] == "native" and len(os.listdir(tmp_path / "cache")) == 1
    for a, b in zip(loaded.atb_quantized.layers, first.atb_quantized.layers):
        assert all(same_codes(getattr(a, f), getattr(b, f)) for f in ("q", "k", "v", "gate", "up", "down"))
        assert torch.equal(a.o, b.o)  # the Q5_1 tensors: float
    native = load_native(model, path)
    assert all(same_codes(a.down, b.down) and same_codes(a.v, b.v) for a, b in
               zip(loaded.atb_quantized.layers, native.layers))
    assert loaded.model.layers[0].mlp.down_proj.weight.stride() == (0, 0)  # a placeholder: no float copy
    ids = cli._token_ids(tok2.apply_chat_template(PROMPT, add_generation_prompt=True))
    infer = atb.TransformerInfer(loaded, max_seq_len=128, quantize="native")
    assert infer.memory_summary()["quantize"] == "stored:native"
    want = greedy(model, ids, f"gguf:{path}", n=10)
    assert infer.generate([ids], max_new_tokens=10)[0] == want
    from_path = atb.TransformerInfer(path, max_seq_len=128, quantize="native")  # the file's path: the same load
    assert from_path.memory_summary()["quantize"] == "stored:native"
    assert from_path.generate([ids], max_new_tokens=10)[0] == want


def test_gguf_native_errors(smollm2_q4_k, tiny, tmp_path):
    _, _, path = smollm2_q4_k
    tiny = tiny[1]
    with pytest.raises(checkpoints.ModelLoadError, match="not a GGUF file"):
        checkpoints.load_model(str(tiny), progress=False, quantize="native")
    with pytest.raises(ValueError, match="quantize must be 'native' or 'native\\+<format>'"):
        checkpoints.load_model(path, progress=False, quantize="w8a16")
    with pytest.raises(convert.ConvertError, match="has no GGUF Q8_0/Q5_0/Q4_0/Q4_1/Q4_K/Q6_K tensors"):
        convert.convert(str(tiny), str(tmp_path / "a"), "float32", quantize="native", progress=False)
    with pytest.raises(convert.ConvertError, match="--group-size: with --quantize native"):
        convert.convert(path, str(tmp_path / "b"), "float32", quantize="native", group_size=32, progress=False)
    with pytest.raises(convert.ConvertError, match="after 'native\\+' comes the format"):
        convert.convert(path, str(tmp_path / "c"), "float32", quantize="native+w6a16", progress=False)
    assert not any(p.name in "abc" for p in tmp_path.iterdir())


def test_stock_transformers_refuses_a_quantized_checkpoint(tiny, tmp_path):
    """Stock from_pretrained stops with an error that says what the directory is and how to load it (not a
    missing-file OSError, nor a model with random projections); atb's loaders still read it."""
    _, src = tiny
    dst = tmp_path / "q"
    convert.convert(str(src), str(dst), "float32", quantize="w4a16", progress=False)
    code = ("from transformers import AutoModelForCausalLM\n"
            f"AutoModelForCausalLM.from_pretrained({str(dst)!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: ") and "atb quantized checkpoint (atb convert --quantize w4a16)" in last
    assert "load it with atb" in last and "atb.TransformerInfer(path)" in last
    loaded, _ = checkpoints.load_model(str(dst), progress=False)
    assert not hasattr(loaded.config, "transformers_weights") and not hasattr(loaded.config, "quantization_config")


def test_engine_from_a_quantized_directory_path(tiny, tmp_path):
    """TransformerInfer(path) loads a quantized DST as stored (no float copy) and reports the bytes saved
    exactly as an engine that quantized the same float model in memory does."""
    model, src = tiny
    dst = tmp_path / "q"
    convert.convert(str(src), str(dst), "bfloat16", quantize="w4a16", group_size=64, progress=False)
    from_path = atb.TransformerInfer(str(dst), max_seq_len=64)
    assert from_path.dtype == torch.bfloat16  # the dtype the float tensors were stored in
    # convert quantizes the float32 source; so does this engine, computing in the same bfloat16.
    in_memory = atb.TransformerInfer(model, max_seq_len=64, quantize="w4a16-g64", dtype=torch.bfloat16)
    ids = [[5, 17, 300, 4000, 42]]
    assert from_path.generate(ids, max_new_tokens=8) == in_memory.generate(ids, max_new_tokens=8)

    got, want = from_path.memory_summary(), in_memory.memory_summary()
    assert got["quantize"] == "stored:w4a16-g64" and want["quantize"] == "w4a16-g64"
    for key in ("weights_bytes", "weights_bytes_unquantized", "weights_bytes_saved"):
        assert got[key] == want[key], key
    # The tables (8-bit per channel) are nearly all of this model: about half of their bf16 bytes saved.
    assert got["weights_bytes_saved"] > 0.45 * got["weights_bytes_unquantized"]
    loaded, _ = checkpoints.load_model(str(dst), torch.float32, progress=False)
    assert atb.TransformerInfer(loaded, max_seq_len=64).memory_summary()["quantize"] == "stored:w4a16-g64"
    assert "weights_bytes_saved" not in atb.TransformerInfer(model, max_seq_len=64).memory_summary()


def test_tensor_parallel_refuses_a_quantized_checkpoint(tiny, tmp_path):
    """tp slices float weights: a quantized DST (path or loaded) is refused before any process group is joined."""
    import torch.distributed as dist

    _, src = tiny
    dst = tmp_path / "q"
    convert.convert(str(src), str(dst), "float32", quantize="w8a16", progress=False)
    with pytest.raises(ValueError, match=f"{dst} is an atb quantized checkpoint.*tp a float checkpoint"):
        atb.TransformerInfer(str(dst), max_seq_len=64, tp=2)
    loaded, _ = checkpoints.load_model(str(dst), progress=False)
    with pytest.raises(ValueError, match="stored quantized by atb convert.*tp a float checkpoint"):
        atb.TransformerInfer(loaded, max_seq_len=64, tp=2)
    assert not dist.is_initialized()


def test_killed_quantized_conversion_leaves_no_destination(tmp_path):
    dst = tmp_path / "q"
    p = subprocess.Popen([sys.executable, "-m", "atb", "convert", smollm2_float_dir(), str(dst), "--quantize",
                          "w4a16", "--max-shard-size", "20MB", "--quiet"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not glob.glob(str(tmp_path / ".q.atb-partial-*/atb-model-00002-*")):
        time.sleep(0.05)
    assert p.poll() is None, "conversion finished before it could be interrupted"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not dst.exists()
    # The next conversion to DST removes the dead process's partial directory.
    convert.convert(str(smollm2_float_dir()), str(dst), "float32", quantize="w8a16", embed_format="float",
                    progress=False, max_shard_size="100MB")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["q"]


def one_error(capsys, argv):
    try:
        status = cli.main(argv)
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atb: error:"), err
    return err[0]


def test_cli_errors(tiny, tmp_path, capsys):
    _, src = tiny
    dst = tmp_path / "q"
    assert "--dtype is required" in one_error(capsys, ["convert", str(src), str(dst)])
    assert "need --quantize" in one_error(capsys, ["convert", str(src), str(dst), "--dtype", "float32",
                                                   "--group-size", "64"])
    assert "group_size" in one_error(capsys, ["convert", str(src), str(dst), "--quantize", "w4a16", "--group-size",
                                              "0"])
    assert "--quantize" in one_error(capsys, ["convert", str(src), str(dst), "--quantize", "w2"])
    assert not dst.exists()
    convert.convert(str(src), str(dst), "float32", quantize="w8a16", progress=False)
    # A quantized checkpoint is not a float source.
    assert "already quantized" in one_error(capsys, ["convert", str(dst), str(tmp_path / "again"), "--dtype",
                                                     "float32"])
    # generate / chat run it as stored; re-quantizing it, or benching it against stock HF, is refused up front.
    capsys.readouterr()
    assert cli.main(["generate", "Hello", "--model", str(dst), "--max-new-tokens", "4", "--quiet", "--raw"]) == 0
    assert capsys.readouterr().out.strip()
    assert "already quantized" in one_error(capsys, ["generate", "Hello", "--model", str(dst), "--quantize", "w4a16"])
    assert "atb-quantized checkpoint" in one_error(capsys, ["bench", "--model", str(dst), "--quiet"])
    # --tp slices float weights: refused before torchrun's process group is looked for.
    for command in (["generate", "Hello"], ["serve"]):
        assert "tensor parallelism slices float weights" in one_error(capsys, command + ["--model", str(dst),
                                                                                         "--tp", "2"])
