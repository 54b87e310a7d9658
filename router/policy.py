"""Routing policy: pick workers by prefix overlap against load (pure functions).

Prefill worker ``w``: ``score(w) = overlap_tokens(w) - load_weight * queued_prefill_tokens(w)``,
where ``overlap_tokens`` is the length of the prompt's block-hash chain that Redis says
``w`` holds (times the block size) and ``queued_prefill_tokens`` are the uncached prompt
tokens the router has sent to ``w`` that are not done yet. Cached tokens are work
saved, queued tokens are work waiting, both in tokens, so the weight is unit-free;
``load_weight = 1`` trades one cached token for one queued token.

Decode worker ``w``: the same formula with ``queued = sum(prompt_len + min(max_tokens, max_output_load_tokens))``
of its live requests (the KV it must hold), so a worker with the prompt's prefix wins
unless it is more loaded than the prefix is worth. Ties go to the lower load, then to
the first worker in registration order (deterministic).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def pick_worker(
    workers: Sequence[str],
    overlap_blocks: Mapping[str, int],
    queued_tokens: Mapping[str, int],
    block_size: int,
    load_weight: float,
    exclude: frozenset[str] = frozenset(),
) -> str | None:
    """The best worker by the module's formula, or None if every worker is excluded."""
    best: tuple[float, int, int] | None = None
    choice = None
    for order, w in enumerate(workers):
        if w in exclude:
            continue
        load = queued_tokens.get(w, 0)
        score = overlap_blocks.get(w, 0) * block_size - load_weight * load
        key = (-score, load, order)
        if best is None or key < best:
            best, choice = key, w
    return choice
