"""DeepSeek-V2/V3 decoder: multi-head latent attention (MLA) over a paged latent cache, and MoE.

Each token of each layer caches one row ``[c_kv (kv_lora_rank) | rotated k_pe (qk_rope_head_dim)]``
(the KV tensor is ``[num_blocks, num_layers, 1, block_size, 1, kv_lora_rank + rope_dim]``), shared
by every head. ``kv_b_proj`` holds per head the up-projections ``W_UK`` (to the key's non-rotary
part) and ``W_UV`` (to the value). Attention runs in one of two forms (``MLAAttention.form``):

* ``"absorbed"``: ``W_UK`` folded into the query (``q_nope @ W_UK``), attention over the latent rows
  themselves, ``W_UV`` applied to the result: no past token is ever decompressed;
* ``"naive"``: each step decompresses every visible latent to per-head K/V;
* ``"auto"`` (default): absorbed for decodes, naive for prefills and chunks (a prompt's many queries
  make the decompressed form the cheaper one), per sequence in a mixed step.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.kernels.mla import (
    absorb_query,
    expand_latent,
    mla_attention,
    mla_attention_mixed,
    mla_attention_naive,
    plan_mixed,
    write_latent,
)
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.deepseek_config import YarnRopeScaling
from pdserve.engine.model.linear import Linear
from pdserve.engine.model.llama import MLP, DecoderLayer, LlamaForCausalLM, RMSNorm, read_shard
from pdserve.engine.model.moe import MoE, MoEGate
from pdserve.engine.model.rope import apply_rotary, apply_rotary_interleaved
from pdserve.engine.model.tp_layers import TPComm
from pdserve.engine.parallel.shard import TPShard

MLA_FORMS = ("auto", "absorbed", "naive")
_LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not rms_norm_eps


class MLAAttention(nn.Module):
    """Multi-head latent attention with HF's module names (``q_proj`` or ``q_a_proj`` +
    ``q_a_layernorm`` + ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``).

    Under tensor parallelism (``comm``) a rank holds its heads' rows of ``q_proj`` / ``q_b_proj``
    and ``kv_b_proj`` and their columns of ``o_proj`` (whose partial outputs are summed), and the
    whole of the latent projections: the latent row a token caches is the same on every rank, and
    every rank writes it itself (the same bytes), so that what it reads in a step is its own write.
    """

    def __init__(self, config: ModelConfig, comm: TPComm | None = None) -> None:
        super().__init__()
        assert config.mla is not None
        mla = config.mla
        shard = comm.shard if comm is not None else TPShard()
        self.comm = comm
        self.num_heads = h = shard.split(config.num_attention_heads)[1]
        self.rank, self.nope, self.rope, self.v_dim = (mla.kv_lora_rank, mla.qk_nope_head_dim,
                                                       mla.qk_rope_head_dim, mla.v_head_dim)  # fmt: skip
        self.form = "auto"
        self.kv_scale = 1.0  # an FP8 cache's scale (DeepseekForCausalLM.kv_scales); 1.0 otherwise
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        hidden, bias = config.hidden_size, config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, h * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = Linear(h * mla.v_head_dim, hidden, bias=bias and shard.rank == 0)
        self.scale = mla.qk_head_dim**-0.5
        if isinstance(config.rope_scaling, YarnRopeScaling):
            self.scale *= config.rope_scaling.softmax_mscale

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """``layer_kv``: this layer's ``[num_blocks, 1, block_size, 1, kv_lora_rank + rope_dim]``."""
        cache = layer_kv[:, 0]
        n, h = x.shape[0], self.num_heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, h, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], self.rotate(q[..., self.nope :], cos, sin)
        kv_a = self.kv_a_proj_with_mqa(x)
        k_pe = self.rotate(kv_a[:, None, self.rank :], cos, sin)[:, 0]
        write_latent(torch.cat([self.kv_a_layernorm(kv_a[:, : self.rank]), k_pe], dim=-1), cache, meta.slot_mapping,
                     kv_scale=self.kv_scale)  # fmt: skip
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)  # per head: W_UK rows, W_UV rows
        batch = (meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale)
        if self.form == "absorbed" or (self.form == "auto" and meta.max_query_len == 1):
            latent = mla_attention(absorb_query(q_nope, q_pe, w), cache, *batch, self.rank, plan=meta.torch_plan,
                                   kv_scale=self.kv_scale)  # fmt: skip
            out = expand_latent(latent, w, self.nope)
        elif self.form == "naive":
            out = mla_attention_naive(q_nope, q_pe, cache, w, *batch, kv_scale=self.kv_scale)
        else:  # a step with a prefill: its decodes absorbed, its prefills decompressed
            if meta.mla_plan is None:  # the first layer plans the step for all of them
                meta.mla_plan = plan_mixed(meta.block_tables, meta.seq_lens, meta.query_start_loc, cache.shape[1])
            out = mla_attention_mixed(q_nope, q_pe, cache, w, *batch, kv_scale=self.kv_scale, plan=meta.mla_plan)
        out = self.o_proj(out.reshape(n, h * self.v_dim))
        return out if self.comm is None else self.comm.all_reduce(out)


