"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch and a paged KV cache.

:class:`LlamaForCausalLM` is also the frame other decoders plug into (DeepSeek's, in
:mod:`engine.model.deepseek`): the embeddings, the stack, the final norm, the head and the strict
weight loading are shared; a subclass names its ``decoder_layer`` and maps checkpoint names.

The batch is flattened: ``input_ids``/``positions`` are ``[num_tokens]`` covering
every scheduled sequence back to back, described by an :class:`AttentionMetadata`.
There is no padding and no per-sequence Python loop; per-layer work is a fixed,
small number of torch calls because tiny-model CPU decoding is overhead-bound.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels import cpu_amx, cpu_gemm, cpu_ops, gather_shared_prefix, paged_attention, write_kv
from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.model import decode_replay, replayer
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.gemm_paths import GEMM_CHOICES, Projection, RowPaths, choose
from pdserve.engine.model.linear import Linear, PackedWeights, onednn_supported, packed_copy, project
from pdserve.engine.model.rope import RotaryEmbedding, apply_rotary
from pdserve.engine.model.tp_layers import TPComm, VocabParallelEmbedding
from pdserve.engine.parallel.shard import TPShard


# ----------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back, then scaled (HF's order of rounding). On the CPU rows
    go through ``cpu_ops`` (one call, the same rounding) when the weight shares their dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self._fused(x):
            return cpu_ops.add_rms_norm(x, None, self.weight, self.eps)[1]
        return self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + delta, self(h + delta))``: a residual add and the norm after it."""
        if h.dim() == 2 and self._fused(h) and delta.dtype == h.dtype and cpu_ops.supports(delta):
            return cpu_ops.add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)

    def _fused(self, x: torch.Tensor) -> bool:
        return self.weight.dtype == x.dtype and cpu_ops.supports(x) and cpu_ops.supports(self.weight)


def rotate_qk(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The first ``heads`` heads of each row of ``qkv [n, w]`` rotated, as ``[n, heads, head_dim]``: in
    place through ``cpu_ops`` (a view of ``qkv``, which the caller owns) or by ``apply_rotary``."""
    n = qkv.shape[0]
    if cpu_ops.supports(qkv) and cos.dtype == qkv.dtype and cos.is_contiguous() and sin.is_contiguous():
        cpu_ops.rotary_(qkv, heads, head_dim, cos, sin)
        return qkv[:, : heads * head_dim].view(n, heads, head_dim)
    return apply_rotary(qkv[:, : heads * head_dim].view(n, heads, head_dim), cos, sin)


class Attention(nn.Module):
    """GQA attention with fused q/k/v projection; K/V go to the paged cache.

    Under tensor parallelism (``comm``) the layer holds its rank's query heads and KV heads
    (``TPShard``), reads and writes only those heads' slice of the cache, and sums ``o_proj``'s
    partial outputs over the ranks (its bias, if any, is held by rank 0 alone).
    """

    def __init__(self, config: ModelConfig, comm: TPComm | None = None, layer_idx: int = 0) -> None:
        super().__init__()
        shard = comm.shard if comm is not None else TPShard()
        self.comm = comm
        self.layer_idx = layer_idx  # which layer of the KV tensor its caches are
        _, self.num_heads = shard.split(config.num_attention_heads)
        kv_start, self.num_kv_heads = shard.kv_heads(config.num_key_value_heads)
        # The cache's head slice this rank owns (None: all of them, the single-device path).
        self.kv_slice = slice(kv_start, kv_start + self.num_kv_heads) if shard.size > 1 else None
        self.head_dim = hd = config.head_dim
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.qk_size = q_size + kv_size
        self.qk_heads = self.num_heads + self.num_kv_heads
        self.scale = config.head_dim**-0.5
        # An FP8 KV cache's per-tensor scales (set by LlamaForCausalLM.kv_scales); 1.0 otherwise.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.sliding_window = config.sliding_window
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias and shard.rank == 0)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``layer_kv``: this layer's ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (K, V)."""
        if self.kv_slice is not None:
            layer_kv = layer_kv[:, :, :, self.kv_slice]
        k_cache, v_cache = layer_kv.unbind(1)
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k in one go: they are adjacent columns of qkv.
        qk = rotate_qk(qkv, self.qk_heads, self.head_dim, cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.qk_size :].view(n, self.num_kv_heads, self.head_dim)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        out = paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.scale, meta.max_query_len, meta.max_seq_len, plan=meta.torch_plan,
            sliding_window=self.sliding_window, k_scale=self.k_scale, v_scale=self.v_scale, layer=self.layer_idx,
        )
        out = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return out if self.comm is None else self.comm.all_reduce(out)


