"""BlockTables (rows kept across steps) against the table built from scratch each step, and the
attention plan's per-group block gather against a per-sequence Python construction."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.block_tables import BlockTables
from pdserve.engine.kernels.torch_paged import plan_attention


def _from_scratch(block_ids: list[list[int]]) -> list[list[int]]:
    width = max((len(b) for b in block_ids), default=0)
    return [[max(i, 0) for i in b] + [0] * (width - len(b)) for b in block_ids]


def test_a_decoding_batch_matches_the_table_built_from_scratch_at_every_step() -> None:
    """Requests join, grow by a block now and then, slide blocks out (-1), get preempted and
    rescheduled with other blocks, skip steps and end; every step's table is the from-scratch one."""
    rng = random.Random(7)
    tables = BlockTables()
    live: dict[str, list[int]] = {}
    next_block, next_id = 1, 0
    for _step in range(400):
        if len(live) < 12 and rng.random() < 0.3:  # a new request with a few blocks
            live[f"r{next_id}"] = list(range(next_block, next_block + rng.randint(0, 5)))
            next_block += 8
            next_id += 1
        for rid, blocks in list(live.items()):
            roll = rng.random()
            if roll < 0.2:
                blocks.append(next_block)
                next_block += 1
            elif roll < 0.25 and blocks:
                blocks[rng.randrange(len(blocks))] = -1  # slid out of the window
            elif roll < 0.28:
                live[rid] = list(range(next_block, next_block + rng.randint(1, 4)))  # preempted, recomputed
                next_block += 8
            elif roll < 0.32:
                del live[rid]  # ended
        step = [rid for rid in live if rng.random() < 0.9]  # some requests sit a step out
        rng.shuffle(step)
        block_ids = [live[rid] for rid in step]
        table = tables.table(step, block_ids)
        assert table.dtype == torch.int32 and table.is_contiguous()
        assert table.tolist() == _from_scratch(block_ids) or (not step and table.shape[0] == 0)
        assert len(tables) == len(step)  # the rows of requests not in the step are released
        tables.check()


def test_a_list_mutated_in_place_after_a_step_is_seen_at_the_next() -> None:
    """The KV manager appends to the list it handed out: the kept row is a copy, so the next
    step still sees the change."""
    tables = BlockTables()
    blocks = [3, 4]
    assert tables.table(["a"], [blocks]).tolist() == [[3, 4]]
    blocks.append(9)
    assert tables.table(["a"], [blocks]).tolist() == [[3, 4, 9]]
    blocks[:] = [5]
    assert tables.table(["a"], [blocks]).tolist() == [[5]]
    tables.check()


def test_bad_arguments_are_refused() -> None:
    tables = BlockTables()
    with pytest.raises(ValueError):
        tables.table(["a", "a"], [[1], [2]])
    with pytest.raises(ValueError):
        tables.table(["a"], [[1], [2]])


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("fused", [False, True])
def test_the_plan_s_decode_groups_read_the_blocks_a_per_sequence_construction_names(
    window: int | None, fused: bool
) -> None:
    rng = random.Random(3)
    block_size = 16
    lens = [rng.randint(1, 200) for _ in range(9)]
    width = max(-(-n // block_size) for n in lens) + 2  # rows longer than their sequences need
    table = torch.tensor([[rng.randint(1, 500) for _ in range(width)] for _ in lens], dtype=torch.int32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)  # every sequence a decode
    plan = plan_attention(table, torch.tensor(lens, dtype=torch.int32), qsl, block_size, window, False, fused)
    for group in plan.decode_groups:
        padded_blocks = group.padded_len // block_size
        want = []
        for row in group.rows.tolist():
            first = 0 if window is None else max(lens[row] - window, 0) // block_size
            ids = table[row, first : -(-lens[row] // block_size)].tolist()
            want.extend(ids + [0] * (padded_blocks - len(ids)))
        assert group.block_index.dtype == torch.int64 and group.block_index.tolist() == want
        if not fused:  # padding rows: every gathered position past the sequence's span
            spans = [lens[r] - (0 if window is None else max(lens[r] - window, 0) // block_size * block_size)
                     for r in group.rows.tolist()]  # fmt: skip
            pad = [b * group.padded_len + p for b, span in enumerate(spans) for p in range(span, group.padded_len)]
            assert group.pad_rows.tolist() == pad
