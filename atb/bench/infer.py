"""TransformerInfer vs HF generate on SmolLM2-135M: prefill and decode tokens/s, side by side.

    python -m atb.bench.infer [--dtypes float32,bfloat16] [--batches 1,16] [--modes graph,python]
                              [--prompt 128] [--new 128] [--repeats 3] [--threads N]

For each dtype and batch size: prefill tok/s (generate with one new token),
decode tok/s ((new - 1) tokens per sequence over the time beyond prefill),
and the same for HF ``generate`` in the same process. Decode is also reported
as a fraction of the weight-streaming roofline (weight bytes per step /
bandwidth measured here, in this run). Medians over ``--repeats``; the machine
is shared, so read the ratios, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import json

import torch

from atb.bench.roofline import median_seconds, stream_read_gbps

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ordinary tokens only (ids below 17 are SmolLM2's special tokens).
    return torch.randint(17, vocab, (batch, length), generator=g).tolist()


def bench_one(model, prompts, new: int, repeats: int, modes: list[str]) -> dict:
    """Prefill/decode rates of TransformerInfer in each mode ("graph", "python") and of HF generate."""
    import atb

    batch = len(prompts)
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    runners = {}
    for mode in modes:
        infer = atb.TransformerInfer(model, max_seq_len=len(prompts[0]) + new, max_batch_size=batch,
                                     block_size=128, graph_mode=mode == "graph")

        def ours(n, infer=infer):
            out = infer.generate(prompts, n, eos_token_id=[])
            assert all(len(o) == n for o in out)

        runners[mode] = ours

    def hf(n):
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    runners["hf"] = hf
    res = {"batch": batch, "weights_bytes": infer.memory_summary()["weights_bytes"]}
    for name, fn in runners.items():
        fn(2)  # warm-up: kernels, allocator, first touch of the KV pool
        t_prefill = median_seconds(lambda: fn(1), repeats)
        t_total = median_seconds(lambda: fn(new), repeats)
        decode_s = max(t_total - t_prefill, 1e-9)
        res[name] = {
            "prefill_tok_s": batch * len(prompts[0]) / t_prefill,
            "decode_tok_s": batch * (new - 1) / decode_s,
            "step_ms": 1e3 * decode_s / (new - 1),
            "throughput_tok_s": batch * new / t_total,
        }
    return res


def main(argv=None) -> list[dict]:
    from atb.checkpoints import load_model

    ap = argparse.ArgumentParser(prog="python -m atb.bench.infer", description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--modes", default="graph,python", help="TransformerInfer decode paths: graph, python")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch and atb thread count (default: as set)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if args.threads:
        import atb

        torch.set_num_threads(args.threads)
        atb.set_num_threads(args.threads)

    results = []
    hdr = (f"{'dtype':9} {'batch':>5} {'path':>6} | {'prefill tok/s':>13} {'x HF':>5} | {'decode tok/s':>12} "
           f"{'x HF':>5} | {'step ms':>7} {'roofline':>8} | {'thru tok/s':>10} {'x b1':>5}")
    if not args.json:
        print(f"SmolLM2-135M, {args.prompt}-token prompts, {args.new} new tokens, median of {args.repeats}, "
              f"threads={torch.get_num_threads()}")
        print(hdr)
        print("-" * len(hdr), flush=True)
    for dname in args.dtypes.split(","):
        model, _ = load_model(dtype=_DTYPES[dname])
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        bw = stream_read_gbps(weights) * 1e9
        per_batch = {}
        for b in (int(x) for x in args.batches.split(",")):
            r = bench_one(model, _prompts(b, args.prompt, model.config.vocab_size, seed=b), args.new, args.repeats,
                          modes)
            r.update(dtype=dname, bandwidth_GB_s=bw / 1e9)
            per_batch[b] = r
            results.append(r)
            for mode in modes:
                m = r[mode]
                m["decode_vs_hf"] = m["decode_tok_s"] / r["hf"]["decode_tok_s"]
                m["prefill_vs_hf"] = m["prefill_tok_s"] / r["hf"]["prefill_tok_s"]
                # One decode step streams every weight once, whatever the batch.
                m["roofline_fraction"] = m["decode_tok_s"] / b * r["weights_bytes"] / bw
                if 1 in per_batch and b != 1:
                    m["throughput_vs_batch1"] = m["throughput_tok_s"] / per_batch[1][mode]["throughput_tok_s"]
            if not args.json:
                for name in modes + ["hf"]:
                    m = r[name]
                    ratio = lambda k: f"{m[k]:5.2f}" if k in m else f"{'':5}"  # noqa: E731
                    roof = f"{m['roofline_fraction']:8.0%}" if "roofline_fraction" in m else f"{'':8}"
                    thr = f"{m['throughput_vs_batch1']:5.1f}" if "throughput_vs_batch1" in m else f"{'':5}"
                    print(f"{dname:9} {b:>5} {name:>6} | {m['prefill_tok_s']:13.0f} {ratio('prefill_vs_hf')} | "
                          f"{m['decode_tok_s']:12.1f} {ratio('decode_vs_hf')} | {m['step_ms']:7.1f} {roof} | "
                          f"{m['throughput_tok_s']:10.1f} {thr}", flush=True)
        if not args.json:
            print(f"{dname}: streaming-read bandwidth in this run {bw / 1e9:.1f} GB/s", flush=True)
        del model
    if args.json:
        print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
