"""Incremental detokenization of a token stream.

Decoding each message's tokens on their own breaks multi-byte characters split across
tokens and drops the word-boundary spaces that SentencePiece-style tokenizers encode in
the token itself. Instead each delta is computed over a window: the tokens of the previous
emission (their context) and the tokens since; the new text is what the window decodes to
beyond what its context decodes to. Text ending in an incomplete character (U+FFFD) is held
back until it completes, so a window never starts inside a character (byte-fallback
decoders turn a whole byte run into U+FFFD if it starts mid-character).

The window stays a few tokens long whatever the output, so each token costs the same: tokens
that add no text where they stand (special tokens skipped, an EOS a request ignores) leave it,
and text that still ends in U+FFFD after ``MAX_HELD`` tokens is a literal U+FFFD or bytes that
never complete (a character is at most 4 bytes, so at most 3 tokens can be waiting for the rest
of one): it is emitted up to the tokens that may still be starting a character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_INCOMPLETE = "\ufffd"
MAX_HELD = 8  # tokens held back while the text ends in U+FFFD, before it is taken as final
_MAX_CHAR_TOKENS = 3  # the tokens an incomplete character can end in (UTF-8: at most 3 of 4 bytes)


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids as they arrive; the concatenated deltas equal the decode of all ids
    (once the stream is final, pending text is flushed even if incomplete), but for tokens that
    decode to nothing where they stand, and a U+FFFD held ``MAX_HELD`` tokens, which is emitted
    as such. Each ``push`` decodes a window of O(its tokens + MAX_HELD) tokens, however long
    the stream."""

    def __init__(self, tokenizer: TokenDecoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self._window: list[int] = []  # the previous emission's tokens (the context), then the pending ones
        self._context = 0  # how many of the window's tokens were emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly completed text (may be empty)."""
        self._window.extend(token_ids)
        prefix = self._decode(self._window[: self._context])
        full = self._decode(self._window)
        if full == prefix:
            del self._window[self._context :]  # they add nothing here: no reason to decode them again
            return ""
        if final or (not full.endswith(_INCOMPLETE) and full.startswith(prefix)):
            return self._emit(len(self._window), prefix, full)
        if len(self._window) - self._context >= MAX_HELD:
            return self._emit_held(prefix)
        return ""

    def _emit(self, end: int, prefix: str, text: str) -> str:
        """Emit the window's tokens up to ``end``, which decode to ``text``; they become the context."""
        delta = text[len(prefix) :]
        del self._window[: self._context]
        self._context = end - self._context
        return delta

    def _emit_held(self, prefix: str) -> str:
        """The pending text has ended in U+FFFD for MAX_HELD tokens: emit it but for the last
        tokens, where a character may still be incomplete."""
        end = len(self._window)
        for cut in range(end - 1, end - _MAX_CHAR_TOKENS - 1, -1):
            text = self._decode(self._window[:cut])
            if not text.endswith(_INCOMPLETE) or cut == end - _MAX_CHAR_TOKENS:
                return self._emit(cut, prefix, text) if len(text) > len(prefix) else ""
        return ""


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
