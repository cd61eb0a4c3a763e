"""TransformerInfer: an inference engine over a paged KV cache, with continuous batching.

    infer = atb.TransformerInfer(model, max_seq_len=2048, soc_type="Ascend910B4")
    logits = infer.forward(input_ids, attention_mask)          # stateless prefill
    tokens = infer.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)

Prefill packs the prompts back to back (no padding compute), writes their
K/V into the paged cache with ``reshape_and_cache`` and attends through
``paged_attention`` (``forward``, which caches nothing, runs
``flash_attention``); decode batches every live sequence through
``paged_attention``. With ``enable_prefix_caching`` a prompt that starts with
cached blocks shares them and prefills only the rest. A sequence that finishes returns its blocks at
once and a waiting prompt is prefilled into the running batch.

Decode runs either as one native call per step (``graph_mode=True``:
``atb.graph.DecodeGraph`` over the engine's own weights, cache and rope
tables) or kernel by kernel from Python (``graph_mode=False``); both take
``(token_ids, positions, block_tables, context_lens, slot_mapping)`` and return
logits, so the scheduler is the same for both.

Under ``generate`` and ``forward`` is a request-level engine (``atb.engine``:
scheduler + model runner): ``add_request``, ``step``, ``abort``,
``has_unfinished`` and ``stats``, safe to call from several threads (one lock);
``generate`` is a loop over it that touches only its own requests.

Stop reasons (``infer.last_stop_reasons``, one per prompt): ``"eos"`` (the EOS
token was produced and is included), ``"length"`` (``max_new_tokens`` reached),
``"max_seq_len"`` (prompt + generated tokens reached ``max_seq_len``: the
sequence stops there and the others carry on). When several hold at once the
first in that order is reported.

Tensor parallelism (``tp=N`` / ``tp_group=``, see ``atb.distributed``): one
model across the N ranks of a ``torch.distributed`` process group, each rank
holding its shard of every layer, the embedding and the LM head, and a KV cache
of its heads. Every rank runs the same calls (same prompts, same settings);
each gets the same tokens back. Given a checkpoint directory, each rank reads
only its slices of the safetensors files.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from atb import soc as _soc
from atb.engine.block_manager import BlockManager
from atb.engine.engine import Engine
from atb.engine.params import SamplingParams
from atb.engine.runner import ModelRunner, as_id_list
from atb.engine.sampling import request_seed
from atb.engine.scheduler import Scheduler
from atb.engine.speculative import SpeculativeConfig

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtype(dtype) -> None:
    """``dtype=`` is None (the model's) or a float dtype the engine computes in."""
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(f"TransformerInfer: dtype must be torch.float32, torch.float16 or torch.bfloat16, "
                         f"got {dtype}")


def _atb_quantized_dir(path: str) -> bool:
    from atb.checkpoints import atb_quantization

    return os.path.isdir(path) and atb_quantization(path) is not None


def _load_gguf(path: str, dtype: torch.dtype | None, quantize) -> torch.nn.Module:
    """The model of a GGUF file: read as its own blocks for a native ``quantize`` spec, else as floats (see
    ``atb.checkpoints.load_model``)."""
    from atb.checkpoints import ModelLoadError, load_model
    from atb.quant.engine import runs_as_stored

    _check_dtype(dtype)
    native = quantize if isinstance(quantize, str) and runs_as_stored(quantize) else None
    try:
        return load_model(path, dtype or torch.float32, progress=False, quantize=native)[0]
    except ModelLoadError as e:
        raise ValueError(f"TransformerInfer: {e}") from None


def _load_quantized_dir(path: str, dtype: torch.dtype | None):
    """The model of an ``atb convert --quantize`` directory (its float tensors in ``dtype``, None: as stored)."""
    from atb.checkpoints import ModelLoadError, load_quantized_model

    _check_dtype(dtype)
    try:
        return load_quantized_model(path, dtype)
    except ModelLoadError as e:
        raise ValueError(f"TransformerInfer: {e}") from None


class TransformerInfer(Engine):
    """Paged-KV-cache inference for a loaded HF causal LM of a supported family.

    Args:
        model: a loaded HF ``*ForCausalLM`` (llama, mistral, qwen2, qwen3 families), or the path of a local
            HF model directory (``config.json`` + ``*.safetensors``), read tensor by tensor (slice by slice
            under tensor parallelism) without building the HF model first. A directory written by
            ``atb convert --quantize`` runs on its weights as stored (not under tensor parallelism, which
            slices float weights: a ValueError). A ``.gguf`` file loads as ``atb.checkpoints.load_model`` loads it:
            with ``quantize="native"`` (or ``"native+<format>"``) as its own blocks, never dequantized.
        max_seq_len: longest sequence (prompt + generated); at most the model's
            ``max_position_embeddings``.
        soc_type: the SoC whose tiling every kernel uses (``atb.soc_names()``).
        max_batch_size: sequences decoded together; the KV pool holds this many
            sequences of ``max_seq_len`` tokens, allocated up front.
        block_size: tokens per KV block, a power of two.
        dtype: compute dtype. None keeps the model's dtype if the SoC supports it,
            else float16 (with a warning); an explicit dtype the SoC lacks is an error.
            A dtype other than the model's converts (copies) the weights; otherwise
            the engine reads the model's own parameter tensors.
        graph_mode: run each decode step as one native call (``atb.graph.DecodeGraph``,
            exposed as ``infer.decode_graph``); False runs the same kernels from Python. On AVX-512 the
            graph keeps a second, repacked copy of the bf16 / fp32 projections and LM head for its steps
            of 1 row (fp32: 1-2; faster from memory, the same bits); ``ATB_DECODE_REPACK=0`` saves that memory.
        max_prefill_tokens: prompt tokens prefilled per step; a prompt that does not fit is split into
            chunks over the following steps (chunked prefill), so arrivals do not stall running decodes
            for long.
        quantize: weight-only quantization of every projection, the embedding and the LM head:
            ``"w8a16"``, ``"w4a16"`` (``"-g64"`` / ``"-g128"`` suffix for the group size; the embedding /
            LM head stay 8-bit), ``"native"`` (the GGUF file the model was loaded from, at its own
            precision; ``"native+w8a16-g32"`` quantizes its tensors of other types), or an
            ``atb.quantize(model, ...)`` result. Python and graph mode alike.
            ``memory_summary()`` reports the bytes saved.
        enable_prefix_caching: requests whose prompts start with the same full KV blocks share them
            and prefill only the rest (``atb.engine.block_manager``). Off by default here: blocks of
            finished prompts then stay cached (counted in ``stats()["kv_blocks_cached"]``) instead of
            free, and a prompt's tokens come from a shorter prefill over another request's K/V, equal
            to a cold run's in greedy tests but not bit for bit; a one-shot ``generate`` gains nothing
            from that. A server with repeated system prompts or chat history should turn it on.
        tp: tensor-parallel size. ``tp > 1`` without ``tp_group`` uses the default process group (joined
            from torchrun's environment if not yet initialized, ``atb.distributed.init_process_group``);
            it must have ``tp`` ranks.
        speculative_config: speculative decoding by prompt lookup (``atb.engine.speculative``): a dict of
            ``SpeculativeConfig`` fields (e.g. ``{"num_speculative_tokens": 3}``) or a ``SpeculativeConfig``.
            Requests then draft the tokens that followed the latest earlier occurrence of their last few
            tokens and verify them in one decode step: greedy tokens are those of plain greedy decoding,
            sampled ones follow its distribution (not its seeded draws). Off by default. ``stats()`` counts
            the drafts verified and accepted.
        tokenizer: the model's HF (fast) tokenizer; only structured output needs it
            (``SamplingParams(json_schema=...)`` / ``regex=``). ``infer.tokenizer`` may be set later.
        tp_group: the ``torch.distributed`` process group to split the model over (its size is the tp size).
            Query heads must divide evenly over it, and KV heads too (or the ranks over the KV heads, each
            KV head then replicated); the intermediate and the vocabulary split as evenly as they can.
    """

    # Greedy decode steps ``generate`` runs natively back to back while no request waits (Engine._decode_steps):
    # no Python between them, so the caches the weights flushed are not refilled by Python each step. SmolLM2
    # W4A16 batch 1 on 2 Zen 3 cores: ~0.29 ms of Python between 5.2 ms steps. Set to 1 to step one at a time.
    generate_decode_steps: int = 8

    def __init__(self, model, max_seq_len: int = 2048, soc_type: str = "host", *, max_batch_size: int = 8,
                 block_size: int = 128, dtype: torch.dtype | None = None, graph_mode: bool = True,
                 max_prefill_tokens: int | None = None, quantize=None, enable_prefix_caching: bool = False,
                 tp: int | None = None, tp_group=None, tokenizer=None, speculative_config=None):
        from atb.registry import get_adapter

        from_path = isinstance(model, (str, os.PathLike))
        tensor_parallel = tp is not None or tp_group is not None
        if from_path and _atb_quantized_dir(os.fspath(model)):
            if tensor_parallel:
                raise ValueError(f"TransformerInfer: {os.fspath(model)} is an atb quantized checkpoint (atb convert "
                                 f"--quantize); tensor parallelism slices float weights and cannot read it: give "
                                 f"tp a float checkpoint (atb convert SRC DST --dtype ...)")
            model, from_path = _load_quantized_dir(os.fspath(model), dtype), False
        elif from_path and os.fspath(model).endswith(".gguf") and os.path.isfile(model):
            if tensor_parallel:
                raise ValueError(f"TransformerInfer: tensor parallelism reads a model directory slice by slice; "
                                 f"{os.fspath(model)} is a GGUF file: convert it first "
                                 f"(atb convert SRC DST --dtype ...)")
            model, from_path = _load_gguf(os.fspath(model), dtype, quantize), False
        if tensor_parallel and getattr(model, "atb_quantized", None) is not None:
            raise ValueError("TransformerInfer: this model's weights are stored quantized by atb convert; tensor "
                             "parallelism slices float weights and cannot run it: give tp a float checkpoint")
        tp_comm = None
        if tensor_parallel:
            from atb.distributed import TensorParallel

            tp_comm = TensorParallel.resolve(tp, tp_group)
        if from_path:
            from atb.distributed import load_config

            config = load_config(os.fspath(model))
        else:
            config = getattr(model, "config", None)
            if config is None or not isinstance(model, torch.nn.Module):
                raise TypeError(f"TransformerInfer: model must be a loaded HF causal LM or a model directory, "
                                f"got {type(model).__name__}")
        self.adapter = get_adapter(config)  # ValueError naming the supported families
        speculative = SpeculativeConfig.resolve(speculative_config)
        if max_prefill_tokens is None:
            max_prefill_tokens = max(2048, max_seq_len)
        for name, v in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size), ("block_size", block_size),
                        ("max_prefill_tokens", max_prefill_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TransformerInfer: {name} must be a positive int, got {v!r}")
        if block_size & (block_size - 1):
            raise ValueError(f"TransformerInfer: block_size must be a power of two, got {block_size}")
        max_pos = getattr(config, "max_position_embeddings", None)
        if max_pos is not None and max_seq_len > max_pos:
            raise ValueError(f"TransformerInfer: max_seq_len={max_seq_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        for name, v in (("graph_mode", graph_mode), ("enable_prefix_caching", enable_prefix_caching)):
            if not isinstance(v, bool):
                raise TypeError(f"TransformerInfer: {name} must be a bool, got {type(v).__name__}")
        self.soc = _soc.get_soc(soc_type)  # ValueError listing the valid names
        self.soc_type = soc_type
        if from_path or tp_comm is not None:
            model = self._load_shard(model, config, dtype, tp_comm, max_seq_len=max_seq_len,
                                     max_batch_size=max_batch_size, block_size=block_size, graph_mode=graph_mode,
                                     max_prefill_tokens=max_prefill_tokens, speculative=speculative)
        self.tp = tp_comm
        self.dtype = self._resolve_dtype(model, dtype)
        self.config = config
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.block_size = block_size

        self.max_prefill_tokens = max_prefill_tokens
        # Under tp the model is this rank's shard, its config the shard's: its heads size the cache and the runner.
        local = get_adapter(model.config) if tp_comm is not None else self.adapter
        spec = local.spec
        cache = BlockManager.for_capacity(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                          max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                          block_size=block_size, dtype=self.dtype,
                                          enable_prefix_caching=enable_prefix_caching)
        runner = ModelRunner(model, local, dtype=self.dtype, soc_type=soc_type, max_seq_len=max_seq_len,
                             max_batch_size=max_batch_size, cache=cache, graph_mode=graph_mode, quantize=quantize,
                             tp=tp_comm, max_step_rows=speculative.max_step_rows if speculative else None)
        self._init_engine(runner, Scheduler(cache, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                            max_prefill_tokens=max_prefill_tokens), tokenizer, speculative)
        self.graph_mode = graph_mode
        from atb.quant.engine import describe

        self.quantize = describe(model, quantize)
        self.enable_prefix_caching = enable_prefix_caching

    # ---- construction -------------------------------------------------------
    def _load_shard(self, source, config, dtype, tp_comm, **settings):
        """This rank's model (the whole model without tp) from a directory's safetensors slices or a loaded
        model, after checking that every rank was given the same model and settings."""
        from atb.distributed import ShardPlan, load_shard

        if tp_comm is None:
            plan = ShardPlan.for_spec(self.adapter.spec, 0, 1)
        else:
            tp_comm.check_same(config, dtype=dtype, **settings)
            plan = tp_comm.plan_for(self.adapter.spec)  # ValueError when the heads do not split
        _check_dtype(dtype)
        return load_shard(source, config, plan, dtype)

    def _resolve_dtype(self, model, dtype):
        model_dtype = next(model.parameters()).dtype
        soc = self.soc
        if dtype is None:
            if model_dtype not in _FLOAT_DTYPES:
                raise ValueError(f"TransformerInfer: model dtype {model_dtype} is not supported; "
                                 f"pass dtype= one of float32, float16, bfloat16")
            if model_dtype == torch.bfloat16 and not soc.supports_bf16:
                warnings.warn(f"TransformerInfer: {soc.name} has no bfloat16; running the bfloat16 model in "
                              f"float16 (weights converted)", stacklevel=3)
                return torch.float16
            return model_dtype
        _check_dtype(dtype)
        if dtype == torch.bfloat16 and not soc.supports_bf16:
            raise ValueError(f"TransformerInfer: dtype=bfloat16 requested but {soc.name} has no bfloat16 "
                             f"(use float16 or float32)")
        return dtype

    # ---- the runner's parts, by their historical names ----------------------------------------------
    cache = property(lambda self: self.scheduler.cache, doc="The paged KV pool (the scheduler's block manager).")
    layers = property(lambda self: self.runner.layers, doc="Per layer, its `LayerWeights`.")
    embed = property(lambda self: self.runner.embed)
    lm_head = property(lambda self: self.runner.lm_head)
    final_norm = property(lambda self: self.runner.final_norm)
    vocab_size = property(lambda self: self.runner.vocab_size)
    decode_graph = property(lambda self: self.runner.graph, doc="The native decode graph (graph mode), else None.")
    default_eos = property(lambda self: self.runner.default_eos)

    @property
    def last_stop_reasons(self) -> list[str] | None:
        """Why each prompt of this thread's last ``generate`` stopped (None before its first)."""
        return getattr(self._local, "stop_reasons", None)

    # ---- introspection ------------------------------------------------------
    def memory_summary(self) -> dict:
        """Bytes held by the engine: weights (shared with the model unless converted), KV pool, scratch, the
        decode graph's repacked weight copies; and the pool's blocks: used (held by requests), cached (prefix
        caching: unheld, kept for reuse), free."""
        weights = self.runner.weight_bytes()
        scratch = self.runner.scratch_bytes(self._block_tables)
        repacked = self.runner.graph.repacked_bytes if self.runner.graph is not None else 0
        quant = {}
        if self.quantize is not None:
            full = self.runner.unquantized_weight_bytes()
            quant = {"quantize": self.quantize, "weights_bytes_unquantized": full, "weights_bytes_saved": full - weights}
        with self._lock:   # one consistent snapshot of the block accounting
            c = self.cache
            blocks = {"kv_blocks_used": c.used_blocks, "kv_blocks_cached": c.cached_blocks,
                      "kv_blocks_free": c.free_blocks}
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "weights_bytes": weights,
            "weights_shared_with_model": self.runner.shared_with_model,
            "kv_cache_bytes": self.cache.nbytes,
            "kv_bytes_per_token": self.cache.nbytes // (self.cache.num_blocks * self.block_size),
            "kv_blocks": self.cache.num_blocks,
            **blocks,
            "scratch_bytes": scratch,
            "decode_repacked_bytes": repacked,
            "total_bytes": weights + self.cache.nbytes + scratch + repacked,
            **quant,
        }

    # ---- validation ---------------------------------------------------------
    def _check_ids(self, what: str, ids: torch.Tensor) -> None:
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"TransformerInfer: {what} contains token id {bad}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def _prompts_from(self, prompts, attention_mask) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() != 2 or prompts.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"generate: a tensor of prompts must be a 2-D integer [batch, seq] tensor, got "
                                 f"{prompts.dtype} of shape {tuple(prompts.shape)}")
            mask = self._mask_for(prompts, attention_mask, "generate")
            return [self.check_prompt("generate", f"prompt {i}", row[m].tolist())
                    for i, (row, m) in enumerate(zip(prompts, mask))]
        if attention_mask is not None:
            raise ValueError("generate: attention_mask is only accepted with a 2-D tensor of prompts")
        if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
            raise TypeError(f"generate: prompts must be a list of token-id lists or a 2-D LongTensor, "
                            f"got {type(prompts).__name__}")
        return [self.check_prompt("generate", f"prompt {i}", p) for i, p in enumerate(prompts)]

    def _mask_for(self, input_ids: torch.Tensor, attention_mask, op: str) -> torch.Tensor:
        if attention_mask is None:
            return torch.ones(input_ids.shape, dtype=torch.bool)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"{op}: attention_mask must be a tensor of shape {tuple(input_ids.shape)}, got {shape}")
        if attention_mask.device.type != "cpu":   # a meta tensor has no values to read
            raise ValueError(f"{op}: attention_mask must be a CPU tensor, got device {attention_mask.device}")
        if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
            raise ValueError(f"{op}: attention_mask must hold 0/1 integers or bools, got {attention_mask.dtype}")
        if attention_mask.numel() and (int(attention_mask.min()) < 0 or int(attention_mask.max()) > 1):
            raise ValueError(f"{op}: attention_mask must hold only 0 and 1")
        return attention_mask.to(torch.bool)

    # ---- public API ---------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` of a full forward pass (stateless prefill).

        Padding (``attention_mask == 0``, usually on the left) is packed away:
        each row's valid tokens form one sequence at positions 0, 1, 2, ...
        (as HF ``generate`` numbers them), and padded positions get zero logits.
        The packed attention needs no KV cache, so the pool is left untouched.
        """
        self._not_in_callback("forward")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
                torch.int64, torch.int32):
            got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(
                input_ids).__name__
            raise ValueError(f"forward: input_ids must be a 2-D integer [batch, seq] tensor, got {got}")
        B, S = input_ids.shape
        if S > self.max_seq_len:
            raise ValueError(f"forward: sequence length {S} exceeds max_seq_len={self.max_seq_len}")
        mask = self._mask_for(input_ids, attention_mask, "forward")
        tokens = input_ids[mask]
        self._check_ids("input_ids", tokens)
        lens = mask.sum(1)
        out = torch.zeros(B, S, self.vocab_size, dtype=self.dtype)
        if tokens.numel() == 0:
            return out
        positions = (mask.cumsum(1) - 1)[mask]
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        with self._lock:  # one model call at a time (kernel launches and scratch are shared with step)
            out[mask] = self.runner.prefill(tokens.to(torch.int32), positions.to(torch.int32), cu, None, None)
        return out

    __call__ = forward

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 32, *, attention_mask: torch.Tensor | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
                 seed: int | None = None, stream: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """New tokens of each prompt (EOS included when produced), in prompt order.

        ``prompts``: a list of token-id lists (any lengths), or a 2-D LongTensor
        with an optional ``attention_mask`` (padding dropped). At most
        ``max_batch_size`` sequences run at once; the rest wait and join as
        others finish. ``stream(seq_index, token)`` is called for every token as
        it is produced, from the calling thread with the engine unlocked (calling
        ``generate``, ``step`` or ``forward`` from it raises RuntimeError; ``abort``
        and ``stats`` are fine). ``seed`` makes sampling reproducible (each sequence
        has its own generator, so its tokens do not depend on its batch mates).
        Why each sequence stopped is in ``self.last_stop_reasons`` (per thread).

        Thread-safe: concurrent calls share the running batch, each reading only
        its own requests. Each caller drives steps from its own thread, so kernel
        launches alternate between threads' OpenMP teams; for throughput, one
        thread driving ``step`` (as a server's engine thread does) is better.
        """
        self._not_in_callback("generate")
        # Everything is validated before a single block is allocated.
        prompts = self._prompts_from(prompts, attention_mask)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        eos = as_id_list(eos_token_id, "eos_token_id") if eos_token_id is not None else None
        if stream is not None and not callable(stream):
            raise TypeError(f"generate: stream must be callable(seq_index, token), got {type(stream).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"generate: seed must be an int, got {type(seed).__name__}")
        base = SamplingParams(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                              top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                              eos_token_id=eos)
        if do_sample and seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))  # follows torch.manual_seed
        params = [base if seed is None else replace(base, seed=request_seed(seed, i)) for i in range(len(prompts))]

        self._local.stop_reasons = None
        reqs = []
        try:
            with self._lock:
                reqs = [self._new_request(None, p, sp, report=False) for p, sp in zip(prompts, params)]
            # Other threads' requests may share these steps; only this call's requests are read here.
            while True:
                with self._lock:
                    if any(not r.finished for r in reqs):
                        self._step_locked(self.generate_decode_steps)
                    done = all(r.finished for r in reqs)
                if stream is not None:
                    self._stream(reqs, stream)
                if done:
                    break
        except BaseException:
            with self._lock:
                for r in reqs:
                    if not r.finished:
                        self.scheduler.finish(r, "abort")
            raise
        self._local.stop_reasons = [r.reason for r in reqs]
        return [r.out for r in reqs]

    def _stream(self, reqs, stream) -> None:
        """Hands each request's new tokens to ``stream(index, token)``, outside the lock; the engine refuses
        to be re-entered from the callback (``generate``/``step``/``forward`` raise RuntimeError)."""
        self._local.in_callback = True
        try:
            for i, r in enumerate(reqs):
                while r.streamed < len(r.out):
                    r.streamed += 1
                    stream(i, r.out[r.streamed - 1])
        finally:
            self._local.in_callback = False

    def __repr__(self) -> str:
        return (f"TransformerInfer({self.config.model_type}, layers={len(self.layers)}, dtype={self.dtype}, "
                f"soc={self.soc.name}, max_seq_len={self.max_seq_len}, max_batch_size={self.max_batch_size}, "
                f"block_size={self.block_size}, graph_mode={self.graph_mode})")

