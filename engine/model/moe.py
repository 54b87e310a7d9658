"""DeepSeek's mixture of experts: a top-k router, the routed experts and the shared experts.

Correct first, simple second: the routed experts run as a loop over the experts that this step's
tokens chose (tokens grouped per expert, one pair of matmuls each), the way transformers does it.
The routing semantics are :class:`engine.model.deepseek_config.MoEConfig`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import MLP
from pdserve.engine.model.tp_layers import TPComm


class MoEGate(nn.Module):
    """Scores every expert for every token and picks ``num_experts_per_tok`` of them (float32)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.moe is not None
        self.cfg = m = config.moe
        self.weight = nn.Parameter(torch.empty(m.n_routed_experts, config.hidden_size))
        # V3: a learned per-expert bias that steers the choice (not the weights).
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(m.n_routed_experts)) if m.topk_method == "noaux_tc" else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights float32 [n, k], expert ids int64 [n, k])`` for ``x [n, hidden]``."""
        m = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # float32 parameters (keep_float32), float32 scores
        scores = logits.softmax(dim=-1) if m.scoring == "softmax" else logits.sigmoid()
        k = m.num_experts_per_tok
        if m.topk_method == "greedy":
            weights, ids = torch.topk(scores, k, dim=-1, sorted=False)
        elif m.topk_method == "group_limited_greedy":
            # Only the topk_group groups whose best expert scores highest compete.
            group_best = scores.view(-1, m.n_group, m.n_routed_experts // m.n_group).amax(dim=-1)
            masked = scores.masked_fill(~self._group_mask(group_best), 0.0)
            weights, ids = torch.topk(masked, k, dim=-1, sorted=False)
        else:  # noaux_tc
            choice = scores + self.e_score_correction_bias.float()
            group_top2 = choice.view(-1, m.n_group, m.n_routed_experts // m.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(group_top2), float("-inf"))
            ids = torch.topk(choice, k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, ids

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """bool ``[n, n_routed_experts]``: experts of each token's ``topk_group`` best groups."""
        m = self.cfg
        best = torch.topk(group_scores, m.topk_group, dim=-1, sorted=False)[1]
        groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return groups.repeat_interleave(m.n_routed_experts // m.n_group, dim=1)


class Experts(nn.Module):
    """The routed experts' SwiGLU weights as stacked tensors: ``gate_up_proj [E, 2I, hidden]``
    (gate rows, then up rows) and ``down_proj [E, hidden, I]``, ``I`` being ``inter`` (a
    tensor-parallel rank's columns of every expert) or the whole ``moe_intermediate_size``."""

    def __init__(self, config: ModelConfig, inter: int | None = None) -> None:
        super().__init__()
        assert config.moe is not None
        e, inter = config.moe.n_routed_experts, inter or config.moe.moe_intermediate_size
        self.inter = inter
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, config.hidden_size, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token ``t``."""
        out = torch.zeros_like(x)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        flat_weights = weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start : start + count]  # (token, slot) pairs routed here, as flat indices
            start += count
            tokens = torch.div(picks, k, rounding_mode="floor")
            gate_up = F.linear(x[tokens], self.gate_up_proj[expert])
            y = F.linear(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :], self.down_proj[expert])
            out.index_add_(0, tokens, (y * flat_weights[picks, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    """``experts(x) + shared_experts(x)``: routed experts weighted by the gate, plus the
    always-on shared experts (one SwiGLU of ``n_shared_experts * moe_intermediate_size``).

    Under tensor parallelism (``comm``) every rank holds the whole gate (so every rank routes each
    token alike) and its share of every expert's intermediate columns, routed and shared, as
    vLLM's tensor-parallel MoE does; one all-reduce sums the ranks' partial outputs of both."""

    def __init__(self, config: ModelConfig, comm: TPComm | None = None) -> None:
        super().__init__()
        assert config.moe is not None
        m = config.moe
        self.comm = comm
        inter = m.moe_intermediate_size if comm is None else comm.shard.split(m.moe_intermediate_size)[1]
        self.gate = MoEGate(config)
        self.experts = Experts(config, inter)
        self.shared_experts = (MLP(config, m.moe_intermediate_size * m.n_shared_experts, comm, reduce=False)
                               if m.n_shared_experts else None)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.comm is None else self.comm.all_reduce(out)
