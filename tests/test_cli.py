"""The command line, through subprocess, as a user runs it."""
import csv
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import atb


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "atb", *args], capture_output=True, text=True, timeout=timeout)


def test_socs_lists_the_table():
    r = run("socs")
    assert r.returncode == 0, r.stderr
    for name in atb.soc_names():
        assert name in r.stdout


def test_bench_tiny_preset_writes_json_and_csv(tmp_path):
    from atb.bench.layers import ROW_NAMES

    js, cs = tmp_path / "out.json", tmp_path / "out.csv"
    r = run("bench", "--config", "tiny", "--repeat", "1", "--prompt-len", "16", "--new-tokens", "3", "--batch", "2",
            "--json", str(js), "--csv", str(cs), "--quiet")
    assert r.returncode == 0, r.stderr
    records = json.loads(js.read_text())
    for phase in ("decode", "prefill"):
        names = [x["name"] for x in records if x["kind"] == "layer" and x["phase"] == phase]
        assert names == ROW_NAMES
    engines = {x["engine"] for x in records if x["kind"] == "end_to_end"}
    assert engines == {"HF stock", "patch_hf_model", "TransformerInfer"}
    for x in records:
        assert x["dtype"] == "float32" and x["threads"] >= 1 and x["cpu"]
    with open(cs) as f:
        assert len(list(csv.DictReader(f))) == len(records)
    assert "speedup" in r.stdout and "roofline" in r.stdout


def test_generate_matches_transformer_infer(smollm2_fp32):
    model, tok = smollm2_fp32
    prompt = "What is the capital of France?"
    r = run("generate", prompt, "--max-new-tokens", "12", "--seed", "0", "--quiet")
    assert r.returncode == 0, r.stderr
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = atb.TransformerInfer(model, max_seq_len=2048).generate([list(ids)], max_new_tokens=12)[0]
    assert r.stdout.strip() == tok.decode(out, skip_special_tokens=True).strip()
    assert "Paris" in r.stdout


def test_generate_with_speculative_decoding_gives_the_same_reply(smollm2_fp32):
    model, tok = smollm2_fp32
    prompt = ("Add docstrings to this Python class:\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
              "    def push(self, item):\n        self.items.append(item)\n")
    plain = run("generate", prompt, "--max-new-tokens", "40", "--quiet")
    spec = run("generate", prompt, "--max-new-tokens", "40", "--quiet", "--num-speculative-tokens", "3")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert spec.stdout == plain.stdout and "class Stack" in spec.stdout
    accepted = re.search(r"speculative: (\d+) of (\d+) draft tokens accepted", spec.stderr)
    assert accepted and 0 < int(accepted[1]) <= int(accepted[2]), spec.stderr


def test_check_supported_and_unsupported(tmp_path):
    r = run("check", "--config", "tiny", "--quiet")
    assert r.returncode == 0, r.stderr
    # An architecture no adapter covers: a tiny GPT-2 saved locally.
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    r = run("check", "--model", str(tmp_path), "--quiet")
    assert r.returncode != 0


