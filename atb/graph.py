"""The native decode graph: one decode step of a whole model as one C++ call.

ATB's GraphOperation on the CPU. ``DecodeGraph`` is built once from a model's
shapes, its weight tensors (kept referenced here, never copied), the paged KV
cache and the rope cos/sin table; ``step`` then runs embedding, every decoder
layer (rms_norm, fused q/k/v linear (+bias), q/k norm, rope,
reshape_and_cache, paged_attention, o_proj + residual, rms_norm, gate/up with
SwiGLU, down_proj + residual), the final norm and the lm_head natively, with
no Python between the kernels and no allocation of its own.

    g = DecodeGraph.from_weights(config, layers, embed=..., final_norm=..., lm_head=...,
                                 cos=cos, sin=sin, key_caches=kc, value_caches=vc, max_batch=8)
    logits = g.step(token_ids, positions, block_tables, context_lens, slot_mapping)

Metadata follows the paged-attention conventions (int32; int64 accepted):
``positions[b]`` is the new token's position, ``context_lens[b]`` counts it,
``slot_mapping[b]`` is where its K/V go. A step whose metadata is out of range
(token id, position >= max_seq_len, a block id outside the pool, a slot
outside the cache or used twice) raises ValueError before anything is written.

Profiling: ``g.profiling = True`` accumulates wall time per node (embed, norm,
qkv, rope, cache_write, attention, o_proj, mlp, lm_head, all_reduce);
``g.profile()`` returns it; off, the cost is one branch per node.

Tensor parallelism (``atb.distributed``): a graph built over one rank's shard
(``vocab_start`` / ``vocab_total`` / ``owns_residual`` in the config) calls
back into Python for the all-reduce of the residual stream after the embedding
and after every o and down projection (:meth:`DecodeGraph.set_all_reduce`);
its logits are the rank's vocab slice.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence

import torch

from atb import _C
from atb import hugepages
from atb.kernels._common import DTYPE_CODES, ROPE_STYLES, float_code, int_tensor, resolve_soc
from atb.kernels.linear import rows4_supported
from atb.models.base import LayerWeights
from atb.quant.formats import QuantizedWeight

_LAYER_REQUIRED = ("input_norm", "q", "k", "v", "o", "post_attention_norm", "gate", "up", "down")


def _need(name: str, t, dtype, shape) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"DecodeGraph: {name} must be a torch.Tensor, got {type(t).__name__}")
    float_code("DecodeGraph", name, t)
    if t.dtype != dtype:
        raise TypeError(f"DecodeGraph: {name} is {t.dtype}, the graph runs in {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"DecodeGraph: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"DecodeGraph: {name} must be contiguous (the graph holds its pointer)")
    return t


def decode_repack_default(dtype: torch.dtype) -> bool:
    """Whether a decode graph keeps rows4 copies of its weights unless told (``DecodeGraph.from_weights``'s
    ``repack``): where the SIMD table has the kernel for ``dtype`` and ``ATB_DECODE_REPACK`` is not ``0``."""
    return os.environ.get("ATB_DECODE_REPACK", "1") != "0" and rows4_supported(dtype)


class DecodeGraph:
    """A built decode graph. Use :meth:`from_weights` (or :meth:`from_runner` for an engine's ModelRunner)."""

    def __init__(self, native, keep: list, *, vocab: int, dtype: torch.dtype, max_batch: int, max_seq_len: int,
                 hidden: int, repacked_bytes: int = 0):
        self._g = native
        self._keep = keep  # every tensor whose pointer the native graph holds
        self.repacked_bytes = repacked_bytes  # the rows4 copies it holds (from_weights' repack)
        self.vocab = vocab
        self.hidden = hidden
        self._tp = False   # an all-reduce callback is set
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len

    @classmethod
    def from_weights(cls, config: Mapping, layers: Sequence[LayerWeights], *, embed: torch.Tensor, final_norm: torch.Tensor,
                     lm_head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_caches: Sequence[torch.Tensor],
                     value_caches: Sequence[torch.Tensor], max_batch: int, soc_type: str | None = None,
                     repack: bool | None = None) -> DecodeGraph:
        """Builds the graph.

        config: ``num_heads, num_kv_heads, head_dim, eps`` (required); optional ``scale`` (default
            head_dim**-0.5), ``rope_style`` ("neox" | "interleave", default "neox"),
            ``sliding_windows`` (per layer: None or a window size); under tensor parallelism
            ``vocab_start``, ``vocab_total`` (the embed / lm_head rows are that slice of the vocabulary)
            and ``owns_residual`` (False on ranks that leave the residual and row-parallel biases to rank 0).
        layers: per layer its `LayerWeights` (weights ``[out, in]``, contiguous, one dtype); any projection may be
            an ``atb.quant.QuantizedWeight`` (gate and up both or neither), and so may ``embed`` / ``lm_head``
            (the embedding lookup then dequantizes each token's row); the graph's dtype is then final_norm's.
        cos/sin: ``[max_seq_len, rotary_dim]`` rope tables (HF layout), the graph's dtype or float32.
        key_caches/value_caches: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        repack: keep a rows4 copy (the layout of ``atb.kernels.linear.pack_rows4``) of the float projections and
            LM head, which steps of 1 row (fp32: 1 or 2, where ``atb.fp32_decode_copy()``; else only the weights
            the batch GEMM reads a copy of) read instead (the same bits), at the cost of a second copy of those
            weights. The native graph lays it out in pieces, one per core tile of each launch, each core's
            pieces of the whole step back to back in the order it reads them: a core streams one front-to-back
            run of memory from the first layer to the LM head. None (default): where `decode_repack_default`
            says so.
        """
        if repack is not None and not isinstance(repack, bool):
            raise TypeError(f"DecodeGraph: repack must be None, True or False, got {repack!r}")
        layers = list(layers)
        if not layers:
            raise ValueError("DecodeGraph: layers is empty")
        for i, lw in enumerate(layers):
            if not isinstance(lw, LayerWeights):
                raise TypeError(f"DecodeGraph: layers[{i}] must be a LayerWeights, got {type(lw).__name__}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"DecodeGraph: max_batch must be a positive int, got {max_batch!r}")
        dtype = final_norm.dtype if isinstance(embed, QuantizedWeight) else embed.dtype
        if dtype not in DTYPE_CODES:
            raise TypeError(f"DecodeGraph: embed must be float32, float16 or bfloat16, got {dtype}")
        vocab, hidden = embed.shape
        H, KH, D = int(config["num_heads"]), int(config["num_kv_heads"]), int(config["head_dim"])
        inter = layers[0].gate.shape[0]
        keep: list = []

        def need(name, t, shape):
            if isinstance(t, QuantizedWeight):
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"DecodeGraph: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
                keep.append(t)
                return t.data.data_ptr()
            keep.append(_need(name, t, dtype, shape))
            return t.data_ptr()

        if len(key_caches) != len(layers) or len(value_caches) != len(layers):
            raise ValueError(f"DecodeGraph: {len(key_caches)} key caches / {len(value_caches)} value caches for "
                             f"{len(layers)} layers")
        cache_shape = tuple(key_caches[0].shape)
        if len(cache_shape) != 4 or cache_shape[2:] != (KH, D):
            raise ValueError(f"DecodeGraph: key_caches[0] has shape {cache_shape}, expected "
                             f"[num_blocks, block_size, {KH}, {D}]")
        windows = list(config.get("sliding_windows") or [None] * len(layers))
        if len(windows) != len(layers):
            raise ValueError(f"DecodeGraph: {len(windows)} sliding_windows for {len(layers)} layers")
        native_layers = []
        for i, lw in enumerate(layers):
            present = lw.tensors()
            missing = [n for n in _LAYER_REQUIRED if n not in present]
            if missing:
                raise ValueError(f"DecodeGraph: layer {i} is missing {', '.join(missing)}")
            shapes = {"input_norm": (hidden,), "q": (H * D, hidden), "k": (KH * D, hidden), "v": (KH * D, hidden),
                      "o": (hidden, H * D), "post_attention_norm": (hidden,), "gate": (inter, hidden),
                      "up": (inter, hidden), "down": (hidden, inter), "q_bias": (H * D,), "k_bias": (KH * D,),
                      "v_bias": (KH * D,), "o_bias": (hidden,), "q_norm": (D,), "k_norm": (D,),
                      "gate_bias": (inter,), "up_bias": (inter,), "down_bias": (hidden,)}
            # The native layer's pointer fields carry the LayerWeights field names.
            nl = _C.DecodeLayer()
            for n, t in present.items():
                setattr(nl, n, need(f"layers[{i}].{n}", t, shapes[n]))
                if isinstance(t, QuantizedWeight):
                    nl.set_quant(n, t.storage())
            if isinstance(lw.gate, QuantizedWeight) != isinstance(lw.up, QuantizedWeight):
                raise TypeError(f"DecodeGraph: layer {i} has only one of gate/up quantized; quantize both or neither")
            nl.key_cache = need(f"key_caches[{i}]", key_caches[i], cache_shape)
            nl.value_cache = need(f"value_caches[{i}]", value_caches[i], cache_shape)
            nl.window = int(windows[i] or 0)
            native_layers.append(nl)
        embed_p = need("embed", embed, (vocab, hidden))
        final_p = need("final_norm", final_norm, (hidden,))
        head_p = need("lm_head", lm_head, (vocab, hidden))
        if cos.dim() != 2 or cos.shape != sin.shape or cos.dtype != sin.dtype:
            raise ValueError(f"DecodeGraph: cos/sin must be two [max_seq_len, rotary_dim] tables of one dtype, got "
                             f"{tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
        if cos.dtype not in (dtype, torch.float32):
            raise TypeError(f"DecodeGraph: cos/sin are {cos.dtype}; expected {dtype} or torch.float32")
        cos, sin = cos.contiguous(), sin.contiguous()
        keep += [cos, sin]
        style = config.get("rope_style", "neox")
        if style not in ROPE_STYLES:
            raise ValueError(f"DecodeGraph: rope_style must be 'neox' or 'interleave', got {style!r}")
        cfg = _C.DecodeGraphConfig()
        cfg.num_layers, cfg.hidden, cfg.intermediate, cfg.vocab = len(layers), hidden, inter, vocab
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim = H, KH, D
        cfg.eps, cfg.scale = float(config["eps"]), float(config.get("scale") or D ** -0.5)
        cfg.rotary_dim, cfg.rope_style = cos.shape[1], ROPE_STYLES[style]
        cfg.max_batch, cfg.max_seq_len = max_batch, cos.shape[0]
        cfg.num_blocks, cfg.block_size = cache_shape[0], cache_shape[1]
        cfg.dtype, cfg.cos_dtype = DTYPE_CODES[dtype], DTYPE_CODES[cos.dtype]
        cfg.vocab_start = int(config.get("vocab_start", 0))
        cfg.vocab_total = int(config.get("vocab_total", vocab))
        cfg.owns_residual = bool(config.get("owns_residual", True))
        repack = decode_repack_default(dtype) if repack is None else repack
        if repack and not rows4_supported(dtype):
            raise ValueError(f"DecodeGraph: repack=True needs the rows4 kernel for {dtype}, which the "
                             f"'{_C.isa()}' SIMD table lacks (bf16 and fp32 on the AVX-512 tables, bf16 on AVX2)")
        native = _C.DecodeGraph(cfg, native_layers, embed_p, final_p, head_p, cos.data_ptr(), sin.data_ptr(),
                                resolve_soc(soc_type))
        if isinstance(embed, QuantizedWeight) or isinstance(lm_head, QuantizedWeight):
            native.set_quant_tables(embed.storage() if isinstance(embed, QuantizedWeight) else None,
                                    lm_head.storage() if isinstance(lm_head, QuantizedWeight) else None)
        # The rows4 copies, planned and packed by the native graph (its launches' tiles, core by core), after the
        # quantized tables: a quantized weight has none.
        repacked = native.plan_rows4_streams() if repack else 0
        if repacked:
            arena = hugepages.empty((repacked,), torch.uint8)
            native.pack_rows4_streams(arena.data_ptr(), repacked)
            keep.append(arena)
        return cls(native, keep, vocab=vocab, dtype=dtype, max_batch=max_batch, max_seq_len=cos.shape[0],
                   hidden=hidden, repacked_bytes=repacked)

    @classmethod
    def from_runner(cls, runner) -> DecodeGraph:
        """The graph over an engine ModelRunner's weights, KV cache and rope tables (shared, not copied);
        over its shard, with the all-reduce wired to its group, when the runner is tensor-parallel."""
        s = runner.shape
        config = {"num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "eps": s.eps,
                  "scale": s.scale, "rope_style": runner.spec.rope.style, "sliding_windows": runner.windows}
        tp = runner.tp
        if tp is not None:
            config.update(vocab_start=tp.plan.vocab[0], vocab_total=tp.plan.vocab_total, owns_residual=tp.rank == 0)
        g = cls.from_weights(config, runner.layers, embed=runner.embed, final_norm=runner.final_norm,
                             lm_head=runner.lm_head, cos=runner.cos, sin=runner.sin,
                             key_caches=runner.cache.key_caches, value_caches=runner.cache.value_caches,
                             max_batch=runner.max_step_rows, soc_type=runner.soc_type)
        if tp is not None:
            g.set_all_reduce(tp.all_reduce)
        return g

    def set_all_reduce(self, fn) -> None:
        """Tensor parallelism: ``fn(x)`` sums ``x [batch, hidden]`` (the graph's residual stream, a view of its
        scratch) over the ranks, in place. Called from inside ``step`` after the embedding and after every o and
        down projection; an exception it raises ends the step and propagates."""
        nbytes = self.max_batch * self.hidden * self.dtype.itemsize
        views: dict[int, torch.Tensor] = {}

        def call(address: int, count: int) -> None:
            x = views.get(address)
            if x is None:   # the scratch never moves: one view, made at the first call
                raw = (ctypes.c_uint8 * nbytes).from_address(address)
                x = views[address] = torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype)
            fn(x[:count].view(-1, self.hidden))

        self._g.set_all_reduce(call)
        self._tp = True

    @classmethod
    def from_model(cls, model, *, key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                   max_batch: int, max_seq_len: int, soc_type: str | None = None,
                   repack: bool | None = None) -> DecodeGraph:
        """The graph over a loaded HF model's own parameters (through its family adapter) and the given caches.

        The model's dtype is the graph's; rope tables come from the model's rotary module. The parameters move
        into huge pages first, in place, as ``TransformerInfer`` moves them (`atb.hugepages`). ``repack``: as
        in `from_weights`.
        """
        from atb.hugepages import move_parameters_to_huge_pages
        from atb.layers.rotary import RotaryEmbedding
        from atb.registry import get_adapter

        ad = get_adapter(model)
        unsupported = ad.unsupported_reasons()
        if unsupported:
            raise ValueError("DecodeGraph: this model cannot run fused: " +
                             "; ".join(f"{role}: {why}" for role, why in unsupported.items()))
        spec = ad.spec
        move_parameters_to_huge_pages(model)
        dtype = ad.embed_tokens(model).dtype
        layers = [ad.layer_weights(model, i).map(torch.Tensor.detach) for i in range(spec.num_layers)]
        cos, sin = RotaryEmbedding.from_hf(ad.rotary(model), max_positions=max_seq_len).table(dtype)
        scale = float(getattr(ad.layers(model)[0].self_attn, "scaling", spec.head_dim ** -0.5))
        config = {"num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                  "eps": spec.rms_norm_eps, "scale": scale, "rope_style": spec.rope.style,
                  "sliding_windows": spec.sliding_windows}
        return cls.from_weights(config, layers, embed=ad.embed_tokens(model).detach(),
                                final_norm=ad.final_norm(model).detach(), lm_head=ad.lm_head(model).detach(),
                                cos=cos[:max_seq_len].contiguous(), sin=sin[:max_seq_len].contiguous(),
                                key_caches=key_caches, value_caches=value_caches, max_batch=max_batch,
                                soc_type=soc_type, repack=repack)

    def _metadata(self, op: str, token_ids, positions, block_tables, context_lens, slot_mapping, logits_out,
                  q_lens=None):
        """The step metadata as int32 tensors (per token row; block tables and context lengths per sequence,
        which is per row without ``q_lens``), and the logits buffer; ValueError/TypeError."""
        token_ids = int_tensor(op, "token_ids", token_ids, ndim=1)
        batch = token_ids.shape[0]
        positions = int_tensor(op, "positions", positions, ndim=1)
        context_lens = int_tensor(op, "context_lens", context_lens, ndim=1)
        slot_mapping = int_tensor(op, "slot_mapping", slot_mapping, ndim=1)
        block_tables = int_tensor(op, "block_tables", block_tables, ndim=2)
        for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
            if t.shape[0] != batch:
                raise ValueError(f"{op}: {name} has {t.shape[0]} entries, token_ids has {batch}")
        seqs, what = batch, "token_ids has"
        if q_lens is not None:
            q_lens = int_tensor(op, "q_lens", q_lens, ndim=1)
            seqs, what = q_lens.shape[0], "q_lens has"
        if context_lens.shape[0] != seqs:
            raise ValueError(f"{op}: context_lens has {context_lens.shape[0]} entries, {what} {seqs}")
        if block_tables.shape[0] != seqs:
            raise ValueError(f"{op}: block_tables has {block_tables.shape[0]} rows, {what} {seqs}")
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"{op}: batch {batch} is outside [1, max_batch={self.max_batch}]")
        if logits_out is None:
            logits_out = torch.empty(batch, self.vocab, dtype=self.dtype)
        elif (logits_out.dtype != self.dtype or tuple(logits_out.shape) != (batch, self.vocab)
              or not logits_out.is_contiguous()):
            raise ValueError(f"{op}: logits_out must be a contiguous {self.dtype} tensor of shape "
                             f"({batch}, {self.vocab}), got {logits_out.dtype} {tuple(logits_out.shape)}")
        return token_ids, positions, block_tables, context_lens, slot_mapping, logits_out, q_lens

    def step(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor, slot_mapping: torch.Tensor, logits_out: torch.Tensor | None = None, *,
             argmax_out: torch.Tensor | None = None, q_lens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step; returns logits ``[batch, vocab]`` in the graph's dtype (``logits_out`` if given).

        ``argmax_out`` (int32 ``[batch]``, optional) receives the greedy tokens, computed natively.
        ``q_lens`` (int32 ``[sequences]``, optional): sequence s has ``q_lens[s]`` consecutive new tokens (rows
        in order, at positions ``context_lens[s] - q_lens[s]`` .. ``context_lens[s] - 1``; speculative
        decoding's verification); ``block_tables`` and ``context_lens`` are then per sequence, the rest per
        row. Each row attends causally as if decoded alone at its position; its sequence's K/V is read once.
        """
        op = "DecodeGraph.step"
        token_ids, positions, block_tables, context_lens, slot_mapping, logits_out, q_lens = self._metadata(
            op, token_ids, positions, block_tables, context_lens, slot_mapping, logits_out, q_lens)
        batch = token_ids.shape[0]
        am = 0
        if argmax_out is not None:
            if argmax_out.dtype != torch.int32 or tuple(argmax_out.shape) != (batch,) or not argmax_out.is_contiguous():
                raise ValueError(f"{op}: argmax_out must be a contiguous int32 tensor of shape ({batch},)")
            am = argmax_out.data_ptr()
        self._g.step(token_ids.data_ptr(), positions.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                     context_lens.data_ptr(), slot_mapping.data_ptr(), batch, logits_out.data_ptr(), am,
                     0 if q_lens is None else q_lens.data_ptr(), 0 if q_lens is None else q_lens.shape[0])
        return logits_out

    def step_greedy(self, steps: int, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, slot_mapping: torch.Tensor,
                    logits_out: torch.Tensor | None = None, stop_tokens: Sequence[int] = ()) -> torch.Tensor:
        """Up to ``steps`` greedy decode steps in one native call: int32 tokens ``[steps run, batch]``.

        ``stop_tokens`` (e.g. the EOS ids): the call ends after the step by which every row has produced one of
        them, instead of computing steps that a finished sequence drops.

        Each step's argmax is the next step's token; positions and context lengths advance by one per step, and
        a later step's K/V slot comes from ``block_tables``, which must already hold every block the steps reach.
        With no Python between the steps, their caches stay warm: at batch 1 the Python of an engine step
        costs more than the kernels' own launch overhead once the weights have streamed through every cache
        level. Every step's metadata is checked before the first runs. ``logits_out`` ends with the last step's.
        """
        op = "DecodeGraph.step_greedy"
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"{op}: steps must be an int >= 1, got {steps!r}")
        if self._tp:
            raise ValueError(f"{op}: a tensor-parallel graph's argmax is its vocab slice; use step")
        token_ids, positions, block_tables, context_lens, slot_mapping, logits_out, _ = self._metadata(
            op, token_ids, positions, block_tables, context_lens, slot_mapping, logits_out)
        batch = token_ids.shape[0]
        stop = torch.tensor(list(stop_tokens), dtype=torch.int32)
        tokens = torch.empty(steps, batch, dtype=torch.int32)
        ran = self._g.step_greedy(steps, token_ids.data_ptr(), positions.data_ptr(), block_tables.data_ptr(),
                                  block_tables.shape[1], context_lens.data_ptr(), slot_mapping.data_ptr(), batch,
                                  logits_out.data_ptr(), tokens.data_ptr(), stop.data_ptr(), stop.numel())
        return tokens[:ran]

    __call__ = step

    # ---- profiling ----------------------------------------------------------------
    @property
    def profiling(self) -> bool:
        return self._g.profiling

    @profiling.setter
    def profiling(self, on: bool) -> None:
        self._g.profiling = bool(on)

    def reset_profile(self) -> None:
        self._g.reset_profile()

    def profile(self) -> dict:
        """``{"steps": n, "nodes": {name: {"ms": total, "ms_per_step": ..., "calls": ...}}}`` since the last reset
        (``all_reduce`` only for a tensor-parallel graph)."""
        nodes, steps = self._g.profile()
        out = {}
        for name, e in nodes.items():
            if name == "all_reduce" and not self._tp:
                continue
            out[name] = {"ms": e["ns"] / 1e6, "ms_per_step": e["ns"] / 1e6 / max(1, steps), "calls": e["calls"]}
        return {"steps": steps, "nodes": out}

    @property
    def scratch_bytes(self) -> int:
        return self._g.scratch_bytes
