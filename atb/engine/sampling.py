"""Token selection: greedy and sampling with HF semantics, per request.

The order of operations: OpenAI's logit bias, then HF ``generate``'s order:
repetition penalty (over every token already in the sequence, prompt included), then
OpenAI's presence and frequency penalties (over the generated tokens), then
temperature, top-k, top-p, min-p, softmax, multinomial draw. Each request has its own
parameters and draws from its own ``torch.Generator``, so its tokens do not
depend on which other requests happen to share its batch.
"""
from __future__ import annotations

import torch

from atb.engine.params import SamplingParams, TokenLogprob

_MASK_SEED = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive indices over the seed space


def request_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th of several requests sharing one user seed (``generate(seed=...)``)."""
    return (seed + index * _GOLDEN) & _MASK_SEED


def generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed & _MASK_SEED)
    return g


def apply_repetition_penalty(logits: torch.Tensor, seen: list[torch.Tensor], penalty: float) -> None:
    """In place, HF semantics: a seen token's logit is divided by the penalty if positive, multiplied if negative."""
    for row, ids in zip(logits, seen):
        score = row.gather(0, ids)
        row.scatter_(0, ids, torch.where(score < 0, score * penalty, score / penalty))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p (HF order); removed tokens get -inf."""
    if params.temperature != 1.0:
        logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # Drop the least likely tokens whose total probability is at most
        # 1 - top_p; the most likely token always survives.
        ascending, order = torch.sort(logits, dim=-1)
        cum = ascending.softmax(-1).cumsum(-1)
        drop = cum <= 1 - params.top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if params.min_p > 0:
        # Below min_p times the most likely token's probability; that token itself always survives.
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def apply_presence_frequency(row: torch.Tensor, generated: list[int], presence: float, frequency: float) -> None:
    """In place, OpenAI semantics: each token generated ``n`` times loses ``presence + frequency * n``."""
    if not generated:
        return
    ids, counts = torch.tensor(generated, dtype=torch.int64).unique(return_counts=True)
    row.index_add_(0, ids, -(presence + frequency * counts.to(row.dtype)))


def logit_bias_tensors(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``params.logit_bias`` as (token ids, biases), built once per request; None without a bias."""
    if not params.logit_bias:
        return None
    ids, bias = zip(*params.logit_bias)
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(bias, dtype=torch.float32)


def select(logits: torch.Tensor, reqs: list) -> list[int]:
    """One token per row of float32 ``logits [batch, vocab]``, row i for ``reqs[i]``: its ``params``, ``seen``
    (token ids for the repetition penalty, or None), ``gen`` (its generator), ``out`` (the tokens generated
    so far, for the presence and frequency penalties), ``bias`` (`logit_bias_tensors`) and ``constraint``
    (its `atb.engine.structured.TokenConstraint`, or None); ``eos`` (its EOS ids, held off before
    ``params.min_tokens``)."""
    if all(r.params.greedy_only for r in reqs):
        return logits.argmax(-1).tolist()
    return [_select_one(row, r) for row, r in zip(logits, reqs)]


def _select_one(row: torch.Tensor, req) -> int:
    return verify_draft(row, req, None)[0]   # with no draft: the row's own pick


def verify_draft(row: torch.Tensor, req, draft: int | None) -> tuple[int, bool]:
    """Speculative decoding's choice at one verification row: ``(draft, True)`` when the draft token is
    accepted, else ``(the row's own token, False)``.

    Greedy: the draft is accepted when it is the argmax. Sampling (Leviathan et al.'s rule for a draft
    distribution that puts all its mass on ``draft``): accepted with probability p(draft), else a token is
    drawn from p with ``draft`` removed, so the token emitted is distributed exactly as p whatever was
    drafted. ``draft`` None (the row after the last draft): the row's own pick. p is the row as sampling
    shapes it from the request's state, so callers emit each token before verifying the next row."""
    row = _shaped(row, req)
    if not req.params.do_sample:
        t = int(row.argmax())
        return t, t == draft
    probs = warp(row.unsqueeze(0), req.params).softmax(-1)[0]
    if draft is not None:
        if float(torch.rand((), generator=req.gen, dtype=torch.float64)) < float(probs[draft]):
            return draft, True
        probs[draft] = 0.0
    return draw(probs, req.gen), False


def _shaped(row: torch.Tensor, req) -> torch.Tensor:
    """The float32 logits of one row after the request's EOS hold (min_tokens), grammar mask, logit bias and
    penalties (a copy when any of them applies)."""
    params = req.params
    hold_eos = len(req.out) < params.min_tokens and req.eos
    if params.penalized or req.constraint is not None or hold_eos:
        row = row.clone()
    if hold_eos:
        row[[t for t in req.eos if t < row.numel()]] = float("-inf")
    if req.constraint is not None:
        # Tokens the grammar does not allow next are out before anything else reshapes the logits.
        row.masked_fill_(~req.constraint.allowed(), float("-inf"))
    if req.bias is not None:
        row.index_add_(0, *req.bias)
    if params.repetition_penalty != 1.0:
        apply_repetition_penalty(row.unsqueeze(0), [req.seen], params.repetition_penalty)
    if params.presence_penalty != 0 or params.frequency_penalty != 0:
        apply_presence_frequency(row, req.out, params.presence_penalty, params.frequency_penalty)
    return row


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token drawn from ``probs`` by inverting their float64 CDF at one uniform from ``gen``: the
    distribution of torch.multinomial at a fraction of its cost over a vocabulary (49k categories on one
    thread: ~1.3 ms -> ~0.09 ms). Tokens of probability 0 are never drawn (the first CDF entry above the
    point is taken)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=gen, dtype=torch.float64)
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if i >= probs.numel():   # u * total rounded up to the total: the last token that can be drawn
        i = int(probs.nonzero()[-1])
    return i


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row i's ``tokens[i]`` and its ``ks[i]`` most likely alternatives as log-probabilities under the model:
    the log-softmax of the raw float32 ``logits [batch, vocab]`` (what sampling then reshapes is not in it)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.int64).unsqueeze(1))[:, 0].tolist()
    out = []
    for i, (t, k) in enumerate(zip(tokens, ks)):
        top = ()
        if k > 0:
            v, ix = logp[i].topk(k)
            top = tuple(zip(ix.tolist(), v.tolist()))
        out.append(TokenLogprob(t, chosen[i], top))
    return out