@pytest.mark.parametrize("args, words", [
    (("bench", "--model", "/no/such/model"), "not found"),
    (("bench", "--config", "no-such-preset"), "unknown preset"),
    (("bench", "--dtype", "bfloat16", "--soc-type", "Ascend910", "--config", "tiny"), "bfloat16"),
    (("bench", "--soc-type", "Ascend999", "--config", "tiny"), "unknown SoC"),
    (("bench", "--dtype", "int8", "--config", "tiny"), "--dtype"),
])
def test_user_errors_are_one_line(args, words):
    r = run(*args)
    assert r.returncode == 2
    # Progress lines may precede it (stderr is not a terminal here); the error is one line, last, no traceback.
    lines = r.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("atb: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and words in errors[0], r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------- arguments checked before any load
def _one_error_line(r, words):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atb: error:") and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(path)
    return path


@pytest.mark.parametrize("args, words", [
    (("generate", "hi", "--top-p", "2"), "--top-p"),
    (("generate", "hi", "--top-p", "0"), "--top-p"),
    (("generate", "hi", "--max-new-tokens", "-1"), "--max-new-tokens"),
    (("generate", "hi", "--temperature", "-1"), "--temperature"),
    (("generate", "hi", "--top-k", "-3"), "--top-k"),
    (("generate", "hi", "--repetition-penalty", "0"), "--repetition-penalty"),
    (("generate", "hi", "--threads", "0"), "--threads"),
    (("generate", "hi", "--threads", "99"), "--threads"),
    (("generate", "hi", "--num-speculative-tokens", "-2"), "--num-speculative-tokens"),
    (("generate", "hi", "--lookup-history", "8"), "give --num-speculative-tokens too"),
    (("chat", "--max-new-tokens", "x"), "--max-new-tokens"),
    (("bench", "--threads", "0"), "--threads"),
    (("bench", "--json", "/no/such/dir/out.json"), "does not exist"),
    (("bench", "--csv", "/no/such/dir/out.csv", "--config", "tiny"), "does not exist"),
    (("bench", "--plot", "/no/such/dir/out.png"), "does not exist"),
    (("generate", "hi", "--model", "/no/such/model"), "not found"),
    (("generate", "hi", "--max-new-tokens", "4096"), "--max-seq-len"),
    (("generate", "hi", "--quantize", "w8a16", "--tp", "2"), "--tp 2 together are not supported"),
    (("serve", "--quantize", "w4a16", "--tp", "2"), "--tp 2 together are not supported"),
])
def test_bad_arguments_fail_before_loading(args, words):
    t0 = time.perf_counter()
    r = run(*args)
    _one_error_line(r, words)  # one line: no progress line, so nothing was loaded
    assert time.perf_counter() - t0 < 60


def test_unsupported_and_empty_model_dirs(gpt2_dir, tmp_path):
    r = run("generate", "hi", "--model", str(gpt2_dir))
    _one_error_line(r, "model_type 'gpt2' is not supported")
    r = run("chat", "--model", str(gpt2_dir))
    _one_error_line(r, "not supported")
    r = run("generate", "hi", "--model", str(tmp_path))
    _one_error_line(r, "config.json is missing")


def test_max_seq_len_defaults_to_the_model_limit(tmp_path):
    """A model with max_position_embeddings < 2048 runs without --max-seq-len."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from atb import checkpoints

    tok_dir = os.path.join(checkpoints.cache_dir(), checkpoints._file_hash(checkpoints.default_model_path()))
    if not os.path.isdir(tok_dir):
        checkpoints.load_model(progress=False)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=49152, max_position_embeddings=256)
                     ).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(tok_dir, f)):
            shutil.copy(os.path.join(tok_dir, f), tmp_path)
    r = run("generate", "hi", "--model", str(tmp_path), "--max-new-tokens", "4", "--quiet")
    assert r.returncode == 0, r.stderr
    r = run("generate", "hi", "--model", str(tmp_path), "--max-new-tokens", "300", "--quiet")
    _one_error_line(r, "--max-seq-len 256")


def test_socs_into_a_closed_pipe():
    p = subprocess.Popen([sys.executable, "-m", "atb", "socs"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the table is written, as with `| head -2`
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_soc_names_in_any_case():
    assert atb.get_soc("ascend910b4").name == "Ascend910B4"
    assert atb.get_soc("ASCEND310P").name == "Ascend310P"
    assert atb.get_soc("Host").name == "host"
    atb.set_soc("ascend910b4")
    try:
        assert atb.soc.default_soc() == "Ascend910B4"
    finally:
        atb.set_soc("host")
    with pytest.raises(ValueError, match="unknown SoC"):
        atb.get_soc("ascend999")


@pytest.mark.parametrize("module", ["kernels", "attention", "linear", "graph", "infer", "patch", "convert"])
def test_bench_modules_print_help_without_running(module):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", f"atb.bench.{module}", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m atb.bench.{module}")
    assert time.perf_counter() - t0 < 60


def test_bench_infer_prints_its_table_on_smollm2(capsys):
    # The end-to-end benchmark's main, as a user runs it (short): the table rows and the footer with the
    # machine's measured read rate and the bytes one decode step reads.
    from atb.bench import infer
    from atb.bench.roofline import decode_step_bytes, decode_token_flops
    from atb.checkpoints import load_model

    results = infer.main(["--models", "smollm2", "--dtypes", "float32", "--batches", "1", "--modes", "graph",
                          "--new", "4", "--prompt", "16", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "smollm2   float32       1   graph |" in out and "streaming read" in out
    model = load_model(dtype=torch.float32)[0]
    assert f"weights read per step {decode_step_bytes(model) / 1e6:.0f} MB" in out
    assert results[0]["step_weights_bytes"] == decode_step_bytes(model) and results[0]["stream_read_GB_s"] > 0
    graph = results[0]["graph"]  # decode as a fraction of the GEMM peak too, at context prompt + new // 2
    flops = decode_token_flops(model, 16 + 4 // 2)
    peak = results[0]["gemm_peak_GFLOP_s"] * 1e9
    assert graph["decode_peak_fraction"] == pytest.approx(graph["decode_tok_s"] * flops / peak)


def test_pyproject_transformers_bound_matches_patch():
    import re

    from atb.patch import MIN_TRANSFORMERS

    text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml")).read()
    low = re.search(r'"transformers>=([\d.]+)', text).group(1)
    assert tuple(int(x) for x in low.split(".")) == MIN_TRANSFORMERS
    assert re.search(r'"safetensors', text)


def test_quiet_hides_every_progress_bar():
    from atb.checkpoints import default_model_path

    r = run("check", "--model", default_model_path(), "--quiet")  # the GGUF path: its own tqdm bar
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr
    r = run("check", "--quiet")  # the cached conversion: transformers' "Loading weights" bar
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


def test_chat_multi_turn_from_piped_stdin():
    r = subprocess.run([sys.executable, "-m", "atb", "chat", "--max-new-tokens", "24", "--quiet"],
                       input="What is the capital of France?\n\nAnd what is the capital of Germany?\n",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    replies = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(replies) == 2, r.stdout
    assert "Paris" in replies[0]
    assert "Berlin" in replies[1]


def test_generate_sampling_options():
    r = run("generate", "Say hello", "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "20",
            "--top-p", "0.9", "--repetition-penalty", "1.2", "--seed", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_bench_writes_outputs_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    r = run("bench", "--config", "tiny", "--repeat", "1", "--prompt-len", "16", "--new-tokens", "3", "--batch", "2",
            "--json", str(js), "--plot", str(png), "--quiet")
    assert r.returncode == 0, r.stderr
    assert js.stat().st_size > 0 and png.stat().st_size > 0
    assert f"wrote {js}" in r.stdout and f"wrote {png}" in r.stdout
    assert "decode vs HF" in r.stdout
