"""Benchmark of the quantized formats: W8A16 and W4A16 against bf16, per GEMV and end to end.

The issue's table (whole models, one process, formats interleaved repeat by repeat):
``python -m atb.bench.quant --e2e`` — SmolLM2-135M and a random TinyLlama-1.1B-shaped model, batch 1
and 16, 128-token prompt: prefill and decode tok/s of HF eager bf16 and of ``TransformerInfer`` in
bf16, W8A16, W4A16 g32 and g128, with the bytes each decode step reads (weights + the batch's K/V)
and decode tok/s as a fraction of that bytes roofline (streaming-read bandwidth / bytes per step).

Per GEMV: ``python -m atb.bench.quant [--quick] [--m 1 16]``. For each weight shape of SmolLM2-135M
and TinyLlama-1.1B and each format, reports µs per GEMV, the weight bytes it streams (packed
values + scales + mins), the achieved GB/s, and that as a fraction of the streaming-read
bandwidth measured in the same run. Enough copies of each weight are cycled that the working
set (>= 2x the 32 MiB L3 of this machine class) comes from DRAM, as in a whole-model decode
step. Activations are bf16; the formats' kernels run on the ISA path shown.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import atb
from atb.bench.roofline import (decode_step_bytes, generate_rates, keep_freed_memory, kv_bytes, median_seconds,
                                stream_read_gbps)
from atb.quant import quantize_weight

# (label, N, K): the projections of one decoder layer and the LM head.
SHAPES = {
    "smollm2": [("q/o 576x576", 576, 576), ("gate/up 1536x576", 1536, 576), ("down 576x1536", 576, 1536),
                ("lm_head 49152x576", 49152, 576)],
    "tinyllama": [("q/o 2048x2048", 2048, 2048), ("gate/up 5632x2048", 5632, 2048), ("down 2048x5632", 2048, 5632),
                  ("lm_head 32000x2048", 32000, 2048)],
}
FORMATS = [("bf16", None, None), ("w8a16", "w8a16", 0), ("w4a16 g32", "w4a16", 32), ("w4a16 g128", "w4a16", 128)]


def _weight(kind, fmt, group, n, k):
    w = torch.randn(n, k) * k ** -0.5
    if kind == "bf16":
        return w.bfloat16(), n * k * 2
    q = quantize_weight(w, fmt, group)
    return q, q.nbytes


def bench_quant(models=("smollm2", "tinyllama"), ms=(1,), working_set: int = 64 << 20, repeats: int = 7,
                quick: bool = False) -> list[dict]:
    keep_freed_memory()
    bw = stream_read_gbps()
    rows = []
    for model in models:
        shapes = SHAPES[model][1:3] if quick else SHAPES[model]
        for label, n, k in shapes:
            for kind, fmt, group in FORMATS:
                one, nbytes = _weight(kind, fmt, group, n, k)
                copies = max(1, working_set // nbytes)
                weights = [one] + [_weight(kind, fmt, group, n, k)[0] for _ in range(copies - 1)]
                for m in ms:
                    x = torch.randn(m, k).bfloat16()

                    def run():
                        for w in weights:
                            atb.kernels.linear(x, w)

                    us = median_seconds(run, repeats) / copies * 1e6
                    gbps = nbytes / (us * 1e-6) / 1e9
                    rows.append(dict(model=model, shape=label, format=kind, m=m, us=us, bytes=nbytes, gbps=gbps,
                                     roofline=gbps / bw, bandwidth=bw))
    return rows


E2E_FORMATS = [("bf16", None), ("w8a16", "w8a16"), ("w4a16 g32", "w4a16"), ("w4a16 g128", "w4a16-g128")]


def _e2e_model(name: str):
    if name == "smollm2":
        from atb.checkpoints import load_model

        model, _ = load_model()
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def bench_e2e(models=("smollm2", "tinyllama"), batches=(1, 16), prompt_len: int = 128, new_tokens: int = 33,
              repeats: int = 3, hf: bool = True) -> list[dict]:
    """Whole-model prefill and decode tok/s per format; decode = (new_tokens - 1) steps over the time a
    generate of new_tokens takes beyond one of a single token (the prefill).

    The roofline's streaming read is the median of one read per repeat round, taken among the runs (as
    ``bench.infer``'s): this machine's read rate drifts by half between minutes, so one read before the
    runs can be far from the rate the decode steps met."""
    rows = []
    for name in models:
        model = _e2e_model(name)
        cfg = model.config
        engines = {label: atb.TransformerInfer(model, max_seq_len=prompt_len + new_tokens, max_batch_size=max(batches),
                                               dtype=torch.bfloat16, quantize=spec)
                   for label, spec in E2E_FORMATS}
        wbytes = {label: e.runner.weight_bytes(decode_step=True) for label, e in engines.items()}
        if hf:
            wbytes["HF eager bf16"] = decode_step_bytes(model)
        for b in batches:
            g = torch.Generator().manual_seed(b)
            prompts = torch.randint(100, cfg.vocab_size - 100, (b, prompt_len), generator=g).tolist()
            runs = {label: (lambda k, e=e: e.generate(prompts, max_new_tokens=k, eos_token_id=[]))
                    for label, e in engines.items()}
            if hf:
                ids = torch.tensor(prompts)

                def hf_run(k, ids=ids):
                    with torch.inference_mode():
                        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                                       do_sample=False, pad_token_id=0)

                runs = {"HF eager bf16": hf_run, **runs}
            for fn in runs.values():  # warm-up: routing measurements, first-touch of the caches
                fn(2)
            pre, dec = {k: [] for k in runs}, {k: [] for k in runs}
            reads = []
            for _ in range(repeats):  # formats interleaved repeat by repeat: load changes hit all alike
                for label, fn in runs.items():
                    t0 = time.perf_counter()
                    fn(1)
                    t1 = time.perf_counter()
                    fn(new_tokens)
                    tn = time.perf_counter() - t1
                    prefill, decode = generate_rates(t1 - t0, tn, b, prompt_len, new_tokens)  # (decode NaN under noise)
                    pre[label].append(prefill)
                    dec[label].append(decode)
                reads.append(stream_read_gbps(repeat=3))
            bw = statistics.median(reads)
            kv = kv_bytes(cfg, b, prompt_len + new_tokens // 2, element_size=2)  # bf16 K/V
            for label in runs:
                step = wbytes[label] + kv
                d = statistics.median(dec[label])
                rows.append(dict(model=name, format=label, batch=b, prefill=statistics.median(pre[label]), decode=d,
                                 bytes_per_step=step, roofline=d / (b * bw * 1e9 / step), bandwidth=bw))
        del engines, model
    return rows


def format_e2e(rows: list[dict]) -> str:
    head = (f"{'model':10} {'format':14} {'batch':>5} {'prefill tok/s':>13} {'decode tok/s':>12} {'MB/step':>8} "
            f"{'roofline':>8} {'vs HF':>6}")
    lines = [head, "-" * len(head)]
    hf = {(r["model"], r["batch"]): r["decode"] for r in rows if r["format"] == "HF eager bf16"}
    for r in rows:
        key = (r["model"], r["batch"])
        vs = f"{r['decode'] / hf[key]:5.2f}x" if key in hf else f"{'-':>6}"  # --no-hf: no ratio to print
        lines.append(f"{r['model']:10} {r['format']:14} {r['batch']:>5} {r['prefill']:13.0f} {r['decode']:12.1f} "
                     f"{r['bytes_per_step'] / 1e6:8.1f} {r['roofline']:8.0%} {vs}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m atb.bench.quant", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes per model, fewer repeats")
    p.add_argument("--m", type=int, nargs="+", default=[1], help="rows of x (decode batch)")
    p.add_argument("--models", nargs="+", default=["smollm2", "tinyllama"], choices=sorted(SHAPES))
    p.add_argument("--e2e", action="store_true", help="the whole-model table (see the module docstring)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="--e2e: batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="--e2e: interleaved repeats (medians)")
    p.add_argument("--no-hf", action="store_true", help="--e2e: skip HF eager")
    a = p.parse_args(argv)
    info = atb.build_info()
    print(f"# {info['processor']}, {info['num_threads']} threads; quantized kernels: {atb.quant.isa()} "
          f"(paths {', '.join(atb.quant.isa_paths())}); CPU features: {info['cpu_features']}")
    if a.e2e:
        rows = bench_e2e(a.models, tuple(a.batches), repeats=a.repeats, hf=not a.no_hf)
        reads = ", ".join(f"{r['model']} batch {r['batch']} {r['bandwidth']:.1f}" for r in rows if r["format"] == "bf16")
        print(f"# streaming read (GB/s, median of one read per round among the runs): {reads}; 128-token prompt, "
              f"32 decode steps; roofline = decode tok/s / (batch x bandwidth / bytes per step)")
        print(format_e2e(rows))
        return
    rows = bench_quant(a.models, tuple(a.m), repeats=3 if a.quick else 7, quick=a.quick)
    print(f"# streaming read: {rows[0]['bandwidth']:.1f} GB/s (the roofline)")
    print(f"{'model':10} {'shape':20} {'format':11} {'M':>3} {'us':>9} {'MB':>8} {'GB/s':>7} {'roofline':>8} {'vs bf16':>7}")
    base = {}
    for r in rows:
        key = (r["model"], r["shape"], r["m"])
        if r["format"] == "bf16":
            base[key] = r["us"]
        speed = base.get(key, r["us"]) / r["us"]
        print(f"{r['model']:10} {r['shape']:20} {r['format']:11} {r['m']:>3} {r['us']:9.1f} {r['bytes'] / 1e6:8.2f} "
              f"{r['gbps']:7.1f} {r['roofline']:8.0%} {speed:6.2f}x")


if __name__ == "__main__":
    main()
