"""Generated tokens to text, piece by piece, with stop strings applied mid-token.

A token does not always end on a character boundary (byte-level BPE splits
multi-byte UTF-8 characters; SentencePiece merges a leading space depending on
the token before), so text is decoded over a short window of recent tokens and
a piece is released only once it no longer ends in an incomplete character.
Stop strings are matched on that text, not on tokens: a stop string may end in
the middle of a token, and text that could still turn out to be the start of a
stop string is held back until the next token decides it.
"""
from __future__ import annotations

# Prompt tokens decoded ahead of the first generated token, so that the first
# piece is rendered as it would be in the middle of the text (vLLM uses 5).
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Text of the generated tokens, released as soon as it is final."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # window start: tokens before it are never decoded again
        self._read = len(self._ids)  # tokens up to here have had their text released

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _pending(self) -> str:
        done = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        return full[len(done):] if len(full) > len(done) else ""

    def push(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        piece = self._pending()
        if not piece or piece.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return piece

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete characters included."""
        piece = self._pending()
        self._prefix = self._read = len(self._ids)
        return piece


class StopStrings:
    """Cuts the text at the first stop string; holds back text that may be one's beginning."""

    def __init__(self, stops: list[str] | None):
        self.stops = list(stops or [])
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all text so far (cut at the stop string once found)
        self._sent = 0
        self._held_off = 0   # no stop string may end within text[:_held_off] (min_tokens)
        self.stopped = False

    def feed(self, piece: str, may_stop: bool = True) -> str:
        """Adds a piece of text; returns what can be sent now. Sets ``stopped`` when a stop string appears.
        ``may_stop=False`` (the tokens before ``min_tokens``, as vLLM holds them): no stop string may end in
        this piece; one that begins in it and ends in a later piece still stops the text."""
        if not self.stops:
            self.text += piece
            self._sent = len(self.text)
            return piece
        # A match not found before must end inside the new piece, so it starts at most longest-1 chars earlier.
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        if not may_stop:
            self._held_off = len(self.text)
        hits = [i for i in (self.text.find(s, max(start, self._held_off - len(s) + 1)) for s in self.stops)
                if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self.flush()
        hold = 0
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        upto = max(self._sent, len(self.text) - hold)
        out = self.text[self._sent:upto]
        self._sent = upto
        return out

    def flush(self) -> str:
        out = self.text[self._sent:]
        self._sent = len(self.text)
        return out