class DeepseekDecoderLayer(DecoderLayer):
    """Pre-norm block with MLA, and MoE from ``first_k_dense_replace`` on (a dense SwiGLU before)."""

    def make_attention(self, config: ModelConfig) -> nn.Module:
        return MLAAttention(config, self.comm)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        assert config.moe is not None
        return MoE(config, self.comm) if config.moe.is_moe_layer(layer_idx) else MLP(config, comm=self.comm)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2/V3 causal LM (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``).

    Checkpoint experts come one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``,
    the released format) or stacked (``mlp.experts.gate_up_proj``, transformers' in-memory form);
    both load. V3's multi-token-prediction layers (``model.layers.{num_hidden_layers}...``, as many as
    ``num_nextn_predict_layers``) are not used for generation and are skipped.
    """

    decoder_layer = DeepseekDecoderLayer

    def set_mla_form(self, form: str) -> None:
        """Choose the attention form of every layer (see the module docstring)."""
        if form not in MLA_FORMS:
            raise ValueError(f"MLA form must be one of {MLA_FORMS}, got {form!r}")
        for layer in self.model.layers:
            layer.self_attn.form = form

    def kv_scales(self, quantized: bool) -> tuple[float, ...]:
        """One scale per layer for an FP8 cache of latent rows: the checkpoint's ``self_attn.k_scale``
        where it has one (vLLM reads an MLA cache with it), else 1.0; empty for a float cache. Also
        sets them on the attention layers."""
        found = getattr(self, "checkpoint_kv_scales", {})
        scales: list[float] = []
        for i, layer in enumerate(self.model.layers):
            value = found.get((i, "k"), 1.0) if quantized else 1.0
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"layer {i}: KV-cache scale {value} must be a finite number > 0")
            layer.self_attn.kv_scale = value
            scales.append(value)
        return tuple(scales) if quantized else ()

    @torch.no_grad()
    def keep_float32(self) -> None:
        """The MoE router's weight and correction bias stay float32, as in DeepSeek's and transformers'
        code: rounded to bf16 they pick other experts for a few percent of tokens in every layer."""
        for module in self.modules():
            if isinstance(module, MoEGate):
                for p in module.parameters():
                    p.data = torch.empty_like(p.data, dtype=torch.float32)

    def weight_target(self, name: str, params: dict[str, nn.Parameter]) -> torch.Tensor | None:
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            stack = params.get(f"{expert[1]}.{'down_proj' if expert[3] == 'down_proj' else 'gate_up_proj'}")
            if stack is None or int(expert[2]) >= stack.shape[0]:
                return None
            one = stack.data[int(expert[2])]
            if expert[3] == "down_proj":
                return one
            half = one.shape[0] // 2
            return one.narrow(0, 0 if expert[3] == "gate_proj" else half, half)
        fused = _FUSED_EXPERTS.fullmatch(name)
        if fused is not None:
            param = params.get(name)
            return None if param is None else param.data
        *prefix, module, kind = name.split(".")
        if module in ("gate_proj", "up_proj"):  # dense and shared-expert SwiGLUs: halves of gate_up_proj
            param = params.get(".".join([*prefix, "gate_up_proj", kind]))
            if param is None:
                return None
            half = param.shape[0] // 2
            return param.data.narrow(0, 0 if module == "gate_proj" else half, half)
        param = params.get(name)
        return None if param is None else param.data

    def weight_shard(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint weight ``name`` that this rank holds (see
        :class:`MLAAttention` and :class:`MoE`); None: all of it."""
        if self.shard.size == 1:
            return None
        c, shard = self.config, self.shard
        assert c.mla is not None
        *_, module, kind = name.split(".")
        start, count = shard.split(c.num_attention_heads)
        per_head = {"q_proj": c.mla.qk_head_dim, "q_b_proj": c.mla.qk_head_dim,
                    "kv_b_proj": c.mla.qk_nope_head_dim + c.mla.v_head_dim}  # fmt: skip
        if module in per_head:
            return 0, start * per_head[module], count * per_head[module]
        if module == "o_proj" and kind == "weight":
            return 1, start * c.mla.v_head_dim, count * c.mla.v_head_dim
        if module in ("gate_proj", "up_proj", "down_proj"):
            start, count = shard.split(self._intermediate_size(name))
            return (1 if module == "down_proj" else 0), start, count
        if module in ("embed_tokens", "lm_head"):
            return (0, *shard.vocab(c.vocab_size))
        return None

    def _intermediate_size(self, name: str) -> int:
        """The whole intermediate width of the SwiGLU that checkpoint weight ``name`` belongs to."""
        c = self.config
        if ".mlp.experts." in name or ".mlp.shared_experts." in name:
            assert c.moe is not None
            shared = c.moe.n_shared_experts if ".shared_experts." in name else 1
            return c.moe.moe_intermediate_size * shared
        return c.intermediate_size

    def read_weight(self, name: str, source: torch.Tensor | object) -> torch.Tensor:
        fused = _FUSED_EXPERTS.fullmatch(name)
        if fused is None or self.shard.size == 1:
            return super().read_weight(name, source)
        assert self.config.moe is not None
        whole = read_shard(source, None)  # stacked experts: this rank's columns of each
        start, count = self.shard.split(self.config.moe.moe_intermediate_size)
        if fused[2] == "down_proj":  # [E, hidden, I]
            return whole.narrow(2, start, count)
        inter = self.config.moe.moe_intermediate_size  # [E, 2I, hidden]: gate rows, then up rows
        return torch.cat([whole.narrow(1, start, count), whole.narrow(1, inter + start, count)], dim=1)

    def skip_weight(self, name: str) -> bool:
        layer = _LAYER.match(name)  # V3's multi-token-prediction layers come right after the stack
        c = self.config
        return super().skip_weight(name) or (
            layer is not None and c.num_hidden_layers <= int(layer[1]) < c.num_hidden_layers + c.num_mtp_layers
        )

    def checkpoint_weight_names(self) -> set[str]:
        names: set[str] = set()
        for name, param in self.named_parameters():
            fused = _FUSED_EXPERTS.fullmatch(name)
            if fused is not None:
                projections = ("down_proj",) if fused[2] == "down_proj" else ("gate_proj", "up_proj")
                names.update(f"{fused[1]}.{e}.{p}.weight" for e in range(param.shape[0]) for p in projections)
                continue
            *prefix, module, kind = name.split(".")
            for hf in ("gate_proj", "up_proj") if module == "gate_up_proj" else (module,):
                names.add(".".join([*prefix, hf, kind]))
        return names

    def covered_names(self, name: str) -> list[str]:
        fused = _FUSED_EXPERTS.fullmatch(name)
        if fused is None:
            return [name]
        num = self.config.moe.n_routed_experts if self.config.moe else 0
        projections = ("down_proj",) if fused[2] == "down_proj" else ("gate_proj", "up_proj")
        return [f"{fused[1]}.{e}.{p}.weight" for e in range(num) for p in projections]
