"""What a request asks for (`SamplingParams`) and what a step reports about it (`RequestOutput`)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


# The most alternatives a request may ask for per generated token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# OpenAI's ranges for presence_penalty / frequency_penalty and for logit_bias values.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model (log-softmax of the raw logits, before the
    repetition penalty, temperature, top-k and top-p reshape them for sampling), and the ``top`` most likely
    tokens at that step as ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, HF ``generate`` semantics; validated on construction.

    ``eos_token_id`` None means the model's default (its generation config); ``ignore_eos`` generates
    through EOS tokens. ``min_p`` (HF's MinP, after ``top_p``; 0 disables it) keeps the tokens whose
    probability is at least ``min_p`` times the most likely one's. ``seed`` seeds this request's own generator (None: drawn from torch's global RNG
    when the request is added), so its draws do not depend on its batch mates. ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, in [-2, 2]) subtract ``presence + frequency * count`` from the logit
    of every token generated so far (``count`` times; the prompt's tokens are not counted, as in vLLM),
    after the repetition penalty and before temperature. ``logit_bias``: ``(token_id, bias)`` pairs (a dict
    is taken too) added to those tokens' logits first of all, bias in [-100, 100]. ``logprobs`` k (0 to
    ``MAX_LOGPROBS``) reports each generated token's `TokenLogprob` with the k most likely tokens beside it
    (None: not computed). ``prompt_logprobs`` k (same range; vLLM's name) scores the prompt: every prompt
    token's `TokenLogprob` given the tokens before it, with k alternatives. Such a request computes its whole
    prompt (it does not read the prefix cache, whose tokens have no logits), and may ask for
    ``max_new_tokens=0``: it is prefilled, scored and finished with no token generated. ``json_schema`` (a
    JSON schema, as a dict or its JSON text), ``regex`` or ``grammar`` (a context-free grammar in
    llguidance's Lark syntax, its start rule ``start``) constrains the output to text the schema, the
    expression or the grammar accepts (`atb.engine.structured`; the engine needs a tokenizer); such a
    request finishes with reason ``"grammar"`` once the output is complete. ``min_tokens`` (vLLM's): the EOS tokens are not
    generated before that many tokens are.
    """

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    eos_token_id: int | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    json_schema: str | None = None
    regex: str | None = None
    min_tokens: int = 0
    grammar: str | None = None

    def __post_init__(self):
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"SamplingParams: max_new_tokens must be an int >= 0, got {n!r}")
        for name in ("do_sample", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams: {name} must be a bool, got {type(getattr(self, name)).__name__}")
        t = self.temperature
        if not _number(t) or not t > 0 or t == float("inf"):
            raise ValueError(f"SamplingParams: temperature must be a finite number > 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not _number(p) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {p!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams: min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        r = self.repetition_penalty
        if not _number(r) or not r > 0 or r == float("inf"):
            raise ValueError(f"SamplingParams: repetition_penalty must be a finite number > 0, got {r!r}")
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
            object.__setattr__(self, "logit_bias", bias)
        if not isinstance(bias, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                and p[0] >= 0 and _number(p[1]) and -MAX_LOGIT_BIAS <= p[1] <= MAX_LOGIT_BIAS for p in bias):
            raise ValueError(f"SamplingParams: logit_bias must map token ids >= 0 to numbers in "
                             f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {self.logit_bias!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"SamplingParams: {name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                 f"got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"SamplingParams: seed must be an int or None, got {type(self.seed).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"SamplingParams: {name} must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}")
        schema = self.json_schema
        if isinstance(schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(schema))
        elif schema is not None:
            try:
                parsed = json.loads(schema) if isinstance(schema, str) else None
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ValueError(f"SamplingParams: json_schema must be a JSON schema (a dict or the JSON text of "
                                 f"an object), got {schema!r:.80}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"SamplingParams: {name} must be a str or None, got {type(v).__name__}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= max(n, 0):
            raise ValueError(f"SamplingParams: min_tokens must be an int in [0, max_new_tokens={n}], got {m!r}")
        given = [f for f in ("json_schema", "regex", "grammar") if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"SamplingParams: {' and '.join(given)} are exclusive; give one")
        e = self.eos_token_id
        if e is not None:
            ok = (isinstance(e, int) and not isinstance(e, bool)) or (
                isinstance(e, Sequence) and not isinstance(e, (str, bytes))
                and all(isinstance(t, int) and not isinstance(t, bool) for t in e))
            if not ok:
                raise TypeError(f"SamplingParams: eos_token_id must be an int, a list of ints or None, got {e!r}")

    @property
    def penalized(self) -> bool:
        """Logits are changed before selection (logit bias; repetition, presence or frequency penalty)."""
        return (bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    @property
    def constrained(self) -> bool:
        """The output must follow a grammar (``json_schema``, ``regex`` or ``grammar``)."""
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def greedy_only(self) -> bool:
        """Plain argmax over the logits, nothing else to apply or report."""
        return (not self.do_sample and not self.penalized and self.logprobs is None and not self.constrained
                and self.min_tokens == 0)


FINISH_REASONS = ("eos", "grammar", "length", "max_seq_len", "abort")


@dataclass
class RequestOutput:
    """One request's progress after a step: the tokens it produced in that step and all so far.

    ``finish_reason``: ``"eos"`` (an EOS token was produced; it is included), ``"grammar"`` (a structured
    output is complete: its grammar allows nothing more), ``"length"``
    (``max_new_tokens`` reached), ``"max_seq_len"`` (prompt + output reached the engine's ``max_seq_len``),
    ``"abort"``; None while running. When several hold at once the first in that order is reported.
    ``new_logprobs`` / ``output_logprobs``: one `TokenLogprob` per token of ``new_token_ids`` /
    ``output_token_ids`` when the request asked for ``logprobs``, else None. ``prompt_logprobs``: when the
    request asked for them, from the output that follows its prompt's prefill on, one entry per prompt token,
    the first None (nothing predicts it); else None.
    """

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    output_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
