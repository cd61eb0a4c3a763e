"""TransformerInfer: an inference engine over a paged KV cache, with continuous batching.

    infer = atb.TransformerInfer(model, max_seq_len=2048, soc_type="Ascend910B4")
    logits = infer.forward(input_ids, attention_mask)          # stateless prefill
    tokens = infer.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)

Prefill packs the prompts back to back (no padding compute) and runs
``flash_attention`` over cumulative sequence lengths, writing K/V into the
paged cache with ``reshape_and_cache``; decode batches every live sequence
through ``paged_attention``. A sequence that finishes returns its blocks at
once and a waiting prompt is prefilled into the running batch.

Decode runs either as one native call per step (``graph_mode=True``:
``atb.graph.DecodeGraph`` over the engine's own weights, cache and rope
tables) or kernel by kernel from Python (``graph_mode=False``); both take
``(token_ids, positions, block_tables, context_lens, slot_mapping)`` and return
logits, so the scheduler is the same for both.

Stop reasons (``infer.last_stop_reasons``, one per prompt): ``"eos"`` (the EOS
token was produced and is included), ``"length"`` (``max_new_tokens`` reached),
``"max_seq_len"`` (prompt + generated tokens reached ``max_seq_len``: the
sequence stops there and the others carry on). When several hold at once the
first in that order is reported.
"""
from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from atb import kernels as K
from atb import soc as _soc
from atb.kernels.linear import native_linear_wins
from atb.layers.kv_cache import PagedKVCache
from atb.layers.rotary import RotaryEmbedding
from atb.sampling import SamplingParams, select, sequence_generator

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Seq:
    """One prompt being generated: its tokens so far and where it stands."""

    __slots__ = ("index", "prompt", "out", "length", "table", "seen", "gen", "reason")

    def __init__(self, index: int, prompt: list[int]):
        self.index = index
        self.prompt = prompt
        self.out: list[int] = []
        self.length = len(prompt)  # tokens in the sequence: prompt + generated
        self.table: list[int] = []  # the cache's block table (shared list, grows in place)
        self.seen = None  # token ids for the repetition penalty
        self.gen = None  # this sequence's sampling generator
        self.reason: str | None = None


