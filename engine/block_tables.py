"""BlockTables: the step's block table built from rows kept across steps (a persistent input batch)."""

from __future__ import annotations

import torch


class BlockTables:
    """Each scheduled request's row of physical block ids, kept from one step to the next.

    A decode's block list changes once every ``block_size`` tokens (one block appended), so a step
    writes only the ids that changed and gathers the step's ``[num_seqs, max_blocks]`` table from the
    kept rows in one call, where building it from Python lists costs time in the number of blocks of
    every sequence, every step (2.4 ms for 64 sequences of 2,048 tokens; vLLM V1 keeps its input
    batch for the same reason).

    Guarantees: ``table(request_ids, block_ids)`` equals the table built from scratch: row ``s`` holds
    ``block_ids[s]`` with null ids (-1, blocks slid out of a window) as 0, then zeros to the widest
    row; int32, contiguous. A request's row is released at the first step that does not schedule it,
    so the state holds the last step's requests only and needs no call when a request ends.

    Invariant (``check``): every id of a row past its request's blocks, and every id of a free row, is 0.
    The rows live on the CPU; a step's table is copied to ``device`` once.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._table = torch.zeros((0, 0), dtype=torch.int32)
        self._rows: dict[str, int] = {}  # request id -> its row
        self._written: list[list[int]] = []  # row -> the block ids written there ([] when free)
        self._free: list[int] = []

    def table(self, request_ids: list[str], block_ids: list[list[int]]) -> torch.Tensor:
        """The step's block table, one row per request, in the order given; the rows of requests
        not given are released."""
        if len(request_ids) != len(block_ids) or len(set(request_ids)) != len(request_ids):
            raise ValueError("one list of block ids per distinct request id is required")
        for gone in self._rows.keys() - set(request_ids):
            self._release(self._rows.pop(gone))
        width = max((len(b) for b in block_ids), default=0)
        self._reserve(len(request_ids), width)
        rows = [self._write(rid, blocks) for rid, blocks in zip(request_ids, block_ids)]
        index = torch.tensor(rows, dtype=torch.int64)
        out = self._table[:, :width].index_select(0, index)  # contiguous: a new tensor
        return out if self.device.type == "cpu" else out.to(self.device)

    def __len__(self) -> int:
        """Rows in use."""
        return len(self._rows)

    def check(self) -> None:
        """Raise AssertionError unless the invariant holds (tests)."""
        used = set(self._rows.values())
        assert not used & set(self._free) and len(used) == len(self._rows), "a row both free and in use"
        for row, written in enumerate(self._written):
            assert row in used or not written, f"free row {row} keeps ids"
            want = [max(i, 0) for i in written] + [0] * (self._table.shape[1] - len(written))
            assert self._table[row].tolist() == want, f"row {row} holds {self._table[row].tolist()}, not {want}"

    def _write(self, request_id: str, blocks: list[int]) -> int:
        row = self._rows.get(request_id)
        if row is None:
            row = self._free.pop() if self._free else self._new_row()
            self._rows[request_id] = row
        written = self._written[row]
        if blocks == written:
            return row
        kept = len(written)
        start = kept if len(blocks) >= kept and blocks[:kept] == written else 0  # appended, or rewritten
        if len(blocks) > start:
            self._table[row, start : len(blocks)] = torch.tensor([max(i, 0) for i in blocks[start:]], dtype=torch.int32)
        if kept > len(blocks):
            self._table[row, len(blocks) : kept] = 0
        self._written[row] = list(blocks)
        return row

    def _release(self, row: int) -> None:
        self._table[row, : len(self._written[row])] = 0
        self._written[row] = []
        self._free.append(row)

    def _new_row(self) -> int:
        self._written.append([])
        return len(self._written) - 1

    def _reserve(self, num_rows: int, width: int) -> None:
        """Room for ``num_rows`` more rows than are in use, ``width`` ids each (doubling, so a
        growing batch or sequence copies the table a logarithmic number of times)."""
        rows_needed = len(self._rows) + num_rows
        have_rows, have_width = self._table.shape
        if rows_needed <= have_rows and width <= have_width:
            return
        rows = max(rows_needed, 2 * have_rows) if rows_needed > have_rows else have_rows
        cols = max(width, 2 * have_width) if width > have_width else have_width
        grown = torch.zeros((rows, cols), dtype=torch.int32)
        grown[:have_rows, :have_width] = self._table
        self._table = grown
