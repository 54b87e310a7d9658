"""Incremental detokenization of a token stream.

Decoding each message's tokens on their own breaks multi-byte characters split across
tokens and drops the word-boundary spaces that SentencePiece-style tokenizers encode in
the token itself. Instead each delta is computed over a window that starts where the
previous emission started: the new text is what the window decodes to beyond what its
already-emitted part decodes to. Text ending in an incomplete character (U+FFFD) is held
back until it completes, so a window never starts inside a character (byte-fallback
decoders turn a whole byte run into U+FFFD if it starts mid-character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_INCOMPLETE = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids as they arrive; the concatenated deltas equal the decode of all ids
    (once the stream is final, pending text is flushed even if incomplete)."""

    def __init__(self, tokenizer: TokenDecoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_start = 0  # window start: where the previous emission began
        self.emitted_end = 0  # tokens whose text has been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly completed text (may be empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_start : self.emitted_end])
        full = self._decode(self.ids[self.prefix_start :])
        complete = not full.endswith(_INCOMPLETE) and full.startswith(prefix)
        if not final and (not complete or len(full) <= len(prefix)):
            return ""
        delta = full[len(prefix) :]
        self.prefix_start, self.emitted_end = self.emitted_end, len(self.ids)
        return delta


class TextStream:
    """A request's text as its tokens arrive, cut at the first of its ``stop`` strings.

    ``push`` returns the text that is final now. While stop strings are set, the last
    ``len(longest) - 1`` characters are held back (a stop string could begin there), as vLLM does;
    ``final`` releases them. Once a stop string shows up, the text ends before it and
    ``stopped`` is set: the caller ends the request (finish reason "stop").
    """

    def __init__(self, tokenizer: TokenDecoder, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.stopped: str | None = None  # the stop string that ended the text

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        if self.stopped is not None:
            return ""
        self.pending += self.detok.push(token_ids, final=final)
        hits = [(i, s) for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            cut, self.stopped = min(hits)
            out, self.pending = self.pending[:cut], ""
            return out
        keep = 0 if final else min(self.hold, len(self.pending))
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out