class MLP(nn.Module):
    """SwiGLU with fused gate/up projection (gate first, then up). Under tensor parallelism
    (``comm``) it holds its rank's intermediate columns and sums ``down_proj``'s partial outputs
    (unless ``reduce`` is False: its caller sums them with others, in one all-reduce)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, comm: TPComm | None = None,
                 reduce: bool = True) -> None:  # fmt: skip
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.comm = comm if reduce else None
        self.inter = inter = inter if comm is None else comm.shard.split(inter)[1]
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        self._glu: cpu_amx.AMXGluWeights | cpu_gemm.PanelGluWeights | None = None  # gate/up and silu (fuse_glu)
        self._glu_paths: RowPaths | None = None  # row counts gate/up runs on torch's product (gemm_paths)

    def fuse_glu(self) -> None:
        """Where gate/up's packed copy is one of the C kernels' (AMX tiles in bfloat16, panels in
        float32), replace it by one that applies ``silu(gate) * up`` from the product's sums in the same
        pass (``AMXGluWeights``, ``PanelGluWeights``: bit for bit the product then ``cpu_ops.silu_mul``,
        in one call and without the ``[rows, 2 * inter]`` product in memory). Call after
        ``gate_up_proj.pack()`` and its ``paths``: 2-D inputs then take the fused copy, except the row
        counts ``paths`` sends to torch's product; the weight keeps one packed copy."""
        proj = self.gate_up_proj
        copy, weight = proj.packed_copy, proj.weight
        if proj.bias is not None:
            return
        if isinstance(copy, cpu_amx.AMXWeights) and cpu_amx.glu_available(weight):
            fused: cpu_amx.AMXGluWeights | cpu_gemm.PanelGluWeights = cpu_amx.AMXGluWeights(weight)
        elif isinstance(copy, cpu_gemm.PanelWeights) and cpu_gemm.glu_available(weight):
            fused = cpu_gemm.PanelGluWeights(weight)
        else:
            return
        self._glu, self._glu_paths = fused, proj.paths
        proj.unpack()

    def unfuse_glu(self) -> None:
        """Drop the fused copy (gate/up then runs as its ``Linear`` is packed)."""
        self._glu = self._glu_paths = None

    def fused_glu_for(self, rows: int) -> cpu_amx.AMXGluWeights | cpu_gemm.PanelGluWeights | None:
        """The fused gate/up copy (:meth:`fuse_glu`) that a 2-D input of ``rows`` rows runs through, or
        None where :meth:`forward` takes the unfused path."""
        paths = self._glu_paths
        return None if paths is not None and paths.use_torch(rows) else self._glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        glu = self.fused_glu_for(x.shape[0]) if x.dim() == 2 else None
        if glu is not None:
            act = glu(x)
        else:
            gate_up = self.gate_up_proj(x)
            if cpu_ops.supports(gate_up):
                act = cpu_ops.silu_mul(gate_up, self.inter)
            else:
                act = F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]
        out = self.down_proj(act)
        return out if self.comm is None else self.comm.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, comm: TPComm | None = None) -> None:
        super().__init__()
        self.comm = comm  # read by make_attention / make_mlp
        self.layer_idx = layer_idx  # read by make_attention
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.make_attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, layer_idx)

    def make_attention(self, config: ModelConfig) -> nn.Module:
        return Attention(config, self.comm, self.layer_idx)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return MLP(config, comm=self.comm)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        layer_kv: torch.Tensor, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The block on ``residual + h`` (on ``h`` for the first layer, whose ``residual`` is None), as
        ``(delta, residual)``: its output is their sum, which the next norm adds in its own pass
        (``RMSNorm.add_forward``) rather than an add of its own per layer; the same rounding.
        ``layer_kv``: this layer's slice of the KV tensor (what its attention reads and writes)."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = self.input_layernorm.add_forward(residual, h)
        attn = self.self_attn(x, cos, sin, layer_kv, meta)
        residual, x = self.post_attention_layernorm.add_forward(residual, attn)
        return self.mlp(x), residual


class Embedding(nn.Embedding):
    """``nn.Embedding`` without its random init: the checkpoint overwrites the weight, and the init's
    ``normal_`` on the meta device (where models are built) imports ``torch._dynamo``, about 2.5 s of
    every worker's start that nothing else needs."""

    def reset_parameters(self) -> None:
        pass


