"""Perplexity of a model over a text: the usual check of what a dtype or a quantized format costs in quality.

The text's tokens are cut into windows of ``context`` tokens that start ``stride`` tokens apart (HF's strided
evaluation). Each token is scored once, by the first window that holds it past that window's first token,
so with ``stride < context`` every scored token but those of the first window sees at least
``context - stride`` tokens before it; with ``stride == context`` the windows are disjoint and the first token
of each goes unscored. Every window is one engine request scoring its prompt
(``SamplingParams(prompt_logprobs=0, max_new_tokens=0)``), all queued at once, so the engine prefills as many
together as its batch and prefill budget allow.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atb.engine import SamplingParams


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float        # nats per scored token
    tokens: int            # tokens scored
    windows: int
    context: int
    stride: int
    seconds: float

    def __str__(self) -> str:
        return (f"perplexity {self.perplexity:.4f} (mean NLL {self.mean_nll:.4f} nats) over {self.tokens} tokens: "
                f"{self.windows} windows of {self.context} tokens, stride {self.stride}; "
                f"{self.seconds:.2f} s, {self.tokens / self.seconds:.0f} scored tok/s")


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` of each window over ``n`` tokens: it holds tokens ``[begin, end)`` and
    scores ``[first_scored, end)``."""
    out, scored_to = [], 1   # token 0 has nothing before it
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        first = max(scored_to, begin + 1)
        if first < end:
            out.append((begin, end, first))
            scored_to = end
        if end == n:
            break
    return out


def perplexity(infer, token_ids: list[int], *, context: int | None = None, stride: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of ``infer``'s model (a ``TransformerInfer``) over ``token_ids``.

    ``context`` defaults to ``infer.max_seq_len``, ``stride`` to half of it. ``progress(done, total)`` is called
    as windows finish.
    """
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.reshape(-1).tolist()
    token_ids = list(token_ids)   # each window is checked as a prompt (ids, vocabulary) when it is queued
    if len(token_ids) < 2:
        raise ValueError(f"perplexity: token_ids needs at least 2 tokens to score one, got {len(token_ids)}")
    context = infer.max_seq_len if context is None else context
    if isinstance(context, bool) or not isinstance(context, int) or not 2 <= context <= infer.max_seq_len:
        raise ValueError(f"perplexity: context must be an int in [2, max_seq_len={infer.max_seq_len}], "
                         f"got {context!r}")
    stride = max(1, context // 2) if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= context:
        raise ValueError(f"perplexity: stride must be an int in [1, context={context}], got {stride!r}")
    spans = windows(len(token_ids), context, stride)
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=0)
    t0 = time.perf_counter()
    ids: dict[str, tuple[int, int, int]] = {}
    nll, scored, done = 0.0, 0, 0
    try:
        for b, e, f in spans:
            ids[infer.add_request(token_ids[b:e], params)] = (b, e, f)
        while infer.has_unfinished():
            for out in infer.step():
                if out.request_id not in ids or not out.finished:
                    continue
                b, e, f = ids.pop(out.request_id)
                lps = out.prompt_logprobs
                if out.finish_reason != "length" or lps is None:
                    raise RuntimeError(f"perplexity: window [{b}, {e}) ended with {out.finish_reason!r}")
                nll -= sum(lp.logprob for lp in lps[f - b:])
                scored += e - f
                done += 1
                if progress is not None:
                    progress(done, len(spans))
    finally:
        for rid in ids:   # an error (or an interrupt) leaves no window holding blocks
            infer.abort(rid)
        if ids:
            infer.step()  # reports the aborted windows, so no later step hands them to another caller
    mean = nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, len(spans), context, stride, time.perf_counter() - t0)
