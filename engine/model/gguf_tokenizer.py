"""A GGUF file's tokenizer, built as transformers builds it from the same metadata.

Two vocabularies of the Llama family:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE (Llama 3, SmolLM, Qwen2): the file's tokens are
  spelled in GPT-2's byte alphabet and it lists its merges; Llama 3's vocabularies split text with
  their own pattern first (``tokenizer.ggml.pre``).
- ``"llama"``: SentencePiece BPE (Llama 2, Mistral, TinyLlama): pieces with ``▁`` for a space,
  ``<0xNN>`` byte tokens for anything outside the vocabulary, and a score per piece instead of a
  merge list. Merges are recovered from the scores: a piece that two other pieces concatenate to is a
  merge of them, ranked by its own score (SentencePiece merges the best-scored pair first). Text gets
  a ``▁`` in front (once, at the start) and spaces become ``▁``; BOS is added unless the file says
  not to.

Control tokens become special tokens, user-defined ones added tokens (both stay whole in text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from pdserve.engine.model.gguf import check_arch, metadata
from pdserve.engine.tokenizer import TokenizerInfo, byte_to_unicode

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
# The pre-tokenizer split of Llama 3's vocabulary (tiktoken's cl100k pattern); other byte-level
# vocabularies use GPT-2's, which the ByteLevel pre-tokenizer applies by itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}
SPACE = "\u2581"  # SentencePiece's ▁


def _byte_level(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, set[str]]:
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}  # fmt: skip
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    if meta.get("tokenizer.ggml.pre") in _LLAMA3_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges: every split of a piece into two pieces of the vocabulary, best
    score of the merged piece first (ties: longer left, then longer right piece first; within a
    piece, by the ids of its halves)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in scores.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked += [(score, len(left), len(right), left, right) for left, right in splits]
    # A stable sort keeps the per-piece order among equal keys.
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    merges = merges_from_scores(vocab, dict(zip(tokens, scores)))
    # Characters outside the vocabulary fall back to their <0xNN> byte tokens.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([
        decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])  # fmt: skip
    return tok


def read_gguf_tokenizer(path: str | Path) -> tuple[Tokenizer, TokenizerInfo]:
    """The file's tokenizer, special tokens and chat template."""
    meta = metadata(path)
    check_arch(meta, path)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    if kind == "gpt2":
        tok, alphabet = _byte_level(meta, tokens)
        control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens)
        control = [t for t, k in zip(tokens, types) if k == _CONTROL]
    else:
        raise ValueError(f"{path}: GGUF tokenizer {kind!r} is not supported (byte-level BPE 'gpt2' or "
                         "SentencePiece 'llama')")  # fmt: skip
    # Control tokens (<|im_start|>, <s>) stay whole and are special; user-defined ones stay whole too.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    vocab = tok.get_vocab()
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None and kind == "llama":
        add_bos = True  # older SentencePiece files say nothing; llama.cpp and transformers add BOS
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    info = TokenizerInfo(
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens={"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")},
        add_bos_token=bool(add_bos) if add_bos is not None else None,
        add_eos_token=bool(add_eos) if add_eos is not None else None,
    )  # fmt: skip
    return tok, info