class TransformerInfer:
    """Paged-KV-cache inference for a loaded HF causal LM of a supported family.

    Args:
        model: a loaded HF ``*ForCausalLM`` (llama, mistral, qwen2, qwen3 families).
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
            exposed as ``infer.decode_graph``); False runs the same kernels from Python.
    """

    def __init__(self, model, max_seq_len: int = 2048, soc_type: str = "host", *, max_batch_size: int = 8,
                 block_size: int = 128, dtype: torch.dtype | None = None, graph_mode: bool = True):
        from atb.registry import get_adapter

        config = getattr(model, "config", None)
        if config is None or not isinstance(model, torch.nn.Module):
            raise TypeError(f"TransformerInfer: model must be a loaded HF causal LM, got {type(model).__name__}")
        self.adapter = get_adapter(config)  # ValueError naming the supported families
        for name, v in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TransformerInfer: {name} must be a positive int, got {v!r}")
        if block_size & (block_size - 1):
            raise ValueError(f"TransformerInfer: block_size must be a power of two, got {block_size}")
        max_pos = getattr(config, "max_position_embeddings", None)
        if max_pos is not None and max_seq_len > max_pos:
            raise ValueError(f"TransformerInfer: max_seq_len={max_seq_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        if not isinstance(graph_mode, bool):
            raise TypeError(f"TransformerInfer: graph_mode must be a bool, got {type(graph_mode).__name__}")
        self.soc = _soc.get_soc(soc_type)  # ValueError listing the valid names
        self.soc_type = soc_type
        self.dtype = self._resolve_dtype(model, dtype)
        self.config = config
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.block_size = block_size

        self._load_weights(model)
        self.cache = PagedKVCache.for_capacity(self.num_layers, self.num_kv_heads, self.head_dim,
                                               max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                               block_size=block_size, dtype=self.dtype)
        self.max_blocks_per_seq = self.cache.blocks_needed(max_seq_len)
        # Decode metadata lives in preallocated int32 buffers, refreshed in place each step.
        self._block_tables = torch.zeros(max_batch_size, self.max_blocks_per_seq, dtype=torch.int32)
        self.last_stop_reasons: list[str] | None = None
        self.graph_mode = False
        # The native decode graph over the same weights, cache and rope tables (shared, not copied);
        # ``decode_graph.profiling = True`` gives per-node decode timings.
        self.decode_graph = None
        if graph_mode:
            from atb.graph import DecodeGraph

            self.decode_graph = DecodeGraph.from_infer(self)
            self.graph_mode = True
            self._logits_buf = torch.empty(max_batch_size, self.lm_head.shape[0], dtype=self.dtype)
            self._argmax_buf = torch.empty(max_batch_size, dtype=torch.int32)

    # ---- construction -------------------------------------------------------
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
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"TransformerInfer: dtype must be torch.float32, torch.float16 or torch.bfloat16, "
                             f"got {dtype}")
        if dtype == torch.bfloat16 and not soc.supports_bf16:
            raise ValueError(f"TransformerInfer: dtype=bfloat16 requested but {soc.name} has no bfloat16 "
                             f"(use float16 or float32)")
        return dtype

    def _w(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The engine's view of a parameter: the same storage unless a dtype conversion was asked for."""
        if t is None:
            return None
        t = t.detach()
        if t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.contiguous()

    def _load_weights(self, model) -> None:
        ad, spec = self.adapter, self.adapter.spec
        unsupported = ad.unsupported_reasons()
        if unsupported:
            raise ValueError("TransformerInfer: this model cannot run fused: " +
                             "; ".join(f"{role}: {why}" for role, why in unsupported.items()))
        self.spec = spec
        self.num_layers = spec.num_layers
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = float(getattr(ad.layers(model)[0].self_attn, "scaling", spec.head_dim ** -0.5))
        self.eps = spec.rms_norm_eps
        self._shared = self.dtype == next(model.parameters()).dtype
        w = self._w
        embed = ad.embed_tokens(model)
        self.embed = w(embed)
        self.final_norm = w(ad.final_norm(model))
        head = ad.lm_head(model)
        self.lm_head = self.embed if head is embed else w(head)
        self.vocab_size = self.embed.shape[0]
        self.layers = []
        for i, window in enumerate(spec.sliding_windows):
            lw = ad.layer_weights(model, i)
            self.layers.append((
                w(lw.input_norm), w(lw.q), w(lw.q_bias), w(lw.k), w(lw.k_bias), w(lw.v), w(lw.v_bias),
                w(lw.q_norm), w(lw.k_norm), w(lw.o), w(lw.o_bias), w(lw.post_attention_norm),
                w(lw.gate), w(lw.gate_bias), w(lw.up), w(lw.up_bias), w(lw.down), w(lw.down_bias), window,
            ))
        # Rotary tables from the model's own HF rotary module; with max_seq_len <= max_position_embeddings
        # every rope type (dynamic NTK included) uses the unscaled table, as HF does at those lengths.
        rotary = RotaryEmbedding.from_hf(ad.rotary(model), max_positions=self.max_seq_len)
        cos, sin = rotary.table(self.dtype)
        self.cos = cos[:self.max_seq_len].contiguous()
        self.sin = sin[:self.max_seq_len].contiguous()
        gen_cfg = getattr(model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None)
        self.default_eos = _as_id_list(eos if eos is not None else getattr(self.config, "eos_token_id", None))

    # ---- introspection ------------------------------------------------------
    def _weight_tensors(self) -> list[torch.Tensor]:
        ts = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            ts += [t for t in layer[:-1] if t is not None]
        return ts

    def memory_summary(self) -> dict:
        """Bytes held by the engine: weights (shared with the model unless converted), KV pool, scratch."""
        seen, weights = set(), 0
        for t in self._weight_tensors():
            key = (t.untyped_storage().data_ptr(), t.data_ptr(), t.nbytes)
            if key not in seen:
                seen.add(key)
                weights += t.nbytes
        scratch = self.cos.nbytes + self.sin.nbytes + self._block_tables.nbytes
        if self.decode_graph is not None:
            scratch += self.decode_graph.scratch_bytes + self._logits_buf.nbytes + self._argmax_buf.nbytes
        else:
            # Python decode step at full batch: residual, normed input, q/k/v, attention out, gate/up/act,
            # logits (allocated per step by the kernels).
            item = self.embed.element_size()
            hidden, inter = self.embed.shape[1], self.layers[0][12].shape[0]
            qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            scratch += self.max_batch_size * item * (3 * hidden + qkv + self.num_heads * self.head_dim + 3 * inter
                                                     + self.vocab_size)
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "weights_bytes": weights,
            "weights_shared_with_model": self._shared,
            "kv_cache_bytes": self.cache.nbytes,
            "kv_bytes_per_token": self.cache.nbytes // (self.cache.num_blocks * self.block_size),
            "kv_blocks": self.cache.num_blocks,
            "scratch_bytes": scratch,
            "total_bytes": weights + self.cache.nbytes + scratch,
        }

    # ---- the model, in two shapes -------------------------------------------
    def _prefill(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                 slot_mapping: torch.Tensor | None, last: torch.Tensor | None) -> torch.Tensor:
        """Packed prompts (varlen, ``cu_seqlens``) through flash attention; K/V cached at ``slot_mapping``
        (None: not cached). Returns logits of the rows ``last`` (all rows when None), in the compute dtype."""
        soc, scale = self.soc_type, self.scale

        def attend(q, k, v, kc, vc, window):
            return K.flash_attention(q, k, v, cu_seqlens, scale=scale, causal=True, window=window, soc_type=soc)

        return self._gemm_forward(tokens, positions, slot_mapping, last, attend)

    def _gemm_forward(self, tokens, positions, slot_mapping, last, attend) -> torch.Tensor:
        """Every layer with oneDNN GEMMs for the projections (prefill-sized M); ``attend`` is the attention."""
        soc, eps = self.soc_type, self.eps
        T, H, KH, D = tokens.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(tokens, self.embed)
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        residual = None
        for (ln1, qw, qb, kw, kb, vw, vb, qn, kn, ow, ob, ln2, gw, gb, uw, ub, dw, db, window), kc, vc in zip(
                self.layers, self.cache.key_caches, self.cache.value_caches):
            if residual is None:
                h, residual = K.rms_norm(x, ln1, eps, soc_type=soc), x
            else:
                h, residual = K.add_rms_norm(x, residual, ln1, eps, soc_type=soc)
            q = F.linear(h, qw, qb).view(T, H, D)
            k = F.linear(h, kw, kb).view(T, KH, D)
            v = F.linear(h, vw, vb).view(T, KH, D)
            if qn is not None:
                q = K.rms_norm(q, qn, eps, soc_type=soc)
                k = K.rms_norm(k, kn, eps, soc_type=soc)
            q, k = K.rope(q, k, cos, sin, inplace=True, soc_type=soc)
            if slot_mapping is not None:
                K.reshape_and_cache(k, v, kc, vc, slot_mapping)
            x = F.linear(attend(q, k, v, kc, vc, window).view(T, H * D), ow, ob)
            h, residual = K.add_rms_norm(x, residual, ln2, eps, soc_type=soc)
            x = F.linear(K.silu_mul(F.linear(h, gw, gb), F.linear(h, uw, ub)), dw, db)
        if last is not None:
            x, residual = x.index_select(0, last), residual.index_select(0, last)
        h, _ = K.add_rms_norm(x, residual, self.final_norm, eps, soc_type=soc)
        return F.linear(h, self.lm_head)

    def _python_decode_step(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """One decode step for a batch of sequences, one new token each; logits ``[batch, vocab]``.

        Same contract as the native decode graph's ``step``: int32 metadata,
        K/V of the new tokens written at ``slot_mapping``, attention over
        ``context_lens`` tokens (the new one included) through ``block_tables``.
        Projections use the decode-shaped fused linear kernels (one weight pass
        for q/k/v, SwiGLU applied on the gate/up pass, residual added on the
        o/down pass): 9 kernel calls per layer.
        """
        B = token_ids.shape[0]
        if not native_linear_wins(B, self.embed.dtype):
            return self._wide_decode_step(token_ids, positions, block_tables, context_lens, slot_mapping)
        soc, eps, scale = self.soc_type, self.eps, self.scale
        H, KH, D = self.num_heads, self.num_kv_heads, self.head_dim
        rms_norm, linear_multi, linear_residual, linear_swiglu = K.rms_norm, K.linear_multi, K.linear_residual, \
            K.linear_swiglu
        rope, reshape_and_cache, paged_attention = K.rope, K.reshape_and_cache, K.paged_attention
        x = F.embedding(token_ids, self.embed)
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        for (ln1, qw, qb, kw, kb, vw, vb, qn, kn, ow, ob, ln2, gw, gb, uw, ub, dw, db, window), kc, vc in zip(
                self.layers, self.cache.key_caches, self.cache.value_caches):
            h = rms_norm(x, ln1, eps, soc_type=soc)
            q, k, v = linear_multi(h, (qw, kw, vw), (qb, kb, vb), soc_type=soc)
            q, k, v = q.view(B, H, D), k.view(B, KH, D), v.view(B, KH, D)
            if qn is not None:
                q = rms_norm(q, qn, eps, soc_type=soc)
                k = rms_norm(k, kn, eps, soc_type=soc)
            q, k = rope(q, k, cos, sin, inplace=True, soc_type=soc)
            reshape_and_cache(k, v, kc, vc, slot_mapping)
            o = paged_attention(q, kc, vc, block_tables, context_lens, scale=scale, window=window, soc_type=soc)
            x = linear_residual(o.view(B, H * D), ow, x, ob, soc_type=soc)
            h = rms_norm(x, ln2, eps, soc_type=soc)
            if gb is None and ub is None:
                a = linear_swiglu(h, gw, uw, soc_type=soc)
            else:
                a = K.silu_mul(K.linear(h, gw, gb, soc_type=soc), K.linear(h, uw, ub, soc_type=soc))
            x = linear_residual(a, dw, x, db, soc_type=soc)
        return K.linear(rms_norm(x, self.final_norm, eps, soc_type=soc), self.lm_head, soc_type=soc)

    def _wide_decode_step(self, token_ids, positions, block_tables, context_lens, slot_mapping) -> torch.Tensor:
        """Decode for batches at or above the linear crossover: oneDNN GEMMs, paged attention."""
        soc, scale = self.soc_type, self.scale

        def attend(q, k, v, kc, vc, window):
            return K.paged_attention(q, kc, vc, block_tables, context_lens, scale=scale, window=window, soc_type=soc)

        return self._gemm_forward(token_ids, positions, slot_mapping, None, attend)

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
            return [row[m].tolist() for row, m in zip(prompts, mask)]
        if attention_mask is not None:
            raise ValueError("generate: attention_mask is only accepted with a 2-D tensor of prompts")
        if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
            raise TypeError(f"generate: prompts must be a list of token-id lists or a 2-D LongTensor, "
                            f"got {type(prompts).__name__}")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, torch.Tensor):
                if p.dim() != 1 or p.dtype not in (torch.int64, torch.int32):
                    raise ValueError(f"generate: prompt {i} must be a 1-D integer tensor, got {p.dtype} "
                                     f"{tuple(p.shape)}")
                p = p.tolist()
            elif not isinstance(p, Sequence) or isinstance(p, (str, bytes)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise TypeError(f"generate: prompt {i} must be a list of int token ids")
            out.append(list(p))
        return out

    def _mask_for(self, input_ids: torch.Tensor, attention_mask, op: str) -> torch.Tensor:
        if attention_mask is None:
            return torch.ones(input_ids.shape, dtype=torch.bool)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"{op}: attention_mask must be a tensor of shape {tuple(input_ids.shape)}, got {shape}")
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
        out = torch.zeros(B, S, self.lm_head.shape[0], dtype=self.dtype)
        if tokens.numel() == 0:
            return out
        positions = (mask.cumsum(1) - 1)[mask]
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        out[mask] = self._prefill(tokens.to(torch.int32), positions.to(torch.int32), cu, None, None)
        return out

    __call__ = forward

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 32, *, attention_mask: torch.Tensor | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
                 seed: int | None = None, stream: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """New tokens of each prompt (EOS included when produced), in prompt order.

        ``prompts``: a list of token-id lists (any lengths), or a 2-D LongTensor
        with an optional ``attention_mask`` (padding dropped). At most
        ``max_batch_size`` sequences run at once; the rest wait and join as
        others finish. ``stream(seq_index, token)`` is called for every token as
        it is produced. ``seed`` makes sampling reproducible (each sequence has
        its own generator, so its tokens do not depend on its batch mates).
        Why each sequence stopped is in ``self.last_stop_reasons``.
        """
        # Everything is validated before a single block is allocated.
        prompts = self._prompts_from(prompts, attention_mask)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"generate: prompt {i} is empty")
            if len(p) > self.max_seq_len:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens, more than max_seq_len={self.max_seq_len}")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"generate: prompt {i} contains token id {lo if lo < 0 else hi}, outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        params = SamplingParams(do_sample, temperature, top_k, top_p, repetition_penalty)
        eos = set(self.default_eos if eos_token_id is None else _as_id_list(eos_token_id, "eos_token_id"))
        if stream is not None and not callable(stream):
            raise TypeError(f"generate: stream must be callable(seq_index, token), got {type(stream).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"generate: seed must be an int, got {type(seed).__name__}")
        if params.do_sample and seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))  # follows torch.manual_seed

        self.last_stop_reasons = None
        seqs = [_Seq(i, p) for i, p in enumerate(prompts)]
        for s in seqs:
            if max_new_tokens == 0:
                s.reason = "length"
            elif s.length >= self.max_seq_len:
                s.reason = "max_seq_len"
            if params.repetition_penalty != 1.0:
                s.seen = torch.tensor(sorted(set(s.prompt)), dtype=torch.int64)
            if params.do_sample:
                s.gen = sequence_generator(seed, s.index)
        try:
            self._run([s for s in seqs if s.reason is None], max_new_tokens, params, eos, stream)
        finally:
            self.cache.free_all()
        self.last_stop_reasons = [s.reason for s in seqs]
        return [s.out for s in seqs]

    # ---- scheduler ----------------------------------------------------------
    def _run(self, todo: list[_Seq], max_new: int, params: SamplingParams, eos: set, stream) -> None:
        waiting = deque(todo)
        running: list[_Seq] = []
        cache, bs, bt, graph = self.cache, self.block_size, self._block_tables, self.decode_graph
        rows_dirty = True

        def emit(s: _Seq, tok: int) -> bool:
            """Appends a token; True when the sequence is finished."""
            s.out.append(tok)
            s.length += 1
            if s.seen is not None and tok not in s.seen:
                s.seen = torch.cat([s.seen, torch.tensor([tok])])
            if stream is not None:
                stream(s.index, tok)
            if tok in eos:
                s.reason = "eos"
            elif len(s.out) >= max_new:
                s.reason = "length"
            elif s.length >= self.max_seq_len:
                s.reason = "max_seq_len"
            return s.reason is not None

        while waiting or running:
            if waiting and len(running) < self.max_batch_size:
                admitted = [waiting.popleft() for _ in range(min(len(waiting), self.max_batch_size - len(running)))]
                logits = self._prefill_seqs(admitted)
                toks = select(logits.float(), params, [s.seen for s in admitted], [s.gen for s in admitted])
                for s, t in zip(admitted, toks):
                    if emit(s, t):
                        cache.free(s.index)
                    else:
                        running.append(s)
                rows_dirty = True
            if not running:
                continue
            # Decode: the last token of each sequence goes in at position length - 1.
            n = len(running)
            meta = []
            for s in running:
                pos = s.length - 1
                if pos == len(s.table) * bs:
                    cache.extend(s.index, pos + 1)
                    rows_dirty = True
                meta.append((s.out[-1], pos, pos + 1, s.table[pos // bs] * bs + pos % bs))
            if rows_dirty:
                for i, s in enumerate(running):
                    bt[i, :len(s.table)] = torch.tensor(s.table, dtype=torch.int32)
                rows_dirty = False
            tok_ids, positions, ctx, slots = torch.tensor(meta, dtype=torch.int32).t().contiguous()
            if graph is not None:
                # Logits land in a preallocated buffer (no per-step 100s-of-KiB allocation); greedy
                # tokens come from the graph's native argmax.
                am = self._argmax_buf[:n] if params.greedy_only else None
                logits = graph.step(tok_ids, positions, bt[:n], ctx, slots, self._logits_buf[:n], argmax_out=am)
                toks = am.tolist() if am is not None else None
            else:
                logits, toks = self._python_decode_step(tok_ids, positions, bt[:n], ctx, slots), None
            if toks is None:
                toks = select(logits.float(), params, [s.seen for s in running], [s.gen for s in running])
            still = []
            for s, t in zip(running, toks):
                if emit(s, t):
                    cache.free(s.index)
                    rows_dirty = True
                else:
                    still.append(s)
            running = still

    def _prefill_seqs(self, seqs: list[_Seq]) -> torch.Tensor:
        """Allocates blocks for and prefills a group of prompts; logits of each prompt's last token."""
        for s in seqs:
            s.table = self.cache.allocate(s.index, s.length)
        lens = [s.length for s in seqs]
        tokens = torch.tensor([t for s in seqs for t in s.prompt], dtype=torch.int32)
        positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lens])
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        slots = self.cache.slot_mapping([s.index for s in seqs], [0] * len(seqs), lens)
        return self._prefill(tokens, positions, cu, slots, (cu[1:] - 1).long())

    def __repr__(self) -> str:
        return (f"TransformerInfer({self.config.model_type}, layers={self.num_layers}, dtype={self.dtype}, "
                f"soc={self.soc.name}, max_seq_len={self.max_seq_len}, max_batch_size={self.max_batch_size}, "
                f"block_size={self.block_size}, graph_mode={self.graph_mode})")


def _as_id_list(v, name: str = "eos_token_id") -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, torch.Tensor):
        return [int(t) for t in v.reshape(-1)]
    if isinstance(v, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    raise TypeError(f"{name} must be an int or a list of ints, got {v!r}")
