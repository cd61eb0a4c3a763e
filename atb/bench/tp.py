"""Tensor-parallel decode: one process with T threads against N ranks with T/N threads each.

    python -m atb.bench.tp                      # TinyLlama-1.1B shape, bf16, batch 1 and 8, tp=1 (2 threads) vs tp=2
    python -m atb.bench.tp --layers 4 --steps 8 # a quick sanity run
    python -m atb.bench.tp --control            # the per-step cost of `atb serve --tp`'s control messages

A random-weight checkpoint of the preset's shape is written to a temporary
directory one layer per safetensors file (so no process ever holds the whole
model but the tp=1 one), then each configuration runs in fresh processes
(ranks over gloo on 127.0.0.1) reading it through ``TransformerInfer(path,
tp=N)``. Per batch size: decode tok/s over ``--steps`` steps after a warm-up,
the time spent inside collectives per step (all-reduces after the embedding
and every o/down projection, plus the greedy argmax reduction), and each
rank's peak RSS.

``--control`` measures instead what following rank 0 costs per engine step
under ``atb serve --tp`` (``atb.serve.tp``): the 16-byte header broadcast of a
plain step and a message carrying one new request, against
``torch.distributed.broadcast_object_list`` of the same content. Each message
is followed by a one-element all-reduce (a step's first collective, where a
late follower would be waited for); the all-reduce alone is timed too and
subtracted. Variants are interleaved round by round, medians reported.

The projection for N machines takes the measured per-step compute of tp=1,
divides it by N (decode streams the weights: each rank streams 1/N), and adds
the measured collective count per step times a per-collective cost
``latency * 2 (N - 1) + 2 (N - 1) / N * bytes / bandwidth`` (ring all-reduce)
for the given network (``--net-latency-us``, ``--net-gbps``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch


def write_checkpoint(path: str, preset: str, dtype: torch.dtype, layers: int | None) -> dict:
    """A random checkpoint of ``preset``'s shape, one safetensors file per layer (plus one for the rest)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from atb.checkpoints import PRESETS

    kw = dict(PRESETS[preset])
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = LlamaConfig(**kw)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    H, KH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    hid, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        save_file({p + "input_layernorm.weight": torch.ones(hid, dtype=dtype),
                   p + "post_attention_layernorm.weight": torch.ones(hid, dtype=dtype),
                   p + "self_attn.q_proj.weight": rnd(H * D, hid), p + "self_attn.k_proj.weight": rnd(KH * D, hid),
                   p + "self_attn.v_proj.weight": rnd(KH * D, hid), p + "self_attn.o_proj.weight": rnd(hid, H * D),
                   p + "mlp.gate_proj.weight": rnd(inter, hid), p + "mlp.up_proj.weight": rnd(inter, hid),
                   p + "mlp.down_proj.weight": rnd(hid, inter)},
                  os.path.join(path, f"layer-{i:03d}.safetensors"), metadata={"format": "pt"})
    rest = {"model.embed_tokens.weight": rnd(V, hid), "model.norm.weight": torch.ones(hid, dtype=dtype)}
    if not cfg.tie_word_embeddings:
        rest["lm_head.weight"] = rnd(V, hid)
    save_file(rest, os.path.join(path, "rest.safetensors"), metadata={"format": "pt"})
    return {"layers": cfg.num_hidden_layers, "hidden": hid}