class LlamaModel(nn.Module):
    """Embeddings, decoder stack, final norm and the shared rope tables (HF module names)."""

    def __init__(self, config: ModelConfig, layer_cls: type[nn.Module] = DecoderLayer, comm: TPComm | None = None) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = (
            Embedding(config.vocab_size, config.hidden_size) if comm is None
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm)
        )
        if comm is None:
            self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        else:
            self.layers = nn.ModuleList(layer_cls(config, i, comm) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


# HF per-projection names -> (our fused module, index of the shard within it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM over a flat batch and a paged KV cache.

    ``kv_cache`` is one tensor ``[num_blocks, num_layers, 2, block_size,
    num_kv_heads, head_dim]`` in the model's dtype; layer ``l`` reads and writes
    ``kv_cache[:, l, 0]`` (K) and ``kv_cache[:, l, 1]`` (V). Parameter names follow
    HF except the fused ``qkv_proj`` (rows q, k, v) and ``gate_up_proj`` (rows gate,
    up); :meth:`load_weights` maps HF checkpoint names onto them.

    ``shard``: the tensor-parallel rank this instance is (``engine/parallel/shard.py``): it holds
    and loads only that rank's slice of every split weight, and must :meth:`join` its group
    before it runs. The KV cache it is given still holds every KV head (the worker's one cache);
    each layer reads and writes its own heads' slice.
    """

    decoder_layer: type[nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = shard or TPShard()
        self.comm = TPComm(shard) if shard.size > 1 else None
        self.model = LlamaModel(config, self.decoder_layer, self.comm)
        # Tied models reuse the embedding matrix; no separate lm_head parameter.
        self.lm_head = (
            None if config.tie_word_embeddings
            else Linear(config.hidden_size, shard.vocab(config.vocab_size)[1], bias=False)
        )
        hd = config.head_dim
        q = shard.split(config.num_attention_heads)[1] * hd
        kv = shard.kv_heads(config.num_key_value_heads)[1] * hd
        inter = shard.split(config.intermediate_size)[1]
        self._shard_sizes = {"qkv_proj": (q, kv, kv), "gate_up_proj": (inter, inter)}
        self._head_packed: PackedWeights | None = None
        self._head_paths: RowPaths | None = None
        # Steps that qualify run their stack as the C kernels' calls alone (decode_replay.py); False:
        # every step takes the modules (the replay's results are the same bits).
        self.replay_decode = True
        self.replay_native = True  # the replay's calls made from C (cpu_replay.c) where built; False: from Python
        self._replayer: replayer.Replayer | None = None  # its layers' replays (parts empty: none qualify)
        self.last_step_replayed = False  # whether the last forward ran as the replay (benchmarks read it)
        # The KV heads the layers' attention reads (a rank's slice, else all), for the step's one gather of
        # a cascade's prefix; None where the layers are not this file's Attention (MLA's read no cascade).
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        self._cascade_heads = (attn.kv_slice or slice(None)) if isinstance(attn, Attention) else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run one step; returns final-normed hidden states ``[num_tokens, hidden]``.

        ``input_ids``/``positions`` are int64 ``[num_tokens]`` (positions are absolute
        token positions in each sequence, used for rope only); token ``t``'s K/V is
        written to ``attn_meta.slot_mapping[t]`` before attention, so the metadata must
        already count this step's tokens in ``seq_lens``.
        """
        c = self.config
        planes = 1 if c.kv_cache_kind == "mla" else 2
        expected = (c.num_hidden_layers, planes, kv_cache.shape[3] if kv_cache.dim() == 6 else -1,
                    c.kv_cache_heads, c.kv_cache_head_dim)  # fmt: skip
        if kv_cache.dim() != 6 or tuple(kv_cache.shape[1:]) != expected:
            raise ValueError(
                f"kv_cache shape {tuple(kv_cache.shape)} is not [num_blocks, {c.num_hidden_layers}, {planes}, "
                f"block_size, {c.kv_cache_heads}, {c.kv_cache_head_dim}]"
            )
        m = self.model
        if self._cascade_heads is not None:
            gather_shared_prefix(attn_meta.torch_plan, kv_cache, self._cascade_heads)
        h, residual = m.embed_tokens(input_ids), None
        cos, sin = m.rotary_emb.lookup(positions, h.dtype)  # shared by all layers
        replay = None
        if self.replay_decode:
            if self._replayer is None:
                self._replayer = replayer.Replayer(decode_replay.parts_of(m.layers) or [])
            if self._replayer.parts:
                replay = self._replayer.build(kv_cache, attn_meta, h, cos, sin, self.replay_native)
        self.last_step_replayed = replay is not None
        if replay is not None:
            h, residual = replay.run(h, cos, sin)
        else:
            for layer, layer_kv in zip(m.layers, kv_cache.unbind(1)):
                h, residual = layer(h, residual, cos, sin, layer_kv, attn_meta)
        return m.norm(h) if residual is None else m.norm.add_forward(residual, h)[1]

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` for the given hidden rows (select first): float32, or with
        ``widen=False`` the head's own dtype (the sampler widens what it reads; a greedy step reads
        none). Under tensor parallelism every rank must call it with the same rows: the ranks' vocab
        slices are gathered, in float32 whatever ``widen``."""
        local = project(hidden, self._head_weight(), None, self._head_packed, self._head_paths)
        if self.comm is None:
            return local.float() if widen else local
        return self.comm.gather_columns(local.float(), self.config.vocab_size)

    def join(self, group: object) -> None:
        """Give a tensor-parallel instance the group its collectives run in (``TPGroup``)."""
        if self.comm is None:
            raise ValueError("join: this model is not tensor-parallel")
        self.comm.join(group)  # type: ignore[arg-type]

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_onednn(self, fp32_gemm: str = "auto") -> bool:
        """Give every projection and the LM head a packed copy (``linear.packed_copy``: panels for the
        C kernel in float32 where it is built, else oneDNN's), and each SwiGLU's gate/up one that applies
        its activation too where the copy is a C kernel's (``MLP.fuse_glu``).

        float32 only, ``fp32_gemm`` (``gemm_paths``): "auto" times the copies against torch's products
        per weight shape and row count and keeps the faster per row count; "kernel" runs every row
        count through the copies; "torch" drops any and returns False.
        Call once the weights are loaded. Returns False (and changes nothing) where the
        path is unsupported: not float32 or bfloat16 (bfloat16: without oneDNN's bfloat16
        kernels for this CPU), not on the CPU, or torch without oneDNN.
        """
        if fp32_gemm not in GEMM_CHOICES:
            raise ValueError(f"fp32_gemm must be one of {GEMM_CHOICES}, got {fp32_gemm!r}")
        weight = self._head_weight()
        fp32 = weight.dtype == torch.float32
        if not onednn_supported(weight.dtype, weight.device):
            return False
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        mlps = [module for module in self.modules() if isinstance(module, MLP)]
        for module in mlps:
            module.unfuse_glu()
        if fp32 and fp32_gemm == "torch":
            for module in linears:
                module.unpack()
            self._head_packed = self._head_paths = None
            return False
        for module in linears:
            module.pack()
        self._head_packed, self._head_paths = packed_copy(weight, None), None
        if fp32 and fp32_gemm == "auto":
            # The head sees a batch's last positions only: its classes past a decode batch's take that choice.
            heads = [Projection(weight, None, self._head_packed, max_rows=64)]
            layers = [Projection(m.weight, m.bias, m.packed_copy) for m in linears]  # type: ignore[arg-type]
            *choices, self._head_paths = choose(layers + heads, lambda x, w, b: project(x, w, b, None))
            for module, paths in zip(linears, choices):
                module.paths = paths
        for module in mlps:
            module.fuse_glu()
        return True

    # ------------------------------------------------------------------ weights
    def checkpoint_weight_names(self) -> set[str]:
        """HF tensor names a complete checkpoint for this config must contain."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            *prefix, module, kind = name.split(".")
            for hf_module in _UNFUSED.get(module, (module,)):
                names.add(".".join([*prefix, hf_module, kind]))
        return names

    def weight_target(self, name: str, params: dict[str, nn.Parameter]) -> torch.Tensor | None:
        """The tensor a checkpoint weight is copied into (a shard of a fused parameter), or None
        when the model has no such weight. Subclasses map their own names."""
        *prefix, module, kind = name.split(".")
        fused, shard = _FUSED.get(module, (module, None))
        param = params.get(".".join([*prefix, fused, kind]))
        if param is None or shard is None:
            return None if param is None else param.data
        sizes = self._shard_sizes[fused]
        return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])

    def keep_float32(self) -> None:
        """Put back in float32 the parameters that must not lose precision in a bf16/fp16 model
        (called by the loader after the cast, before the weights are read). None here."""

    def skip_weight(self, name: str) -> bool:
        """Checkpoint weights read and dropped: ``*.rotary_emb.inv_freq`` (old checkpoints),
        ``lm_head.weight`` when embeddings are tied (it duplicates the embedding), and ``o_proj``'s
        bias on tensor-parallel ranks other than 0 (rank 0 adds it once)."""
        return (name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")
                or (self.shard.rank > 0 and name.endswith("o_proj.bias")))  # fmt: skip

    def weight_shard(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint weight ``name`` that this tensor-parallel rank holds;
        None: all of it (always, on one device)."""
        if self.shard.size == 1:
            return None
        c, shard = self.config, self.shard
        *_, module, kind = name.split(".")
        hd = c.head_dim
        if module == "q_proj":
            start, count = shard.split(c.num_attention_heads)
            return 0, start * hd, count * hd
        if module in ("k_proj", "v_proj"):
            start, count = shard.kv_heads(c.num_key_value_heads)
            return 0, start * hd, count * hd
        if module == "o_proj" and kind == "weight":
            start, count = shard.split(c.num_attention_heads)
            return 1, start * hd, count * hd
        if module in ("gate_proj", "up_proj", "down_proj"):
            start, count = shard.split(c.intermediate_size)
            return (1 if module == "down_proj" else 0), start, count
        if module in ("embed_tokens", "lm_head"):
            return (0, *shard.vocab(c.vocab_size))
        return None

    def read_weight(self, name: str, source: torch.Tensor | object) -> torch.Tensor:
        """This rank's part of checkpoint weight ``name`` (a tensor or a lazy slice)."""
        return read_shard(source, self.weight_shard(name))

    def covered_names(self, name: str) -> list[str]:
        """The :meth:`checkpoint_weight_names` a loaded checkpoint weight accounts for."""
        return [name]

    def kv_scales(self, quantized: bool) -> tuple[float, ...]:
        """(k_scale, v_scale) of each layer in turn for an FP8 cache (``quantized``): the
        checkpoint's where it has them, else 1.0; empty for a float cache. Also sets them on the
        attention layers (1.0 for a float cache)."""
        found = getattr(self, "checkpoint_kv_scales", {})
        scales: list[float] = []
        for i, layer in enumerate(self.model.layers):
            k = found.get((i, "k"), 1.0) if quantized else 1.0
            v = found.get((i, "v"), 1.0) if quantized else 1.0
            for value in (k, v):
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"layer {i}: KV-cache scale {value} must be a finite number > 0")
            layer.self_attn.k_scale, layer.self_attn.v_scale = k, v
            scales += [k, v]
        return tuple(scales) if quantized else ()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | object]]) -> None:
        """Copy HF-named tensors into the parameters (casting to their dtype/device). A weight may
        also be a lazy slice (safetensors' ``get_slice``): only this rank's part of it is read.

        Drops any oneDNN copies (:meth:`pack_onednn` must be called again after loading).

        Strict: raises ValueError listing every missing and unexpected name, or on a
        shape mismatch. Ignored: ``*.rotary_emb.inv_freq`` (old checkpoints) and
        ``lm_head.weight`` when embeddings are tied (it duplicates the embedding).
        """
        for module in self.modules():
            if isinstance(module, Linear):
                module.unpack()
            elif isinstance(module, MLP):
                module.unfuse_glu()
        self._head_packed = None
        self._head_paths = None
        params = dict(self.named_parameters())
        seen: set[str] = set()
        unexpected: list[str] = []
        self.checkpoint_kv_scales = {}
        for name, tensor in weights:
            if self.skip_weight(name):
                continue
            scale = _KV_SCALE_NAME.fullmatch(name)
            if scale is not None:  # an FP8 checkpoint's KV-cache scales (used with an FP8 cache)
                tensor = read_shard(tensor, None)
                if tensor.numel() != 1:
                    raise ValueError(f"{name} must be one value (a per-tensor scale), got shape {tuple(tensor.shape)}")
                self.checkpoint_kv_scales[(int(scale[1]), scale[2])] = float(tensor.float().item())
                continue
            target = self.weight_target(name, params)
            if target is None:
                unexpected.append(name)
                continue
            tensor = self.read_weight(name, tensor)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            seen.update(self.covered_names(name))
        missing = sorted(self.checkpoint_weight_names() - seen)
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing {len(missing)} weight(s): {_preview(missing)}")
            if unexpected:
                parts.append(f"unexpected {len(unexpected)} weight(s): {_preview(sorted(unexpected))}")
            raise ValueError("checkpoint does not match the model: " + "; ".join(parts))


def read_shard(source: torch.Tensor | object, spec: tuple[int, int, int] | None) -> torch.Tensor:
    """``source`` (a tensor, or a lazy checkpoint slice such as safetensors' ``get_slice``) cut to
    ``spec`` = (dim, start, length), reading only that part of a lazy one; None: all of it."""
    if isinstance(source, torch.Tensor):
        return source if spec is None else source.narrow(*spec)
    if spec is None:
        return source[:]  # type: ignore[index]
    dim, start, length = spec
    return source[(slice(None),) * dim + (slice(start, start + length),)]  # type: ignore[index]


_KV_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k|v)_scale")


def _preview(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"
