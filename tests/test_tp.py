"""Tensor parallelism: ranks are processes on 127.0.0.1 talking gloo, spawned by these tests.

Each rank runs this file as a script (``_rank_main``) over a checkpoint directory
written to the test's tmp dir, and writes what it saw to a JSON file; the test
compares it with a single-process run in the pytest process. One thread per rank.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 17, 9, 33, 2], [40, 3, 3, 8, 61, 22, 7, 11, 19], [70], [12, 90, 4]]   # batch of 4 different lengths
TINY = {
    # o/gate/up/down biases: the row-parallel bias lives on rank 0 only; uneven intermediate and vocab.
    "llama": dict(hidden_size=64, intermediate_size=90, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=101, attention_bias=True, mlp_bias=True),
    # one KV head for two ranks: replicated; q/k/v bias.
    "qwen2": dict(hidden_size=64, intermediate_size=97, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, vocab_size=103),
    # q/k norm, explicit head_dim, tied embeddings.
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=100, tie_word_embeddings=True),
}
NEW_TOKENS = 8   # EOS ignored: every run is this long
# Speculative decoding: prompts that repeat a phrase, long enough continuations to draft from.
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1}
LOOPING = [[5, 17, 9] * 4, [40, 3, 8, 61] * 3 + [40]]
SPEC_TOKENS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_model(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY[family], max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw), dtype=torch.float32).eval()


def _save_safetensors(model, path: str) -> None:
    """An HF model directory (config + one safetensors file) of any loaded model, a GGUF-loaded one included
    (``save_pretrained`` refuses those); a tied LM head is stored once, as HF does."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}   # tied weights listed once
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)


def _single(path_or_model, graph_mode: bool) -> dict:
    import atb

    infer = atb.TransformerInfer(path_or_model, max_seq_len=64, max_batch_size=4, block_size=16,
                                 graph_mode=graph_mode)
    return {"one": infer.generate(PROMPTS[:1], NEW_TOKENS, eos_token_id=[]),
            "four": infer.generate(PROMPTS, NEW_TOKENS, eos_token_id=[]),
            "weights_bytes": infer.memory_summary()["weights_bytes"]}


