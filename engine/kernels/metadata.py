"""Per-step attention metadata: how a flattened batch of query tokens maps onto paged KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one forward step over a mixed batch (prefill chunks and decodes).

    The batch's query tokens are flattened: sequence ``s`` owns query rows
    ``query_start_loc[s]:query_start_loc[s+1]``. After this step sequence ``s`` has
    ``seq_lens[s]`` tokens of KV; its queries are the last ``q_len`` of them, so
    query row ``j`` sits at position ``seq_lens[s] - q_len + j`` and attends causally
    to KV positions ``<= `` that. ``block_tables[s, i]`` is the physical block that
    holds positions ``i*block_size .. (i+1)*block_size-1``. ``slot_mapping[t]`` is the
    flat slot (``block_id * block_size + offset``) where token ``t``'s new K/V is
    written; ``-1`` skips the write.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int
    max_seq_len: int
    # CPU only: the torch path's per-step index plan, shared by every layer (see torch_paged).
    torch_plan: object | None = None
    # MLA models: the mixed step's plan (kernels.mla.plan_mixed), made by the first layer, shared by all.
    mla_plan: object | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
