"""GGUF checkpoints against transformers' reading of the same file (``gguf_file=``): config,
tokenizer, chat template and greedy output, on a tiny written file and on SmolLM2-135M-Instruct."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model import ModelConfig
from pdserve.engine.tokenizer import ModelTokenizer
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
    llm, ref = LLM(str(tiny_gguf), num_blocks=64, block_size=8), hf_model(d, name)
    prompts = [ours_tok.encode(t) for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ref, p, 12)


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


def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2: Path) -> None:
    ours, hf = ModelTokenizer.from_path(smollm2), hf_tokenizer(smollm2.parent, smollm2.name)
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids
    for chat in CHATS:
        assert ours.render_chat(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(chat) == hf.apply_chat_template(chat, add_generation_prompt=True,
                                                                return_dict=True)["input_ids"]  # fmt: skip


@pytest.mark.slow
def test_smollm2_greedy_chat_matches_transformers(smollm2: Path) -> None:
    llm = LLM(str(smollm2), num_blocks=256, block_size=16)
    ref = hf_model(smollm2.parent, smollm2.name)
    outs = llm.chat(CHATS, SamplingParams(max_tokens=24))
    for chat, o in zip(CHATS, outs):
        prompt = llm.tokenizer.encode_chat(chat)
        expected = hf_greedy(ref, prompt, 24)
        eos = expected.index(2) + 1 if 2 in expected else len(expected)  # <|im_end|> ends the answer
        assert o.token_ids == expected[:eos]
    assert "Paris" in outs[0].text