def _launch(world: int, job: dict, tmp_path, timeout: float = 240.0) -> list[dict]:
    """Runs ``job`` on ``world`` ranks; each rank's result dict."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = []
    for r in range(world):
        spec = dict(job, rank=r, world=world, port=port, out=str(tmp_path / f"rank{r}.json"))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    results = []
    for r in range(world):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n{logs[r][-3000:]}"
        results.append(json.loads(f.read_text()))
    return results


# ---------------------------------------------------------------- the ranks
def _rank_main(job: dict) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    import atb
    from atb.distributed import TensorParallelError

    atb.set_num_threads(1)
    torch.set_num_threads(1)
    rank, world = job["rank"], job["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=job["timeout"]))
    out: dict = {}

    def save():
        with open(job["out"], "w") as f:
            json.dump(out, f)

    for name, path in job["models"].items():
        for graph_mode in (False, True):
            infer = atb.TransformerInfer(path, max_seq_len=64, max_batch_size=4, block_size=16,
                                         graph_mode=graph_mode, tp=world)
            out[f"{name}/{graph_mode}"] = {
                "one": infer.generate(PROMPTS[:1], NEW_TOKENS, eos_token_id=[]),
                "four": infer.generate(PROMPTS, NEW_TOKENS, eos_token_id=[]),
                "weights_bytes": infer.memory_summary()["weights_bytes"],
                "kv_bytes_per_token": infer.memory_summary()["kv_bytes_per_token"]}
        out[f"{name}/sampled"] = infer.generate(PROMPTS, NEW_TOKENS, do_sample=True, top_k=20)
    # Speculative decoding: greedy drafts verified on every rank alike; sampled requests do not draft.
    spec = atb.TransformerInfer(next(iter(job["models"].values())), max_seq_len=64, max_batch_size=4, block_size=16,
                                tp=world, speculative_config=SPEC)
    out["spec"] = {"greedy": spec.generate(LOOPING, SPEC_TOKENS, eos_token_id=[]),
                   "sampled": spec.generate(LOOPING, SPEC_TOKENS, do_sample=True, top_k=20, seed=3),
                   "stats": spec.stats()}
    # A greedy request beside an unseeded sampled one (each rank's own generator): that batch does not
    # speculate, so rank 0's draws reach every rank; alone again, the greedy one does.
    from atb.engine import SamplingParams

    spec.add_request(LOOPING[0], SamplingParams(max_new_tokens=SPEC_TOKENS, ignore_eos=True), request_id="g")
    spec.add_request(LOOPING[1], SamplingParams(max_new_tokens=8, do_sample=True, ignore_eos=True), request_id="s")
    mixed = {}
    while spec.has_unfinished():
        for o in spec.step():
            if o.finished:
                mixed[o.request_id] = o.output_token_ids
    out["spec"]["mixed"] = mixed
    save()
    if job.get("mismatch"):
        path = next(iter(job["models"].values()))
        try:
            atb.TransformerInfer(path, max_seq_len=64 if rank == 0 else 48, max_batch_size=4, block_size=16, tp=world)
            out["mismatch"] = "no error"
        except ValueError as e:
            out["mismatch"] = str(e)
        save()
    if job.get("kill"):
        path = next(iter(job["models"].values()))
        infer = atb.TransformerInfer(path, max_seq_len=64, max_batch_size=4, block_size=16, tp=world)
        seen = []

        def die(_i, tok):
            seen.append(tok)
            if rank == world - 1 and len(seen) == 3:
                os._exit(0)   # this rank is gone mid-generate

        t0 = time.perf_counter()
        try:
            infer.generate(PROMPTS[:1], 32, stream=die)
            out["kill"] = {"error": None}
        except TensorParallelError as e:
            out["kill"] = {"error": str(e), "seconds": time.perf_counter() - t0}
        save()
        os._exit(0)   # the group is broken: do not wait for the dead rank at exit
    dist.destroy_process_group()


# ---------------------------------------------------------------- tests
def test_shard_plan_splits_heads_and_refuses_what_does_not_divide():
    from atb.distributed import ShardPlan
    from atb.registry import get_adapter
    from transformers import LlamaConfig

    def spec(h, kh, inter=96, vocab=100):
        return get_adapter(LlamaConfig(hidden_size=16 * h, num_attention_heads=h, num_key_value_heads=kh,
                                       head_dim=16, intermediate_size=inter, vocab_size=vocab)).spec

    smol = spec(9, 3, 1536, 49152)
    plans = [ShardPlan.for_spec(smol, r, 3) for r in range(3)]
    assert [p.heads for p in plans] == [(0, 3), (3, 6), (6, 9)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2), (2, 3)]
    assert [p.vocab for p in plans] == [(0, 16384), (16384, 32768), (32768, 49152)]
    # Fewer KV heads than ranks: each KV head on the ranks whose query heads read it.
    assert [ShardPlan.for_spec(spec(4, 2), r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # Uneven intermediate / vocab: as even as possible, covering everything.
    odd = [ShardPlan.for_spec(spec(4, 2, 97, 101), r, 2) for r in range(2)]
    assert [p.intermediate for p in odd] == [(0, 48), (48, 97)] and [p.vocab for p in odd] == [(0, 50), (50, 101)]
    assert odd[0].holds("o_bias") and not odd[1].holds("o_bias") and odd[1].holds("q_bias")
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible by tp=2"):
        ShardPlan.for_spec(smol, 0, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=6 is not divisible by tp=4"):
        ShardPlan.for_spec(spec(12, 6), 0, 4)
    with pytest.raises(ValueError, match="tp=4 exceeds num_key_value_heads=3"):
        ShardPlan.for_spec(spec(12, 3), 0, 4)


def test_tp_arguments_are_checked():
    import atb

    model = _tiny_model("llama")
    with pytest.raises(ValueError, match="tp must be a positive int"):
        atb.TransformerInfer(model, max_seq_len=64, tp=0)
    with pytest.raises(ValueError, match="no process group is initialized"):
        atb.TransformerInfer(model, max_seq_len=64, tp=2)


def test_cli_tp_outside_torchrun_is_a_one_line_error(capsys, monkeypatch):
    from atb import cli

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert cli.main(["generate", "hi", "--tp", "2", "--quiet"]) == 2
    assert "torchrun --nproc-per-node 2 -m atb generate --tp 2" in capsys.readouterr().err


def test_a_model_directory_loads_without_the_hf_model(tmp_path):
    model = _tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    for graph_mode in (False, True):
        assert _single(str(tmp_path / "m"), graph_mode) == _single(model, graph_mode)


def test_tiny_families_tp2_match_tp1_and_a_killed_rank_fails_the_others(tmp_path):
    """llama (biases), qwen2 (replicated KV head), qwen3 (q/k norm, tied) at tp=2, Python and graph mode;
    then mismatched settings are refused on every rank, and a rank dying mid-generate fails the other."""
    models, ref, replicated = {}, {}, {}
    for family in TINY:
        m = _tiny_model(family)
        path = str(tmp_path / family)
        m.save_pretrained(path)
        models[family] = path
        for graph_mode in (False, True):
            ref[f"{family}/{graph_mode}"] = _single(m, graph_mode)
        # A single KV head is held whole by both ranks.
        replicated[family] = sum(p.nbytes for n, p in m.named_parameters() if ".k_proj." in n or ".v_proj." in n
                                 ) if m.config.num_key_value_heads == 1 else 0
    timeout = 10.0
    ranks = _launch(2, {"models": models, "timeout": timeout, "mismatch": True, "kill": True}, tmp_path)
    for key, want in ref.items():
        for r, got in enumerate(ranks):
            assert got[key]["one"] == want["one"], (key, r)
            assert got[key]["four"] == want["four"], (key, r)
        # Each rank holds about half the weights (norms replicated, row-parallel biases on rank 0).
        total, share = want["weights_bytes"], (want["weights_bytes"] + replicated[key.split("/")[0]]) / 2
        assert all(abs(got[key]["weights_bytes"] - share) < 0.02 * total for got in ranks), key
    for family in TINY:
        assert ranks[0][f"{family}/sampled"] == ranks[1][f"{family}/sampled"]
    import atb

    plain = atb.TransformerInfer(models["llama"], max_seq_len=64, max_batch_size=4, block_size=16)
    want = plain.generate(LOOPING, SPEC_TOKENS, eos_token_id=[])
    for got in ranks:
        assert got["spec"]["greedy"] == want and got["spec"]["sampled"] == ranks[0]["spec"]["sampled"]
        assert got["spec"]["mixed"] == {"g": want[0], "s": ranks[0]["spec"]["mixed"]["s"]}
        assert got["spec"]["stats"]["spec_accepted_tokens"] > 0, got["spec"]["stats"]
    for got in ranks:
        assert "rank 1 differs from rank 0 in engine.max_seq_len: '64' vs '48'" in got["mismatch"]
    kill = ranks[0]["kill"]
    assert kill["error"] is not None and "failed on rank 0 of 2" in kill["error"]
    assert kill["seconds"] < timeout + 5


def test_smollm2_tp3_matches_tp1(tmp_path, smollm2_fp32):
    """SmolLM2-135M (9 heads, 3 KV heads) over 3 ranks, each reading its slices of a safetensors copy."""
    model, _ = smollm2_fp32
    path = str(tmp_path / "smollm2")
    _save_safetensors(model, path)
    ref = {graph_mode: _single(model, graph_mode) for graph_mode in (False, True)}
    ranks = _launch(3, {"models": {"smollm2": path}, "timeout": 60.0}, tmp_path)
    for graph_mode, want in ref.items():
        for r, got in enumerate(ranks):
            got = got[f"smollm2/{graph_mode}"]
            assert got["one"] == want["one"] and got["four"] == want["four"], (graph_mode, r)
            assert abs(got["weights_bytes"] - want["weights_bytes"] / 3) < 0.01 * want["weights_bytes"]
            # One KV head of three per rank.
            assert got["kv_bytes_per_token"] * 3 == 2 * 30 * 3 * 64 * 4


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))


_JOINS_GLOO_THREADS = r"""
import json, os, socket, sys
import atb                                   # before the group: atb pre-imports what captures it
import torch.distributed as dist

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
json.dump({"model_type": "llama", "num_hidden_layers": 1}, open(os.path.join(sys.argv[1], "config.json"), "w"))
from transformers import AutoConfig
AutoConfig.from_pretrained(sys.argv[1])      # imports torch.distributed.nn.functional on the way
dist.destroy_process_group()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sorted(n for n in names if "gloo" in n))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_destroy_process_group_joins_gloo_threads_after_a_config_load(tmp_path):
    # torch.distributed.nn.functional binds the live default group as a default argument when first
    # imported after init_process_group; the group then outlives destroy_process_group and a gloo
    # thread can abort the interpreter at exit. `import atb` imports it first.
    r = subprocess.run([sys.executable, "-c", _JOINS_GLOO_THREADS, str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
