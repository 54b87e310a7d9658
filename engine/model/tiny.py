"""Deterministic tiny Llama checkpoints for tests, demos and CPU-only clusters.

:func:`make_tiny_model` writes an HF-compatible directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with a chat template)
without needing transformers. Same
arguments -> byte-identical files, so separate processes (prefill and decode
workers, a test and its subprocess) can each build "the same model" locally.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from pdserve.engine.tokenizer import byte_to_unicode

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
NUM_BYTES = 256


# A Zephyr-style template over the byte tokenizer: role tags are plain text, turns end with </s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_byte_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level tokenizer: ids 0..255 are bytes, 256 ``<s>``, 257 ``</s>``.

    Ids from 258 up to ``vocab_size - 1`` are unused special tokens
    ``<|extra_N|>`` so every model id decodes. ``encode`` prepends ``<s>`` unless
    ``add_special_tokens=False``; ``decode`` round-trips any UTF-8 text.
    """
    if vocab_size < NUM_BYTES + 2:
        raise ValueError(f"vocab_size must be >= {NUM_BYTES + 2} for a byte tokenizer, got {vocab_size}")
    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS_TOKEN, EOS_TOKEN] + [f"<|extra_{i}|>" for i in range(vocab_size - NUM_BYTES - 2)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, NUM_BYTES)],
    )
    return tok


def _tiny_config(
    hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
    intermediate_size: int, vocab_size: int, max_position_embeddings: int,
) -> dict[str, object]:
    rope_theta = 10000.0
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        # Both layouts: transformers v4 reads rope_theta, v5 reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": NUM_BYTES,
        "eos_token_id": NUM_BYTES + 1,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _tiny_weights(cfg: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    # numpy's PCG64 stream is stable across versions and platforms, unlike torch's
    # RNG guarantees, so the bytes only depend on `seed` and the shapes.
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    q_size, kv_size = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(std) + np.float32(mean)
        return torch.from_numpy(arr)

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        # ~unit-variance activations: large enough that attention is not uniform
        # and greedy argmax has clear margins (robust across kernels and dtypes).
        return normal((out_f, in_f), gain / in_f**0.5)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, hidden), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal((hidden,), 0.1, 1.0)
        w[p + "self_attn.q_proj.weight"] = linear(q_size, hidden, 2.0)
        w[p + "self_attn.k_proj.weight"] = linear(kv_size, hidden, 2.0)
        w[p + "self_attn.v_proj.weight"] = linear(kv_size, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        w[p + "post_attention_layernorm.weight"] = normal((hidden,), 0.1, 1.0)
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    w["model.norm.weight"] = normal((hidden,), 0.1, 1.0)
    w["lm_head.weight"] = linear(vocab, hidden, 3.0)
    return w


def make_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a seeded random tiny Llama checkpoint into ``out_dir``; return its path.

    ``vocab_size`` defaults to 258 (256 bytes + ``<s>`` + ``</s>``). The files are
    a function of the arguments only (byte-identical across runs). Existing files
    of the same names are overwritten.
    """
    vocab = NUM_BYTES + 2 if vocab_size is None else vocab_size
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
    cfg = _tiny_config(
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab, max_position_embeddings
    )
    tokenizer = build_byte_tokenizer(vocab)  # validates vocab before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(_tiny_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    tok_config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "chat_template": CHAT_TEMPLATE,
                  "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    return out
