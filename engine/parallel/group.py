"""The collectives that join one worker's tensor-parallel ranks (gloo, on the CPU).

Each worker builds its own group from a ``FileStore`` in a private directory (mode 0700) rather
than torch's global default group: several TP engines can then live in one process (tests, an
offline engine beside a server), and the rendezvous opens no listening socket. Gloo's own pairs
connect over loopback only: the ranks of a worker always share a host.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


class TPGroup:
    """Rank ``rank`` of ``size`` in the group rendezvousing at ``store_path``.

    Construction blocks until every rank has joined (or ``timeout_s`` passes: RuntimeError). A
    collective that a rank does not join within ``timeout_s`` raises; one whose peer process has
    died raises at once (its connection closes). Every rank must call the same collectives in the
    same order with tensors of the same shape.

    ``comm_s``: seconds this rank has spent inside collectives (the wire and the wait for the slowest
    rank), for ``pdserve bench tp``.
    """

    def __init__(self, store_path: str, rank: int, size: int, timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self._store = dist.FileStore(store_path, size)
        # Loopback only: torch's default device follows the hostname, which may be an outside address.
        # (``_Options`` is how torch's own process-group helper passes devices and a timeout.)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timedelta(seconds=timeout_s)
        self._pg = dist.ProcessGroupGloo(self._store, rank, size, options)
        self.comm_s = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it. Every rank gets the same bytes."""
        t0 = time.perf_counter()
        if tensor.dtype == torch.bfloat16 or tensor.dtype == torch.float16:
            # gloo sums reduced-precision floats pairwise in that precision; sum in float32, as NCCL does
            # within its kernels, and round once.
            wide = tensor.float()
            self._pg.allreduce([wide]).wait()
            tensor.copy_(wide)
        else:
            self._pg.allreduce([tensor]).wait()
        self.comm_s += time.perf_counter() - t0
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on all), in rank order."""
        t0 = time.perf_counter()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._pg.allgather([out], [tensor.contiguous()]).wait()
        self.comm_s += time.perf_counter() - t0
        return out

    def barrier(self) -> None:
        self._pg.barrier().wait()
