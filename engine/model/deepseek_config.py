"""The parts of a DeepSeek-V2/V3 ``config.json`` a Llama config lacks: MLA, MoE and YaRN rope.

``ModelConfig`` holds them as optional sub-configs (:class:`MLAConfig`, :class:`MoEConfig`,
:class:`YarnRopeScaling`); this module defines and parses them. Semantics follow the released
checkpoints and transformers' ``DeepseekV2``/``DeepseekV3`` models; every field is validated so a
bad checkpoint fails at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEEPSEEK_ARCHITECTURES: tuple[str, ...] = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
TOPK_METHODS: tuple[str, ...] = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN rope scaling (``rope_type: yarn``), as transformers computes it.

    ``attention_factor`` multiplies cos/sin (so q·k by its square); DeepSeek's attention also
    multiplies its softmax scale by ``mscale(factor, mscale_all_dim) ** 2`` (``softmax_mscale``).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"yarn rope_scaling factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("yarn rope_scaling original_max_position_embeddings must be > 0, got "
                             f"{self.original_max_position_embeddings}")  # fmt: skip
        if not self.beta_fast > 0 or not self.beta_slow > 0:
            raise ValueError(f"yarn beta_fast/beta_slow must be > 0, got {self.beta_fast}/{self.beta_slow}")

    @staticmethod
    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def cos_sin_factor(self) -> float:
        """What cos/sin are multiplied by (transformers' ``attention_factor``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.get_mscale(self.factor, self.mscale) / self.get_mscale(self.factor, self.mscale_all_dim)
        return self.get_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """DeepSeek's extra softmax-scale factor: ``mscale(factor, mscale_all_dim) ** 2`` (1.0 without)."""
        if not self.mscale_all_dim:
            return 1.0
        return self.get_mscale(self.factor, self.mscale_all_dim) ** 2

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_position_embeddings: int | None = None) -> YarnRopeScaling:
        """From a config's rope parameters; a missing ``factor`` is ``max_position_embeddings /
        original_max_position_embeddings``, as transformers derives it."""
        try:
            original = int(d["original_max_position_embeddings"])
            factor = d.get("factor")
            if factor is None:
                if max_position_embeddings is None:
                    raise KeyError("factor")
                factor = max_position_embeddings / original
            return cls(
                factor=float(factor),
                original_max_position_embeddings=original,
                beta_fast=float(d.get("beta_fast") or 32),
                beta_slow=float(d.get("beta_slow") or 1),
                mscale=float(d.get("mscale") or 0),
                mscale_all_dim=float(d.get("mscale_all_dim") or 0),
                attention_factor=None if d.get("attention_factor") is None else float(d["attention_factor"]),
                truncate=bool(d.get("truncate", True)),
            )
        except KeyError as e:
            raise ValueError(f"yarn rope scaling is missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"yarn rope scaling has a bad value: {e}") from None


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: each token caches ``kv_lora_rank`` latent values plus a
    ``qk_rope_head_dim`` rotary key shared by all heads.

    ``rope_interleave``: the checkpoint's rotary dims come in interleaved pairs (DeepSeek's
    layout, always in V2; V3's ``rope_interleave``), else in two halves (Llama's layout).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be None or > 0, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token per layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts of the layers from ``first_k_dense_replace`` on.

    Routing: ``scoring`` (softmax for V2, sigmoid for V3) gives each expert a score;
    ``topk_method`` picks ``num_experts_per_tok`` of them: ``greedy`` (the best overall),
    ``group_limited_greedy`` (V2: only within the ``topk_group`` groups whose best expert scores
    highest) or ``noaux_tc`` (V3: groups ranked by the sum of their two best scores plus the
    learned ``e_score_correction_bias``, which steers the choice but not the weights). The chosen
    scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``, weight the experts.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    topk_method: str
    scoring: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def __post_init__(self) -> None:
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("n_shared_experts and first_k_dense_replace must be >= 0")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; supported: {', '.join(TOPK_METHODS)}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring!r} is not supported (softmax, sigmoid)")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} > n_group {self.n_group}")
        if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
            raise ValueError("noaux_tc ranks groups by their two best experts: needs >= 2 experts per group")
        if self.topk_method != "greedy" and self.topk_group * (self.n_routed_experts // self.n_group) \
                < self.num_experts_per_tok:
            raise ValueError("topk_group groups hold fewer experts than num_experts_per_tok")
        if not math.isfinite(self.routed_scaling_factor) or self.routed_scaling_factor <= 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def _num(cfg: dict[str, Any], key: str, default: float | None, kind: type = int) -> Any:
    """``cfg[key]`` as ``kind`` (``default`` when absent or null); ValueError naming the key otherwise."""
    value = cfg.get(key)
    if value is None:
        value = default
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"config.json: {key} must be a number, got {cfg.get(key)!r}") from None


