"""The scheduler: requests, the waiting and running queues, and the block manager (the paged KV pool).

vLLM's ``Scheduler``. A request waits until a batch slot, its KV blocks and the
step's prefill token budget allow it in; it is then prefilled and decoded with
the running batch until it finishes (or is aborted), when its blocks return to
the pool at once. A request's blocks are reserved on admission for its longest
possible length (prompt + ``max_new_tokens``, at most ``max_seq_len``), so a
running request never has to wait for a block.

With prefix caching on, admission first looks the prompt's full blocks up in
the block manager: the cached run that starts the prompt is shared, only the
rest is allocated, and only the uncached tokens count against the prefill
budget (``Request.cached`` tells the engine where its prefill starts). Blocks
that decode fills are keyed as well (:meth:`Scheduler.key_filled_blocks`), so
a later prompt that repeats a previous answer reuses its K/V.
"""
from __future__ import annotations

from collections import deque

import torch

from atb.engine.params import RequestOutput, SamplingParams
from atb.engine.block_manager import BlockManager
from atb.layers.kv_cache import CacheFullError


class Request:
    """One prompt being generated: its tokens so far, its sampling state and where it stands."""

    __slots__ = ("request_id", "prompt", "params", "eos", "out", "table", "seen", "gen", "reason", "reported",
                 "streamed", "keys", "cached", "keyed")

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, eos: frozenset,
                 gen: torch.Generator | None):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.eos = eos
        self.out: list[int] = []
        self.table: list[int] = []   # the block manager's table of this request (the live list)
        self.seen = torch.tensor(sorted(set(prompt)), dtype=torch.int64) if params.repetition_penalty != 1.0 else None
        self.gen = gen
        self.reason: str | None = None
        self.reported = 0            # tokens already handed out in a RequestOutput
        self.streamed = 0            # tokens already handed to generate's stream callback
        # Prefix-cache keys of the sequence's full blocks: the prompt's (computed once), then each block decode
        # fills, appended by the scheduler.
        self.keys: list[bytes] | None = None
        self.cached = 0              # prompt tokens whose K/V was already cached when it was admitted
        self.keyed = 0               # leading full blocks whose key was offered to the block manager

    @property
    def length(self) -> int:
        """Tokens in the sequence: prompt + generated."""
        return len(self.prompt) + len(self.out)

    @property
    def finished(self) -> bool:
        return self.reason is not None

    def output(self) -> RequestOutput:
        """What happened since the last report (and marks it reported)."""
        new = self.out[self.reported:]
        self.reported = len(self.out)
        return RequestOutput(self.request_id, new, list(self.out), len(self.prompt), self.finished, self.reason)

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
        self.running: list[Request] = []
        self.done: list[Request] = []              # finished outside a step (at add or abort), reported next step
        # True when the running batch (its order or a block table) changed since the decode metadata was built.
        self.rows_dirty = True

    def add(self, req: Request, report: bool = True) -> None:
        """Queues a request; one that is finished before it starts is reported by the next step if ``report``."""
        p = req.params
        if p.max_new_tokens == 0:
            req.reason = "length"
        elif req.length >= self.max_seq_len:
            req.reason = "max_seq_len"
        if req.finished:
            if report:
                self.done.append(req)
        else:
            self.requests[req.request_id] = req
            self.waiting.append(req)

    def reserve_tokens(self, req: Request) -> int:
        return min(len(req.prompt) + req.params.max_new_tokens, self.max_seq_len)

    def admit(self) -> list[Request]:
        """Waiting requests that join the batch this step, their blocks allocated.

        First come, first served, while there is a batch slot, the blocks, and room in the step's prefill
        token budget (a prompt longer than the budget is admitted alone), so arrivals do not stall the
        running decodes for long.
        """
        out: list[Request] = []
        budget = self.max_prefill_tokens
        cache = self.cache
        if cache.enable_prefix_caching:
            self.key_filled_blocks(self.running)
        while self.waiting and len(self.running) + len(out) < self.max_batch_size:
            req = self.waiting[0]
            if req.keys is None:
                req.keys = cache.block_keys(req.prompt) if cache.enable_prefix_caching else []
            # Tokens this prefill computes: the uncached suffix, at least the last token.
            hit = len(cache.cached_prefix(req.keys)) * cache.block_size
            n = len(req.prompt) - min(hit, len(req.prompt) - 1)
            if out and n > budget:
                break
            try:
                req.table, req.cached = cache.allocate_prompt(req, req.prompt, req.keys, self.reserve_tokens(req))
            except CacheFullError as e:
                if not out and not self.running:
                    raise CacheFullError(f"TransformerInfer: request {req.request_id!r} does not fit in the KV pool "
                                         f"and nothing is running (blocks held outside the engine?): {e}") from e
                break
            self.waiting.popleft()
            req.keyed = len(req.keys)   # allocate_prompt offered the prompt's full blocks
            out.append(req)
            budget -= n
        return out

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
        try:
            self.running.remove(req)
            self.rows_dirty = True
        except ValueError:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
