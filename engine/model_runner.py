"""ModelRunner: turns one scheduled step into flat model inputs, runs the model, samples."""

from __future__ import annotations

import torch

from pdserve.engine.block_tables import BlockTables
from pdserve.engine.kernels import cpu_decode, plan_attention
from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.kv_tensor import KVTensor
from pdserve.engine.parallel.ranks import RankLost, Ranks
from pdserve.engine.parallel.step_plan import StepPlan
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.engine.scheduler import ScheduledRequest


class ModelRunner:
    """Owns the model, the KV tensor and the sampler of one engine.

    ``execute`` guarantees: every scheduled request's new tokens have their K/V written
    into the slots its block table names, and each request with ``samples=True`` gets
    exactly one sampled token back, in scheduling order.

    ``cascade``: decodes that share prefix blocks read them once (``engine/kernels/cascade.py``).

    ``ranks``: the worker's other tensor-parallel ranks (``model`` is then rank 0's shard): each
    step's plan goes to them before the forward, which they run alongside. A step that loses a rank
    raises :class:`RankLost`, as does every step after it.
    """

    def __init__(self, model: torch.nn.Module, kv_tensor: KVTensor, block_size: int,
                 ranks: Ranks | None = None, cascade: bool = False) -> None:  # fmt: skip
        self.model = model
        self.cascade = cascade  # plan cascade attention for shared-prefix decodes (torch path)
        self.kv_tensor = kv_tensor
        self.block_size = block_size
        self.device = kv_tensor.device
        self.sampler = Sampler()
        self.block_tables = BlockTables(self.device)  # rows kept across steps
        self.ranks = ranks
        # CPU decodes read K/V in place (engine/kernels/cpu_decode.py) where its kernel builds here.
        self.fused_decode = self.device.type == "cpu" and cpu_decode.supports_model(
            model.config, next(model.parameters()).dtype, kv_tensor.layout.dtype)

    def prepare(
        self, scheduled: list[ScheduledRequest], block_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        sample_rows: list[int] = []
        for sr, blocks in zip(scheduled, block_ids):
            req = sr.request
            start = req.num_computed_tokens
            end = start + sr.num_new_tokens
            input_ids.extend(req.all_token_ids[start:end])
            pos = range(start, end)
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            seq_lens.append(end)
            qsl.append(qsl[-1] + sr.num_new_tokens)
            if sr.samples:
                sample_rows.append(qsl[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            # Null blocks (-1: slid out of the window) and padding point at block 0: never read.
            block_tables=self.block_tables.table([sr.request.request_id for sr in scheduled], block_ids),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_new_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
        )
        if dev.type == "cpu":
            meta.torch_plan = plan_attention(meta.block_tables, meta.seq_lens, meta.query_start_loc, bs,
                                             self.model.config.sliding_window, self.cascade, self.fused_decode)  # fmt: skip
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos_t, meta, sample_rows

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], block_ids: list[list[int]]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Run one step; return the sampled token of each request with ``samples=True`` (and its
        log-probs, when its params ask for them)."""
        if not scheduled:
            return [], []
        ids, positions, meta, rows = self.prepare(scheduled, block_ids)
        if self.ranks is None:
            hidden = self.model(ids, positions, self.kv_tensor.tensor, meta)
            if not rows:
                return [], []
            logits = self.model.compute_logits(hidden[rows], widen=False)
        else:
            logits = self._forward_parallel(ids, positions, meta, rows)
            if logits is None:
                return [], []
        sampling = [sr for sr in scheduled if sr.samples]
        return self.sampler.sample(
            logits, [sr.request.request_id for sr in sampling], [sr.request.sampling_params for sr in sampling]
        )

    def _forward_parallel(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                          rows: list[int]) -> torch.Tensor | None:  # fmt: skip
        """The step on every rank: the plan out, then rank 0's part of the forward (the others run
        theirs from the plan); the logits of ``rows``, or None without any."""
        assert self.ranks is not None
        self.ranks.send(StepPlan(ids, positions, meta, rows).encode())
        try:
            hidden = self.model(ids, positions, self.kv_tensor.tensor, meta)
            return self.model.compute_logits(hidden[rows]) if rows else None
        except Exception as e:  # the ranks are out of step now: a rank died, timed out, or this one failed
            self.ranks.fail(self.ranks.exited(wait_s=1.0) or f"a tensor-parallel step failed ({e})")
            raise RankLost(self.ranks.failure) from e
