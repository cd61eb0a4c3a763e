"""The scheduler: requests, the waiting and running queues, and the block manager (the paged KV pool).

vLLM's ``Scheduler``. A request waits until a batch slot and its KV blocks allow
it in; it is then prefilled and decoded with the running batch until it
finishes (or is aborted), when its blocks return to the pool at once. A
request's blocks are reserved on admission for its longest possible length
(prompt + ``max_new_tokens``, at most ``max_seq_len``), so a running request
never has to wait for a block.

Prefill is chunked (vLLM's chunked prefill): each step computes at most
``max_prefill_tokens`` prompt tokens, first continuing the prompts already being
prefilled, then starting waiting ones, first come first served. A prompt longer
than what is left of the budget is split: its first chunk goes in this step and
the rest in the next ones, each chunk attending to the K/V its earlier chunks
wrote. So a running decode waits at most one budget's worth of prefill per
step, however long the arriving prompts are, and a request produces its first
token in the step that computes its last prompt token.

With prefix caching on, admission first looks the prompt's full blocks up in
the block manager: the cached run that starts the prompt is shared, only the
rest is allocated, and only the uncached tokens count against the prefill
budget (``Request.cached`` tells the engine where its prefill starts). A prompt
block is keyed in the step whose chunk writes it, never before, so no other
request can match a block whose K/V is not written yet. Blocks
that decode fills are keyed as well (:meth:`Scheduler.key_filled_blocks`), so
a later prompt that repeats a previous answer reuses its K/V.
"""
from __future__ import annotations

from collections import deque

import torch

from atb.engine.params import RequestOutput, SamplingParams
from atb.engine.block_manager import BlockManager
from atb.engine.sampling import logit_bias_tensors
from atb.layers.kv_cache import CacheFullError


class Request:
    """One prompt being generated: its tokens so far, its sampling state and where it stands."""

    __slots__ = ("request_id", "prompt", "params", "eos", "out", "logprobs", "prompt_lps", "table", "seen", "bias",
                 "constraint", "gen", "drafter",
                 "reason", "reported", "streamed", "keys", "cached", "keyed", "prefilled")

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, eos: frozenset,
                 gen: torch.Generator | None):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.eos = eos
        self.out: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None  # a TokenLogprob per out token
        # Scoring the prompt: a TokenLogprob per prompt token computed so far (nothing predicts the first).
        self.prompt_lps: list | None = [None] if params.prompt_logprobs is not None else None
        self.table: list[int] = []   # the block manager's table of this request (the live list)
        self.seen = torch.tensor(sorted(set(prompt)), dtype=torch.int64) if params.repetition_penalty != 1.0 else None
        self.bias = logit_bias_tensors(params)
        self.constraint = None       # its grammar state (atb.engine.structured), when the output is constrained
        self.gen = gen
        self.drafter = None          # its prompt-lookup index (atb.engine.speculative), once it speculates
        self.reason: str | None = None
        self.reported = 0            # tokens already handed out in a RequestOutput
        self.streamed = 0            # tokens already handed to generate's stream callback
        # Prefix-cache keys of the sequence's full blocks: the prompt's (computed once), then each block decode
        # fills, appended by the scheduler.
        self.keys: list[bytes] | None = None
        self.cached = 0              # prompt tokens whose K/V was already cached when it was admitted
        self.keyed = 0               # leading full blocks whose key was offered to the block manager
        self.prefilled = 0           # prompt tokens whose K/V is in the cache (computed or cached)

    @property
    def length(self) -> int:
        """Tokens in the sequence: prompt + generated."""
        return len(self.prompt) + len(self.out)

    @property
    def finished(self) -> bool:
        return self.reason is not None

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_lps is not None

    def output(self) -> RequestOutput:
        """What happened since the last report (and marks it reported)."""
        new = self.out[self.reported:]
        lp, plp = self.logprobs, self.prompt_lps
        out = RequestOutput(self.request_id, new, list(self.out), len(self.prompt), self.finished, self.reason,
                            None if lp is None else lp[self.reported:], None if lp is None else list(lp),
                            list(plp) if plp is not None and len(plp) == len(self.prompt) else None)
        self.reported = len(self.out)
        return out

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt_len={len(self.prompt)}, out={len(self.out)}, reason={self.reason})"


