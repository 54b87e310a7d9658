"""Token bitmasks: which tokens each constrained row of a step may sample, applied in one op.

A bitmask is int32 ``[rows, ceil(vocab / 32)]`` on the CPU (where the grammar library writes it),
bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed; xgrammar's layout. The sampler
fills one bitmask per step for all its rows (unconstrained rows stay all ones) and applies it to
the step's logits on their device at once: no loop over the vocabulary, none over rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BITS = 32


def new_bitmask(rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """An all-allowed bitmask for ``rows`` rows, on the CPU (pinned when it will be copied to a GPU)."""
    shape = (rows, (vocab_size + BITS - 1) // BITS)
    pin = device.type == "cuda"
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask unpacked: bool ``[rows, vocab_size]``, True where the token is allowed (on the
    bitmask's device)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    # An arithmetic shift of a negative word copies its sign bit, and "& 1" keeps the bit asked for.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose token ``bitmask`` does not allow.

    ``logits`` is ``[batch, vocab]`` on any device; ``bitmask`` is the CPU bitmask of the whole
    batch (row i for logits row i). On CUDA, xgrammar's kernel applies it in one launch; elsewhere
    the bits are unpacked on the logits' device and masked in one ``masked_fill``.
    """
    if not rows:
        return
    vocab = logits.shape[-1]
    mask = bitmask.to(logits.device, non_blocking=True)
    if logits.device.type == "cuda":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=list(rows))
        return
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed(mask, vocab), float("-inf"))
        return
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed(mask[index], vocab), float("-inf"))