def parse_deepseek(cfg: dict[str, Any], arch: str) -> tuple[MLAConfig, MoEConfig]:
    """The MLA and MoE parts of a DeepSeek-V2/V3 ``config.json`` (transformers' defaults where a
    key is absent)."""
    v3 = arch == "DeepseekV3ForCausalLM"
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?") if isinstance(cfg["quantization_config"], dict) else "?"
        raise ValueError(f"quantized checkpoints are not supported (quantization_config: {method}); "
                         "use a bf16 or float32 checkpoint")  # fmt: skip
    # Absent: transformers' default (1536); null: no low-rank query projection (V2-Lite).
    q_lora = cfg.get("q_lora_rank", 1536)
    mla = MLAConfig(
        q_lora_rank=None if q_lora is None else _num({"q_lora_rank": q_lora}, "q_lora_rank", None),
        kv_lora_rank=_num(cfg, "kv_lora_rank", 512),
        qk_nope_head_dim=_num(cfg, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_num(cfg, "qk_rope_head_dim", 64),
        v_head_dim=_num(cfg, "v_head_dim", 128),
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
    )
    if int(cfg.get("moe_layer_freq", 1)) != 1:
        raise ValueError(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported (only 1)")
    experts = _num(cfg, "n_routed_experts", cfg.get("num_local_experts") or (256 if v3 else 64))
    if v3:
        method = cfg.get("topk_method", "noaux_tc")
        scoring = cfg.get("scoring_func", "sigmoid")
        if (method, scoring) != ("noaux_tc", "sigmoid"):
            raise ValueError(f"DeepSeek-V3 routes with noaux_tc over sigmoid scores, config says {method}/{scoring}")
    else:
        method = cfg.get("topk_method") or "greedy"
        scoring = cfg.get("scoring_func", "softmax")
        if method == "noaux_tc" or scoring != "softmax":
            raise ValueError(f"DeepSeek-V2 routes over softmax scores with greedy or group_limited_greedy, "
                             f"config says {method}/{scoring}")  # fmt: skip
    grouped = method != "greedy"
    if not v3 and cfg.get("norm_topk_prob"):
        # DeepSeek's own V2 code renormalises (and then skips the scaling factor), vLLM renormalises
        # and scales, transformers ignores the flag: no one answer to match. Released V2 configs say False.
        raise ValueError("DeepSeek-V2 with norm_topk_prob=true is not supported (implementations disagree on it)")
    moe = MoEConfig(
        n_routed_experts=experts,
        num_experts_per_tok=_num(cfg, "num_experts_per_tok", 8 if v3 else 0),
        moe_intermediate_size=_num(cfg, "moe_intermediate_size", 2048 if v3 else 1407),
        n_shared_experts=_num(cfg, "n_shared_experts", 1 if v3 else 2),
        first_k_dense_replace=_num(cfg, "first_k_dense_replace", 3 if v3 else 0),
        topk_method=method,
        scoring=scoring,
        n_group=_num(cfg, "n_group", 8 if v3 else 1) if grouped else 1,
        topk_group=_num(cfg, "topk_group", 4 if v3 else 1) if grouped else 1,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
        routed_scaling_factor=_num(cfg, "routed_scaling_factor", 2.5 if v3 else 1.0, float),
    )
    return mla, moe
