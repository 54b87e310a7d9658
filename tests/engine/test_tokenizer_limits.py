"""ModelTokenizer.encode_limited: text that cannot fit is refused with bounded work (by its length
alone where the vocabulary bounds the bytes a token covers, else counted in pieces that stop
early), accepted text gets exactly encode's ids, and tokenizing releases the GIL."""

from __future__ import annotations

import random
import threading
import time

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from pdserve.engine.tokenizer import ModelTokenizer, TokenizerInfo, TooManyTokens, token_bound

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "naïve café — 東京 🚀 " * 30,
    "    indented\n\n\t\tcode();   // with    runs of   spaces\n" * 20,
    "".join(chr(random.Random(7).randrange(0x20, 0x3000)) for _ in range(2000)),
    "\x04\x06 control \x1d bytes \U00040000 and a rare plane " * 10,
]


def test_the_bound_holds_for_byte_level_tokenizers(tiny_model: str) -> None:
    tok = ModelTokenizer.from_path(tiny_model)
    assert tok.token_bound is not None and tok.token_bound.bytes_per_token == 4  # bytes, and "</s>"
    for text in SAMPLES:
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False))


def test_the_bound_holds_for_smollm2_whose_vocabulary_lacks_some_bytes() -> None:
    """SmolLM2's byte-level vocabulary has no entry for a few control bytes (and two lead bytes of
    rare planes): the tokenizer drops those characters, so they do not count toward the bound."""
    from tests.support.gguf_files import smollm2_path

    tok = ModelTokenizer.from_path(smollm2_path())
    bound = tok.token_bound
    assert bound is not None and bound.vanishing is not None and bound.bytes_per_token == 81
    for text in [*SAMPLES, "\x04" * 5000 + "word"]:
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False))


def _spm_like() -> Tokenizer:
    """Llama 2's shape: BPE with byte fallback, spaces replaced by "▁" in a normalizer."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "b": 259, "▁ab": 260,
             "ab": 261}  # fmt: skip
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("▁", "ab")], unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))  # fmt: skip
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.ByteFallback()
    return tok


def test_the_bound_holds_for_byte_fallback_and_is_none_where_text_can_vanish() -> None:
    spm = ModelTokenizer(_spm_like(), TokenizerInfo())
    assert spm.token_bound is not None
    for text in [*SAMPLES, "ab ab ab abab " * 50]:
        assert spm.min_tokens(text) <= len(spm.encode(text, add_special_tokens=False))
    # BERT-like: whitespace is deleted and a whole unknown word is one token: no bound.
    bert = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    bert.normalizer = normalizers.BertNormalizer()
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    assert token_bound(bert) is None
    stripped = _spm_like()
    stripped.normalizer = normalizers.Strip()
    assert token_bound(stripped) is None


def test_accepted_text_gets_encodes_ids_and_refused_text_says_why(tiny_model: str) -> None:
    tok = ModelTokenizer.from_path(tiny_model)
    for text in SAMPLES:
        n = len(tok.encode(text))
        assert tok.encode_limited(text, n) == tok.encode(text)
        with pytest.raises(TooManyTokens, match=f"{n} tokens, more than the {n - 1} allowed"):
            tok.encode_limited(text, n - 1)
    long_text = "x" * 1_040_000
    with pytest.raises(TooManyTokens, match=r"at least 260000 tokens \(1040000 bytes of text, at most 4 bytes a token"):
        tok.encode_limited(long_text, 2047)
    with pytest.raises(UnicodeEncodeError):
        tok.encode_limited("a lone \ud800 surrogate", 2047)


def test_without_a_bound_long_text_is_counted_in_pieces_that_stop_early(tiny_model: str) -> None:
    tok = ModelTokenizer.from_path(tiny_model)
    tok.__dict__["token_bound"] = None  # as a tokenizer that gives none
    text = "lorem ipsum dolor sit amet " * 40_000  # 1.08 MB: 1.08 M tokens whole
    with pytest.raises(TooManyTokens, match="counted in pieces") as err:
        tok.encode_limited(text, 2047)
    assert err.value.at_least < 20_000  # it stopped after the first piece, not at the end
    medium = "lorem ipsum dolor sit amet " * 1000  # several pieces, fits: tokenized whole
    assert tok.encode_limited(medium, 30_000) == tok.encode(medium)


def test_tokenizing_releases_the_gil(tiny_model: str) -> None:
    """While another thread tokenizes a long text, this thread keeps running: the longest stall
    of a loop here is a small part of the tokenization's time, not all of it (``encode`` of the
    tokenizers library holds the GIL throughout; ``encode_batch`` releases it)."""
    tok = ModelTokenizer.from_path(tiny_model)
    text = "hello world " * 60_000
    done = threading.Event()
    took: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        tok.encode_limited(text, 10**7)
        took.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=work)
    last = time.perf_counter()
    worst = 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    worker.join()
    assert worst < took[0] / 3, (worst, took[0])
