"""The tensor-parallel pieces of a decoder: a model's place in its group and the vocab-parallel
embedding. Column-parallel projections are plain ``Linear`` layers of the rank's rows; the
row-parallel ones (``o_proj``, ``down_proj``) are plain ``Linear`` layers of its columns whose
outputs :meth:`TPComm.all_reduce` sums. With one rank every call here is a no-op on the
single-device path.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.parallel.shard import TPShard


class Collectives(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


class TPComm:
    """A model's tensor-parallel place: its ``shard`` and, once :meth:`join` is called, the group
    whose collectives its layers run (a model with ``shard.size > 1`` cannot run before)."""

    def __init__(self, shard: TPShard) -> None:
        self.shard = shard
        self.group: Collectives | None = None

    @property
    def parallel(self) -> bool:
        return self.shard.size > 1

    def join(self, group: Collectives) -> None:
        self.group = group

    def _group(self) -> Collectives:
        if self.group is None:
            raise RuntimeError(f"tensor-parallel rank {self.shard.rank} of {self.shard.size} has not joined its group")
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (``x`` itself with one rank)."""
        return self._group().all_reduce(x) if self.parallel else x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """The ranks' column blocks of ``x`` (each ``shard.vocab_width(total)`` wide, the last padded)
        side by side, cut to ``total`` columns."""
        if not self.parallel:
            return x
        width = self.shard.vocab_width(total)
        if x.shape[1] < width:
            x = F.pad(x, (0, width - x.shape[1]))
        return torch.cat(self._group().all_gather(x), dim=1)[:, :total]


class VocabParallelEmbedding(nn.Module):
    """The rank's rows ``[start, start + count)`` of the embedding (parameter ``weight``, HF's name);
    a token outside them contributes zeros, and the all-reduce adds the owning rank's row."""

    def __init__(self, vocab_size: int, hidden_size: int, comm: TPComm) -> None:
        super().__init__()
        self.start, count = comm.shard.vocab(vocab_size)
        self.weight = nn.Parameter(torch.empty(count, hidden_size))
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(1), 0)
        return self.comm.all_reduce(out)
