"""Incremental detokenization of a token stream.

Decoding each message's tokens on their own breaks multi-byte characters split across
tokens and drops the word-boundary spaces that SentencePiece-style tokenizers encode in
the token itself. Instead each delta is computed over a window: the tokens of the previous
emission (their context) and the tokens since; the new text is what the window decodes to
beyond what its context decodes to. Text ending in an incomplete character (U+FFFD) is held
back until it completes, so a window never starts inside a character (byte-fallback
decoders turn a whole byte run into U+FFFD if it starts mid-character).

Each token costs about the same however long the stream: tokens that add no text after the
text so far (special tokens skipped, an EOS a request ignores) leave the window, and text held
because it ends in U+FFFD for more than ``MAX_HELD`` tokens (a literal U+FFFD, bytes that never
complete) is decoded again only when its tokens have doubled, so a held run of n tokens costs
O(n) decoding, not O(n^2). Held text is never emitted early: where a byte-fallback decoder turns
a whole byte run into U+FFFD while its last character is incomplete, no cut inside the run can
be told correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_INCOMPLETE = "\ufffd"
MAX_HELD = 8  # pending tokens looked at on every push; beyond, when their number doubles


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids as they arrive; the concatenated deltas equal the decode of all ids
    (once the stream is final, pending text is flushed even if incomplete). Decoding costs
    O(tokens) over the stream whatever its text (module docstring)."""

    def __init__(self, tokenizer: TokenDecoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self._window: list[int] = []  # the previous emission's tokens (the context), then the pending ones
        self._context = 0  # how many of the window's tokens were emitted
        self._look_at = MAX_HELD  # pending tokens beyond this: decoded again once there are this many

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly completed text (may be empty)."""
        self._window.extend(token_ids)
        pending = len(self._window) - self._context
        if not final and pending > MAX_HELD:
            if pending < self._look_at:
                return ""  # held text: looked at again when the pending tokens have doubled
            self._look_at = 2 * pending
        prefix = self._decode(self._window[: self._context])
        full = self._decode(self._window)
        if full == prefix:
            if self._context:  # after text they add nothing: no reason to decode them again
                del self._window[self._context :]
            return ""  # (before any text they may: a SentencePiece space shows with the next word)
        if final or (not full.endswith(_INCOMPLETE) and full.startswith(prefix)):
            delta = full[len(prefix) :]
            del self._window[: self._context]
            self._context = len(self._window)
            self._look_at = MAX_HELD
            return delta
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


def text_tokens(token_ids: Sequence[int], finished: bool, finish_reason: str | None) -> Sequence[int]:
    """The tokens of a step whose text is output: all of them, but the last of a step that
    finishes the request with reason "stop". The engine stops a request only on a stop token (EOS,
    one of ``stop_token_ids``, the EOS that completes a structured-output constraint), and that
    token ends the text without being part of it, as in vLLM; its id stays in the token ids and
    in the counts."""
    if finished and finish_reason == "stop" and token_ids:
        return token_ids[:-1]
    return token_ids


def stop_token(token_ids: Sequence[int], finish_reason: str | None, stop_token_ids: Sequence[int]) -> int | None:
    """vLLM's ``stop_reason`` for a request the engine stopped: the stop token id that ended it (its
    last token, one of ``stop_token_ids``); None otherwise (EOS also ends a request as "stop")."""
    last = token_ids[-1] if token_ids else None
    return last if finish_reason == "stop" and last in stop_token_ids else None
