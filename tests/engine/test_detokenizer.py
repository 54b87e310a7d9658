"""Streamed text equals the decode of the whole token sequence, for byte-level and SentencePiece-style tokenizers."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.model import load_tokenizer, make_tiny_model


def metaspace_tokenizer() -> Tokenizer:
    # Words carry their leading space as "▁", which a per-token decode strips.
    words = ["▁the", "▁quick", "▁brown", "▁fox", "jump", "s", "▁over", "▁lazy", "▁dog", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="."))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def stream(tok: Tokenizer, ids: list[int], chunk_sizes: list[int]) -> str:
    d = IncrementalDetokenizer(tok)
    out, i = "", 0
    for n in chunk_sizes:
        part = ids[i : i + n]
        i += n
        out += d.push(part, final=i >= len(ids))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_byte_level_utf8_split_across_tokens(tmp_path, seed: int) -> None:
    tok = load_tokenizer(make_tiny_model(tmp_path / "m"))
    text = "héllo € wörld 😀 naïve ☃ " * 3
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3) for _ in ids]
    assert stream(tok, ids, sizes) == tok.decode(ids) == text
    # the per-message decode this replaces would have produced replacement characters
    assert "".join(tok.decode([i]) for i in ids) != text


def test_sentencepiece_style_spaces_survive() -> None:
    tok = metaspace_tokenizer()
    ids = tok.encode("the quick brown fox jumps over the lazy dog.").ids
    assert stream(tok, ids, [1] * len(ids)) == tok.decode(ids)
    assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids)


def test_incomplete_tail_flushed_when_final(tmp_path) -> None:
    tok = load_tokenizer(make_tiny_model(tmp_path / "m"))
    ids = tok.encode("€", add_special_tokens=False)  # 3 bytes
    d = IncrementalDetokenizer(tok)
    assert d.push(ids[:2]) == ""  # held back: not a whole character yet
    assert d.push([], final=True) == tok.decode(ids[:2])


def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2/Mistral style: ▁-prefixed pieces, <0xNN> byte tokens for anything else."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for ch in "▁abcdefghijklmnopqrstuvwxyz":  # single characters; anything else falls back to bytes
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


@pytest.mark.parametrize("seed", range(8))
def test_byte_fallback_multibyte_characters(seed: int) -> None:
    tok = byte_fallback_tokenizer()
    rng = random.Random(seed)
    pieces = ["😀", "😁", "é", "中文", " hello", " world", " a", "€", "🤣"]
    text = "hello" + "".join(rng.choice(pieces) for _ in range(12))
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text  # the tokenizer itself round-trips
    sizes = [rng.randint(1, 3) for _ in ids]
    assert stream(tok, ids, sizes) == text


class CountingDecoder:
    """A tokenizer whose decodes count the ids they are given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def one_by_one(decoder: CountingDecoder, ids: list[int]) -> tuple[str, str]:
    """(text streamed before the last token, all text streamed), tokens pushed one at a time."""
    d = IncrementalDetokenizer(decoder)
    parts = [d.push([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    return "".join(parts[:-1]), "".join(parts)


def test_tokens_that_add_no_text_cost_the_same_as_others_and_keep_the_spaces() -> None:
    """An EOS a request ignores, thousands of times: each decode stays a few tokens long (the
    window does not grow with them), and the word after them keeps its leading space."""
    tok = metaspace_tokenizer()
    tok.add_special_tokens(["</s>"])
    eos = tok.token_to_id("</s>")
    words = tok.encode("the quick brown").ids
    ids = words[:2] + [eos] * 4000 + words[2:] + [eos] * 4000
    decoder = CountingDecoder(tok)
    _, streamed = one_by_one(decoder, ids)
    assert streamed == tok.decode(ids) == "the quick brown"
    assert decoder.decoded < 10 * len(ids)  # linear; a window growing with the EOS run: ~16 million


def test_text_held_on_a_replacement_character_costs_linear_time(tmp_path) -> None:
    """Output that ends in U+FFFD at every token (the model writes "\ufffd" itself) is held, but
    decoded again only when its held tokens have doubled: linear cost, and the text after it,
    characters split across tokens included, comes out whole."""
    tok = load_tokenizer(make_tiny_model(tmp_path / "m"))
    text = "\ufffd" * 500 + "é€\ufffd😀" + "\ufffd" * 500 + "naïve"
    ids = tok.encode(text, add_special_tokens=False)
    decoder = CountingDecoder(tok)
    _, streamed = one_by_one(decoder, ids)
    assert streamed == tok.decode(ids) == text
    assert decoder.decoded < 20 * len(ids)  # held and decoded at every token: ~1.5 million


def test_replacement_characters_split_characters_and_leading_spaces_around_held_text() -> None:
    """Byte-fallback tokens: literal U+FFFD (three byte tokens each) held past MAX_HELD, then a
    character split across byte tokens right after them; and spaces the decoder strips at the start
    of a stream. Streamed one token at a time, the text equals the decode of all the ids."""
    tok = byte_fallback_tokenizer()
    cases = [
        tok.encode("hello").ids + tok.encode("\ufffd" * 3 + "é€").ids + tok.encode(" hello").ids,
        tok.encode("\ufffd" * 5 + "😀a\ufffd中").ids,
        [tok.token_to_id("▁")] + tok.encode("hello hello").ids,
        [tok.token_to_id("▁")] * 2 + tok.encode("hello").ids,
    ]
    for ids in cases:
        _, streamed = one_by_one(CountingDecoder(tok), ids)
        assert streamed == tok.decode(ids), (streamed, tok.decode(ids))
