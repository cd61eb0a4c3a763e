"""``python -m atb`` / ``atb``: benchmarks, generation, chat, conversion, model check, SoC table.

User errors (bad argument, missing model, unknown preset, bad dtype for the SoC,
missing optional package, unwritable output path) print one ``atb: error:`` line
and exit with status 2, checked before anything slow (model load, benchmark)
starts wherever the arguments alone decide it; anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sys
import time

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


class UserError(Exception):
    """A mistake in the command line or the environment, reported in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse reporting bad arguments as the rest of the CLI reports user errors: one line, status 2."""

    def error(self, message):
        print(f"atb: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


# argparse `type=` checks: a bad value is rejected while parsing, before any work.
def _number(kind, low=None, high=None, low_open=False, what=""):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got '{text}'")
        if v != v or (low is not None and (v < low or (low_open and v == low))) or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v
    return parse


_POSITIVE = _number(int, 1, what=">= 1")
_NON_NEGATIVE_INT = _number(int, 0, what=">= 0 (0 = off)")
_TEMPERATURE = _number(float, 0.0, what=">= 0 (0 = greedy)")
_TOP_P = _number(float, 0.0, 1.0, low_open=True, what="in (0, 1]")
_MIN_P = _number(float, 0.0, 1.0, what="in [0, 1] (0 = off)")
_PENALTY = _number(float, 0.0, low_open=True, what="> 0 (1 = off)")


def _threads(text):
    n = os.cpu_count() or 1
    return _number(int, 1, n, what=f"between 1 and {n} (this machine's CPUs)")(text)


def _dtype_name(text):
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype '{text}'; use one of float32, bfloat16, float16")
    return DTYPES[text]


def _output_path(path: str | None, flag: str) -> None:
    """Fails now, not after the benchmark, when an output file cannot be created."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a directory")
    if not os.path.isdir(parent):
        raise UserError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable")


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

    return getattr(torch, DTYPES[name])


def _preflight(args, runs_on_atb: bool = True):
    """Checks --model from its config alone (no weights read): the path, config.json, and (for
    commands that run the model on atb) a supported family. Returns the config, or None for the
    default model and --config presets."""
    from atb import checkpoints
    from atb.registry import supported_model_types

    if getattr(args, "config", None) or not args.model:
        return None
    try:
        config = checkpoints.model_config(args.model)
    except checkpoints.ModelLoadError as e:
        raise UserError(str(e)) from None
    if runs_on_atb and config.model_type not in supported_model_types():
        raise UserError(f"{args.model}: model_type '{config.model_type}' is not supported by atb "
                        f"(supported: {', '.join(supported_model_types())})")
    return config


def _atb_quantization(args) -> dict | None:
    """The quantization_config of --model when it is an ``atb convert --quantize`` directory, else None."""
    if not (getattr(args, "model", None) and os.path.isdir(args.model)):
        return None
    from atb.checkpoints import atb_quantization

    return atb_quantization(args.model)


def check_quantize_args(args) -> None:
    """Refuses, before anything loads, --lookup-history without speculation and the --quantize / --tp
    combinations no engine runs: --quantize under
    tensor parallelism (--tp slices float weights), and what an ``atb convert --quantize`` --model cannot do:
    be quantized again (--quantize) or be sliced by --tp."""
    from atb.quant.engine import runs_as_stored

    speculative_config(args)  # --lookup-history without --num-speculative-tokens
    quantize, tp = getattr(args, "quantize", None), getattr(args, "tp", 1)
    if quantize is not None and tp > 1:
        raise UserError(f"--quantize {quantize} and --tp {tp} together are not supported (tensor parallelism "
                        f"slices float weights): use one or the other")
    qc = _atb_quantization(args)
    if qc is None:
        return
    if not runs_as_stored(quantize):
        raise UserError(f"--quantize {quantize}: {args.model} is already quantized by atb convert "
                        f"({qc.get('format')}) and runs as stored; leave --quantize out")
    if tp > 1:
        raise UserError(f"--tp {args.tp}: {args.model} is an atb quantized checkpoint, and tensor parallelism "
                        f"slices float weights: run it without --tp, or give --tp a float checkpoint")


def _max_seq_len(args, config) -> int:
    """--max-seq-len, or 2048 clamped to the model's max_position_embeddings."""
    if args.max_seq_len is not None:
        return args.max_seq_len
    limit = getattr(config, "max_position_embeddings", None) if config is not None else None
    return min(2048, limit) if limit else 2048


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
    from atb.quant.engine import runs_as_stored

    try:
        if getattr(args, "config", None):
            progress(f"building random-weight model '{args.config}'")
            return checkpoints.random_model(args.config, dtype=dtype), None, f"random:{args.config}"
        progress("loading " + (args.model or "SmolLM2-135M-Instruct (embedded default)"))
        # A GGUF --model with --quantize native[+<format>] is read as its own blocks, never as floats.
        native = getattr(args, "quantize", None)
        native = native if (args.model or "").endswith(".gguf") and native and runs_as_stored(native) else None
        model, tok = checkpoints.load_model(args.model, dtype=dtype, progress=progress.enabled, quantize=native)
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

    dtype = _torch_dtype(args.dtype)
    _preflight(args, runs_on_atb=False)  # path and config.json; an unsupported family is what check reports
    progress = Progress(not args.quiet)
    model, _, label = _load(args, dtype, progress)
    progress.done()
    report = atb.check_model(model)
    print(f"model: {label}")
    print(report)
    if (args.model or "").endswith(".gguf"):
        from atb.quant.gguf import type_summary

        print(f"GGUF weight matrices under --quantize native: {type_summary(args.model)}")
    from atb.kernels.linear import ROUTED_OPS, routing_mode, routing_table

    info = atb.build_info()
    name = str(dtype).replace("torch.", "")
    print(f"linear routing by rows of x ({info['processor']}, isa {info['isa']}, mode {routing_mode()}):")
    for op in ROUTED_OPS:
        rows = routing_table([dtype], op)[name]
        print(f"  {op}: " + ", ".join(f"{r}: {path}" for r, path in rows.items()))
    return 0 if report.supported else 1


# ---------------------------------------------------------------- generate / chat
def _engine(args):
    """(TransformerInfer, tokenizer) for generate/chat, every argument checked before the model loads."""
    import atb

    dtype = _torch_dtype(args.dtype)
    _check_soc_dtype(args.soc_type, dtype)
    config = _preflight(args)
    check_quantize_args(args)
    max_seq_len = _max_seq_len(args, config)
    if args.max_new_tokens >= max_seq_len:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                        f"--max-seq-len {max_seq_len}")
    if args.threads:
        atb.set_num_threads(args.threads)
    tp = getattr(args, "tp", 1)   # generate only; chat runs on one process
    lead = _join_tp(args) if tp > 1 else True   # under --tp only rank 0 prints
    progress = Progress(not args.quiet and lead)
    if tp > 1 and args.model and os.path.isdir(args.model):
        # Each rank reads only its slices of the directory's safetensors files.
        from transformers import AutoTokenizer

        progress(f"loading tokenizer of {args.model}")
        model, tok = args.model, AutoTokenizer.from_pretrained(args.model)
    else:
        model, tok, _ = _load(args, dtype, progress)
    if tok is None:
        raise UserError("this command needs a tokenizer: use the default model or --model with a tokenizer")
    progress("building engine")
    infer = atb.TransformerInfer(model, max_seq_len=max_seq_len, soc_type=args.soc_type, dtype=dtype,
                                 quantize=args.quantize, tp=tp if tp > 1 else None,
                                 speculative_config=speculative_config(args))
    progress.done()
    return infer, tok, max_seq_len, lead


def _token_ids(ids) -> list[int]:
    import torch

    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(i) for i in (ids.tolist() if torch.is_tensor(ids) else ids)]


def _stream_reply(infer, tok, ids: list[int], args, lead: bool = True) -> tuple[list[int], float]:
    """Generates after ``ids``, printing the text as it grows (on the rank that prints); returns (new tokens,
    seconds)."""
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
                         temperature=max(args.temperature, 1e-5), top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty, seed=args.seed, stream=on_token)
    dt = time.perf_counter() - t0
    if lead:
        sys.stdout.write("\n")
    sys.stdout.flush()
    return out[0], dt


def cmd_generate(args) -> int:
    infer, tok, max_seq_len, lead = _engine(args)
    if tok.chat_template and not args.raw:
        ids = _token_ids(tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                 add_generation_prompt=True))
    else:
        ids = _token_ids(tok(args.prompt))
    if len(ids) + args.max_new_tokens > max_seq_len:
        raise UserError(f"the prompt ({len(ids)} tokens) plus --max-new-tokens {args.max_new_tokens} exceeds "
                        f"--max-seq-len {max_seq_len}")
    out, dt = _stream_reply(infer, tok, ids, args, lead)
    if getattr(args, "tp", 1) > 1:
        # Every rank leaves generate after the same last collective. Left alive, the gloo group's threads
        # met interpreter shutdown and aborted a rank now and then ("terminate called without an active
        # exception", about 1 run in 4 of the README's tensor-parallel block).
        import torch.distributed as dist

        dist.destroy_process_group()
    if not lead:
        return 0
    n = len(out)
    spec = ""
    if infer.speculative is not None:
        st = infer.stats()
        spec = f"; speculative: {st['spec_accepted_tokens']} of {st['spec_draft_tokens']} draft tokens accepted"
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s incl. prefill of {len(ids)} prompt tokens; "
          f"soc_type={args.soc_type}, dtype={args.dtype}{spec}]", file=sys.stderr)
    return 0


def cmd_perplexity(args) -> int:
    """Perplexity of the model over a text file (or --text), windowed through the engine's prompt scoring."""
    import atb
    from atb.perplexity import perplexity

    if (args.file is None) == (args.text is None):
        raise UserError("perplexity needs the text to score: give --file or --text (one of them)")
    if args.file is not None:
        try:
            text = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--file {args.file}: {e}") from None
    else:
        text = args.text
    if args.stride is not None and args.stride > args.context:
        raise UserError(f"--stride {args.stride} must be at most --context {args.context}")
    dtype = _torch_dtype(args.dtype)
    _check_soc_dtype(args.soc_type, dtype)
    config = _preflight(args)
    check_quantize_args(args)
    limit = getattr(config, "max_position_embeddings", None) if config is not None else None
    if limit and args.context > limit:
        raise UserError(f"--context {args.context} exceeds the model's max_position_embeddings={limit}")
    if args.threads:
        atb.set_num_threads(args.threads)
    progress = Progress(not args.quiet)
    model, tok, label = _load(args, dtype, progress)
    if tok is None:
        raise UserError("perplexity needs a tokenizer: use the default model or --model with a tokenizer")
    ids = _token_ids(tok(text))
    if args.max_tokens is not None:
        ids = ids[:args.max_tokens]
    if len(ids) < 2:
        raise UserError(f"the text has {len(ids)} token(s); at least 2 are needed to score one")
    progress("building engine")
    infer = atb.TransformerInfer(model, max_seq_len=args.context, soc_type=args.soc_type, dtype=dtype,
                                 quantize=args.quantize, max_batch_size=args.batch,
                                 block_size=min(128, 1 << (args.context - 1).bit_length()))
    result = perplexity(infer, ids, context=args.context, stride=args.stride,
                        progress=lambda done, total: progress("scoring windows", done - 1, total))
    progress.done()
    print(f"{result}; {label}, dtype={args.dtype}" + (f", quantize={args.quantize}" if args.quantize else ""))
    return 0


def cmd_chat(args) -> int:
    """Multi-turn chat on stdin: one user message per line, replies streamed; ends at end of input (Ctrl-D)."""
    infer, tok, max_seq_len, _ = _engine(args)
    if not tok.chat_template:
        raise UserError("chat needs a tokenizer with a chat template")
    interactive = sys.stdin.isatty()
    if interactive:
        print("atb chat: one message per line; Ctrl-D ends.", file=sys.stderr)
    history = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        turn = history + [{"role": "user", "content": line}]
        ids = _token_ids(tok.apply_chat_template(turn, add_generation_prompt=True))
        # The oldest exchanges go first when the conversation outgrows the context (a system prompt stays).
        first = 1 if args.system else 0
        while len(ids) + args.max_new_tokens > max_seq_len and len(turn) > first + 1:
            del turn[first:first + 2]
            ids = _token_ids(tok.apply_chat_template(turn, add_generation_prompt=True))
        if len(ids) + args.max_new_tokens > max_seq_len:
            print(f"atb: message too long ({len(ids)} tokens with --max-new-tokens {args.max_new_tokens} "
                  f"exceeds --max-seq-len {max_seq_len}); not sent", file=sys.stderr)
            continue
        out, _ = _stream_reply(infer, tok, ids, args)
        history = turn + [{"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)}]


# ---------------------------------------------------------------- convert
def cmd_convert(args) -> int:
    from atb import convert

    def on_term(_signum, _frame):
        raise KeyboardInterrupt

    # A polite kill (SIGTERM) unwinds like Ctrl-C, so the partial output is removed.
    if args.dtype is None and args.quantize is None:
        raise UserError("convert: --dtype is required (float16, bfloat16 or float32) unless --quantize is given")
    if args.quantize is None and (args.group_size is not None or args.embed_format != "w8a16"):
        raise UserError("convert: --group-size and --embed-format need --quantize")
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        summary = convert.convert(args.src, args.dst, args.dtype or "float32", max_shard_size=args.max_shard_size,
                                  force=args.force, progress=not args.quiet, quantize=args.quantize,
                                  group_size=args.group_size, embed_format=args.embed_format)
    except convert.ConvertError as e:
        raise UserError(str(e)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"wrote {args.dst}: {summary.line()}")
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
        distributed.init_process_group(args.tp_backend,
                                       timeout=getattr(args, "tp_timeout", distributed.DEFAULT_TIMEOUT_S))
    except ValueError as e:
        raise UserError(f"{e} (run: torchrun --nproc-per-node {args.tp} -m atb {args.command} --tp {args.tp} "
                        f"...)") from None
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
    for flag in ("json", "csv", "plot"):
        _output_path(getattr(args, flag), f"--{flag}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError('--plot needs matplotlib: pip install -e ".[plot]"') from None
    _preflight(args)
    if _atb_quantization(args) is not None:
        raise UserError(f"bench: {args.model} is an atb-quantized checkpoint, which the stock HF rows of the "
                        f"bench cannot run (no float weights); bench its float source, or use generate")
    if args.threads:
        atb.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
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
        print(f"wrote {args.json}")
    if args.csv:
        keys = sorted({k for r in records for k in r})
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(records)
        print(f"wrote {args.csv}")
    if args.plot:
        _plot(rows, e2e_rows, args.plot, title=f"{label} {args.dtype}, soc_type {args.soc_type}")
        print(f"wrote {args.plot}")
    return 0


def _plot(rows, e2e_rows, path: str, title: str) -> None:
    """Per-layer latency (decode, prefill) with each row's speedup and the total, and end-to-end tok/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(20, 6), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    for ax, phase in zip(axes, ("decode", "prefill")):
        sel = [r for r in rows if r.phase == phase]
        names = [r.name for r in sel] + ["total (layer + head)"]
        stock = [r.stock_us for r in sel] + [sum(r.stock_us for r in sel)]
        fused = [r.atb_us for r in sel] + [sum(r.atb_us for r in sel)]
        y = range(len(names))
        ax.barh([i + 0.2 for i in y], stock, height=0.4, label="HF stock")
        ax.barh([i - 0.2 for i in y], fused, height=0.4, label="atb")
        for i, (s_us, a_us) in enumerate(zip(stock, fused)):
            ax.text(max(s_us, a_us) * 1.08, i, f"{s_us / a_us:.2f}x", va="center", fontsize=8)
        ax.set_yticks(list(y), names)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(right=max(stock + fused) * 4)
        ax.set_xlabel("µs per call (log); label = speedup")
        ax.set_title(f"one decoder layer: {phase}")
        ax.legend(loc="lower right")
    ax = axes[2]
    labels = [f"{r.engine}\nbatch {r.batch}" for r in e2e_rows]
    x = range(len(e2e_rows))
    base = e2e_rows[0] if e2e_rows else None
    for off, key, name in ((-0.2, "prefill_tok_s", "prefill"), (0.2, "decode_tok_s", "decode")):
        vals = [getattr(r, key) for r in e2e_rows]
        ax.bar([i + off for i in x], vals, width=0.4, label=f"{name} tok/s")
        for i, v in enumerate(vals):
            if v != v:  # NaN: too few new tokens to time decode
                continue
            ratio = v / getattr(base, key) if base and getattr(base, key) else float("nan")
            ax.text(i + off, v, f"{v:.0f}\n{ratio:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log); label = tok/s and ratio to HF stock batch 1")
    ax.set_title("end to end")
    ax.legend(loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- main
def _model_args(sp, default_dtype="float32"):
    sp.add_argument("--model", help="local HF model directory (original or `atb convert`-ed) or .gguf file "
                                    "(default: embedded SmolLM2-135M-Instruct)")
    sp.add_argument("--dtype", default=default_dtype, type=_dtype_name, help="float32 | bfloat16 | float16")
    sp.add_argument("--quiet", action="store_true", help="no progress display")


def _engine_args(sp):
    """Options of the commands that generate text (generate, chat)."""
    _model_args(sp)
    sp.add_argument("--max-new-tokens", type=_POSITIVE, default=128, help="per reply")
    sp.add_argument("--max-seq-len", type=_POSITIVE, default=None,
                    help="context length (default: 2048, or the model's max_position_embeddings if smaller)")
    sp.add_argument("--temperature", type=_TEMPERATURE, default=0.0, help="0 = greedy")
    sp.add_argument("--top-k", type=_NON_NEGATIVE_INT, default=0, help="sample from the k most likely (0 = off)")
    sp.add_argument("--top-p", type=_TOP_P, default=1.0, help="nucleus sampling mass in (0, 1]")
    sp.add_argument("--min-p", type=_MIN_P, default=0.0,
                    help="drop tokens less likely than min-p times the most likely one (0 = off)")
    sp.add_argument("--repetition-penalty", type=_PENALTY, default=1.0, help="> 1 discourages repeats (1 = off)")
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--soc-type", default="host")
    sp.add_argument("--threads", type=_threads, default=None, help="atb threads (default: as set)")
    _quantize_arg(sp)
    _speculative_arg(sp)


def _speculative_arg(sp):
    """--num-speculative-tokens and --lookup-history of the commands that build an engine (generate, chat, serve)."""
    sp.add_argument("--num-speculative-tokens", type=_NON_NEGATIVE_INT, default=0,
                    help="speculative decoding by prompt lookup: draft tokens verified per step for greedy requests "
                         "(0 = off; 3 is a good start)")
    sp.add_argument("--lookup-history", type=_NON_NEGATIVE_INT, default=0, metavar="N",
                    help="with --num-speculative-tokens: also draft from the last N finished requests (requests of "
                         "one shape draft each other's structure; 0 = off)")


def speculative_config(args) -> dict | None:
    """The engine's speculative_config from --num-speculative-tokens / --lookup-history (None: off)."""
    k, history = getattr(args, "num_speculative_tokens", 0), getattr(args, "lookup_history", 0)
    if history and not k:
        raise UserError("--lookup-history drafts for speculative decoding: give --num-speculative-tokens too")
    return {"num_speculative_tokens": k, "lookup_history": history} if k else None


def _quantize_arg(sp):
    """--quantize of the commands that build an engine (generate, chat, serve)."""
    sp.add_argument("--quantize", default=None,
                    help="weight-only quantization: w8a16 | w4a16 (| -g32 | -g64 | -g128 suffix; w8a16 also -g16) | "
                         "native (a GGUF file's Q8_0/Q5_0/Q4_0/Q4_1/Q4_K/Q6_K tensors as shipped; native+w8a16-g32: "
                         "its other tensors at 8 bits)")


def _add_bench(sub):
    b = sub.add_parser("bench", help="per-layer latency table and end-to-end tok/s (the main job)")
    _model_args(b)
    b.add_argument("--config", help="random-weight preset instead of a checkpoint (e.g. tinyllama-1.1b, tiny)")
    b.add_argument("--soc-type", default="host")
    b.add_argument("--threads", type=_threads, default=None, help="threads for atb and torch (default: torch's)")
    b.add_argument("--prompt-len", type=_POSITIVE, default=128)
    b.add_argument("--new-tokens", type=_POSITIVE, default=64)
    b.add_argument("--batch", type=_POSITIVE, default=16, help="batch size of the batched end-to-end run")
    b.add_argument("--repeat", type=_POSITIVE, default=9, help="timed repeats per layer row (median reported)")
    b.add_argument("--json", metavar="PATH")
    b.add_argument("--csv", metavar="PATH")
    b.add_argument("--plot", metavar="PATH.png", help='per-layer and end-to-end chart (pip install -e ".[plot]")')
    b.set_defaults(func=cmd_bench)


def _add_generate(sub):
    g = sub.add_parser("generate", help="answer one prompt through TransformerInfer, streaming")
    g.add_argument("prompt")
    _engine_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (under torchrun --nproc-per-node N; only rank 0 prints)")
    g.add_argument("--tp-backend", default="gloo", help="torch.distributed backend for --tp (default gloo)")
    g.set_defaults(func=cmd_generate)


def _add_chat(sub):
    c = sub.add_parser("chat", help="interactive multi-turn chat (one message per line, Ctrl-D ends), streaming")
    _engine_args(c)
    c.add_argument("--system", help="system prompt")
    c.set_defaults(func=cmd_chat)


def _add_perplexity(sub):
    p = sub.add_parser("perplexity", help="perplexity of the model over a text (what a dtype or --quantize costs)",
                       description="Scores a text in windows of --context tokens that start --stride tokens apart; "
                                   "each token is scored once, with at least context - stride tokens before it "
                                   "past the first window.")
    _model_args(p)
    p.add_argument("--file", help="UTF-8 text file to score ('-': standard input)")
    p.add_argument("--text", help="the text itself")
    p.add_argument("--context", type=_number(int, 2, what=">= 2"), default=512, help="window length (default 512)")
    p.add_argument("--stride", type=_POSITIVE, default=None, help="window start spacing (default: context / 2)")
    p.add_argument("--max-tokens", type=_POSITIVE, default=None, help="score only the text's first N tokens")
    p.add_argument("--batch", type=_POSITIVE, default=8, help="windows scored together (default 8)")
    p.add_argument("--soc-type", default="host")
    p.add_argument("--threads", type=_threads, default=None, help="atb threads (default: as set)")
    _quantize_arg(p)
    p.set_defaults(func=cmd_perplexity)


def _add_convert(sub):
    from atb.convert import DEFAULT_MAX_SHARD

    v = sub.add_parser("convert", help="checkpoint -> sharded safetensors of one dtype, in bounded memory",
                       description="Convert an HF model directory (safetensors or pytorch_model*.bin shards) or "
                                   "a .gguf file into sharded safetensors that stock transformers loads.")
    v.add_argument("src", help="HF model directory or .gguf file")
    v.add_argument("dst", help="output directory (must not exist unless --force)")
    v.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="dtype of the float tensors (required; with --quantize, of the norms and biases, "
                        "default float32)")
    v.add_argument("--quantize", metavar="{w8a16,w4a16,native,native+FORMAT}",
                   help="store every projection in atb's W8A16 / W4A16 format (loads in atb only); native (a GGUF "
                        "source): its Q8_0/Q5_0/Q4_0/Q4_1/Q4_K/Q6_K tensors as their own blocks, the others float, or "
                        "quantized to FORMAT (e.g. native+w8a16-g32)")
    v.add_argument("--group-size", type=int, choices=(0, 16, 32, 64, 128),
                   help="with --quantize: values per scale along K (w8a16: 0 = per channel, the default, or 16 "
                        "to 128; w4a16: 32, the default, 64 or 128)")
    v.add_argument("--embed-format", choices=("w8a16", "w4a16", "float"), default="w8a16",
                   help="with --quantize: the embedding / LM head's format (default w8a16: at 4 bits SmolLM2's "
                        "tied table loses the capital-of-France answer)")
    v.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help=f"e.g. 500MB, 2GB (default {DEFAULT_MAX_SHARD})")
    v.add_argument("--force", action="store_true", help="replace an existing DST")
    v.add_argument("--quiet", action="store_true", help="no progress bars")
    v.set_defaults(func=cmd_convert)


def _add_check(sub):
    c = sub.add_parser("check", help="which modules of a model run fused, stay stock, or are unsupported")
    _model_args(c)
    c.add_argument("--config", help="random-weight preset instead of a checkpoint")
    c.set_defaults(func=cmd_check)


def _add_socs(sub):
    s = sub.add_parser("socs", help="the SoC table")
    s.set_defaults(func=cmd_socs)


def _add_serve(sub):
    from atb.serve.cli import add_parser

    add_parser(sub, _model_args, _quantize_arg, _speculative_arg)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="atb", description="Ascend Transformer Boost-style acceleration on the CPU")
    sub = p.add_subparsers(dest="command")
    for add in (_add_bench, _add_generate, _add_chat, _add_perplexity, _add_convert, _add_serve, _add_check,
                _add_socs):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe (`atb socs | head -2`) surfaces here, inside the handler below
        return status
    except UserError as e:
        print(f"atb: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("atb: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`atb socs | head -2`): stop quietly, as other command-line tools do. Point stdout
        # at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
