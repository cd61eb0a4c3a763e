"""End-to-end decode benchmark of the native decode graph vs HF generate, against the roofline.

Run: ``python -m atb.bench.graph [--models smollm2,tinyllama] [--dtypes float32,bfloat16]``.

For each model and dtype: a ``prompt``-token prompt goes through the graph one
token per step (the graph only decodes), then ``new`` tokens are decoded
greedily (native argmax); HF ``generate`` decodes the same prompt with
``min_new_tokens = new``. Decode tok/s of HF is ``(new - 1) / (t(new) - t(1))``
so its prefill is excluded. The roofline is the bytes a decode step must read
(every weight but the embedding table, plus the lm_head, plus the KV cache at
the mean context) divided by the streaming-read bandwidth measured in the same
run; ``roofline`` is the achieved fraction of it. A per-node profile of the
graph (one more decode pass with profiling on) shows where a step goes.
"""
from __future__ import annotations

import argparse
import time

import torch

import atb
from atb.bench.roofline import decode_step_bytes, keep_freed_memory, stream_read_gbps
from atb.graph import DecodeGraph

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK = 128


def _load(name: str, dtype: torch.dtype):
    from atb.checkpoints import load_model, random_model

    if name == "smollm2":
        return load_model(dtype=dtype)[0], "SmolLM2-135M"
    if name == "tinyllama":
        return random_model("tinyllama-1.1b", dtype), "TinyLlama-1.1B (random weights)"
    raise ValueError(f"unknown model '{name}' (smollm2, tinyllama)")


def bench_decode_e2e(model, *, prompt_len: int = 128, new: int = 256, hf_repeats: int = 1, seed: int = 0) -> dict:
    """Decode tok/s of the graph and of HF generate on one model (batch 1), and the roofline fraction."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    max_len = prompt_len + new
    blocks = (max_len + BLOCK - 1) // BLOCK
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, blocks, BLOCK, cfg.num_key_value_heads, d)
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    g = DecodeGraph.from_model(model, key_caches=list(kc.unbind(0)), value_caches=list(vc.unbind(0)), max_batch=1,
                               max_seq_len=max_len)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(17, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    table = torch.arange(blocks, dtype=torch.int32)[None]
    logits = torch.empty(1, cfg.vocab_size, dtype=dtype)
    am = torch.empty(1, dtype=torch.int32)
    meta = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]  # token, position, context, slot

    def run(p, tok):
        meta[0][0], meta[1][0], meta[2][0], meta[3][0] = tok, p, p + 1, p
        g.step(meta[0], meta[1], table, meta[2], meta[3], logits, argmax_out=am)
        return int(am[0])

    def decode_pass():
        for p in range(prompt_len - 1):
            run(p, prompt[p])
        tok = prompt[-1]
        t0 = time.perf_counter()
        for i in range(new):
            tok = run(prompt_len - 1 + i, tok)
        return time.perf_counter() - t0

    decode_pass()  # warm-up: thread pool, page faults in the KV pool
    t_graph = min(decode_pass() for _ in range(2))
    g.profiling = True
    decode_pass()
    prof = g.profile()
    g.profiling = False

    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def hf(n):
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    hf(2)
    t1 = min(hf(1) for _ in range(hf_repeats))
    tn = min(hf(new) for _ in range(hf_repeats))
    hf_tok_s = (new - 1) / max(tn - t1, 1e-9)
    graph_tok_s = new / t_graph
    nbytes = decode_step_bytes(model, 1, prompt_len + new // 2)
    bw = stream_read_gbps() * 1e9
    steps = prof["steps"] or 1
    return {
        "dtype": str(dtype).replace("torch.", ""), "graph_tok_s": graph_tok_s, "hf_tok_s": hf_tok_s,
        "speedup": graph_tok_s / hf_tok_s, "step_mb": nbytes / 1e6, "bandwidth_gbs": bw / 1e9,
        "roofline_tok_s": bw / nbytes, "roofline": graph_tok_s * nbytes / bw,
        "profile_ms": {k: v["ms"] / steps for k, v in prof["nodes"].items()},
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m atb.bench.graph", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,tinyllama")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="kernel and torch threads (0: keep the default)")
    args = ap.parse_args(argv)
    if args.threads:
        atb.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    print(f"threads={atb.get_num_threads()} isa={atb.build_info()['isa']}; batch 1, {args.prompt}-token prompt, "
          f"{args.new} new tokens")
    results = []
    for name in args.models.split(","):
        for dname in args.dtypes.split(","):
            if name == "tinyllama" and dname == "float32":
                continue  # 4.4 GB of fp32 weights: the bf16 run is the one the roofline target names
            model, label = _load(name, _DTYPES[dname])
            r = bench_decode_e2e(model, prompt_len=args.prompt, new=args.new)
            r["model"] = label
            results.append(r)
            print(f"{label:32s} {r['dtype']:9s} graph {r['graph_tok_s']:7.1f} tok/s  HF {r['hf_tok_s']:6.1f} tok/s  "
                  f"x{r['speedup']:.2f}  | {r['step_mb']:.0f} MB/step at {r['bandwidth_gbs']:.1f} GB/s -> roofline "
                  f"{r['roofline_tok_s']:.1f} tok/s, achieved {100 * r['roofline']:.0f}%")
            print("    per step (ms): " + "  ".join(f"{k} {v:.2f}" for k, v in r["profile_ms"].items()))
            del model
    return results


if __name__ == "__main__":
    main()
