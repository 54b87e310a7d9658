"""GGUF checkpoints (llama.cpp's single-file format) for the Llama family, read with ``gguf``.

A GGUF file holds the model's hyperparameters, its tokenizer (vocabulary, merges, special
tokens, chat template) and its tensors, often quantized (``gguf_file`` reads the header). pdserve
reads all three the way transformers does (``from_pretrained(dir, gguf_file=...)``), so that both
produce the same tokens:

- the config becomes a Hugging Face ``config.json`` dict (``read_gguf_config``);
- each tensor is dequantized to float32 (``gguf.quants.dequantize``), renamed to its Hugging Face
  name and, for ``attn_q``/``attn_k``, un-permuted (llama.cpp's converter interleaves the rotary
  halves of each head; ``iter_gguf_tensors``);
- the tokenizer, special tokens and chat template come from the metadata
  (``pdserve.engine.model.gguf_tokenizer``).

Supported: ``general.architecture == "llama"`` (Llama 2 and 3, Mistral, SmolLM, TinyLlama), with
llama3 rope scaling as llama.cpp stores it (``rope_freqs.weight``, a divisor per frequency; it
becomes ``ModelConfig.rope_freq_factors``). transformers' GGUF reader drops ``rope_freqs``: for
such files the reference is the checkpoint they were converted from.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from pdserve.engine.model.gguf_file import GGUFFile

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@lru_cache(maxsize=4)
def _reader(path: str) -> GGUFFile:
    from pdserve.engine.model.gguf_file import GGUFFile

    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def metadata(path: str | Path) -> dict[str, Any]:
    """The file's metadata, as ``gguf.GGUFReader``'s ``field.contents()`` gives it (a copy)."""
    return dict(_reader(str(path)).metadata)


def check_arch(meta: dict[str, Any], path: str | Path) -> str:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    return arch


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The model's hyperparameters as a Hugging Face ``config.json`` dict."""
    meta = metadata(path)
    a = check_arch(meta, path)
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{path}: rope scaling {scaling!r} in GGUF files is not supported (llama3's rope_freqs is)")
    heads = int(meta[f"{a}.attention.head_count"])
    hidden = int(meta[f"{a}.embedding_length"])
    tensors = {t.name: t for t in _reader(str(path)).tensors}
    freqs = tensors.get("rope_freqs.weight")  # llama3 rope scaling, as one divisor per frequency
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    return {
        "architectures": ["LlamaForCausalLM"],
        # The embedding's rows are the vocabulary the model was trained with.
        "vocab_size": int(meta.get(f"{a}.vocab_size") or tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{a}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{a}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv") or heads),
        "head_dim": int(meta.get(f"{a}.attention.key_length") or hidden // heads),
        "rms_norm_eps": float(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "rope_freq_factors": None if freqs is None else np.asarray(freqs.data, dtype=np.float32).tolist(),
    }


def tensor_types(path: str | Path) -> frozenset[str]:
    """The GGML types the file's tensors are stored in, by name (``"F32"``, ``"F16"``, ``"Q4_1"``...)."""
    return frozenset(t.tensor_type.name for t in _reader(str(path)).tensors)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary interleave of a q/k projection (rows grouped by head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def iter_gguf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, float32 tensor)`` for every weight, dequantized one at a time."""
    import torch  # here: reading a GGUF's config and tokenizer needs no torch
    from gguf.quants import dequantize

    config = read_gguf_config(path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in _reader(str(path)).tensors:
        if t.name == "rope_freqs.weight":  # read into the config (rope_freq_factors), not a weight
            continue
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r}")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        w = np.ascontiguousarray(w)
        yield name, torch.from_numpy(w if w.flags.writeable else w.copy())  # an F32 tensor is a read-only map