def _worker(job: dict) -> None:
    """One rank: decode timings per batch size, printed as one JSON line."""
    from datetime import timedelta

    import atb
    from atb.engine import SamplingParams

    atb.set_num_threads(job["threads"])
    torch.set_num_threads(job["threads"])
    world, rank = job["world"], job["rank"]
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
    dtype = getattr(torch, job["dtype"])
    batches, steps, warm, prompt = job["batches"], job["steps"], 2, job["prompt_len"]
    infer = atb.TransformerInfer(job["path"], max_seq_len=prompt + steps + warm + 8, max_batch_size=max(batches),
                                 dtype=dtype, graph_mode=job["graph"], block_size=64, tp=world if world > 1 else None)
    g = torch.Generator().manual_seed(1)
    rows = []
    for b in batches:
        for _ in range(b):
            ids = torch.randint(100, infer.vocab_size - 100, (prompt,), generator=g).tolist()
            infer.add_request(ids, SamplingParams(max_new_tokens=steps + warm + 2, ignore_eos=True))
        for _ in range(warm):
            infer.step()
        if infer.tp is not None:
            infer.tp.reset_comm_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            infer.step()
        dt = time.perf_counter() - t0
        comm = infer.tp.comm_seconds if infer.tp is not None else 0.0
        calls = infer.tp.comm_calls if infer.tp is not None else 0
        while infer.has_unfinished():
            infer.step()
        rows.append({"batch": b, "tok_s": b * steps / dt, "ms_per_step": 1e3 * dt / steps,
                     "comm_ms_per_step": 1e3 * comm / steps, "collectives_per_step": calls / steps})
    mem = infer.memory_summary()
    print(json.dumps({"rank": rank, "world": world, "threads": job["threads"], "rows": rows,
                      "weights_bytes": mem["weights_bytes"], "kv_cache_bytes": mem["kv_cache_bytes"],
                      # VmHWM, not ru_maxrss: the latter keeps the launching process's peak across exec.
                      "peak_rss_bytes": _status_kb("VmHWM") * 1024,
                      "anon_bytes": _status_kb("RssAnon") * 1024}), flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _control_worker(job: dict) -> None:
    """One rank of ``--control``: rank 0 prints microseconds per message and variant as one JSON line."""
    from datetime import timedelta

    import torch.distributed as dist

    from atb.distributed import TensorParallel
    from atb.engine import SamplingParams
    from atb.serve.tp import STEP, _Channel

    rank, world = job["rank"], job["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    channel = _Channel(TensorParallel())
    one = torch.zeros(1)
    add = [("add", "cmpl-0123456789abcdef0123456789abcdef", list(range(100, 100 + job["prompt_len"])),
            SamplingParams(max_new_tokens=64, temperature=0.7, do_sample=True))]

    def header(changes):
        def go():
            if rank == 0:
                channel.send(STEP, changes)
            else:
                channel.receive()
        return go

    def objects(changes):
        def go():
            box = [(STEP, changes)] if rank == 0 else [None]
            dist.broadcast_object_list(box, src=0)
        return go

    variants = {"all_reduce only": lambda: None, "header, plain step": header([]),
                "object_list, plain step": objects([]), "header + payload, 1 add": header(add),
                "object_list, 1 add": objects(add)}
    per: dict[str, list[float]] = {k: [] for k in variants}
    n = job["steps"]
    for _ in range(job["rounds"]):
        for name, go in variants.items():   # interleaved: every round times every variant
            dist.all_reduce(one)
            t0 = time.perf_counter()
            for _ in range(n):
                go()
                dist.all_reduce(one)
            per[name].append((time.perf_counter() - t0) / n * 1e6)
    if rank == 0:
        med = {k: sorted(v)[len(v) // 2] for k, v in per.items()}
        print(json.dumps(med), flush=True)
    dist.destroy_process_group()


def control(args) -> dict:
    """Runs ``--control`` on 2 ranks of one thread each; rank 0's medians (us per message)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "atb.bench.tp", "--worker", json.dumps(
        {"control": True, "rank": r, "world": 2, "port": port, "steps": args.steps * 25, "rounds": 9,
         "prompt_len": args.prompt_len})], env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("bench.tp --control: a rank failed")
    return json.loads(outs[0].strip().splitlines()[-1])


def _status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in kB (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(path: str, world: int, threads: int, args) -> list[dict]:
    """Runs the worker on ``world`` ranks of ``threads`` threads; each rank's report."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    procs = []
    for r in range(world):
        job = {"path": path, "world": world, "rank": r, "port": port, "threads": threads, "dtype": args.dtype,
               "batches": args.batch, "steps": args.steps, "prompt_len": args.prompt_len, "graph": args.graph}
        procs.append(subprocess.Popen([sys.executable, "-m", "atb.bench.tp", "--worker", json.dumps(job)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    reports = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"bench.tp: a rank exited with status {p.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def project(t1_ms: float, collectives: float, bytes_per: float, machines: int, latency_us: float,
            gbps: float) -> float:
    """Projected ms per decode step on ``machines`` machines (see the module docstring)."""
    n = machines
    per = latency_us * 1e-3 * 2 * (n - 1) + 2 * (n - 1) / n * bytes_per / (gbps * 1e9 / 8) * 1e3
    return t1_ms / n + collectives * per


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m atb.bench.tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--preset", default="tinyllama-1.1b")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count (quick runs)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads of the tp=1 run; each tp rank gets threads/tp")
    p.add_argument("--python", dest="graph", action="store_false", help="the Python executor instead of the graph")
    p.add_argument("--net-latency-us", type=float, default=30.0, help="per-hop latency of the projected network")
    p.add_argument("--net-gbps", type=float, default=10.0, help="bandwidth of the projected network")
    p.add_argument("--control", action="store_true",
                   help="time atb serve --tp's per-step control broadcast (2 ranks) instead")
    args = p.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        (_control_worker if job.get("control") else _worker)(job)
        return 0
    if args.control:
        med = control(args)
        base = med.pop("all_reduce only")
        print(f"control message per engine step, 2 ranks over gloo on 127.0.0.1 (median us, a 1-element "
              f"all-reduce of {base:.0f} us subtracted; the add carries a {args.prompt_len}-token prompt):")
        for name, us in med.items():
            print(f"  {name:<26}{us - base:8.1f}")
        return 0
    with tempfile.TemporaryDirectory(prefix="atb-bench-tp-") as path:
        shape = write_checkpoint(path, args.preset, getattr(torch, args.dtype), args.layers or None)
        one = run(path, 1, args.threads, args)[0]
        many = run(path, args.tp, max(1, args.threads // args.tp), args)
    mode = "graph" if args.graph else "python"
    print(f"{args.preset} ({shape['layers']} layers), {args.dtype}, {mode} decode, prompt {args.prompt_len}, "
          f"{args.steps} timed steps")
    print(f"{'config':<22}{'batch':>6}{'tok/s':>9}{'ms/step':>9}{'comm ms/step':>14}{'coll/step':>11}"
          f"{'weights MB':>12}{'peak RSS MB':>13}{'anon MB':>10}")
    for label, reps in ((f"tp=1 x {one['threads']} threads", [one]),
                        (f"tp={args.tp} x {many[0]['threads']} thread(s)", many)):
        for i, row in enumerate(reps[0]["rows"]):
            comm = max(r["rows"][i]["comm_ms_per_step"] for r in reps)
            rss = "/".join(f"{r['peak_rss_bytes'] / 2**20:.0f}" for r in reps)
            wts = "/".join(f"{r['weights_bytes'] / 2**20:.0f}" for r in reps)
            anon = "/".join(f"{r['anon_bytes'] / 2**20:.0f}" for r in reps)
            print(f"{label:<22}{row['batch']:>6}{row['tok_s']:>9.2f}{row['ms_per_step']:>9.1f}{comm:>14.2f}"
                  f"{row['collectives_per_step']:>11.0f}{wts:>12}{rss:>13}{anon:>10}")
    for i, row in enumerate(many[0]["rows"]):
        per = max(r["rows"][i]["comm_ms_per_step"] for r in many) / max(1.0, row["collectives_per_step"])
        print(f"measured here: batch {row['batch']}: {1e3 * per:.0f} us per collective (gloo, 127.0.0.1)")
    item = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    print(f"\nprojection ({args.net_latency_us:g} us/hop, {args.net_gbps:g} Gbit/s, ring all-reduce; compute = "
          f"tp=1 step / machines):")
    for i, row in enumerate(one["rows"]):
        b = row["batch"]
        coll = many[0]["rows"][i]["collectives_per_step"]
        t1 = row["ms_per_step"]
        parts = []
        for n in (2, 4):
            t = project(t1, coll, b * shape["hidden"] * item, n, args.net_latency_us, args.net_gbps)
            parts.append(f"{n} machines {t:.1f} ms/step ({t1 / t:.2f}x)")
        print(f"  batch {b}: 1 machine {t1:.1f} ms/step; " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
