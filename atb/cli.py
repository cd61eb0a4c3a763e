"""``python -m atb`` / ``atb``: benchmarks, generation, model check, SoC table.

User errors (missing model, unknown preset, bad dtype for the SoC, missing
optional package) print one line and exit with status 2; anything else is a
bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


class UserError(Exception):
    """A mistake in the command line or the environment, reported in one line."""


class Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, what: str, i: int | None = None, n: int | None = None):
        if not self.enabled:
            return
        step = f" [{i + 1}/{n}]" if i is not None and n else ""
        msg = f"[{time.perf_counter() - self.t0:6.1f}s] {what}{step}"
        if self.tty:
            sys.stderr.write("\r\033[K" + msg)
        else:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def done(self):
        if self.enabled and self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise UserError(f"unknown --dtype '{name}'; use one of float32, bfloat16, float16")
    return getattr(torch, DTYPES[name])


def _check_soc_dtype(soc_type: str, dtype) -> None:
    import torch

    import atb

    try:
        soc = atb.get_soc(soc_type)
    except ValueError as e:
        raise UserError(str(e)) from None
    if dtype == torch.bfloat16 and not soc.supports_bf16:
        raise UserError(f"--dtype bfloat16 is not supported on {soc_type} (no bf16 unit); use float16 or float32")


def _load(args, dtype, progress: Progress):
    """(model, tokenizer or None, label) from --model / --config / the default checkpoint."""
    from atb import checkpoints

    try:
        if getattr(args, "config", None):
            progress(f"building random-weight model '{args.config}'")
            return checkpoints.random_model(args.config, dtype=dtype), None, f"random:{args.config}"
        progress("loading " + (args.model or "SmolLM2-135M-Instruct (embedded default)"))
        model, tok = checkpoints.load_model(args.model, dtype=dtype)
        return model, tok, args.model or "SmolLM2-135M-Instruct"
    except checkpoints.ModelLoadError as e:
        raise UserError(str(e)) from None


# ---------------------------------------------------------------- socs
def cmd_socs(args) -> int:
    import atb

    print(f"{'soc_type':<14}{'cube cores':>11}{'vector cores':>14}{'UB / core':>11}{'L1':>10}{'bf16':>6}")
    for name in atb.soc_names():
        s = atb.get_soc(name)
        print(f"{name:<14}{s.cube_core_num:>11}{s.vector_core_num:>14}{s.ub_size // 1024:>8} KiB"
              f"{s.l1_size // 1024:>6} KiB{'yes' if s.supports_bf16 else 'no':>6}")
    print("aliases: Ascend910B, Ascend910ProB -> Ascend910-class; Ascend310P -> Ascend310P3; "
          "host = this CPU (cores = atb threads)")
    return 0


# ---------------------------------------------------------------- check
def cmd_check(args) -> int:
    import atb

    progress = Progress(not args.quiet)
    dtype = _torch_dtype(args.dtype)
    model, _, label = _load(args, dtype, progress)
    progress.done()
    report = atb.check_model(model)
    print(f"model: {label}")
    print(report)
    return 0 if report.supported else 1


# ---------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    import torch

    import atb

    dtype = _torch_dtype(args.dtype)
    _check_soc_dtype(args.soc_type, dtype)
    if args.threads:
        atb.set_num_threads(args.threads)
    lead = _join_tp(args)   # under --tp only rank 0 prints
    progress = Progress(not args.quiet and lead)
    if args.tp > 1 and args.model and os.path.isdir(args.model):
        # Each rank reads only its slices of the directory's safetensors files.
        from transformers import AutoTokenizer

        progress(f"loading tokenizer of {args.model}")
        model, tok = args.model, AutoTokenizer.from_pretrained(args.model)
    else:
        model, tok, _ = _load(args, dtype, progress)
    if tok is None:
        raise UserError("generate needs a tokenizer: use the default model or --model with a tokenizer")
    progress("building engine")
    infer = atb.TransformerInfer(model, max_seq_len=args.max_seq_len, soc_type=args.soc_type, dtype=dtype,
                                 tp=args.tp if args.tp > 1 else None)
    progress.done()
    if tok.chat_template and not args.raw:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tok(args.prompt)["input_ids"]
    ids = [int(i) for i in (ids.tolist() if torch.is_tensor(ids) else ids)]
    streamed: list[int] = []
    printed = [0]

    def on_token(_seq: int, token: int):
        if not lead:
            return
        streamed.append(token)
        text = tok.decode(streamed, skip_special_tokens=True)
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    t0 = time.perf_counter()
    out = infer.generate([ids], max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                         temperature=max(args.temperature, 1e-5), top_p=args.top_p, seed=args.seed, stream=on_token)
    dt = time.perf_counter() - t0
    if not lead:
        return 0
    sys.stdout.write("\n")
    n = len(out[0])
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s incl. prefill of {len(ids)} prompt tokens; "
          f"soc_type={args.soc_type}, dtype={args.dtype}]", file=sys.stderr)
    return 0


def _join_tp(args) -> bool:
    """Joins the torchrun process group for ``--tp N``; True on the rank that prints (rank 0, or no tp)."""
    if args.tp < 1:
        raise UserError(f"--tp must be >= 1, got {args.tp}")
    if args.tp == 1:
        return True
    import torch.distributed as dist

    from atb import distributed

    try:
        distributed.init_process_group(args.tp_backend)
    except ValueError as e:
        raise UserError(f"{e} (run: torchrun --nproc-per-node {args.tp} -m atb generate --tp {args.tp} ...)") from None
    if dist.get_world_size() != args.tp:
        raise UserError(f"--tp {args.tp} but torchrun started {dist.get_world_size()} processes")
    return dist.get_rank() == 0


# ---------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    import torch

    import atb
    from atb.bench import e2e, layers, roofline

    dtype = _torch_dtype(args.dtype)
    _check_soc_dtype(args.soc_type, dtype)
    if args.threads:
        atb.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    for flag in ("prompt_len", "new_tokens", "batch", "repeat"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    progress = Progress(not args.quiet)
    model, tok, label = _load(args, dtype, progress)
    progress("measuring memory bandwidth and GEMM peak")
    roofline.keep_freed_memory()
    machine = roofline.Machine.measure(dtype)
    info = atb.build_info()
    rows = []
    for phase, batch, tokens, context in (("decode", 1, 1, args.prompt_len), ("prefill", 1, args.prompt_len, args.prompt_len)):
        rows += layers.layer_table(model, phase=phase, batch=batch, tokens=tokens, context=context, machine=machine,
                                   repeat=args.repeat, soc_type=args.soc_type, progress=progress)
    e2e_rows = e2e.end_to_end(model, prompt_len=args.prompt_len, new_tokens=args.new_tokens, batch=args.batch,
                              repeat=2 if args.repeat > 1 else 1, soc_type=args.soc_type, machine=machine,
                              progress=progress)
    progress.done()

    print(f"atb {atb.__version__} | model {label} | dtype {args.dtype} | soc_type {args.soc_type} | "
          f"threads {info['num_threads']} | {info['processor']} ({info['isa']})")
    print(f"machine: streaming read {machine.bandwidth / 1e9:.1f} GB/s, {args.dtype} GEMM "
          f"{machine.gemm_peak / 1e9:.0f} GFLOP/s (measured now)\n")
    for phase in ("decode", "prefill"):
        title = (f"one decoder layer, decode (1 new token, {args.prompt_len}-token context)" if phase == "decode"
                 else f"one decoder layer, prefill ({args.prompt_len} tokens)")
        print(title)
        print(layers.format_table([r for r in rows if r.phase == phase]))
        print()
    print("end to end")
    print(e2e.format_table(e2e_rows))

    common = {"model": label, "dtype": args.dtype, "soc_type": args.soc_type, "threads": info["num_threads"],
              "cpu": info["processor"], "isa": info["isa"], "atb_version": atb.__version__,
              "bandwidth_gbps": machine.bandwidth / 1e9}
    records = [{"kind": "layer", **common, **r.as_dict()} for r in rows]
    records += [{"kind": "end_to_end", **common, **r.as_dict()} for r in e2e_rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.csv:
        keys = sorted({k for r in records for k in r})
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(records)
    if args.plot:
        _plot(rows, args.plot, title=f"{label} {args.dtype}: per-layer latency")
    return 0


def _plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["decode", "prefill"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, phase in zip(axes, phases):
        sel = [r for r in rows if r.phase == phase]
        y = range(len(sel))
        ax.barh([i + 0.2 for i in y], [r.stock_us for r in sel], height=0.4, label="HF stock")
        ax.barh([i - 0.2 for i in y], [r.atb_us for r in sel], height=0.4, label="atb")
        ax.set_yticks(list(y), [r.name for r in sel])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("µs (log)")
        ax.set_title(phase)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atb", description="Ascend Transformer Boost-style acceleration on the CPU")
    sub = p.add_subparsers(dest="command")

    def model_args(sp, default_dtype="float32"):
        sp.add_argument("--model", help="local HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
        sp.add_argument("--dtype", default=default_dtype, help="float32 | bfloat16 | float16")
        sp.add_argument("--quiet", action="store_true", help="no progress display")

    b = sub.add_parser("bench", help="per-layer latency table and end-to-end tok/s (the main job)")
    model_args(b)
    b.add_argument("--config", help="random-weight preset instead of a checkpoint (e.g. tinyllama-1.1b, tiny)")
    b.add_argument("--soc-type", default="host")
    b.add_argument("--threads", type=int, default=0, help="threads for atb and torch (default: torch's)")
    b.add_argument("--prompt-len", type=int, default=128)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--batch", type=int, default=16, help="batch size of the batched end-to-end run")
    b.add_argument("--repeat", type=int, default=9, help="timed repeats per layer row (median reported)")
    b.add_argument("--json", metavar="PATH")
    b.add_argument("--csv", metavar="PATH")
    b.add_argument("--plot", metavar="PATH.png")
    b.set_defaults(func=cmd_bench)

    g = sub.add_parser("generate", help="chat with the model through TransformerInfer, streaming")
    g.add_argument("prompt")
    model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--soc-type", default="host")
    g.add_argument("--threads", type=int, default=0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (under torchrun --nproc-per-node N; only rank 0 prints)")
    g.add_argument("--tp-backend", default="gloo", help="torch.distributed backend for --tp (default gloo)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("check", help="which modules of a model run fused, stay stock, or are unsupported")
    model_args(c)
    c.add_argument("--config", help="random-weight preset instead of a checkpoint")
    c.set_defaults(func=cmd_check)

    s = sub.add_parser("socs", help="the SoC table")
    s.set_defaults(func=cmd_socs)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UserError as e:
        print(f"atb: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("atb: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
