"""ModelTokenizer: a checkpoint's tokenizer, its special tokens, chat template and EOS ids.

From a Hugging Face directory (``tokenizer.json``; ``tokenizer_config.json`` and/or
``chat_template.jinja`` for the special tokens and the chat template; ``generation_config.json``
for extra EOS ids) or a GGUF file (``pdserve.engine.model.gguf``). It behaves as transformers'
tokenizer of the same files:

- ``encode(text)`` adds special tokens the way the tokenizer says: the post-processor of
  ``tokenizer.json`` (BOS for Llama 3), or for a GGUF file its ``add_bos_token`` /
  ``add_eos_token`` flags. Special tokens written in the text are read as those tokens unless
  ``split_special_tokens``.
- ``encode_chat(messages)`` renders the chat template and encodes the result without adding
  special tokens (the template writes them), as ``apply_chat_template`` does.

For servers, ``encode_limited`` refuses text with more than a given number of tokens while doing
at most a bounded amount of work on it, and releases the GIL while it tokenizes (see there).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pdserve.engine.chat_template import ChatTemplateError, render_chat

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# encode_limited counts the tokens of long text in pieces of about this many characters first.
COUNT_CHUNK_CHARS = 16_384


class TooManyTokens(ValueError):
    """The text has more tokens than allowed; ``at_least`` is a lower bound on its token count."""

    def __init__(self, at_least: int, limit: int, how: str | None = None) -> None:
        self.count = f"{at_least} tokens" if how is None else f"at least {at_least} tokens ({how})"
        super().__init__(f"{self.count}, more than the {limit} allowed")
        self.at_least = at_least
        self.limit = limit


@dataclass(frozen=True)
class TokenizerInfo:
    """What the tokenizer's config says beyond ``tokenizer.json``."""

    chat_template: str | None = None
    special_tokens: Mapping[str, str | None] = field(default_factory=dict)
    # A GGUF file's flags (its tokenizer has no post-processor); None: as the post-processor does.
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    generation_eos_token_ids: tuple[int, ...] = ()


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def read_tokenizer_dir(model_dir: str | Path) -> tuple[Tokenizer, TokenizerInfo]:
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer.json not found in model directory {model_dir}")
    config = _read_json(model_dir / "tokenizer_config.json")
    generation = _read_json(model_dir / "generation_config.json")
    info = TokenizerInfo(
        chat_template=_chat_template(model_dir, config),
        special_tokens={name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES},
        generation_eos_token_ids=_ids(generation.get("eos_token_id")),
    )
    return Tokenizer.from_file(str(path)), info


