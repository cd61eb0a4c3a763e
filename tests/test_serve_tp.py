"""`atb serve --tp 2` for real: two ranks over gloo on 127.0.0.1, rank 0 serving HTTP, the other following.

The server runs under ``python -m torch.distributed.run`` (torchrun) for the normal life (concurrent requests,
an abort, SIGTERM on rank 0); the failure tests start the two ranks as plain processes with torchrun's
environment, so that what stops the survivor is atb's own error handling, not torchrun tearing the job down.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import atb  # noqa: E402
from atb.serve.metrics import parse as parse_metrics  # noqa: E402
from conftest import wait_health  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_SEQ_LEN = 256
PROMPTS = [[5, 17, 9, 33, 2], [40, 3, 3, 8, 61, 22, 7, 11, 19, 300, 1000], [70], [12, 90, 4, 4000, 77, 8]]
NEW_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random 2-layer llama (4 heads, 2 KV heads: one of each per rank) with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from atb import checkpoints

    tok = AutoTokenizer.from_pretrained(checkpoints.cached_conversion(checkpoints.default_model_path(),
                                                                      progress=False))
    path = tmp_path_factory.mktemp("tiny_tp")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


def _serve_args(path, port: int) -> list[str]:
    return ["-m", "atb", "serve", "--tp", "2", "--model", str(path), "--port", str(port), "--max-seq-len",
            str(MAX_SEQ_LEN), "--max-batch-size", "8", "--quiet", "--tp-timeout", "20"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _rank_pids(parent: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (from their environment)."""
    out = {}
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        for pid in map(int, f.read().split()):
            with open(f"/proc/{pid}/environ", "rb") as e:
                env = dict(kv.split(b"=", 1) for kv in e.read().split(b"\0") if b"=" in kv)
            out[int(env[b"RANK"])] = pid
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] == "Z"   # a zombie has exited
    except FileNotFoundError:
        return True


def _kill_all(procs) -> None:
    """Kills what is left: torchrun starts its workers in sessions of their own, so they go by pid first."""
    for p in procs:
        if p.poll() is None:
            try:
                workers = list(_rank_pids(p.pid).values())
            except (OSError, KeyError, ValueError):
                workers = []
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _text(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_tp2_server_matches_tp1_aborts_a_stream_and_stops_on_sigterm(checkpoint):
    path, tok = checkpoint
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                            "127.0.0.1", "--master-port", str(_free_port()), *_serve_args(path, port)],
                           env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        # The tp=1 reference, while the ranks load.
        ref = atb.TransformerInfer(str(path), max_seq_len=MAX_SEQ_LEN, max_batch_size=1)
        want = [_text(tok, ref.generate([p], max_new_tokens=NEW_TOKENS, eos_token_id=[])[0]) for p in PROMPTS]
        wait_health(url, [run])
        ranks = _rank_pids(run.pid)
        assert sorted(ranks) == [0, 1]

        # Concurrent completions, and one long stream dropped after 3 chunks (its request is aborted).
        got, errors = {}, []

        def complete(i):
            try:
                r = httpx.post(url + "/v1/completions", timeout=120, json={
                    "prompt": PROMPTS[i], "max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
                got[i] = r.json()["choices"][0]["text"]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def quitter():
            try:
                n = 0
                body = {"prompt": [9] * 30, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        n += line.startswith("data: ")
                        if n == 3:
                            break
                got["quit"] = n
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        def sampled():
            # Unseeded sampling: each rank's generator differs, so rank 0's tokens are broadcast in the step.
            try:
                r = httpx.post(url + "/v1/completions", timeout=120, json={
                    "prompt": PROMPTS[1], "max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.9})
                got["sampled"] = r.json()["usage"]["completion_tokens"]
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(PROMPTS))]
        threads += [threading.Thread(target=quitter), threading.Thread(target=sampled)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors
        assert [got[i] for i in range(len(PROMPTS))] == want
        assert got["quit"] == 3 and got["sampled"] == NEW_TOKENS
        deadline = time.time() + 30
        while True:   # the dropped stream's blocks come back: its abort reached the engine
            m = parse_metrics(httpx.get(url + "/metrics").text)
            if (m["atb_requests_running"], m["atb_requests_waiting"], m["atb_kv_blocks_used"]) == (0, 0, 0):
                assert m["atb_tp_control_messages_total"] >= NEW_TOKENS and m["atb_tp_control_seconds_total"] > 0
                break
            assert time.time() < deadline, m
            time.sleep(0.1)
        # Idle longer than a heartbeat (5 s with --tp-timeout 20), then serve again: the follower kept up.
        time.sleep(6)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0})
        assert r.json()["choices"][0]["text"] == want[0]

        t0 = time.time()
        os.kill(ranks[0], signal.SIGTERM)
        code = run.wait(30)
        took = time.time() - t0
        err = run.stderr.read()
        assert code == 0, err[-5000:]
        assert all(_gone(pid) for pid in ranks.values())
        assert "Traceback" not in err and "atb: error" not in err, err[-3000:]
        # Only rank 0 logs requests: one line per request (4 greedy, the dropped stream, the sampled one and the
        # one after the pause).
        assert err.count("prompt_tokens=") == len(PROMPTS) + 3, err[-3000:]
        assert "finish=abort" in err and "tp control:" in err
        assert took < 30
    finally:
        _kill_all([run])


@pytest.mark.parametrize("victim", [1, 0], ids=["follower_dies", "rank0_dies"])
def test_a_dead_rank_stops_the_others_with_an_error(checkpoint, victim):
    path, _ = checkpoint
    port, master = _free_port(), _free_port()
    procs = []
    for rank in range(2):
        env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
        procs.append(subprocess.Popen([sys.executable, *_serve_args(path, port)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_health(url, procs)
        survivor = procs[1 - victim]
        lines = []
        body = {"prompt": [7] * 20, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        t0 = time.time()
                        procs[victim].kill()
                    if victim == 0 and len(lines) >= 2:
                        break
        # Well within the group's timeout: the dead rank's closed connection fails the next collective.
        code = survivor.wait(25)
        took = time.time() - t0
        err = survivor.stderr.read()
        assert code != 0 and "atb: error: tensor parallel" in err, err[-3000:]
        assert took < 25
        if victim == 1:
            # The stream in flight ended with an error event naming the failure, then [DONE].
            assert lines[-1] == "data: [DONE]" and "tensor parallel" in lines[-2], lines[-3:]
    finally:
        _kill_all(procs)
