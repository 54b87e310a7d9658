"""Model configuration parsed from a Hugging Face ``config.json``.

Two families are supported: the Llama family (Llama, Mistral, Qwen2), which shares one
forward pass and differs only in a few flags (q/k/v bias, rope scaling), and DeepSeek-V2/V3
(multi-head latent attention, MoE, YaRN rope; their extra fields live in ``mla``/``moe``, see
:mod:`engine.model.deepseek_config`). Everything is validated up front so a bad checkpoint
fails at load, not mid-step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from pdserve.engine.model.deepseek_config import (
    DEEPSEEK_ARCHITECTURES,
    MLAConfig,
    MoEConfig,
    YarnRopeScaling,
    parse_deepseek,
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    *DEEPSEEK_ARCHITECTURES,
)

# Bumped whenever the fingerprint's input changes meaning.
_FINGERPRINT_VERSION = "pdserve-model-config-v1"


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 style frequency-dependent rope scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"llama3 rope_scaling factor must be > 0, got {self.factor}")
        if self.low_freq_factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low={self.low_freq_factor} high={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "llama3 rope_scaling original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one checkpoint.

    ``attention_bias`` means q/k/v projections carry a bias; ``o_proj_bias`` means
    o_proj does too (Llama's ``attention_bias=True`` sets both, Qwen2 sets only the
    former). ``eos_token_ids`` is always a tuple (possibly empty). DeepSeek models have
    ``mla`` and ``moe`` (and ``head_dim`` is their rotary dim, as in transformers); the
    Llama family has neither.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    sliding_window: int | None = None
    # A GGUF file's ``rope_freqs.weight``: one divisor per rotary frequency (llama.cpp's form of
    # llama3 rope scaling, computed by its converter); None: none.
    rope_freq_factors: tuple[float, ...] | None = None
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    # DeepSeek-V3's multi-token-prediction layers: stored after the stack in the checkpoint, not run.
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported_msg(self.architecture))
        deepseek = self.architecture in DEEPSEEK_ARCHITECTURES
        if deepseek != (self.mla is not None) or deepseek != (self.moe is not None):
            raise ValueError(f"{self.architecture}: mla/moe are given for DeepSeek models and only for them")
        if isinstance(self.rope_scaling, YarnRopeScaling) and not deepseek:
            raise ValueError("yarn rope scaling is supported for DeepSeek models only")
        if deepseek and self.sliding_window is not None:
            raise ValueError("DeepSeek models have no sliding window")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        for tok in (self.bos_token_id, *self.eos_token_ids):
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(f"special token id {tok} outside vocab of size {self.vocab_size}")

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a HF ``config.json`` dict (transformers v4 or v5 layout)."""
        archs = cfg.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture, got {archs!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported_msg(arch))
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window", False):
            raise ValueError("Qwen2 use_sliding_window=True is not supported")

        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _parse_rope(cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        llama_bias = bool(cfg.get("attention_bias", False))
        mla, moe = parse_deepseek(cfg, arch) if arch in DEEPSEEK_ARCHITECTURES else (None, None)
        # DeepSeek: every head reads the one latent; head_dim is the rotary dim (transformers' choice).
        head_dim = mla.qk_rope_head_dim if mla else int(cfg.get("head_dim") or hidden // heads)
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        bos = cfg.get("bos_token_id")
        # transformers v5 writes "dtype", v4 wrote "torch_dtype".
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        sliding = cfg.get("sliding_window") if not is_qwen2 else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=heads if mla else int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=(not is_qwen2) and llama_bias,
            mla=mla,
            moe=moe,
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0)
            if arch == "DeepseekV3ForCausalLM" else 0,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            torch_dtype=None if dtype is None else str(dtype),
            sliding_window=None if sliding is None or mla else int(sliding),
            rope_freq_factors=_freq_factors(cfg.get("rope_freq_factors"), head_dim),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """From a checkpoint directory (its ``config.json``) or a ``.gguf`` file."""
        if str(path).endswith(".gguf"):
            from pdserve.engine.model.gguf import read_gguf_config

            return cls.from_dict(read_gguf_config(path))
        return cls.from_dir(path)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``<model_dir>/config.json``; FileNotFoundError names the file if absent."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"config.json not found in model directory {Path(model_dir)}")
        with path.open("r", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @property
    def max_context_len(self) -> int:
        """Longest sequence served: ``max_position_embeddings`` (a sliding window, as in
        Mistral, is applied by the attention kernels and does not shorten it)."""
        return self.max_position_embeddings

    # ---------------------------------------------------------------- identity
    @property
    def fingerprint(self) -> str:
        """Stable hex digest of every field that changes the forward pass.

        Token ids and the stored dtype are excluded (they do not change the math);
        weights are NOT covered: equal fingerprints mean same architecture only.
        """
        fields = asdict(self)
        for name in ("bos_token_id", "eos_token_ids", "torch_dtype", "num_mtp_layers"):
            fields.pop(name)
        for name in ("mla", "moe"):  # absent for the Llama family: their digests stay as they were
            if fields[name] is None:
                fields.pop(name)
        blob = json.dumps([_FINGERPRINT_VERSION, fields], sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(blob.encode("utf-8"))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    # ---------------------------------------------------------------- KV cache
    @property
    def kv_cache_kind(self) -> str:
        """``"mha"``: K and V per KV head; ``"mla"``: one latent (plus rotary key) per token."""
        return "mla" if self.mla else "mha"

    @property
    def kv_cache_heads(self) -> int:
        return 1 if self.mla else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        return self.mla.cache_dim if self.mla else self.head_dim

    @property
    def kv_cache_rope_dim(self) -> int:
        """Trailing rotary values of an MLA cache row (0 for K/V caches)."""
        return self.mla.qk_rope_head_dim if self.mla else 0


def _unsupported_msg(arch: object) -> str:
    return (
        f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _freq_factors(value: Any, head_dim: int) -> tuple[float, ...] | None:
    if value is None:
        return None
    factors = tuple(float(f) for f in value)
    if len(factors) != head_dim // 2 or not all(f > 0 for f in factors):
        raise ValueError(f"rope_freqs: {len(factors)} factors, expected {head_dim // 2} positive ones")
    return factors


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | YarnRopeScaling | None]:
    """Return (rope_theta, scaling) from v4 (``rope_theta``/``rope_scaling``) or v5
    (``rope_parameters``) layouts."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "yarn":
        return float(theta), YarnRopeScaling.from_dict(scaling, cfg.get("max_position_embeddings"))
    if rope_type != "llama3":
        raise ValueError(f"rope type {rope_type!r} is not supported (only 'default', 'llama3' and 'yarn')")
    try:
        return float(theta), Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings")
                or cfg.get("max_position_embeddings", 2048)
            ),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling is missing key {e.args[0]!r}") from None
