"""The model runner: weights, rope tables and the two executors over one KV cache.

vLLM's ``ModelRunner``. Built from a loaded HF model through its family
adapter: every layer is a `LayerWeights` (the HF parameter tensors
themselves unless a dtype conversion was asked for). Prefill and the Python
decode step run the decoder layer of ``atb.layers.decoder``; the native
``DecodeGraph`` (graph mode) is built from the same descriptions. Both take
token-major metadata and return logits, so the scheduler does not care which
one runs.

Under tensor parallelism (``tp``, an ``atb.distributed.TensorParallel``) the
model is this rank's shard: the embedding is looked up vocab-parallel, every
layer all-reduces its row-parallel projections, and logits are gathered (or
greedy tokens reduced) across the ranks, so callers still see the whole
vocabulary.
"""
from __future__ import annotations

import torch

from atb import kernels as K
from atb.hugepages import HugePageArena, huge_pages_enabled, move_parameters_to_huge_pages
from atb.layers.decoder import AttentionShape, decoder_layer, lm_head
from atb.layers.kv_cache import PagedKVCache
from atb.layers.linear import ROUTE_POLICY, ROUTE_ROW_INVARIANT
from atb.layers.rotary import RotaryEmbedding
from atb.quant.formats import QuantizedWeight


def as_id_list(v, name: str = "eos_token_id") -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, torch.Tensor):
        return [int(t) for t in v.reshape(-1)]
    if isinstance(v, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    raise TypeError(f"{name} must be an int or a list of ints, got {v!r}")


def _distinct_sum(items, key, size) -> int:
    """The sum of ``size(x)`` over ``items``, counting items with equal ``key(x)`` once."""
    sizes = {}
    for x in items:
        sizes.setdefault(key(x), size(x))
    return sum(sizes.values())


class ModelRunner:
    """Weights and executors of one model in one compute dtype, over ``cache``."""

    def __init__(self, model, adapter, *, dtype: torch.dtype, soc_type: str, max_seq_len: int, max_batch_size: int,
                 cache: PagedKVCache, graph_mode: bool, quantize=None, tp=None, max_step_rows: int | None = None):
        spec = adapter.spec
        unsupported = adapter.unsupported_reasons()
        if unsupported:
            raise ValueError("TransformerInfer: this model cannot run fused: " +
                             "; ".join(f"{role}: {why}" for role, why in unsupported.items()))
        self.spec = spec
        self.tp = tp
        self.dtype = dtype
        self.soc_type = soc_type
        self.cache = cache
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        # Rows one decode step may compute: a row per sequence, more when speculative decoding verifies drafts.
        self.max_step_rows = max(max_batch_size, max_step_rows or 0)
        w = self._w
        from atb.quant.engine import resolve

        if quantize is not None and tp is not None:
            raise ValueError("TransformerInfer: quantize= and tensor parallelism together are not supported "
                             "(tp slices float weights); use one or the other")
        quantized = resolve(model, quantize)
        self.quant_report = None if quantized is None else quantized.report
        if quantized is None:
            self.shared_with_model = dtype == next(model.parameters()).dtype
            if self.shared_with_model:
                move_parameters_to_huge_pages(model)  # in place: the model and the engine share them there
            embed = adapter.embed_tokens(model)
            self.embed = w(embed)
            self.final_norm = w(adapter.final_norm(model))
            head = adapter.lm_head(model)
            self.lm_head = self.embed if head is embed else w(head)
            self.layers = [adapter.layer_weights(model, i).map(w) for i in range(spec.num_layers)]
        else:
            # Quantized projections (and tables) are the engine's own; norms and biases follow the dtype rule.
            self.shared_with_model = False
            keep = lambda t: t if isinstance(t, QuantizedWeight) else w(t)  # noqa: E731
            self.embed = keep(quantized.embed)
            self.final_norm = w(quantized.final_norm)
            self.lm_head = self.embed if quantized.tied else keep(quantized.lm_head)
            self.layers = [lw.map(keep) for lw in quantized.layers]
        # Copies only the engine holds: a converted dtype, or quantized weights made here (not a caller's
        # atb.quantize result, nor the ones a quantized checkpoint's model carries).
        stored = getattr(model, "atb_quantized", None)
        made_here = quantized is None or (quantized is not quantize and quantized is not stored)
        if not self.shared_with_model and made_here:
            self._own_weights_to_huge_pages()
        self.vocab_size = tp.plan.vocab_total if tp is not None else self.embed.shape[0]
        self.windows = tuple(spec.sliding_windows)
        # HF's own attention scale (``scaling``), not head_dim ** -0.5: some configs override it.
        scale = float(getattr(adapter.layers(model)[0].self_attn, "scaling", spec.head_dim ** -0.5))
        self.shape = AttentionShape.from_spec(spec, scale)
        # Rotary tables from the model's own HF rotary module; with max_seq_len <= max_position_embeddings
        # every rope type (dynamic NTK included) uses the unscaled table, as HF does at those lengths.
        rotary = RotaryEmbedding.from_hf(adapter.rotary(model), max_positions=max_seq_len)
        cos, sin = rotary.table(dtype)
        self.cos = cos[:max_seq_len].contiguous()
        self.sin = sin[:max_seq_len].contiguous()
        gen_cfg = getattr(model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None)
        self.default_eos = as_id_list(eos if eos is not None else getattr(model.config, "eos_token_id", None))
        self.graph = None
        if graph_mode:
            from atb.graph import DecodeGraph

            self.graph = DecodeGraph.from_runner(self)
            self._logits_buf = torch.empty(self.max_step_rows, self.lm_head.shape[0], dtype=dtype)
            self._argmax_buf = torch.empty(self.max_step_rows, dtype=torch.int32)

    def _w(self, t: torch.Tensor) -> torch.Tensor:
        """The runner's view of a parameter: the same storage unless a dtype conversion was asked for."""
        t = t.detach()
        if t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.contiguous()

    def _own_weights_to_huge_pages(self) -> None:
        """Moves the engine's own weight copies (a converted dtype, quantized copies) into huge pages
        (`atb.hugepages`), tied tables staying one tensor, layer by layer so each copy's old storage is freed as
        it goes."""
        if not huge_pages_enabled():
            return
        arena = HugePageArena(HugePageArena.bytes_for({id(t): t for t in self.weight_tensors()}.values()))
        moved: dict[int, object] = {}

        def move(t):
            if id(t) not in moved:
                moved[id(t)] = (QuantizedWeight(move(t.data), move(t.scale), None if t.min is None else move(t.min),
                                                t.shape, t.bits, t.group_size, t.source)
                                if isinstance(t, QuantizedWeight) else arena.copy(t))
            return moved[id(t)]

        self.embed, self.final_norm, self.lm_head = move(self.embed), move(self.final_norm), move(self.lm_head)
        for i, lw in enumerate(self.layers):
            self.layers[i] = lw.map(move)

    def weight_tensors(self, *, decode_step: bool = False) -> list[torch.Tensor]:
        """Every tensor the weights occupy (a quantized weight's data, scales and mins); with ``decode_step``,
        those one decode step reads whole: all but an embedding table that is not also the LM head (a step
        reads one row of it per sequence)."""
        ts = []
        for t in self._weights(with_embedding=not decode_step or self.embed is self.lm_head):
            ts += [x for x in (t.data, t.scale, t.min) if x is not None] if isinstance(t, QuantizedWeight) else [t]
        return ts

    def _weights(self, with_embedding: bool = True) -> list:
        ws = ([self.embed] if with_embedding else []) + [self.final_norm, self.lm_head]
        for lw in self.layers:
            ws += list(lw.tensors().values())
        return ws

    def weight_bytes(self, *, decode_step: bool = False) -> int:
        """Bytes of ``weight_tensors(decode_step=...)``, each tensor once (a tied table is one tensor)."""
        return _distinct_sum(self.weight_tensors(decode_step=decode_step),
                             key=lambda t: (t.untyped_storage().data_ptr(), t.data_ptr(), t.nbytes),
                             size=lambda t: t.nbytes)

    def unquantized_weight_bytes(self) -> int:
        """What the weights would occupy in the compute dtype (each distinct weight once)."""
        return _distinct_sum(self._weights(), key=id, size=lambda t: t.shape.numel() * self.dtype.itemsize)

    # ---- executors ----------------------------------------------------------------------------------
    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend_for,
                route: str = ROUTE_POLICY) -> torch.Tensor:
        """Embedding and every decoder layer; ``attend_for(i)`` is layer i's attention core, ``route`` how the
        projections pick their kernels (``atb.layers.linear``)."""
        tp = self.tp
        if isinstance(self.embed, QuantizedWeight):
            x = self.embed.rows(tokens, self.dtype, soc_type=self.soc_type)  # each token's row dequantized
        elif tp is not None:
            x = tp.embedding(tokens, self.embed)
        else:
            x = torch.nn.functional.embedding(tokens, self.embed)
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        for i, lw in enumerate(self.layers):
            x = decoder_layer(x, lw, self.shape, cos, sin, attend_for(i), soc_type=self.soc_type, tp=tp, route=route)
        return x

    def _logits(self, x: torch.Tensor, gather: bool = True, route: str = ROUTE_POLICY) -> torch.Tensor:
        """Logits of the whole vocabulary; under tp with ``gather=False``, of this rank's slice."""
        logits = lm_head(x, self.final_norm, self.lm_head, self.shape.eps, soc_type=self.soc_type, route=route)
        return self.tp.gather_logits(logits) if gather and self.tp is not None else logits

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None,
                slot_mapping: torch.Tensor | None, last: torch.Tensor | None,
                paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                score: torch.Tensor | None = None):
        """Packed prompt tokens through every layer; logits of the rows ``last`` (all rows when None), in the
        compute dtype. With ``score``, ``(those logits, the logits of the rows score)``: rows wanted for their
        log-probabilities (a prompt being scored), not to pick a token, so their LM head takes the routing
        policy's kernel (one GEMM over them all) instead of the engine prefill's row-invariant few rows per call.

        Stateless (``forward``): whole prompts packed by ``cu_seqlens``, flash attention, nothing cached
        (``slot_mapping`` None). Engine prefill: ``paged = (block_tables, context_lens, q_lens)``; sequence b's
        rows are the last ``q_lens[b]`` tokens of a context of ``context_lens[b]``, their K/V are written at
        ``slot_mapping`` (a negative slot is not written) and they attend to the whole context through paged
        attention, so a prompt whose first blocks are already cached (prefix caching) computes only its
        suffix. Every prompt takes this path, cached prefix or not: paged attention computes a query's row the
        same way whatever the other rows of the call, so a suffix prefilled over a cached prefix gets the
        attention a cold prefill of the whole prompt would (flash attention tiles differently; in bf16 the
        two paths can pick different greedy tokens on near ties). For the same reason its projections run
        the row-invariant route (the native GEMM kernel at every row count, ``atb.layers.linear``): the
        routing policy would send a 1000-row prompt and its 30-row suffix to kernels that round differently.
        Every layer writes the step's K/V before any attention reads it, so a sequence may read blocks that
        another sequence of the same call fills.
        """
        soc, scale, kcs, vcs = self.soc_type, self.shape.scale, self.cache.key_caches, self.cache.value_caches

        def attend_for(i):
            window = self.windows[i]

            def attend(q, k, v):
                if slot_mapping is not None:
                    K.reshape_and_cache(k, v, kcs[i], vcs[i], slot_mapping)
                if paged is None:
                    return K.flash_attention(q, k, v, cu_seqlens, scale=scale, causal=True, window=window,
                                             soc_type=soc)
                tables, ctx, q_lens = paged
                return K.paged_attention(q, kcs[i], vcs[i], tables, ctx, scale=scale, q_lens=q_lens, window=window,
                                         soc_type=soc)
            return attend

        route = ROUTE_POLICY if paged is None else ROUTE_ROW_INVARIANT
        x = self._layers(tokens, positions, attend_for, route)
        logits = self._logits(x if last is None else x.index_select(0, last), route=route)
        return logits if score is None else (logits, self._logits(x.index_select(0, score)))

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, slot_mapping: torch.Tensor, greedy: bool,
               q_lens: torch.Tensor | None = None):
        """One decode step of ``B`` sequences: ``(logits [B, vocab], greedy tokens or None)``.

        With ``greedy`` the graph computes the argmax natively and returns it as a list; under tensor
        parallelism greedy steps return ``(None, tokens)`` (no logits are gathered). ``q_lens`` [sequences]:
        sequence s decodes ``q_lens[s]`` consecutive tokens (rows; speculative verification), each attending
        as if decoded alone at its position; ``block_tables`` and ``context_lens`` are then per sequence and
        the logits per row."""
        if self.graph is not None:
            n = token_ids.shape[0]
            am = self._argmax_buf[:n] if greedy else None
            logits = self.graph.step(token_ids, positions, block_tables, context_lens, slot_mapping,
                                     self._logits_buf[:n], argmax_out=am, q_lens=q_lens)
            if self.tp is not None:   # the graph's logits and argmax are this rank's vocab slice
                return (None, self.tp.argmax(logits, am)) if greedy else (self.tp.gather_logits(logits), None)
            return logits, (am.tolist() if am is not None else None)
        soc, scale, kcs, vcs = self.soc_type, self.shape.scale, self.cache.key_caches, self.cache.value_caches

        def attend_for(i):
            window = self.windows[i]

            def attend(q, k, v):
                K.reshape_and_cache(k, v, kcs[i], vcs[i], slot_mapping)
                return K.paged_attention(q, kcs[i], vcs[i], block_tables, context_lens, scale=scale, q_lens=q_lens,
                                         window=window, soc_type=soc)
            return attend

        x = self._layers(token_ids, positions, attend_for)
        if self.tp is not None and greedy:
            # Only the tokens are needed: reduce (value, index) pairs instead of gathering V/N logits per rank.
            return None, self.tp.argmax(self._logits(x, gather=False))
        return self._logits(x), None

    def decode_greedy(self, steps: int, token_ids: torch.Tensor, positions: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor,
                      slot_mapping: torch.Tensor, stop_tokens=()) -> list[list[int]]:
        """Up to ``steps`` greedy decode steps of ``B`` sequences in one native call (graph mode, one rank): the
        tokens, ``[steps run][B]``; fewer once every sequence has produced one of ``stop_tokens``. The block
        tables must already cover every step."""
        n = token_ids.shape[0]
        return self.graph.step_greedy(steps, token_ids, positions, block_tables, context_lens, slot_mapping,
                                      self._logits_buf[:n], stop_tokens=stop_tokens).tolist()

    @property
    def multi_step(self) -> bool:
        """Whether :meth:`decode_greedy` can run (a decode graph on a single rank)."""
        return self.graph is not None and self.tp is None

    def scratch_bytes(self, block_tables: torch.Tensor) -> int:
        scratch = self.cos.nbytes + self.sin.nbytes + block_tables.nbytes
        if self.graph is not None:
            return scratch + self.graph.scratch_bytes + self._logits_buf.nbytes + self._argmax_buf.nbytes
        # Python decode step at full batch: residual, normed input, q/k/v, attention out, gate/up/act,
        # logits (allocated per step by the kernels).
        item = self.dtype.itemsize
        hidden, inter, vocab = self.embed.shape[1], self.layers[0].gate.shape[0], self.lm_head.shape[0]
        s = self.shape
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        return scratch + self.max_step_rows * item * (3 * hidden + qkv + s.num_heads * s.head_dim + 3 * inter
                                                       + vocab)