class ModelTokenizer:
    def __init__(self, tokenizer: Tokenizer, info: TokenizerInfo) -> None:
        self.raw = tokenizer
        self.info = info
        self._split: Tokenizer | None = None  # reads special tokens in text as text; made on first use
        self.bos_token_id = self._id(info.special_tokens.get("bos_token"))
        self.eos_token_id = self._id(info.special_tokens.get("eos_token"))

    @classmethod
    def from_path(cls, path: str | Path) -> ModelTokenizer:
        """From a checkpoint directory or a ``.gguf`` file."""
        if str(path).endswith(".gguf"):
            from pdserve.engine.model.gguf_tokenizer import read_gguf_tokenizer

            return cls(*read_gguf_tokenizer(path))
        return cls(*read_tokenizer_dir(path))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.raw.token_to_id(token)

    @property
    def chat_template(self) -> str | None:
        return self.info.chat_template

    def _tokenizer(self, split_special_tokens: bool) -> Tokenizer:
        if not split_special_tokens:
            return self.raw
        if self._split is None:
            split = Tokenizer.from_str(self.raw.to_str())
            split.encode_special_tokens = True
            self._split = split
        return self._split

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        ids = self._tokenizer(split_special_tokens).encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            ids = self._apply_bos_eos(ids)
        return ids

    @cached_property
    def token_bound(self) -> TokenBound | None:
        """How many UTF-8 bytes of text one token can stand for at most, or None where this
        tokenizer does not bound it (``token_bound``, the function). Computed once."""
        return token_bound(self.raw)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text`` (0 where none is known), from its
        length alone. ``UnicodeEncodeError`` for text that is not valid Unicode (a lone surrogate)."""
        nbytes = len(text.encode("utf-8"))
        bound = self.token_bound
        if bound is None:
            return 0
        if bound.vanishing is not None:  # characters the vocabulary lacks are dropped: count without them
            nbytes = len(bound.vanishing.sub("", text).encode("utf-8"))
        return -(-nbytes // bound.bytes_per_token)

    def encode_limited(self, text: str, max_tokens: int, add_special_tokens: bool = True,
                       split_special_tokens: bool = False) -> list[int]:  # fmt: skip
        """``encode(text)``, or ``TooManyTokens`` when it would have more than ``max_tokens`` ids,
        decided with bounded work: at once, untokenized, when the text is longer than
        ``max_tokens`` tokens can stand for (``min_tokens``); otherwise long text is first counted
        in pieces that stop as soon as the count is clearly over (so a refusal tokenizes little
        more than ``max_tokens`` tokens' worth of text). An accepted text is tokenized whole, so
        its ids are exactly ``encode``'s. Tokenizes through ``encode_batch``, which releases the
        GIL: other threads, a server's event loop among them, run meanwhile."""
        if (least := self.min_tokens(text)) > max_tokens:
            per = self.token_bound.bytes_per_token  # type: ignore[union-attr]
            raise TooManyTokens(least, max_tokens, f"{len(text.encode('utf-8'))} bytes of text, at most {per} bytes "
                                                   "a token")  # fmt: skip
        tok = self._tokenizer(split_special_tokens)
        if len(text) > COUNT_CHUNK_CHARS:
            self._count_or_refuse(tok, text, max_tokens, add_special_tokens)
        ids = tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens:
            ids = self._apply_bos_eos(ids)
        if len(ids) > max_tokens:
            raise TooManyTokens(len(ids), max_tokens)
        return ids

    @staticmethod
    def _count_or_refuse(tok: Tokenizer, text: str, max_tokens: int, add_special_tokens: bool) -> None:
        """Count ``text``'s tokens piece by piece; ``TooManyTokens`` as soon as the count is over
        ``max_tokens`` by more than the pieces' cuts could explain. Pieces end before a whitespace
        run where there is one (where most pre-tokenizers split anyway); a cut can still make a
        piece tokenize to a token or two more than the whole would there, so each cut is allowed
        4 and the count as a whole 1/16 of the limit before it refuses: what is refused here is
        well over the limit, and a text near it is decided by its whole count."""
        counted = 0
        for i, piece in enumerate(_pieces(text, COUNT_CHUNK_CHARS)):
            counted += len(tok.encode_batch([piece], add_special_tokens=add_special_tokens and i == 0)[0])
            if counted > max_tokens + max_tokens // 16 + 4 * i:
                raise TooManyTokens(counted - 4 * i, max_tokens, "counted in pieces")

    def _apply_bos_eos(self, ids: list[int]) -> list[int]:
        """A GGUF file's ``add_bos_token`` / ``add_eos_token`` flags (its tokenizer has no
        post-processor): add what they ask for, never remove a token the text itself wrote."""
        bos, eos, info = self.bos_token_id, self.eos_token_id, self.info
        if bos is not None and info.add_bos_token and not (ids and ids[0] == bos):
            ids = [bos, *ids]
        if eos is not None and info.add_eos_token and not (ids and ids[-1] == eos):
            ids = [*ids, eos]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], /, add_generation_prompt: bool = True,
                    **kwargs: Any) -> str:  # fmt: skip
        """The chat template applied to ``messages``; ``ChatTemplateError`` when there is none."""
        if self.info.chat_template is None:
            raise ChatTemplateError("this model has no chat template: send a text prompt instead")
        return render_chat(self.info.chat_template, messages, self.info.special_tokens, add_generation_prompt,
                           **kwargs)  # fmt: skip

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], /, add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:  # fmt: skip
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def _pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, each cut (where the second half of the
    window has a space or newline) at the start of the whitespace run before a word."""
    start = 0
    while len(text) - start > size:
        end = start + size
        lo = start + size // 2
        cut = max(text.rfind(" ", lo, end), text.rfind("\n", lo, end))
        if cut <= lo:
            cut = end
        else:
            while cut > lo and text[cut - 1].isspace():
                cut -= 1
        yield text[start:cut]
        start = cut
    yield text[start:]


# Normalizers that never delete text, with how many input bytes at most become one byte of
# their output: NFC composes a Hangul syllable's three jamo (9 bytes) into one (3 bytes); NFKC
# maps a 4-byte mathematical letter to an ASCII one; lowercasing maps the Kelvin sign (3 bytes)
# to "k". Prepend/Append only add text.
_NORMALIZER_SHRINK = {"NFC": 3.0, "NFD": 3.0, "NFKC": 4.0, "NFKD": 4.0, "Lowercase": 3.0, "Prepend": 1.0,
                      "Append": 1.0}  # fmt: skip
# Pre-tokenizers that split without deleting (Whitespace, BertPreTokenizer, CharDelimiterSplit
# drop the characters they split on; Split and Punctuation only with behavior "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


@dataclass(frozen=True)
class TokenBound:
    """One token stands for at most ``bytes_per_token`` UTF-8 bytes of the input, not counting
    the characters ``vanishing`` matches (the tokenizer may drop them: their bytes are missing
    from a byte-level vocabulary)."""

    bytes_per_token: int
    vanishing: re.Pattern[str] | None = None


def token_bound(tokenizer: Tokenizer) -> TokenBound | None:
    """The most UTF-8 bytes of input text that one token of ``tokenizer`` covers, so a text of B
    bytes has at least B / bound tokens; None where the tokenizer gives no such bound (it may
    delete text, or fold any run of unknown characters into one token).

    A token covers at most its own text: the longest entry of the vocabulary (added tokens
    included) in UTF-8 bytes, and at least 4 (an unknown character, one token). An entry of a
    byte-level vocabulary counts one byte per character (each character is a byte); spellings
    that stand for fewer bytes than they have (``<0xAB>`` of byte fallback, ``▁`` for a space)
    only overstate it, which keeps the bound safe. A normalizer that shrinks text multiplies the
    bound by how much it can shrink it; characters whose bytes a byte-level vocabulary lacks are
    dropped by the tokenizer, so they are not counted (``TokenBound.vanishing``)."""
    try:
        spec = json.loads(tokenizer.to_str())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot describe itself gets no bound
        return None
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(pre) or not _model_covers_all(model, pre):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):  # such a token also swallows the spaces beside it
        return None
    vanishing = None
    byte_level = _has_byte_level(pre) and not model.get("byte_fallback")
    if byte_level:
        vocab = model.get("vocab") or {}
        missing = [b for b in range(256) if b not in _NOT_IN_UTF8 and _BYTE_CHARS[b] not in vocab]
        if any(0x80 <= b <= 0xBF for b in missing):  # a continuation byte: any character may lose bytes
            return None
        vanishing = _characters_with(missing)
    longest = max(_longest_entry(tokenizer, byte_level), 4)
    return TokenBound(math.ceil(longest * shrink), vanishing)


def _longest_entry(tokenizer: Tokenizer, byte_level: bool) -> int:
    """The most input bytes an entry of the vocabulary stands for: its UTF-8 length, except that
    an entry of a byte-level vocabulary stands for one byte per character (its characters are
    the bytes, some written as 2-byte characters). Added tokens are matched as written."""
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    byte_chars = set(_BYTE_CHARS) if byte_level else set()
    longest = 1
    for entry in tokenizer.get_vocab(with_added_tokens=True):
        n = len(entry) if entry not in added and byte_chars.issuperset(entry) else len(entry.encode("utf-8"))
        longest = max(longest, n)
    return longest


def _characters_with(lead_bytes: list[int]) -> re.Pattern[str] | None:
    """A pattern for the characters whose UTF-8 form starts with one of ``lead_bytes``."""
    if not lead_bytes:
        return None
    parts = []
    for b in lead_bytes:
        if b < 0x80:
            lo = hi = b
        elif b < 0xE0:
            lo = (b & 0x1F) << 6
            hi = lo + 0x3F
        elif b < 0xF0:
            lo = (b & 0x0F) << 12
            hi = lo + 0xFFF
        else:
            lo = (b & 0x07) << 18
            hi = min(lo + 0x3FFFF, 0x10FFFF)
        parts.append(f"\\U{lo:08x}-\\U{hi:08x}")
    return re.compile(f"[{''.join(parts)}]")


def _normalizer_shrink(spec: dict | None) -> float | None:
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in spec.get("normalizers") or []:
            f = _normalizer_shrink(part)
            if f is None:
                return None
            total *= f
        return total
    if kind == "Replace":
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content") or ""
        if not isinstance(pattern, str) or not content:  # a regex, or a deletion
            return None
        return max(1.0, len(pattern.encode("utf-8")) / len(content.encode("utf-8")))
    return _NORMALIZER_SHRINK.get(kind)  # type: ignore[arg-type]


def _keeps_text(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in spec.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _has_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in spec.get("pretokenizers") or [])
    return spec.get("type") == "ByteLevel"


def _model_covers_all(model: dict, pre_tokenizer: dict | None) -> bool:
    """A token never stands for a run of unknown characters: byte fallback, byte-level input, or
    BPE with an unknown token that is not fused."""
    if model.get("type") not in ("BPE", "Unigram"):
        return False  # WordPiece and WordLevel read a whole unknown word as one token
    if model.get("byte_fallback"):
        return True
    if model.get("type") == "Unigram":
        return False  # it fuses unknown characters
    if _has_byte_level(pre_tokenizer):
        return True  # each byte is a character of its own (those the vocabulary lacks: token_bound)
    return model.get("unk_token") is not None and not model.get("fuse_unk")


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character each byte is written as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()
_NOT_IN_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}  # bytes no valid UTF-8 text contains


def byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: every byte maps to one printable character.

    Printable Latin-1 bytes map to themselves; the rest are shifted to code points
    from 256 upward in byte order. This is the alphabet the ``ByteLevel``
    pre-tokenizer emits, so a vocab over it covers any byte string.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    mapping: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in kept:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping
