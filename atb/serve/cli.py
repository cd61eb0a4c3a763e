"""The ``serve`` subcommand of ``python -m atb`` / ``atb``.

Registering the arguments imports nothing heavy, so ``atb --help`` works
without the ``serve`` extra; running the command without it is a one-line
user error.
"""
from __future__ import annotations

import gc
import logging
import os

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_parser(sub, model_args, quantize_arg, speculative_arg) -> None:
    """Adds ``serve`` to the subparsers ``sub``; ``model_args`` adds the shared --model/--dtype/--quiet,
    ``quantize_arg`` the shared --quantize, ``speculative_arg`` --num-speculative-tokens."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching (needs atb[serve])")
    model_args(s)
    quantize_arg(s)
    speculative_arg(s)
    s.add_argument("--served-model-name", help="the model id clients name (default: the checkpoint's name)")
    s.add_argument("--soc-type", default="host")
    s.add_argument("--threads", type=int, default=0, help="threads for atb (default: torch's)")
    s.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together (default 16)")
    s.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens of one request (default 2048)")
    # Bounds how long running decodes wait for arrivals' prefill in one step (see the README's Serving).
    s.add_argument("--max-prefill-tokens", type=int, default=512,
                   help="prompt tokens prefilled per engine step; longer prompts are split into chunks over "
                        "the following steps (default 512)")
    # Chat traffic repeats system prompts and history: sharing their KV blocks skips that prefill.
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="turn off automatic prefix caching (on by default: shared prompt prefixes skip prefill)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting for a batch slot before new ones get 429 (default 256)")
    s.add_argument("--api-key", default=os.environ.get("ATB_API_KEY") or None,
                   help="clients must send 'Authorization: Bearer KEY' to /v1/* (default: $ATB_API_KEY; unset: "
                        "no key); /health and /metrics stay open")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    s.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (under torchrun --nproc-per-node N): rank 0 serves HTTP, the other "
                        "ranks follow its engine steps")
    s.add_argument("--tp-backend", default="gloo", help="torch.distributed backend for --tp (default gloo)")
    s.add_argument("--tp-timeout", type=float, default=60.0,
                   help="seconds a rank waits for the others before failing with an error (default 60)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from atb.cli import (Progress, UserError, _check_soc_dtype, _load, _torch_dtype, check_quantize_args,
                         speculative_config)

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("serve needs the serve extra: pip install 'atb[serve]' (fastapi, uvicorn)") from None
    for flag in ("max_batch_size", "max_seq_len", "max_prefill_tokens", "max_waiting", "port"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if not args.tp_timeout > 0:
        raise UserError(f"--tp-timeout must be positive, got {args.tp_timeout}")

    check_quantize_args(args)

    import atb
    from atb.cli import _join_tp
    from atb.serve.app import create_app

    lead = _join_tp(args)   # under --tp: rank 0 serves, the others follow (and log only their own failures)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("atb.serve").setLevel(args.log_level.upper() if lead else "WARNING")
    dtype = _torch_dtype(args.dtype)
    _check_soc_dtype(args.soc_type, dtype)
    if args.threads:
        atb.set_num_threads(args.threads)
    progress = Progress(not args.quiet and lead)
    if args.tp > 1 and args.model and os.path.isdir(args.model):
        # Each rank reads only its slices of the directory's safetensors files; only rank 0 tokenizes.
        from transformers import AutoTokenizer

        model, label = args.model, args.model
        tok = AutoTokenizer.from_pretrained(args.model) if lead else None
    else:
        model, tok, label = _load(args, dtype, progress)
    if tok is None and lead:
        raise UserError("serve needs a tokenizer: use the default model or --model with a tokenizer")
    progress("building engine")
    try:
        engine = atb.TransformerInfer(model, max_seq_len=args.max_seq_len, soc_type=args.soc_type, dtype=dtype,
                                      max_batch_size=args.max_batch_size, max_prefill_tokens=args.max_prefill_tokens,
                                      enable_prefix_caching=not args.no_prefix_caching, quantize=args.quantize,
                                      tp=args.tp if args.tp > 1 else None,
                                      speculative_config=speculative_config(args))
    except ValueError as e:
        raise UserError(str(e)) from None
    progress.done()
    logging.getLogger("atb.serve").info(
        "serving %s: dtype %s, weights %s, max batch %d, max seq len %d, speculative tokens %d, on http://%s:%d",
        label, str(engine.dtype).replace("torch.", ""), engine.quantize or "float", args.max_batch_size,
        args.max_seq_len, args.num_speculative_tokens, args.host, args.port)
    if args.tp > 1:
        return _serve_tp(args, engine, tok, label, lead)
    app = create_app(engine, tok, model_name=args.served_model_name or label, max_waiting=args.max_waiting,
                     api_key=args.api_key)
    _run_server(app, args)
    return 0


def _run_server(app, args) -> None:
    """Serves ``app`` until SIGINT/SIGTERM.

    The model, tokenizer and engine are built by now and live as long as the process: frozen out of the
    cyclic collector's reach, its full collections stop walking them. Before, at 16 concurrent streams the
    collector took 6% of the serving process's CPU (perf), time the engine's kernels lost.
    """
    from atb.serve.app import make_server

    gc.collect()
    gc.freeze()
    make_server(app, host=args.host, port=args.port, log_level=args.log_level).run()


def _serve_tp(args, engine, tok, label: str, lead: bool) -> int:
    """Rank 0 serves HTTP through a `Leader`; every other rank follows it until it shuts down."""
    from atb.cli import UserError
    from atb.distributed import TensorParallelError
    from atb.serve.app import create_app
    from atb.serve.tp import Leader, follow

    import torch.distributed as dist

    tp = engine.runner.tp
    if not lead:
        try:
            follow(engine, tp)
        except (TensorParallelError, RuntimeError) as e:
            raise UserError(str(e)) from None
        dist.destroy_process_group()   # every rank got here together: gloo's threads are joined before exit
        return 0
    # Heartbeats well inside the timeout, so an idle server never makes a follower give up.
    leader = Leader(engine, tp, heartbeat=min(5.0, args.tp_timeout / 4))
    logging.getLogger("atb.serve").info("tensor parallel: rank 0 of %d serves; the other ranks follow its steps",
                                        tp.world)
    app = create_app(leader, tok, model_name=args.served_model_name or label, max_waiting=args.max_waiting,
                     followers=leader, api_key=args.api_key)
    _run_server(app, args)
    fatal = app.state.atb.loop.fatal
    if fatal is not None:
        raise UserError(str(fatal))
    dist.destroy_process_group()
    return 0
