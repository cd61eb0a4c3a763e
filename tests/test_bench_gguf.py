"""python -m atb.bench.gguf: atb on GGUF files at their own precision, beside llama.cpp's llama-bench."""
import json
import stat
import sys

import pytest

pytest.importorskip("gguf")
from atb.bench import gguf as bench  # noqa: E402


def _fake_llama_bench(tmp_path, body: str):
    """An executable standing in for llama.cpp's llama-bench: a Python script that runs ``body`` with argv."""
    path = tmp_path / "llama-bench"
    path.write_text(f"#!{sys.executable}\nimport json, sys\nargs = sys.argv[1:]\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


PRINTS_RESULTS = """
p, n = int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1])
assert args[args.index("-o") + 1] == "json" and args[args.index("-r") + 1] == "1", args
print(json.dumps([{"n_prompt": p, "n_gen": 0, "avg_ts": 250.5}, {"n_prompt": 0, "n_gen": n, "avg_ts": 99.5}]))
"""


def test_llama_bench_results_are_read_from_its_json(tmp_path):
    binary = _fake_llama_bench(tmp_path, PRINTS_RESULTS)
    assert bench.llama_bench(binary, "model.gguf", 128, 64, 2) == (250.5, 99.5)


@pytest.mark.parametrize("body,message", [
    ("sys.stderr.write('error: failed to load model\\n'); sys.exit(1)", "exited with 1: error: failed to load model"),
    ("print('pp128 | 250.5')", "printed no pp128 / tg64 results in JSON"),
    ("print(json.dumps([{'n_prompt': 128, 'n_gen': 0, 'avg_ts': 1.0}]))", "printed no pp128 / tg64 results"),
])
def test_llama_bench_failures_name_the_command(tmp_path, body, message):
    binary = _fake_llama_bench(tmp_path, body)
    with pytest.raises(SystemExit, match=message):
        bench.llama_bench(binary, "model.gguf", 128, 64, 2)


def test_tensor_types_counts_the_load_report():
    report = {"layers.0.q": "QuantizedWeight(w8a16, ..., from gguf:Q5_0)", "layers.0.k": "QuantizedWeight(w8a16, ..., "
              "from gguf:Q5_0)", "layers.0.down": "Q6_K: float torch.bfloat16 (dequantized by gguf)",
              "embed": "QuantizedWeight(w8a16, ..., from gguf:Q8_0)", "lm_head": "tied to embed"}
    assert bench.tensor_types(report) == "Q5_0 2, Q6_K (float) 1, Q8_0 1"
    report["layers.0.down"] = "Q6_K: quantized from float, QuantizedWeight(w8a16, shape=(576, 1536), group 32, ...)"
    assert bench.tensor_types(report) == "Q5_0 2, Q6_K (as w8a16) 1, Q8_0 1"


def test_bad_arguments_are_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path / "missing.gguf")])
    assert "no such GGUF file" in capsys.readouterr().err
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path / "x.gguf"), "--llama-bench", str(tmp_path / "x.gguf")])
    assert "not an executable file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path / "x.gguf"), "--rest", "w6a16"])
    assert "--rest: quantize: unknown spec 'w6a16'" in capsys.readouterr().err


def test_embedded_model_beside_a_llama_bench(tmp_path, capsys):
    binary = _fake_llama_bench(tmp_path, PRINTS_RESULTS)
    # 16 new tokens: with 4, three decode steps can fall inside a one-token generate's noise on a busy machine
    # (decode is then NaN, not a rate).
    (row,) = bench.main(["--new", "16", "--prompt", "16", "--repeats", "1", "--llama-bench", binary, "--json"])
    assert row["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and row["tensors"] == "Q4_1 210, Q8_0 1"
    assert row["atb decode tok/s"] > 0 and row["atb prefill tok/s"] > 0
    assert (row["llama.cpp prefill tok/s"], row["llama.cpp decode tok/s"]) == (250.5, 99.5)
    assert json.loads(capsys.readouterr().out) == [row]
