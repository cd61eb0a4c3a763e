"""The command line, through subprocess, as a user runs it."""
import csv
import json
import subprocess
import sys

import pytest

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
