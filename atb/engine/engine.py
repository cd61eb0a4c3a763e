"""The request-level engine: ``add_request``, ``step``, ``abort``, ``has_unfinished``, ``stats``.

A `Scheduler` (requests, queues, block manager) plus a `ModelRunner`
(weights, executors), as vLLM splits them. One lock serializes every public
call, so any thread may add or abort requests while another drives ``step``
(an HTTP server's engine thread does exactly that). Each step:

1. prefills up to a per-step budget of prompt tokens: the prompts already
   being prefilled continue, then waiting requests are admitted (batch slots,
   KV blocks), a prompt that does not fit split into chunks over the next
   steps (chunked prefill); each request whose prompt completes produces its
   first token;
2. runs one decode step of the whole running batch (the requests that just
   completed their prompt included), one token each;
3. returns a `RequestOutput` for every request that produced tokens or
   finished, and frees the blocks of finished requests at once.

A request's prefill does not depend on its batch mates (or on how much of its
prompt was cached): the prefill projections run the row-invariant GEMM and
paged attention computes each query row on its own. Decode picks each linear's
kernel by the batch size (the few-row kernel below 16 rows in bf16 with
AVX512-BF16, 32 otherwise), so a decode row may round differently once the
batch crosses that size. Each request samples from its own generator.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading

import torch

from atb.engine.params import RequestOutput, SamplingParams
from atb.engine.runner import ModelRunner
from atb.engine.sampling import generator, select, token_logprobs, verify_draft
from atb.engine.scheduler import Request, Scheduler
from atb.engine.speculative import LookupHistory, NgramDrafter, SpeculativeConfig
from atb.runtime import pool_launches_off_main_thread

log = logging.getLogger("atb.engine")


@contextlib.contextmanager
def serial_torch_ops():
    """torch ops on the calling thread run on it alone while inside (its OpenMP thread count is per thread).

    Sampling's ops are small ([batch, vocab] floats): torch would run each as a parallel region, after which
    the OpenMP team's workers spin on the cores the next decode step's kernels need. SmolLM2 bf16, batch 1,
    2 Zen 3 cores, tok/s: a request that takes the logits path (logprobs=0) 55 -> 78, temperature sampling
    47 -> 69; greedy (native argmax, no torch ops) 79-95 either way."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class Engine:
    """Scheduler + model runner behind one lock. ``TransformerInfer`` is the public face of this class."""

    runner: ModelRunner
    scheduler: Scheduler

    def _init_engine(self, runner: ModelRunner, scheduler: Scheduler, tokenizer=None,
                     speculative: SpeculativeConfig | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.speculative = speculative
        # Finished requests looked up for drafts across requests (SpeculativeConfig.lookup_history).
        self._lookup_history = (LookupHistory(speculative.lookup_history, speculative.prompt_lookup_min,
                                              speculative.prompt_lookup_max)
                                if speculative is not None and speculative.lookup_history else None)
        # Speculation counters (stats()): verification steps, draft tokens verified, drafts accepted.
        self._spec_steps = self._spec_drafted = self._spec_accepted = 0
        self._grammars = None     # built from the tokenizer by the first constrained request
        self._lock = threading.RLock()
        self._local = threading.local()   # per thread: inside a stream callback?
        self._ids = itertools.count()
        # Decode metadata lives in a preallocated int32 buffer, refreshed in place when the batch changes.
        self._block_tables = torch.zeros(runner.max_batch_size, scheduler.cache.blocks_needed(runner.max_seq_len),
                                         dtype=torch.int32)

    # ---- guards -------------------------------------------------------------------------------------
    def _not_in_callback(self, op: str) -> None:
        if getattr(self._local, "in_callback", False):
            raise RuntimeError(f"TransformerInfer.{op}: called from inside a generate() stream callback; the engine "
                               f"is in the middle of that generate call (collect the tokens and call it afterwards)")

    # ---- requests -----------------------------------------------------------------------------------
    def check_prompt(self, op: str, what: str, prompt) -> list[int]:
        """A prompt as a list of ints, or a ValueError/TypeError naming ``what``."""
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"{op}: {what} must be a 1-D integer tensor, got {prompt.dtype} {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        elif isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"{op}: {what} must be a list of int token ids")
        prompt = list(prompt)
        if not prompt:
            raise ValueError(f"{op}: {what} is empty")
        if len(prompt) > self.runner.max_seq_len:
            raise ValueError(f"{op}: {what} has {len(prompt)} tokens, more than max_seq_len={self.runner.max_seq_len}")
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.runner.vocab_size:
            raise ValueError(f"{op}: {what} contains token id {lo if lo < 0 else hi}, outside the vocabulary "
                             f"[0, {self.runner.vocab_size})")
        return prompt

    def constraint(self, params: SamplingParams, op: str = "add_request"):
        """A new grammar state for ``params``' ``json_schema`` / ``regex`` (None without one); ValueError when the
        engine cannot constrain (no tokenizer, tensor parallelism) or the grammar is unusable."""
        if not params.constrained:
            return None
        field = next(f for f in ("json_schema", "regex", "grammar") if getattr(params, f) is not None)
        if self.runner.tp is not None:
            raise ValueError(f"{op}: sampling_params.{field}: structured output is not supported with tensor "
                             f"parallelism")
        if self.tokenizer is None:
            raise ValueError(f"{op}: sampling_params.{field} needs the engine's tokenizer: "
                             f"TransformerInfer(model, tokenizer=tok), or set infer.tokenizer")
        return self.grammars().constraint(params, op)

    def grammars(self):
        """The grammar compiler of structured output over ``tokenizer``, built on first use (~0.4 s for a
        49k-token vocabulary; a server builds it at start-up rather than inside its first such request)."""
        if self._grammars is None or self._grammars.tokenizer is not self.tokenizer:
            from atb.engine.structured import Grammars

            self._grammars = Grammars(self.tokenizer, self.runner.vocab_size, self.runner.default_eos)
        return self._grammars

    def _new_request(self, request_id: str | None, prompt: list[int], params: SamplingParams,
                     report: bool = True, constraint=None) -> Request:
        """Under the lock: a Request with its generator and EOS set, queued."""
        sched = self.scheduler
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in sched.requests:
                request_id = f"req-{next(self._ids)}"
        elif request_id in sched.requests:
            raise ValueError(f"add_request: request_id {request_id!r} is already in use")
        gen = None
        if params.do_sample:
            # Without a seed the request's generator follows torch's global RNG (torch.manual_seed).
            gen = generator(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
        if params.ignore_eos:
            eos = frozenset()
        elif params.eos_token_id is None:
            eos = frozenset(self.runner.default_eos)
        elif isinstance(params.eos_token_id, int):
            eos = frozenset((params.eos_token_id,))
        else:
            eos = frozenset(params.eos_token_id)
        req = Request(request_id, prompt, params, eos, gen)
        req.constraint = constraint
        sched.add(req, report)
        return req

    def add_request(self, prompt_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a prompt; returns its request id. Everything is validated before anything is allocated.

        ``request_id`` None gets a fresh id; an id already in use (waiting or running) is a ValueError.
        The request joins the running batch at a following ``step``.
        """
        prompt = self.check_prompt("add_request", "prompt_ids", prompt_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        elif not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"add_request: sampling_params must be an atb.engine.SamplingParams, got "
                            f"{type(sampling_params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"add_request: request_id must be a str or None, got {type(request_id).__name__}")
        outside = [t for t, _ in sampling_params.logit_bias if t >= self.runner.vocab_size]
        if outside:
            raise ValueError(f"add_request: sampling_params.logit_bias names token id {outside[0]}, outside the "
                             f"vocabulary [0, {self.runner.vocab_size})")
        constraint = self.constraint(sampling_params)   # compiled outside the lock: steps go on meanwhile
        with self._lock:
            return self._new_request(request_id, prompt, sampling_params, constraint=constraint).request_id

    def abort(self, request_id: str) -> bool:
        """Stops a waiting or running request and frees its KV blocks at once; False if no such request.

        The next ``step`` reports it once more, finished with reason ``"abort"``."""
        with self._lock:
            req = self.scheduler.requests.get(request_id)
            if req is None:
                return False
            self.scheduler.finish(req, "abort")
            self.scheduler.done.append(req)
            return True

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.scheduler.requests)

    def stats(self) -> dict:
        """``running`` (holding a batch slot, ``prefilling`` included), ``prefilling`` (prompt partly computed),
        ``waiting`` request counts and KV block accounting (ints).

        ``kv_blocks_used`` are held by requests, ``kv_blocks_cached`` are held by none but keep a prefix's K/V
        for reuse (evicted when needed, so they are available too), ``kv_blocks_free`` are neither; the three
        add up to ``kv_blocks_total``. ``prefix_cache_queries`` / ``prefix_cache_hits``: prompt tokens looked
        up in the prefix cache on admission / found there (0 with prefix caching off). Speculative decoding
        (``speculative_config``): ``spec_decode_steps`` verification steps run, ``spec_draft_tokens`` draft
        tokens verified in them, ``spec_accepted_tokens`` of those accepted (0 without speculation).
        """
        with self._lock:
            s, cache = self.scheduler, self.scheduler.cache
            return {"running": len(s.running) + len(s.prefilling), "prefilling": len(s.prefilling),
                    "waiting": len(s.waiting), "kv_blocks_total": cache.num_blocks,
                    "kv_blocks_used": cache.used_blocks, "kv_blocks_free": cache.free_blocks,
                    "kv_blocks_cached": cache.cached_blocks, "prefix_cache_queries": cache.query_tokens,
                    "prefix_cache_hits": cache.hit_tokens, "spec_decode_steps": self._spec_steps,
                    "spec_draft_tokens": self._spec_drafted, "spec_accepted_tokens": self._spec_accepted}

    # ---- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration (admit + prefill, then one decode step); the outputs of every request that
        produced tokens or finished in it."""
        self._not_in_callback("step")
        with self._lock, pool_launches_off_main_thread():
            return [r.output() for r in self._step_locked()]

    def _emit(self, req: Request, tok: int, logprob=None) -> bool:
        """Appends a token (and its TokenLogprob, when the request asked for them); True when the request is
        finished (its reason is set, blocks not yet freed)."""
        req.out.append(tok)
        if req.logprobs is not None:
            req.logprobs.append(logprob)
        if req.seen is not None and tok not in req.seen:
            req.seen = torch.cat([req.seen, torch.tensor([tok])])
        grammar = req.constraint
        if grammar is not None and not grammar.accept(tok):
            # The mask allows only tokens the grammar accepts; a state that breaks anyway ends the request
            # rather than let it produce text outside the grammar.
            log.error("request %s: its grammar refused token %d: %s", req.request_id, tok, grammar.error)
            req.reason = "abort"
            return True
        if tok in req.eos:
            req.reason = "eos"
        elif grammar is not None and grammar.complete:
            req.reason = "grammar"
        else:
            req.reason = self.scheduler.no_room(req)
        return req.reason is not None

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, object]]:
        """Each request's token and, when it asked for logprobs, its TokenLogprob (else None)."""
        with serial_torch_ops():
            return self._sample_serial(logits, reqs)

    def _sample_serial(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, object]]:
        logits = logits.float()
        toks = select(logits, reqs)
        if self.runner.tp is not None and any(r.params.do_sample for r in reqs):
            # Tensor-parallel ranks hold the same logits, but an unseeded generator is per process: rank 0 decides.
            toks = self.runner.tp.broadcast_tokens(toks)
        lps = [None] * len(reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            got = token_logprobs(logits[want], [toks[i] for i in want], [reqs[i].params.logprobs for i in want])
            for i, lp in zip(want, got):
                lps[i] = lp
        return list(zip(toks, lps))

    def _decode_steps(self, running: list[Request], greedy: bool, max_steps: int) -> int:
        """How many greedy decode steps the next call may run natively back to back: one unless every running
        request is greedy, none waits for admission or prefill (continuous batching admits only between
        calls), and each has that many tokens left to generate (its blocks are reserved for them at
        admission: Scheduler.reserve_tokens). The native call ends after the step by which every request has
        produced an EOS id; a request that stops earlier than the others drops the tokens computed past its
        end. With speculative decoding on, every step is one: a draft may appear after any token (SmolLM2 fp32
        on 2 Zen 3 cores, 11 chat tasks one after another: 22.5 s with single steps, 24.8-24.9 s with 4 or 8
        back to back while no request has a draft, 29.9 s without speculation)."""
        sched = self.scheduler
        if (max_steps <= 1 or not greedy or not self.runner.multi_step or sched.waiting or sched.prefilling
                or self.speculative is not None):
            return 1
        left = min(min(r.params.max_new_tokens - len(r.out), self.runner.max_seq_len - r.length)
                   for r in running)
        return max(1, min(max_steps, left))

    def _step_locked(self, max_decode_steps: int = 1) -> list[Request]:
        touched = self._step_body(max_decode_steps)
        if self._lookup_history is not None:
            for r in touched:
                if r.finished and r.reason != "abort" and r.out:
                    self._lookup_history.add(r.prompt + r.out)
        return touched

    def _step_body(self, max_decode_steps: int) -> list[Request]:
        sched, runner = self.scheduler, self.runner
        touched: dict[int, Request] = {id(r): r for r in sched.done}
        sched.done.clear()
        # Admitted requests are registered (prefilling) before the forward: if it raises, abort frees them.
        chunks = sched.schedule_prefill()
        if chunks:
            try:
                logits = self._prefill(chunks)
            except BaseException:
                # Blocks keyed for this prefill were never filled: they must not be matched.
                sched.cache.discard_pending()
                raise
            sched.cache.commit()
            # Requests whose last prompt token was in this step sample their first token from its logits, unless
            # none may follow (a scored prompt with max_new_tokens=0 or at max_seq_len).
            done = []
            for i, (r, _, end) in enumerate(chunks):
                if sched.finish_chunk(r, end):
                    touched[id(r)] = r
                    reason = sched.no_room(r)
                    if reason is None:
                        done.append(i)
                    else:
                        sched.finish(r, reason)
            if done:
                firsts = [chunks[i][0] for i in done]
                for r, (t, lp) in zip(firsts, self._sample(logits[done], firsts)):
                    if self._emit(r, t, lp):
                        sched.finish(r, r.reason)
        running = sched.running
        if running:
            bs, bt = sched.cache.block_size, self._block_tables
            n = len(running)
            if sched.rows_dirty:
                for i, r in enumerate(running):
                    bt[i, :len(r.table)] = torch.tensor(r.table, dtype=torch.int32)
                sched.rows_dirty = False
            greedy = all(r.params.greedy_only for r in running)
            drafts = self._drafts(running) if self.speculative is not None else None
            if drafts is not None:
                self._verify(running, drafts, greedy, touched)
                return list(touched.values())
            # The last token of each request goes in at position length - 1.
            meta = []
            for r in running:
                pos = r.length - 1
                meta.append((r.out[-1], pos, pos + 1, r.table[pos // bs] * bs + pos % bs))
            tok_ids, positions, ctx, slots = torch.tensor(meta, dtype=torch.int32).t().contiguous()
            steps = self._decode_steps(running, greedy, max_decode_steps)
            if steps > 1:
                # The steps stop early once every request has produced one of its EOS ids.
                stop = set().union(*(r.eos for r in running))
                rows = [[(t, None) for t in toks] for toks in runner.decode_greedy(steps, tok_ids, positions, bt[:n],
                                                                                    ctx, slots, stop)]
            else:
                logits, toks = runner.decode(tok_ids, positions, bt[:n], ctx, slots, greedy)
                rows = [[(t, None) for t in toks] if toks is not None else self._sample(logits, running)]
            batch = list(running)
            for row in rows:
                for r, (t, lp) in zip(batch, row):
                    if r.finished:
                        continue
                    touched[id(r)] = r
                    if self._emit(r, t, lp):
                        sched.finish(r, r.reason)
        return list(touched.values())

    # ---- speculative decoding (atb.engine.speculative) ---------------------------------------------------
    def _drafts(self, running: list[Request]) -> list[list[int]] | None:
        """Each running request's draft tokens for this step, trimmed to the step's row budget and to what the
        request may still generate; None when no request has one (the step is then a plain decode step).
        Under tensor parallelism only batches of greedy requests speculate: a sampled token (an acceptance, or
        a draw) is random, every rank must take the same one, and only the plain step broadcasts rank 0's."""
        cfg, sched = self.speculative, self.scheduler
        spare = cfg.max_step_rows - len(running)   # the runner's buffers were sized for it
        if spare <= 0 or (self.runner.tp is not None and not all(r.params.greedy_only for r in running)):
            return None
        drafts = []
        for r in running:
            # Accepting k drafts emits k + 1 tokens: at most what max_new_tokens and max_seq_len leave.
            k = min(cfg.num_speculative_tokens, spare, r.params.max_new_tokens - len(r.out) - 1,
                    sched.max_seq_len - r.length - 1)
            if k <= 0:
                drafts.append([])
                continue
            if r.drafter is None:
                r.drafter = NgramDrafter(r.prompt, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            d = r.drafter.propose(r.out, k, self._lookup_history)
            spare -= len(d)
            drafts.append(d)
        return drafts if any(drafts) else None

    def _verify(self, running: list[Request], drafts: list[list[int]], greedy: bool, touched: dict) -> None:
        """One decode step over every request's last token and its drafts (a row each, at consecutive positions:
        ``q_lens``, so each row attends causally to the rows before it and the request's K/V is read once for
        all of them); emits each request's accepted drafts and the token of the row after them (its first
        rejected row's, or its last row's)."""
        bs = self.scheduler.cache.block_size
        batch = list(running)   # finishing a request removes it from the scheduler's list
        meta = []
        for r, d in zip(batch, drafts):
            start = r.length - 1
            for j, t in enumerate([r.out[-1]] + d):
                pos = start + j
                meta.append((t, pos, r.table[pos // bs] * bs + pos % bs))
        tok_ids, positions, slots = torch.tensor(meta, dtype=torch.int32).t().contiguous()
        q_lens = torch.tensor([1 + len(d) for d in drafts], dtype=torch.int32)
        ctx = torch.tensor([r.length for r in batch], dtype=torch.int32) + q_lens - 1
        logits, toks = self.runner.decode(tok_ids, positions, self._block_tables[:len(batch)], ctx, slots, greedy,
                                          q_lens)
        self._spec_steps += 1
        row = 0
        for r, d in zip(batch, drafts):
            rows = slice(row, row + len(d) + 1)
            row = rows.stop
            touched[id(r)] = r
            if r.params.greedy_only:
                with serial_torch_ops():
                    picked = toks[rows] if toks is not None else logits[rows].float().argmax(-1).tolist()
                ok = 0
                while ok < len(d) and picked[ok] == d[ok]:
                    ok += 1
                for i, t in enumerate(picked[:ok + 1]):
                    if self._emit(r, t):
                        self.scheduler.finish(r, r.reason)
                        ok = min(ok, i + 1)
                        break
            else:
                ok = self._verify_rows(r, d, logits[rows])
            self._spec_drafted += len(d)
            self._spec_accepted += ok
            if d:
                r.drafter.accepted(len(d), ok)

    def _verify_rows(self, req: Request, draft: list[int], logits: torch.Tensor) -> int:
        """A request that does not decode greedily (sampling, penalties, logprobs, a grammar, min_tokens): row by
        row, each shaped from the request's state after the tokens before it, the draft token accepted or
        replaced (`verify_draft`) and emitted, until a replacement or the request's end; the drafts accepted."""
        accepted = 0
        want_lp = req.params.logprobs
        with serial_torch_ops():
            for j in range(len(draft) + 1):
                row = logits[j].float()
                t, ok = verify_draft(row, req, draft[j] if j < len(draft) else None)
                accepted += ok
                lp = None if want_lp is None else token_logprobs(row.unsqueeze(0), [t], [want_lp])[0]
                if self._emit(req, t, lp):
                    self.scheduler.finish(req, req.reason)
                    break
                if not ok:
                    break
        return accepted

    def _prefill(self, chunks: list[tuple[Request, int, int]]) -> torch.Tensor:
        """Prefills prompt chunks ``(request, start, end)`` into their blocks; logits of each chunk's last token.

        A chunk computes prompt tokens ``[start, end)`` and attends to its whole context ``[0, end)`` through
        the paged cache: the cached prefix (prefix caching) and the earlier chunks (chunked prefill) are read
        there. A prompt cached entirely (whole blocks) recomputes its last token for the logits but does not
        write its K/V: that slot is in a shared block, which holds it already. A request that scores its prompt
        also gets the logits of every row of its chunk (through the routing policy's LM head: those rows pick
        no token), turned into its prompt tokens' TokenLogprobs here.
        """
        cache = self.scheduler.cache
        reqs = [r for r, _, _ in chunks]
        starts = [a for _, a, _ in chunks]
        lens = [n for _, _, n in chunks]
        tokens = torch.tensor([t for r, a, n in chunks for t in r.prompt[a:n]], dtype=torch.int32)
        positions = torch.cat([torch.arange(a, n, dtype=torch.int32) for _, a, n in chunks])
        slots = cache.slot_mapping(reqs, starts, lens)
        q_lens = torch.tensor([n - a for _, a, n in chunks], dtype=torch.int32)
        ends = q_lens.cumsum(0)
        for (r, _, n), e in zip(chunks, ends.tolist()):
            if r.cached == n:
                slots[e - 1] = -1
        paged = (cache.block_tables(reqs), torch.tensor(lens, dtype=torch.int32), q_lens)
        last = (ends - 1).long()
        # Every row of a chunk whose request scores its prompt (its last row is in both sets: that one picks
        # the next token, computed as for any other request).
        scored = [range(e - (n - a), e) for (r, a, n), e in zip(chunks, ends.tolist()) if r.scores_prompt]
        if not scored:
            return self.runner.prefill(tokens, positions, None, slots, last, paged=paged)
        logits, score_logits = self.runner.prefill(tokens, positions, None, slots, last, paged=paged,
                                                   score=torch.tensor([i for rows in scored for i in rows]))
        first = 0
        for r, a, n in chunks:
            if r.scores_prompt:
                self._score_prompt(r, score_logits[first:first + n - a], a, n)
                first += n - a
        return logits

    # Rows of logits turned into float32 log-probabilities at a time (a long prompt's would take GBs at once).
    _SCORE_ROWS = 256

    def _score_prompt(self, req: Request, logits: torch.Tensor, start: int, end: int) -> None:
        """Appends the TokenLogprobs of the prompt tokens that rows ``[start, end)`` predict (``start + 1`` up to
        ``end``, the last one only if the prompt goes on) to ``req.prompt_lps``."""
        targets = req.prompt[start + 1:end + 1]
        k = req.params.prompt_logprobs
        for i in range(0, len(targets), self._SCORE_ROWS):
            part = targets[i:i + self._SCORE_ROWS]
            req.prompt_lps += token_logprobs(logits[i:i + len(part)].float(), part, [k] * len(part))
