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

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids as they arrive; the concatenated deltas equal the decode of all ids
    (once the stream is final, pending text is flushed even if incomplete)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
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
