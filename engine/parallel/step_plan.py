"""One step's inputs as the driver sends them to the other tensor-parallel ranks.

Integers only (no pickle: a rank never unpickles what arrives on its pipe), framed as an 8-byte
length then int64 values: a header ``[VERSION, tokens, seqs, max_blocks, sample_rows,
max_query_len, max_seq_len]``, then input ids, positions, slot mapping, the block table row by
row, sequence lengths, query start offsets and the rows to sample. A rank rebuilds exactly the
driver's tensors from it, and derives the rest (the torch attention plan) itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

from pdserve.engine.kernels.metadata import AttentionMetadata

VERSION = 1
_HEADER = 7
_LENGTH = struct.Struct("<Q")


@dataclass
class StepPlan:
    """What every rank's forward needs: the model inputs, the attention metadata (without its
    torch plan) and the hidden rows whose logits are computed."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]

    def encode(self) -> bytes:
        m = self.meta
        tokens, seqs = self.input_ids.numel(), m.seq_lens.numel()
        header = torch.tensor([VERSION, tokens, seqs, m.block_tables.shape[1], len(self.sample_rows),
                               m.max_query_len, m.max_seq_len], dtype=torch.int64)  # fmt: skip
        parts = [header, self.input_ids, self.positions, m.slot_mapping, m.block_tables.reshape(-1), m.seq_lens,
                 m.query_start_loc, torch.tensor(self.sample_rows, dtype=torch.int64)]  # fmt: skip
        body = torch.cat([p.to(torch.int64) for p in parts]).numpy().tobytes()
        return _LENGTH.pack(len(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> StepPlan:
        """ValueError on a frame that is not a well-formed plan of this version."""
        values = torch.frombuffer(bytearray(body), dtype=torch.int64)
        if values.numel() < _HEADER or int(values[0]) != VERSION:
            raise ValueError("not a step plan of this version")
        _, tokens, seqs, max_blocks, rows, max_q, max_seq = (int(v) for v in values[:_HEADER])
        sizes = [tokens, tokens, tokens, seqs * max_blocks, seqs, seqs + 1, rows]
        if min(sizes) < 0 or _HEADER + sum(sizes) != values.numel():
            raise ValueError("step plan: the sizes in its header do not match its length")
        ids, pos, slots, table, seq_lens, qsl, sample = values[_HEADER:].split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots.clone(),
            block_tables=table.to(torch.int32).view(seqs, max_blocks),
            seq_lens=seq_lens.to(torch.int32),
            query_start_loc=qsl.to(torch.int32),
            max_query_len=max_q,
            max_seq_len=max_seq,
        )
        return cls(ids.clone(), pos.clone(), meta, sample.tolist())


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's body, or None at the end of the stream (the driver closed it)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    body = stream.read(length)
    if len(body) < length:
        return None
    return body
