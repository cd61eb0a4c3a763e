"""Speculative decoding by prompt lookup: n-gram drafts, verified in one decode step.

A decode step reads every weight once whatever its row count, and at small
batches it is bound by those bytes: on a 2-core Zen 3, SmolLM2's bf16 graph
step over 4 rows takes 1.05-1.15x the time of 1 row. So a request whose next
tokens can be guessed gets several of them for about the price of one step.
The guess here is prompt lookup (llama.cpp's lookup decoding, vLLM's
``ngram`` method, HF's ``prompt_lookup_num_tokens``): the sequence's last n
tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked
up in the sequence itself, and the tokens that followed their most recent
earlier occurrence are the draft. Text that copies from its context (edits,
extraction, quoting, code, structured data, repetition loops) drafts well;
free prose rarely matches, and then no draft is made and the step is a plain
decode step.

Verification (`atb.engine.engine.Engine`) runs the request's last token and its
k draft tokens as k + 1 rows of an ordinary decode step: row j sits at position
``length - 1 + j`` with context ``length + j``, so paged attention gives it
exactly the causal attention of a one-token step there, and every layer writes
all rows' K/V before any row attends. Row j's logits give the token after draft
j. A greedy request accepts drafts while they equal the argmax, and the first
row that disagrees contributes its own token; its tokens are those of plain
greedy decoding (bit for bit while the step's row count stays within one
kernel choice of the routing policy: rows are computed by the same kernels as
a decode step of that many rows). Any other request (sampling, penalties,
logprobs, a grammar) verifies row by row, each row shaped by its state after
the tokens before it; a sampled draft is accepted with probability p(draft)
and otherwise replaced by a draw from p without it (`atb.engine.sampling.
verify_draft`), so its tokens follow plain sampling's distribution, though
not its seeded draws. The K/V a rejected draft wrote lies past the sequence's
end and is overwritten by the next step before anything reads it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine speculates (``TransformerInfer(speculative_config=...)``; a dict of these fields works too).

    num_speculative_tokens: draft tokens verified per request and step (k; the step computes k + 1 rows).
    prompt_lookup_max / prompt_lookup_min: the longest / shortest n-gram looked up (longest first).
    max_step_rows: rows a verification step may compute over the whole batch; drafts are trimmed, first come
        first served, to fit (each running request keeps its one row). At larger batches a step is bound by
        arithmetic rather than by the weight bytes, and extra rows stop being nearly free.
    lookup_history: finished requests (prompt and output) kept and looked up too, most recent first, when a
        request's own tokens give no draft (0: off). Requests of one shape (the same JSON schema, form or code
        skeleton with other contents) then draft each other's structure (`LookupHistory`).
    """

    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 8
    prompt_lookup_min: int = 2
    max_step_rows: int = 8
    method: str = "ngram"
    lookup_history: int = 0

    def __post_init__(self):
        op = "speculative_config"
        if self.method != "ngram":
            raise ValueError(f"{op}: method must be 'ngram' (prompt lookup), got {self.method!r}")
        for f in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_step_rows"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{op}: {f} must be an int >= 1, got {v!r}")
        v = self.lookup_history
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{op}: lookup_history must be an int >= 0 (finished requests kept), got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{op}: prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.max_step_rows < 2:
            raise ValueError(f"{op}: max_step_rows must be >= 2 (a request's row and one draft), got "
                             f"{self.max_step_rows}")

    @classmethod
    def resolve(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or a dict of its fields (vLLM's ``speculative_config`` keys)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
            return cls(**value)
        raise TypeError(f"speculative_config must be a dict, an atb.engine.SpeculativeConfig or None, got "
                        f"{type(value).__name__}")


class NgramDrafter:
    """One request's prompt-lookup index: for each n, the end position of each n-gram's most recent occurrence.

    The sequence's n-grams are indexed incrementally as tokens arrive (each token once per n), so a lookup
    costs one dict probe per n however long the sequence is."""

    __slots__ = ("lo", "hi", "tokens", "prompt_len", "_last_end", "_indexed", "_wait", "_backoff")

    # A draft rejected outright costs its rows for nothing; after one, the request does not draft for
    # 1, 2, 4, ... steps (up to this many), until a draft is accepted.
    MAX_BACKOFF = 16

    def __init__(self, prompt: list[int], lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.tokens = list(prompt)     # prompt + the generated tokens seen so far
        self.prompt_len = len(prompt)
        self._last_end: list[dict] = [{} for _ in range(hi - lo + 1)]
        self._indexed = 0      # n-grams ending before this position are in the index
        self._wait = 0         # steps to go before the next draft
        self._backoff = 0      # the pause after the next draft rejected outright

    def accepted(self, drafted: int, accepted: int) -> None:
        """Feedback from verification: ``accepted`` of the ``drafted`` tokens were right."""
        if accepted:
            self._backoff = 0
        elif drafted:
            self._backoff = min(self.MAX_BACKOFF, max(1, 2 * self._backoff))
            self._wait = self._backoff

    def propose(self, out: list[int], k: int, history: LookupHistory | None = None) -> list[int]:
        """Up to ``k`` draft tokens to follow ``prompt + out`` (``out`` only grows between calls), from the
        request's own tokens, else from ``history``; none while backing off after a rejected draft."""
        if self._wait:
            self._wait -= 1
            return []
        seq = self.tokens
        seq += out[len(seq) - self.prompt_len:]
        end = len(seq) - 1
        # Index the n-grams that end before the last token: the suffix itself must not match itself.
        for e in range(self._indexed, end):
            for n, table in zip(range(self.lo, self.hi + 1), self._last_end):
                if e + 1 >= n:
                    table[tuple(seq[e + 1 - n:e + 1])] = e
        self._indexed = end
        for n in range(min(self.hi, len(seq)), self.lo - 1, -1):
            e = self._last_end[n - self.lo].get(tuple(seq[len(seq) - n:]))
            if e is not None:
                # Copy what followed, continuing into the copy itself: a loop of period p < k drafts k tokens.
                draft = []
                src = seq[e + 1:]
                for j in range(k):
                    draft.append(src[j] if j < len(src) else draft[j - len(src)])
                return draft
        return history.draft(seq, k) if history is not None else []


class LookupHistory:
    """Finished requests' tokens, for drafting across requests (``SpeculativeConfig.lookup_history``).

    Requests of one shape repeat each other's structure, not their own: the second JSON record of a schema
    finds its keys, quotes and braces in the first one's output, where prompt lookup finds nothing. Each n-gram
    (n from ``lo`` to ``hi``) maps to its most recent occurrence among the kept requests, keyed by its hash (a
    collision only costs a rejected draft: verification decides what is emitted). The oldest request is
    dropped past ``max_requests``; entries that point into it are skipped at lookup and cleared when they
    outnumber the live ones."""

    def __init__(self, max_requests: int, lo: int, hi: int):
        self.max_requests, self.lo, self.hi = max_requests, lo, hi
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()
        self._tables: list[dict[int, tuple[int, int]]] = [{} for _ in range(hi - lo + 1)]
        self._next_id = 0
        self._kept_tokens = 0  # sum of the kept requests' lengths, for the stale-entry check

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, tokens: list[int]) -> None:
        """Keeps a finished request's prompt + output (the most recent occurrence of each n-gram wins)."""
        if len(tokens) <= self.lo:
            return
        sid, self._next_id = self._next_id, self._next_id + 1
        self._seqs[sid] = list(tokens)
        self._kept_tokens += len(tokens)
        self._index(sid, self._seqs[sid])
        while len(self._seqs) > self.max_requests:
            self._kept_tokens -= len(self._seqs.popitem(last=False)[1])
        live = self._kept_tokens * len(self._tables)
        if sum(len(t) for t in self._tables) > 2 * live:  # mostly stale: rebuild from the kept requests
            for table in self._tables:
                table.clear()
            for sid, seq in self._seqs.items():
                self._index(sid, seq)

    def _index(self, sid: int, seq: list[int]) -> None:
        for n, table in zip(range(self.lo, self.hi + 1), self._tables):
            for e in range(n - 1, len(seq) - 1):  # n-grams with a token after them
                table[hash(tuple(seq[e + 1 - n:e + 1]))] = (sid, e)

    def draft(self, seq: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of ``seq`` found in a kept request."""
        for n in range(min(self.hi, len(seq)), self.lo - 1, -1):
            hit = self._tables[n - self.lo].get(hash(tuple(seq[len(seq) - n:])))
            if hit is not None and hit[0] in self._seqs:
                return self._seqs[hit[0]][hit[1] + 1:hit[1] + 1 + k]
        return []
