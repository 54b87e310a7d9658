"""GGUF checkpoints against transformers' reading of the same file (``gguf_file=``): config,
tokenizer, chat template and greedy output, on a tiny written file and on SmolLM2-135M-Instruct."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model import ModelConfig
from pdserve.engine.tokenizer import ModelTokenizer
from tests.support import hf_gguf
from tests.support.gguf_files import smollm2_path, write_gguf
from tests.support.models import make_hf_checkpoint

TEXTS = ["<|im_start|>user\nHi<|im_end|>", "Hello world 12345", "  spaces\tand\nnewlines  ", "ünïcödé — 世界 😀", "a</s>b<s>", "What's the time?"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a prime number."}],
]


def hf_model(directory: Path, name: str):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


def hf_tokenizer(directory: Path, name: str):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    t = torch.tensor([ids])
    out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)  # fmt: skip
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gguf")
    hf = make_hf_checkpoint(d / "hf", "llama_gqa", seed=5)
    return write_gguf(hf, d / "tiny.gguf")


def test_tiny_gguf_matches_transformers(tiny_gguf: Path) -> None:
    """GQA (q/k un-permuted with different head counts), F32 and Q8_0 tensors, untied head."""
    d, name = tiny_gguf.parent, tiny_gguf.name
    cfg = ModelConfig.from_path(tiny_gguf)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (4, 2, False)
    ours_tok, hf_tok = ModelTokenizer.from_path(tiny_gguf), hf_tokenizer(d, name)
    for text in TEXTS:
        assert ours_tok.encode(text) == hf_tok(text).input_ids
    for chat in CHATS:
        assert ours_tok.render_chat(chat) == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # float32: the file has Q8_0 tensors, which auto would run in bfloat16 on a CPU with bf16 units.
    llm, ref = LLM(str(tiny_gguf), num_blocks=64, block_size=8, dtype="float32"), hf_model(d, name)
    prompts = [ours_tok.encode(t) for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ref, p, 12)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gguf-spm")
    hf = make_hf_checkpoint(d / "hf", "llama_gqa", seed=6)
    return write_gguf(hf, d / "spm.gguf", tokenizer="llama")


SPM_TEXTS = ["hello world", "Hello  the world\nis it?", " leading space", "ünïcödé 世界 😀", "the</s>end<s>", "a\tb", ""]


def test_sentencepiece_gguf_matches_transformers(spm_gguf: Path) -> None:
    """A SentencePiece vocabulary (Llama 2, Mistral, TinyLlama): merges recovered from the scores,
    byte fallback for characters outside it, BOS added, text decoded back."""
    d, name = spm_gguf.parent, spm_gguf.name
    ours, hf = ModelTokenizer.from_path(spm_gguf), hf_tokenizer(d, name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.encode("the") == [1, 274]  # <s> ▁the: ▁+t, then h+e, then ▁t+he, best score first
    llm, ref = LLM(str(spm_gguf), num_blocks=64, block_size=8, dtype="float32"), hf_model(d, name)
    prompts = [ours.encode(t) for t in SPM_TEXTS[:4]]
    for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))):
        assert o.token_ids == hf_greedy(ref, p, 10)


def test_llama3_rope_scaling_from_rope_freqs_matches_the_checkpoint(tmp_path: Path) -> None:
    """A Llama 3.1-style file carries its rope scaling as ``rope_freqs`` (llama.cpp's divisors), which
    transformers' GGUF reader drops: the reference is transformers on the checkpoint it came from."""
    from tests.support.models import load_hf_reference

    hf_dir = make_hf_checkpoint(tmp_path / "hf", "llama3_rope", seed=7)
    path = write_gguf(hf_dir, tmp_path / "llama3.gguf", quantize=())
    cfg = ModelConfig.from_path(path)
    assert cfg.rope_freq_factors is not None and max(cfg.rope_freq_factors) == 8.0 and min(cfg.rope_freq_factors) == 1
    llm, ref = LLM(str(path), num_blocks=64, block_size=8, dtype="float32"), load_hf_reference(hf_dir)
    prompts = [[5, 6, 7] * 15, list(range(40, 100))]  # past the original 32-token context
    for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))):
        assert o.token_ids == hf_greedy(ref, p, 16)


def test_unsupported_and_broken_files_are_named(tmp_path: Path, tiny_gguf: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelConfig.from_path(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_path(tmp_path / "missing.gguf")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = smollm2_path()
    d = tmp_path_factory.mktemp("smollm2")
    (d / src.name).symlink_to(src)
    return d / src.name


def test_smollm2_tokenizer_and_chat_template_match_transformers(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ours, hf = ModelTokenizer.from_path(smollm2), hf_gguf.hf_tokenizer(smollm2, tmp_path_factory)
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids
    for chat in CHATS:
        assert ours.render_chat(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(chat) == hf.apply_chat_template(chat, add_generation_prompt=True,
                                                                return_dict=True)["input_ids"]  # fmt: skip


@pytest.mark.slow
def test_smollm2_greedy_chat_matches_transformers(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    llm = LLM(str(smollm2), num_blocks=256, block_size=16, dtype="float32")  # Q4_1: auto could pick bfloat16
    ref = hf_gguf.hf_model(smollm2, tmp_path_factory)
    outs = llm.chat(CHATS, SamplingParams(max_tokens=24))
    for chat, o in zip(CHATS, outs):
        prompt = llm.tokenizer.encode_chat(chat)
        expected = hf_greedy(ref, prompt, 24)
        eos = expected.index(2) + 1 if 2 in expected else len(expected)  # <|im_end|> ends the answer
        assert o.token_ids == expected[:eos]
    assert "Paris" in outs[0].text
