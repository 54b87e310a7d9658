"""Large CPU tensors laid out for 2 MB pages (``engine/hugepages.py``), and the KV cache made that way."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine import hugepages
from pdserve.engine.kv_tensor import KVLayout, KVTensor

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected transparent-huge-page mode (always, madvise, never), None where there is none."""
    if not THP_SETTING.exists():
        return None
    found = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    return found.group(1) if found else None


def _mapping_fields(address: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            if inside:
                break
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_zeros_are_zeros_of_the_shape_and_take_writes(dtype: torch.dtype) -> None:
    shape = (5, 3, 2 << 18)  # several huge pages' worth
    t = hugepages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
    t[2, 1, 7] = 3
    t[4, 2, -1] = 5
    assert t.sum().item() == 8 and t[2, 1, 7].item() == 3


@pytest.mark.skipif(not hugepages.advisable(), reason="no madvise here")
def test_a_large_tensor_starts_on_a_huge_page_and_a_small_one_is_plain() -> None:
    big = hugepages.zeros((3 * hugepages.HUGE_PAGE // 4 + 5,), torch.float32)
    assert big.data_ptr() % hugepages.HUGE_PAGE == 0
    small = hugepages.zeros((1000,), torch.float32)
    assert not small.any() and small.untyped_storage().nbytes() == 4000


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
                    reason="Linux with transparent huge pages on (always or madvise) only")  # fmt: skip
def test_the_kernel_may_back_a_large_tensor_with_huge_pages() -> None:
    """Under ``madvise`` an anonymous mapping is eligible for huge pages only where it was advised: the
    mapping holding the tensor says so (whether a 2 MB page was free at each fault is the OS's matter)."""
    t = hugepages.zeros((8 * hugepages.HUGE_PAGE,), torch.uint8)
    fields = _mapping_fields(t.data_ptr())
    assert fields.get("THPeligible") == "1", fields


def test_the_cpu_kv_cache_is_laid_out_for_huge_pages_and_its_views_share_it() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    kv = KVTensor(layout, num_blocks=128)  # 8 MB
    if hugepages.advisable():
        assert kv.tensor.data_ptr() % hugepages.HUGE_PAGE == 0
    assert not kv.tensor.any()
    kv.block_bytes(5)[:2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # bfloat16 1.0, little-endian
    assert kv.tensor[5].reshape(-1)[0].item() == 1.0
    host = kv.host_bytes()
    assert host is not None and len(host) == 128 * layout.block_nbytes
    assert host[5 * layout.block_nbytes + 1] == 0x3F
