"""The worker's one preallocated paged KV tensor.

Layout ``[num_blocks, num_layers, planes, block_size, num_kv_heads, head_dim]``: block-major,
so every block (all layers) is one contiguous span of memory. A transfer sends or receives a
block as one buffer with no gather. Two kinds of layout:

* ``"mha"``: ``planes = 2``, K and V per KV head; attention kernels read a layer through the
  strided views ``kv[:, layer, 0]`` (K) and ``kv[:, layer, 1]`` (V);
* ``"mla"``: ``planes = 1``, one latent row per token (``num_kv_heads = 1``, ``head_dim =
  kv_lora_rank + rope_dim``, the last ``rope_dim`` values the rotary key), read as ``kv[:, layer, 0]``.

Everything that moves, hashes or counts blocks is the same for both; only the kernels differ.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

from pdserve.engine import hugepages


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one worker's KV blocks; peers must agree on it to exchange blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # what the cache stores: the model's dtype, or an FP8 format
    # An FP8 cache's scales, one per plane of each layer in turn ((k_scale, v_scale), or the
    # latent's one scale for MLA): stored value * scale is the value. Empty for a float cache.
    # Part of the layout: bytes written under one set of scales mean something else under another.
    kv_scales: tuple[float, ...] = ()
    kind: str = "mha"  # "mha": K and V per head; "mla": one latent row per token
    rope_dim: int = 0  # "mla": the trailing rotary values of a row

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kind not in ("mha", "mla"):
            raise ValueError(f"kind must be 'mha' or 'mla', got {self.kind!r}")
        if self.kind == "mla" and (self.num_kv_heads != 1 or not 0 < self.rope_dim < self.head_dim):
            raise ValueError(f"an MLA layout has 1 row per token and 0 < rope_dim < head_dim, got "
                             f"num_kv_heads={self.num_kv_heads}, rope_dim={self.rope_dim}, head_dim={self.head_dim}")
        if self.kind == "mha" and self.rope_dim:
            raise ValueError("rope_dim is for MLA layouts only")
        if self.kv_scales and len(self.kv_scales) != self.planes * self.num_layers:
            raise ValueError(f"kv_scales must hold {self.planes} per layer ({self.planes * self.num_layers}), "
                             f"got {len(self.kv_scales)}")  # fmt: skip

    @property
    def planes(self) -> int:
        return 1 if self.kind == "mla" else 2

    @property
    def block_numel(self) -> int:
        return self.num_layers * self.planes * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_nbytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.dtype).element_size()

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.block_nbytes


class KVTensor:
    """Owns the KV tensor; hands out per-layer views and per-block byte views.

    The KV-handover API gives the KV wire (and any other reader or writer of whole blocks)
    this object, never the cache manager: a block is ``layout.block_nbytes`` bytes at
    ``block_bytes(block_id)``.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
                 shared: bool = False) -> None:  # fmt: skip
        """``shared``: a CPU cache in an anonymous shared-memory file (``memfd``, owner-only, no
        name in any file system) that the worker's tensor-parallel ranks map too (:attr:`fd`,
        :meth:`attach`); otherwise the process's own memory, on 2 MB pages where the OS allows
        (``engine/hugepages.py``: the decode kernel's reads of blocks anywhere in it miss the TLB less)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.fd: int | None = None
        shape = (num_blocks, *self.block_shape(layout))
        if not shared:
            on_cpu = torch.device(device).type == "cpu"
            self.tensor = (hugepages.zeros(shape, layout.dtype) if on_cpu
                           else torch.zeros(shape, dtype=layout.dtype, device=device))  # fmt: skip
            return
        if torch.device(device).type != "cpu":
            raise ValueError("a shared KV cache is a CPU cache")
        self.fd = os.memfd_create("pdserve-tp-cache", os.MFD_CLOEXEC)  # not the KV wire's "pdserve-kv-staging"
        os.ftruncate(self.fd, num_blocks * layout.block_nbytes)  # a new memfd reads as zeros
        self.tensor = _map(self.fd, layout, num_blocks)

    @staticmethod
    def block_shape(layout: KVLayout) -> tuple[int, ...]:
        return (layout.num_layers, layout.planes, layout.block_size, layout.num_kv_heads, layout.head_dim)

    @classmethod
    def attach(cls, fd: int, layout: KVLayout, num_blocks: int) -> KVTensor:
        """The shared cache another process made (``fd`` is that memfd, passed to this process)."""
        self = cls.__new__(cls)
        self.layout, self.num_blocks, self.fd = layout, num_blocks, fd
        if os.fstat(fd).st_size != num_blocks * layout.block_nbytes:
            raise ValueError(f"shared KV cache: the file holds {os.fstat(fd).st_size} bytes, expected "
                             f"{num_blocks * layout.block_nbytes}")  # fmt: skip
        self.tensor = _map(fd, layout, num_blocks)
        return self

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Views of one layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``: (K, V), or
        (latent rows,) for an MLA layout."""
        return tuple(self.tensor[:, layer, p] for p in range(self.layout.planes))

    def block(self, block_id: int) -> torch.Tensor:
        """The contiguous tensor of one block (all layers, K and V)."""
        return self.tensor[block_id]

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """One block as a flat uint8 tensor sharing memory with the cache."""
        return self.tensor[block_id].reshape(-1).view(torch.uint8)

    def host_bytes(self) -> memoryview | None:
        """A CPU cache's bytes as one flat view sharing its memory (block ``b`` is
        ``[b * block_nbytes, (b + 1) * block_nbytes)``): copies in and out by slice, with no tensor
        view per block. None for a cache on a GPU."""
        if self.tensor.device.type != "cpu":
            return None
        return memoryview(self.tensor.view(-1).view(torch.uint8).numpy())


def _map(fd: int, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """The cache tensor over a shared mapping of ``fd`` (the mapping lives as long as the tensor)."""
    region = mmap.mmap(fd, num_blocks * layout.block_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    return flat.view(layout.dtype).view(num_blocks, *KVTensor.block_shape(layout))
