"""Structured output: a request's tokens constrained to a JSON schema or a regular expression.

Each step, a request with a constraint gets a mask of the tokens its grammar
allows next (every token that keeps the text a prefix of some valid output),
and every other logit becomes -inf before selection: greedy picks the most
likely allowed token, sampling draws among the allowed ones. The grammar work
(JSON schema -> grammar, the token trie walk for each mask) is llguidance's, the
Rust library vLLM and llama.cpp use for the same job: an optional dependency
(``pip install "atb[structured]"``), imported only when a request asks for it.

When the grammar accepts nothing more than the end of the text (a JSON value
closed), the request finishes with reason ``"grammar"``; no EOS is generated.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from atb.engine.params import SamplingParams

_BITS = torch.arange(32, dtype=torch.int32)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ImportError("structured output (json_schema / regex) needs llguidance: pip install "
                          "\"atb[structured]\" (or pip install llguidance)") from None
    return llguidance


def grammar_source(params: SamplingParams) -> tuple[str, str] | None:
    """``(field, llguidance grammar)`` of a request's constraint; None without one."""
    if params.json_schema is not None:
        return "json_schema", _llguidance().LLMatcher.grammar_from_json_schema(json.loads(params.json_schema))
    if params.regex is not None:
        return "regex", _llguidance().LLMatcher.grammar_from_regex(params.regex)
    if params.grammar is not None:
        return "grammar", _llguidance().LLMatcher.grammar_from_lark(params.grammar)
    return None


class Grammars:
    """One engine's grammar compiler: the tokenizer's vocabulary as llguidance sees it (built once, ~0.4 s for
    a 49k vocabulary), and a `TokenConstraint` per constrained request.

    Compiled grammars are kept (the last ``CACHED`` distinct ones): a request repeating a schema (a server's
    clients send the same tool or response schema again and again, and the server checks each request's
    grammar before the engine adds it) gets a copy of the compiled matcher instead of compiling it anew."""

    CACHED = 64

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        llg = _llguidance()
        try:
            self._tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        except ValueError as e:
            raise ValueError(f"structured output: {e} (got {type(tokenizer).__name__})") from None
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, object] = OrderedDict()   # grammar -> a matcher in its start state
        self._lock = threading.Lock()   # the server's event loop and the engine thread both ask

    def constraint(self, params: SamplingParams, op: str = "add_request") -> TokenConstraint | None:
        """The request's constraint, or None if it has none; a grammar llguidance rejects is a ValueError naming
        the field."""
        src = grammar_source(params)
        if src is None:
            return None
        field, grammar = src
        with self._lock:
            start = self._compiled.get(grammar)
            if start is not None:
                self._compiled.move_to_end(grammar)
                return TokenConstraint(start.deep_copy(), self.vocab_size)
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"{op}: sampling_params.{field} is not a usable grammar: {error}")
        start = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        with self._lock:
            self._compiled[grammar] = start
            while len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
            return TokenConstraint(start.deep_copy(), self.vocab_size)


class TokenConstraint:
    """One request's grammar state: which tokens may come next, and the tokens it produced so far."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab = vocab_size
        self._bits = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """A bool mask over the vocabulary: True where the grammar allows the token next."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        return ((self._bits.unsqueeze(1) >> _BITS) & 1).bool().view(-1)[:self._vocab]

    def accept(self, token: int) -> bool:
        """Advances past ``token``; False if the grammar did not allow it (the state is then an error)."""
        return self._matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """Nothing but the end of the text may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()
