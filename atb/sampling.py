"""Token selection for TransformerInfer: greedy and sampling with HF semantics.

The order of operations is HF ``generate``'s: repetition penalty on the raw
logits (over every token already in the sequence, prompt included), then
temperature, top-k, top-p, softmax, multinomial draw. Each sequence draws from
its own ``torch.Generator`` seeded from (seed, sequence index), so a sequence's
tokens do not depend on which other sequences happen to share its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK_SEED = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive indices over the seed space


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {type(self.do_sample).__name__}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite number > 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0 or r == float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")

    @property
    def greedy_only(self) -> bool:
        """Plain argmax over the logits, nothing else to apply."""
        return not self.do_sample and self.repetition_penalty == 1.0


def sequence_generator(seed: int, index: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed + index * _GOLDEN) & _MASK_SEED)
    return g


def apply_repetition_penalty(logits: torch.Tensor, seen: list[torch.Tensor], penalty: float) -> None:
    """In place, HF semantics: a seen token's logit is divided by the penalty if positive, multiplied if negative."""
    for row, ids in zip(logits, seen):
        score = row.gather(0, ids)
        row.scatter_(0, ids, torch.where(score < 0, score * penalty, score / penalty))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (HF order); removed tokens get -inf."""
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
    return logits


def select(logits: torch.Tensor, params: SamplingParams, seen: list[torch.Tensor] | None = None,
           generators: list[torch.Generator] | None = None) -> list[int]:
    """One token per row of float32 ``logits [batch, vocab]``."""
    if params.greedy_only:
        return logits.argmax(-1).tolist()
    if params.repetition_penalty != 1.0:
        logits = logits.clone()
        apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if not params.do_sample:
        return logits.argmax(-1).tolist()
    probs = warp(logits, params).softmax(-1)
    return [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, generators)]