class Scheduler:
    """Owns the requests and the block manager; decides who is prefilled and who decodes each step."""

    def __init__(self, cache: BlockManager, *, max_batch_size: int, max_seq_len: int, max_prefill_tokens: int):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.requests: dict[str, Request] = {}     # every unfinished request by id
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []        # admitted, part of the prompt still to compute (FCFS)
        self.running: list[Request] = []           # prompt computed: decoded every step
        self.done: list[Request] = []              # finished outside a step (at add or abort), reported next step
        # True when the running batch (its order or a block table) changed since the decode metadata was built.
        self.rows_dirty = True

    def add(self, req: Request, report: bool = True) -> None:
        """Queues a request; one that is finished before it starts is reported by the next step if ``report``.
        A request that scores its prompt is prefilled even when no token may follow (`Engine` finishes it
        then, with the same reason)."""
        reason = self.no_room(req)
        if reason is not None and not req.scores_prompt:
            req.reason = reason
        if req.finished:
            if report:
                self.done.append(req)
        else:
            self.requests[req.request_id] = req
            self.waiting.append(req)

    def no_room(self, req: Request) -> str | None:
        """Why a request may generate no (further) token: ``"length"`` or ``"max_seq_len"``; None if it may."""
        if len(req.out) >= req.params.max_new_tokens:
            return "length"
        if req.length >= self.max_seq_len:
            return "max_seq_len"
        return None

    def reserve_tokens(self, req: Request) -> int:
        return min(len(req.prompt) + req.params.max_new_tokens, self.max_seq_len)

    def schedule_prefill(self) -> list[tuple[Request, int, int]]:
        """This step's prefill chunks ``(request, start, end)``: prompt tokens ``[start, end)`` to compute.

        Prompts being prefilled continue first, then waiting requests are admitted (their blocks allocated)
        first come, first served while there is a batch slot, the blocks, and budget left; every chunk but
        the budget's last is a whole remaining prompt. A newly admitted request starts past its cached prefix
        (at least its last token is computed, for its logits). Each chunk's full prompt blocks are keyed
        now, pending until the prefill commits.
        """
        chunks: list[tuple[Request, int, int]] = []
        budget = self.max_prefill_tokens
        cache = self.cache

        def take(req: Request, start: int) -> None:
            nonlocal budget
            end = min(len(req.prompt), start + budget)
            budget -= end - start
            self._offer_prompt_keys(req, end)
            chunks.append((req, start, end))

        for req in self.prefilling:
            if budget == 0:
                return chunks
            take(req, req.prefilled)
        if cache.enable_prefix_caching:
            self.key_filled_blocks(self.running)
        while budget and self.waiting and len(self.running) + len(self.prefilling) < self.max_batch_size:
            req = self.waiting[0]
            if req.keys is None:
                req.keys = cache.block_keys(req.prompt) if cache.enable_prefix_caching else []
            try:
                # A prompt to score computes every token (cached ones would have no logits); its blocks are
                # still keyed for others.
                req.table, req.cached = cache.allocate_prompt(req, req.prompt, req.keys, self.reserve_tokens(req),
                                                              key_upto=0, share=not req.scores_prompt)
            except CacheFullError as e:
                if not chunks and not self.running:
                    raise CacheFullError(f"TransformerInfer: request {req.request_id!r} does not fit in the KV pool "
                                         f"and nothing is running (blocks held outside the engine?): {e}") from e
                break
            self.waiting.popleft()
            self.prefilling.append(req)
            req.keyed = req.cached // cache.block_size   # the cached prefix is keyed already
            req.prefilled = req.cached
            # Tokens this prefill computes: the uncached suffix, at least the last token.
            take(req, min(req.cached, len(req.prompt) - 1))
        return chunks

    def _offer_prompt_keys(self, req: Request, end: int) -> None:
        """Keys (pending) the prompt blocks that prompt tokens ``[0, end)`` fill entirely."""
        full = min(end // self.cache.block_size, len(req.keys))
        if full > req.keyed:
            self.cache.key_prompt_blocks(req, req.keys, req.keyed, full)
            req.keyed = full

    def finish_chunk(self, req: Request, end: int) -> bool:
        """Records a chunk's prefill; True when it completed the prompt (the request then decodes)."""
        req.prefilled = end
        if end < len(req.prompt):
            return False
        self.prefilling.remove(req)
        self.running.append(req)
        self.rows_dirty = True
        return True

    def key_filled_blocks(self, reqs) -> None:
        """Keys the blocks that decode filled since the last call, exactly as a prefill keys a prompt's.

        A running request that has produced tokens has the K/V of every position but its last token's written
        (that token goes in at the next decode step): the blocks wholly before it are full and are never
        written again. Called when the next step admits (so a prompt repeating an answer finds it) and when a
        request finishes (before its blocks are freed into the cache).
        """
        cache = self.cache
        bs = cache.block_size
        for r in reqs:
            if not r.out:
                continue   # its prefill has not completed: nothing past the cached prefix is written
            full = (r.length - 1) // bs
            if full <= r.keyed:
                continue
            seq = r.prompt + r.out
            for i in range(r.keyed, full):
                key = cache.chain_key(r.keys[i - 1] if i else None, seq[i * bs:(i + 1) * bs])
                r.keys.append(key)
                cache.key_block(r, i, key)
            r.keyed = full

    def finish(self, req: Request, reason: str) -> None:
        """Marks a request finished and returns its blocks (it must be waiting or running)."""
        req.reason = reason
        del self.requests[req.request_id]
        if req in self.cache:
            if self.cache.enable_prefix_caching:
                self.key_filled_blocks((req,))
            self.cache.free(req)
        if req in self.running:
            self.running.remove(req)
            self.rows_dirty = True
        elif req in self.prefilling:
            self.prefilling.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
