"""Incremental detokenization of a token stream.

Decoding each message's tokens on their own breaks multi-byte characters split across
tokens and drops the word-boundary spaces that SentencePiece-style tokenizers encode
in the token itself. Instead the stream keeps a small window of recent tokens: a delta
is the text of the window beyond what the window's already-emitted prefix decodes to,
and text that ends in an incomplete character (U+FFFD) is held back until it completes.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"
_CONTEXT = 6  # tokens of left context kept so spaces and merges decode as in the full text


class IncrementalDetokenizer:
    """Feed token ids as they arrive; the concatenated deltas equal the decode of all ids
    (once the stream is finished, pending bytes are flushed even if incomplete)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_start = 0  # window start (context tokens)
        self.emitted_end = 0  # tokens whose text has been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly completed text (may be empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_start : self.emitted_end])
        full = self._decode(self.ids[self.prefix_start :])
        if not final and (full.endswith(_INCOMPLETE) or len(full) <= len(prefix)):
            return ""
        delta = full[len(prefix) :]
        self.emitted_end = len(self.ids)
        self.prefix_start = max(0, self.emitted_end - _CONTEXT)
        return delta
