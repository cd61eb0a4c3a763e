"""TransformerInfer and the patched model vs HF generate: prefill and decode tokens/s, side by side.

    python -m atb.bench.infer [--models smollm2,tinyllama] [--dtypes float32,bfloat16] [--batches 1,16]
                              [--modes graph,python,patched] [--prompt 128] [--new 128] [--repeats 3]
                              [--threads N]

For each model, dtype and batch size: prefill tok/s (generate with one new
token), decode tok/s ((new - 1) tokens per sequence over the time beyond
prefill), and the same for HF ``generate`` in the same process. ``graph`` and
``python`` are TransformerInfer's two decode paths; ``patched`` is the same HF
model after ``patch_hf_model`` (unpatched again afterwards). ``tinyllama`` is a
random-weight model of TinyLlama-1.1B's shape. Decode is reported as a fraction
of the weight-streaming roofline (the bytes a step reads, ``atb.bench.roofline.decode_step_bytes``:
the weights and the batch's K/V, over the streaming-read bandwidth: the median of one read per
repeat round, taken among the runs), prefill and decode as fractions of the GEMM peak
(torch.matmul on 1024^3, measured in this run: fp32, or for fp16/bf16 the larger of that dtype and fp32,
``atb.bench.roofline.gemm_gflops``; prefill FLOPs
counted as 2 x the layers' linear parameters x tokens, a decode token's as ``decode_token_flops``: the LM head
and attention's too). At batch 1 a decode step is bound by its bytes, at batch 16 (on a CPU without a bf16
dot product) by its FLOPs: each has its own column. Medians over ``--repeats``
rounds, in each of which every path at every batch size runs once (so batch 16's
``x b1``, the median of the rounds' ratios, compares runs minutes apart at most).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from atb.bench.roofline import (add_table_or_json_args, apply_threads, decode_step_bytes, decode_token_flops,
                                generate_rates, json_results, print_table_head, stream_read_gbps)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ordinary tokens only (ids below 17 are SmolLM2's special tokens).
    return torch.randint(17, vocab, (batch, length), generator=g).tolist()


_MODELS = {"smollm2": "SmolLM2-135M", "tinyllama": "TinyLlama-1.1B-shaped (random weights)"}


def _load(name: str, dtype: torch.dtype):
    from atb.checkpoints import load_model, random_model

    if name == "tinyllama":
        return random_model("tinyllama-1.1b", dtype=dtype)
    return load_model(dtype=dtype)[0]


def bench_batches(model, prompts_by_batch: dict[int, list[list[int]]], new: int, repeats: int,
                  modes: list[str]) -> dict[int, dict]:
    """Prefill/decode rates of TransformerInfer in each mode ("graph", "python"), of the patched model
    ("patched") and of HF generate, at every batch size: {batch: results}.

    Every path at every batch takes its turn in each repeat round: the machine is shared and its speed
    drifts over minutes, so each median covers the same stretch of time as the others' and the ratios hold,
    between paths and between batch sizes (a batch's ``decode_vs_batch1`` is the median of the rounds'
    ratios to batch 1)."""
    import atb

    runners = {}  # (batch, name) -> fn(n)
    for b, prompts in prompts_by_batch.items():
        ids = torch.tensor(prompts)
        mask = torch.ones_like(ids)

        def hf(n, ids=ids, mask=mask):
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        for mode in modes:
            if mode == "patched":
                runners[(b, mode)] = hf  # run between patch_hf_model and unpatch_hf_model below
                continue
            infer = atb.TransformerInfer(model, max_seq_len=len(prompts[0]) + new, max_batch_size=b,
                                         block_size=128, graph_mode=mode == "graph")

            def ours(n, infer=infer, prompts=prompts):
                out = infer.generate(prompts, n, eos_token_id=[])
                assert all(len(o) == n for o in out)

            runners[(b, mode)] = ours
        runners[(b, "hf")] = hf
    step_weights_bytes = decode_step_bytes(model)  # (also the read probe's buffer: as large as the weights)

    def timed(name, fn, n):
        if name == "patched":
            atb.patch_hf_model(model)
        try:
            t0 = time.perf_counter()
            fn(n)
            return time.perf_counter() - t0
        finally:
            if name == "patched":
                atb.unpatch_hf_model(model)

    for (_, name), fn in runners.items():
        timed(name, fn, 2)  # warm-up: kernels, allocator, first touch of the KV pool
    prefill = {key: [] for key in runners}
    total = {key: [] for key in runners}
    # The roofline's streaming read is sampled in every round too: this machine's read rate drifts (31-53 GB/s
    # between runs of one session), so a single read taken before the runs can be far from the rate the decode
    # steps met, in either direction; the median of reads taken among them is the same stretch of time.
    reads = {b: [] for b in prompts_by_batch}
    for _ in range(repeats):
        for b in prompts_by_batch:
            for (rb, name), fn in runners.items():
                if rb == b:
                    prefill[(b, name)].append(timed(name, fn, 1))
                    total[(b, name)].append(timed(name, fn, new))
            reads[b].append(stream_read_gbps(step_weights_bytes, repeat=3))

    prompt_len = len(next(iter(prompts_by_batch.values()))[0])

    def decode_rate(b, t_prefill, t_total):  # NaN where noise put the decode under its own prefill
        return generate_rates(t_prefill, t_total, b, prompt_len, new)[1]

    out = {}
    for b, prompts in prompts_by_batch.items():
        res = {"batch": b, "step_weights_bytes": step_weights_bytes, "stream_read_GB_s": statistics.median(reads[b])}
        for (rb, name) in runners:
            if rb != b:
                continue
            t_prefill, t_total = statistics.median(prefill[(b, name)]), statistics.median(total[(b, name)])
            rate = decode_rate(b, t_prefill, t_total)
            res[name] = {
                "prefill_tok_s": b * len(prompts[0]) / t_prefill,
                "decode_tok_s": rate,
                "step_ms": 1e3 * b / rate,  # NaN with the rate
                "throughput_tok_s": b * new / t_total,
            }
            if b != 1 and (1, name) in runners:
                per_round = [decode_rate(b, p, t) / decode_rate(1, p1, t1) for p, t, p1, t1 in
                             zip(prefill[(b, name)], total[(b, name)], prefill[(1, name)], total[(1, name)])]
                res[name]["decode_vs_batch1"] = statistics.median(per_round)
        out[b] = res
    return out


def main(argv=None) -> list[dict]:
    from atb.bench.roofline import gemm_gflops

    ap = argparse.ArgumentParser(prog="python -m atb.bench.infer", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2", help="comma-separated: " + ", ".join(_MODELS))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--modes", default="graph,python,patched",
                    help="comma-separated: graph, python (TransformerInfer decode paths), patched (patch_hf_model)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    add_table_or_json_args(ap)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    apply_threads(args.threads)

    results = []
    hdr = (f"{'model':9} {'dtype':9} {'batch':>5} {'path':>7} | {'prefill tok/s':>13} {'x HF':>5} {'%peak':>5} | "
           f"{'decode tok/s':>12} {'x HF':>5} {'x b1':>5} | {'step ms':>7} {'roofline':>8} {'%peak':>5}")
    if not args.json:
        print_table_head(f"{args.prompt}-token prompts, {args.new} new tokens, median of {args.repeats}, "
                         f"threads={torch.get_num_threads()}", hdr)
    for mname in args.models.split(","):
        if mname not in _MODELS:
            raise SystemExit(f"atb.bench.infer: error: unknown model '{mname}'; known: {', '.join(_MODELS)}")
        for dname in args.dtypes.split(","):
            dtype = _DTYPES[dname]
            model = _load(mname, dtype)
            # Prefill runs every layer's linears on every token, the LM head only on the last one.
            head = model.get_output_embeddings()
            linear_params = sum(m.weight.numel() for m in model.modules()
                                if isinstance(m, torch.nn.Linear) and m is not head)
            peak = gemm_gflops(dtype) * 1e9
            batches = [int(x) for x in args.batches.split(",")]
            per_batch = bench_batches(model, {b: _prompts(b, args.prompt, model.config.vocab_size, seed=b)
                                              for b in batches}, args.new, args.repeats, modes)
            context = args.prompt + args.new // 2  # a decode step's mean context
            flops = decode_token_flops(model, context)
            for b, r in per_batch.items():
                bw = r["stream_read_GB_s"] * 1e9
                # One decode step streams the weights once, whatever the batch, and each sequence's K/V.
                step = decode_step_bytes(model, b, context)
                r.update(model=mname, dtype=dname, bandwidth_GB_s=bw / 1e9, gemm_peak_GFLOP_s=peak / 1e9)
                results.append(r)
                for name in modes + ["hf"]:
                    m = r[name]
                    if name != "hf":
                        m["decode_vs_hf"] = m["decode_tok_s"] / r["hf"]["decode_tok_s"]
                        m["prefill_vs_hf"] = m["prefill_tok_s"] / r["hf"]["prefill_tok_s"]
                    m["roofline_fraction"] = m["decode_tok_s"] / b * step / bw
                    m["decode_peak_fraction"] = m["decode_tok_s"] * flops / peak
                    m["prefill_peak_fraction"] = m["prefill_tok_s"] * 2 * linear_params / peak
                if not args.json:
                    for name in modes + ["hf"]:
                        m = r[name]
                        ratio = lambda k, w=5: f"{m[k]:{w}.2f}" if k in m else f"{'':{w}}"  # noqa: E731
                        print(f"{mname:9} {dname:9} {b:>5} {name:>7} | {m['prefill_tok_s']:13.0f} "
                              f"{ratio('prefill_vs_hf')} {m['prefill_peak_fraction']:5.0%} | "
                              f"{m['decode_tok_s']:12.1f} {ratio('decode_vs_hf')} {ratio('decode_vs_batch1')} | "
                              f"{m['step_ms']:7.1f} {m['roofline_fraction']:8.0%} {m['decode_peak_fraction']:5.0%}",
                              flush=True)
            if not args.json:
                reads = ", ".join(f"batch {b} {r['stream_read_GB_s']:.1f}" for b, r in per_batch.items())
                print(f"{mname} {dname}: streaming read (GB/s, median of one read per round among the runs) {reads}; "
                      f"GEMM peak {peak / 1e9:.0f} GFLOP/s (torch.matmul 1024^3, gemm_gflops), "
                      f"weights read per step {decode_step_bytes(model) / 1e6:.0f} MB", flush=True)
            del model
    return json_results(results, args.json)


if __name__ == "__main__":
    main()
