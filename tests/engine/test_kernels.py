"""Tests for engine.kernels: Triton and torch paths vs the reference.

The Triton cases run compiled on CUDA when a GPU is present, else in Triton's CPU
interpreter; the torch path and the reference always run on the CPU.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, fields

import pytest
import torch

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if TRITON_DEVICE == "cpu":
    # Must precede the import of engine.kernels.triton_kernels (decorators read it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine.kernels import paged_attention, paged_attention_ref, write_kv, write_kv_ref

NUM_LAYERS = 2
LAYER = 1  # a non-zero layer, so cache views have a non-trivial offset and block stride


@dataclass
class Batch:
    """One attention problem laid out like the engine does it."""

    kv: torch.Tensor  # [num_blocks, num_layers, 2, block_size, Hkv, D]
    q: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    scale: float

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv[:, LAYER, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv[:, LAYER, 1]

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )

    def ref(self, sliding_window: int | None = None) -> torch.Tensor:
        return paged_attention_ref(*self.args()[:7], sliding_window=sliding_window)

    def to(self, device: str) -> Batch:
        """The same problem on ``device`` (the KV views keep their strides)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return Batch(**moved)


def device_for(impl: str) -> str:
    return TRITON_DEVICE if impl == "triton" else "cpu"


def skip_without_triton_fp8(dtype: torch.dtype) -> None:
    """Compiled Triton has float8_e4m3fn from compute capability 8.9 (Ada, Hopper) on; the engine
    refuses that cache there too. The interpreter and e5m2 run anywhere."""
    if dtype == torch.float8_e4m3fn and TRITON_DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_e4m3fn needs compute capability 8.9+ in compiled Triton")


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    q_strided: bool = False,
) -> Batch:
    """Build a batch from ``(context_len, q_len)`` pairs with shuffled physical blocks.

    Cache slots no sequence uses are filled with NaN, so any read of them (padding,
    the tail of a partial last block, spare blocks) poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that nobody owns
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 1
    # Unused table entries hold an out-of-range id: kernels must never follow them.
    block_tables = torch.full((len(seqs), width), 10**6, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    next_block = 0
    for s, seq_len in enumerate(seq_lens):
        ids = perm[next_block : next_block + blocks_per_seq[s]]
        next_block += blocks_per_seq[s]
        block_tables[s, : len(ids)] = ids.to(torch.int32)
        for pos in range(seq_len):
            used[ids[pos // block_size], pos % block_size] = True

    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    kv[:, LAYER, 0][~used] = float("nan")
    kv[:, LAYER, 1][~used] = float("nan")

    q_lens = [n for _, n in seqs]
    num_tokens = sum(q_lens)
    if q_strided:
        # q as a slice of a fused qkv projection: token stride > num_heads * head_dim.
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
        q = qkv[:, :num_heads]
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return Batch(
        kv=kv,
        q=q,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        scale=head_dim**-0.5,
    )


def _seed(*parts: object) -> int:
    """A per-case seed that, unlike the builtin hash, is stable across interpreter runs."""
    return zlib.crc32(repr(parts).encode())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# Batch shapes: (context_len, q_len) per sequence. Lengths straddle block boundaries
# (15/16/17, 31/32/33) and leave partial last blocks.
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "decode": [(15, 1), (0, 1), (31, 1), (48, 1), (70, 1)],
    "prefill": [(0, 17), (0, 32), (0, 5)],
    "mixed": [(0, 20), (40, 1), (33, 15), (15, 1), (7, 1)],
    # (62, 3): the query tile starts 2 before a 16/32/64 KV-tile edge, where an
    # off-by-one in the "fully visible tile" bound would leak a future key.
    "chunked": [(16, 16), (45, 9), (3, 30), (62, 3)],
}

# (num_heads, num_kv_heads): GQA ratios 1, 2, 4 and MQA.
HEADS = [(4, 4), (4, 2), (8, 2), (4, 1)]


# ------------------------------------------------------------------ torch path


# The torch path is fast: the full scenario x heads x head_dim grid, plus extras.
TORCH_CASES = [(s, h, d, 16) for s in SCENARIOS for h in HEADS for d in (32, 64, 128)] + [
    ("mixed", (8, 2), 64, 8),
    ("chunked", (4, 1), 32, 32),
    ("decode", (8, 2), 128, 8),
    ("prefill", (4, 4), 64, 32),
    ("mixed", (6, 2), 64, 16),
    ("chunked", (6, 3), 48, 16),  # GQA 2 with a non-power-of-two head_dim (torch only)
]


def _case_id(case: tuple[str, tuple[int, int], int, int]) -> str:
    scenario, (num_heads, num_kv_heads), head_dim, block_size = case
    return f"{scenario}-h{num_heads}kv{num_kv_heads}-d{head_dim}-bs{block_size}"


@pytest.mark.parametrize("scenario,heads,head_dim,block_size", TORCH_CASES, ids=[_case_id(c) for c in TORCH_CASES])
def test_torch_attention_matches_reference(
    scenario: str, heads: tuple[int, int], head_dim: int, block_size: int
) -> None:
    seed = _seed(scenario, heads, head_dim, block_size)
    b = make_batch(
        SCENARIOS[scenario], num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size, seed=seed
    )
    out = paged_attention(*b.args(), impl="torch")
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    assert rel_err(out, b.ref()) < 1e-3


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_torch_attention_low_precision(dtype: torch.dtype, tol: float, scenario: str) -> None:
    b = make_batch(SCENARIOS[scenario], num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=7)
    out = paged_attention(*b.args(), impl="torch")
    assert out.dtype == dtype
    assert rel_err(out, b.ref()) < tol


def test_default_impl_on_cpu_is_torch() -> None:
    b = make_batch(SCENARIOS["mixed"], num_heads=4, num_kv_heads=2, head_dim=32, seed=3)
    torch.testing.assert_close(paged_attention(*b.args()), paged_attention(*b.args(), impl="torch"))


def test_torch_attention_strided_q() -> None:
    b = make_batch(SCENARIOS["mixed"], num_heads=8, num_kv_heads=2, head_dim=64, seed=5, q_strided=True)
    assert not b.q.is_contiguous()
    assert rel_err(paged_attention(*b.args(), impl="torch"), b.ref()) < 1e-3


@pytest.mark.parametrize("seed", range(4))
def test_torch_attention_random_batches(seed: int) -> None:
    """Fresh random mixes of decode, prefill and chunked prefill sequences."""
    gen = torch.Generator().manual_seed(1000 + seed)
    num_seqs = int(torch.randint(1, 7, (1,), generator=gen))
    seqs = []
    for _ in range(num_seqs):
        context = int(torch.randint(0, 80, (1,), generator=gen))
        q_len = 1 if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(1, 40, (1,), generator=gen))
        seqs.append((context, q_len))
    heads = HEADS[seed % len(HEADS)]
    b = make_batch(seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64, block_size=(8, 16, 32)[seed % 3], seed=seed)
    assert rel_err(paged_attention(*b.args(), impl="torch"), b.ref()) < 1e-3


# ---------------------------------------------------------------- triton path

# Few cases: the interpreter runs every program in Python. Together they cover each
# scenario, GQA 1/2/3/4 and MQA, head_dim 8/32/64/128, block sizes 8/16/32.
TRITON_CASES = [
    ("decode", (8, 2), 128, 16),
    ("decode", (4, 1), 32, 8),
    ("prefill", (4, 4), 64, 16),
    ("mixed", (8, 2), 64, 16),
    ("mixed", (4, 1), 128, 32),
    ("chunked", (4, 2), 32, 16),
    ("chunked", (6, 2), 64, 8),  # GQA 3: BLOCK_M is not a multiple of the group
    ("decode", (4, 2), 8, 16),  # head_dim below 16 is zero-padded inside the kernel
    ("mixed", (7, 1), 64, 16),  # GQA 7 (Qwen2-7B's 28 / 4 heads): BLOCK_Q = BLOCK_M // 7
    ("chunked", (4, 2), 96, 16),  # head_dim 96 (Phi-3): padded to 128 inside the kernel
]


@pytest.mark.parametrize("scenario,heads,head_dim,block_size", TRITON_CASES, ids=[_case_id(c) for c in TRITON_CASES])
def test_triton_attention_matches_reference(
    scenario: str, heads: tuple[int, int], head_dim: int, block_size: int
) -> None:
    seed = _seed(scenario, heads, head_dim, block_size, "triton")
    b = make_batch(
        SCENARIOS[scenario], num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size, seed=seed
    ).to(TRITON_DEVICE)
    out = paged_attention(*b.args(), impl="triton")
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    assert rel_err(out, b.ref()) < 1e-3


@pytest.mark.parametrize(
    "tiles",
    [
        dict(block_m=16, block_n=16),  # many query and KV tiles, GQA rows packed per tile
        dict(block_m=16, block_n=16, num_segments=4),  # split-KV partials + merge kernel
        dict(block_n=32, num_segments=2),
    ],
)
def test_triton_attention_tilings(tiles: dict[str, int]) -> None:
    """Small tiles force unmasked + masked KV loops and several query tiles per sequence."""
    from pdserve.engine.kernels.triton_kernels import paged_attention_triton

    b = make_batch(SCENARIOS["mixed"], num_heads=8, num_kv_heads=2, head_dim=32, seed=11, q_strided=True)
    b = b.to(TRITON_DEVICE)
    out = paged_attention_triton(*b.args(), **tiles)
    assert rel_err(out, b.ref()) < 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_triton_attention_random_batches(seed: int) -> None:
    """Random mixes with 16-wide tiles, so query tiles hit many KV-tile alignments."""
    from pdserve.engine.kernels.triton_kernels import paged_attention_triton

    gen = torch.Generator().manual_seed(2000 + seed)
    seqs = []
    for _ in range(4):
        context = int(torch.randint(0, 50, (1,), generator=gen))
        q_len = 1 if torch.rand(1, generator=gen) < 0.4 else int(torch.randint(2, 24, (1,), generator=gen))
        seqs.append((context, q_len))
    heads = HEADS[seed % len(HEADS)]
    b = make_batch(seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=32, block_size=(16, 8, 32)[seed], seed=seed)
    b = b.to(TRITON_DEVICE)
    out = paged_attention_triton(*b.args(), block_m=16, block_n=16)
    assert rel_err(out, b.ref()) < 1e-3


# ------------------------------------------------------------------ sliding window

# Windows below, at and above block/tile sizes, and one wider than every sequence.
WINDOWS = [1, 5, 16, 33, 1000]


def test_sliding_window_reference_is_the_plain_definition() -> None:
    """Window 1 sees only itself (output = its own V); a window past every length is full attention."""
    b = make_batch(SCENARIOS["mixed"], num_heads=4, num_kv_heads=2, head_dim=32, seed=21)
    assert torch.equal(b.ref(sliding_window=1000), b.ref())
    own = b.ref(sliding_window=1)
    starts = b.query_start_loc.tolist()
    for s, seq_len in enumerate(b.seq_lens.tolist()):
        for j, row in enumerate(range(starts[s], starts[s + 1])):
            pos = seq_len - (starts[s + 1] - starts[s]) + j
            table = b.block_tables[s].long()
            v = b.v_cache[table[pos // 16], pos % 16]  # [Hkv, D]
            torch.testing.assert_close(own[row], v.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_torch_sliding_window_matches_reference(scenario: str, window: int) -> None:
    b = make_batch(SCENARIOS[scenario], num_heads=8, num_kv_heads=2, head_dim=32, block_size=8, seed=window)
    assert rel_err(paged_attention(*b.args(), impl="torch", sliding_window=window), b.ref(window)) < 1e-3


@pytest.mark.parametrize("window", WINDOWS)
def test_triton_sliding_window_matches_reference(window: int) -> None:
    """Small tiles so windows start mid-tile, inside fully visible tiles and across segments."""
    from pdserve.engine.kernels.triton_kernels import paged_attention_triton

    seqs = SCENARIOS["mixed"] + SCENARIOS["chunked"]
    b = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=100 + window).to(TRITON_DEVICE)
    assert rel_err(paged_attention(*b.args(), impl="triton", sliding_window=window), b.ref(window)) < 1e-3
    out = paged_attention_triton(*b.args(), block_m=16, block_n=16, sliding_window=window)
    assert rel_err(out, b.ref(window)) < 1e-3
    decode = make_batch(SCENARIOS["decode"], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=window)
    decode = decode.to(TRITON_DEVICE)
    out = paged_attention_triton(*decode.args(), block_m=16, block_n=16, num_segments=4, sliding_window=window)
    assert rel_err(out, decode.ref(window)) < 1e-3


def test_torch_plan_must_match_the_window() -> None:
    from pdserve.engine.kernels.torch_paged import plan_attention

    b = make_batch(SCENARIOS["decode"], num_heads=4, num_kv_heads=2, head_dim=32, seed=3)
    plan = plan_attention(b.block_tables, b.seq_lens, b.query_start_loc, 16, sliding_window=8)
    assert rel_err(paged_attention(*b.args(), impl="torch", plan=plan, sliding_window=8), b.ref(8)) < 1e-3
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(*b.args(), impl="torch", plan=plan)


def test_triton_attention_bfloat16() -> None:
    b = make_batch(SCENARIOS["mixed"], num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16, seed=13)
    b = b.to(TRITON_DEVICE)
    out = paged_attention(*b.args(), impl="triton")
    assert out.dtype == torch.bfloat16
    assert rel_err(out, b.ref()) < 2e-2


@pytest.mark.parametrize("impl", ["torch", "triton", "reference"])
def test_padding_rows_are_zero(impl: str) -> None:
    """Query rows past query_start_loc[-1] (e.g. CUDA-graph padding) come back as zeros."""
    b = make_batch(SCENARIOS["decode"], num_heads=4, num_kv_heads=2, head_dim=32, seed=17).to(device_for(impl))
    b.q = torch.cat([b.q, torch.randn(3, *b.q.shape[1:], device=b.q.device)])
    out = paged_attention(*b.args(), impl=impl)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    assert rel_err(out[:-3], b.ref()[:-3]) < 1e-3


def test_empty_batch() -> None:
    for impl in ("torch", "triton", "reference"):
        b = make_batch([(3, 1)], num_heads=4, num_kv_heads=2, head_dim=32).to(device_for(impl))
        out = paged_attention(
            b.q[:0], b.k_cache, b.v_cache, b.block_tables[:0], b.seq_lens[:0], b.query_start_loc[:1], 1.0, 0, 0, impl=impl
        )
        assert out.shape == (0, 4, 32)


# -------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (1, 32, 8), (3, 128, 32)])
def test_write_kv_matches_reference(impl: str, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads * 1000 + head_dim + block_size)
    num_blocks, num_tokens = 6, 21
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, generator=gen)
    kv_ref = kv.clone()
    # Distinct random slots across shuffled blocks, with some tokens skipped (-1).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.tensor([0, 5, 20])] = -1
    # key/value as slices of a fused projection: strided token dim.
    kv_proj = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen)
    key, value = kv_proj[:, :num_kv_heads], kv_proj[:, num_kv_heads : 2 * num_kv_heads]

    device = device_for(impl)
    kv, kv_ref, slots = kv.to(device), kv_ref.to(device), slots.to(device)
    key, value = kv_proj.to(device)[:, :num_kv_heads], kv_proj.to(device)[:, num_kv_heads : 2 * num_kv_heads]
    write_kv(key, value, kv[:, LAYER, 0], kv[:, LAYER, 1], slots, impl=impl)
    write_kv_ref(key, value, kv_ref[:, LAYER, 0], kv_ref[:, LAYER, 1], slots)
    # Whole-tensor equality: the right slots changed and nothing else (other layers included).
    assert torch.equal(kv, kv_ref)
    b, o = divmod(int(slots[1]), block_size)
    assert torch.equal(kv[b, LAYER, 0, o], key[1])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_write_then_attend(impl: str) -> None:
    """End to end: write a chunk's K/V through write_kv, then attend over it."""
    b = make_batch([(20, 12), (9, 1)], num_heads=4, num_kv_heads=2, head_dim=32, seed=19).to(device_for(impl))
    num_tokens = b.q.shape[0]
    key = torch.randn(num_tokens, 2, 32, device=b.q.device)
    value = torch.randn(num_tokens, 2, 32, device=b.q.device)
    slots = []
    for s, (start, end) in enumerate(zip(b.query_start_loc[:-1].tolist(), b.query_start_loc[1:].tolist())):
        seq_len = int(b.seq_lens[s])
        for pos in range(seq_len - (end - start), seq_len):
            slots.append(int(b.block_tables[s, pos // 16]) * 16 + pos % 16)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=b.q.device)
    write_kv(key, value, b.k_cache, b.v_cache, slot_mapping, impl=impl)
    assert rel_err(paged_attention(*b.args(), impl=impl), b.ref()) < 1e-3


# ------------------------------------------------------------------ validation


def _good_attention_args() -> dict:
    b = make_batch([(5, 3), (2, 1)], num_heads=4, num_kv_heads=2, head_dim=32)
    names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "scale", "max_query_len", "max_seq_len"]
    return dict(zip(names, b.args()))


ATTENTION_BREAKERS = {
    "q_2d": lambda a: a.update(q=a["q"][:, 0]),
    "q_dtype": lambda a: a.update(q=a["q"].half()),
    "q_int": lambda a: a.update(q=a["q"].long()),
    "head_dim_mismatch": lambda a: a.update(q=a["q"][..., :16].contiguous()),
    "heads_not_multiple": lambda a: a.update(q=a["q"][:, :3].contiguous()),
    "q_last_dim_strided": lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
    "cache_3d": lambda a: a.update(k_cache=a["k_cache"][0]),
    "cache_shape_mismatch": lambda a: a.update(v_cache=a["v_cache"][:-1]),
    "cache_inner_not_contiguous": lambda a: a.update(k_cache=a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
    "cache_dtype": lambda a: a.update(v_cache=a["v_cache"].double()),
    "block_tables_int64": lambda a: a.update(block_tables=a["block_tables"].long()),
    "block_tables_rows": lambda a: a.update(block_tables=a["block_tables"][:1]),
    "seq_lens_int64": lambda a: a.update(seq_lens=a["seq_lens"].long()),
    "seq_lens_len": lambda a: a.update(seq_lens=a["seq_lens"][:1]),
    "qsl_len": lambda a: a.update(query_start_loc=a["query_start_loc"][:2]),
    "qsl_dtype": lambda a: a.update(query_start_loc=a["query_start_loc"].long()),
    "scale_tensor": lambda a: a.update(scale=torch.tensor(1.0)),
    "scale_nan": lambda a: a.update(scale=float("nan")),
    "max_len_negative": lambda a: a.update(max_seq_len=-1),
    "max_len_float": lambda a: a.update(max_query_len=3.0),
    "device": lambda a: a.update(seq_lens=a["seq_lens"].to("meta")),
}


@pytest.mark.parametrize("breaker", list(ATTENTION_BREAKERS))
def test_paged_attention_rejects_bad_inputs(breaker: str) -> None:
    args = _good_attention_args()
    paged_attention(**args)  # sanity: the unbroken arguments are accepted
    ATTENTION_BREAKERS[breaker](args)
    with pytest.raises(ValueError):
        paged_attention(**args)


def test_paged_attention_rejects_bad_impl_and_head_dim() -> None:
    args = _good_attention_args()
    with pytest.raises(ValueError, match="impl"):
        paged_attention(**args, impl="cuda")
    b = make_batch([(4, 2)], num_heads=2, num_kv_heads=1, head_dim=288)
    paged_attention(*b.args(), impl="torch")  # torch handles any head_dim
    with pytest.raises(ValueError, match="head_dim <= 256"):
        paged_attention(*b.to(TRITON_DEVICE).args(), impl="triton")
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(**args, sliding_window=0)


def _good_write_args() -> dict:
    kv = torch.randn(4, NUM_LAYERS, 2, 16, 2, 32)
    return dict(
        key=torch.randn(5, 2, 32),
        value=torch.randn(5, 2, 32),
        k_cache=kv[:, 0, 0],
        v_cache=kv[:, 0, 1],
        slot_mapping=torch.arange(5, dtype=torch.int64),
    )


WRITE_BREAKERS = {
    "key_2d": lambda a: a.update(key=a["key"][:, 0]),
    "value_shape": lambda a: a.update(value=a["value"][:4]),
    "heads_mismatch": lambda a: a.update(key=a["key"][:, :1].contiguous(), value=a["value"][:, :1].contiguous()),
    "key_dtype": lambda a: a.update(key=a["key"].half()),
    "cache_dtype": lambda a: a.update(v_cache=a["v_cache"].half()),
    "slot_int32": lambda a: a.update(slot_mapping=a["slot_mapping"].int()),
    "slot_len": lambda a: a.update(slot_mapping=a["slot_mapping"][:4]),
    "slot_2d": lambda a: a.update(slot_mapping=a["slot_mapping"][:, None]),
    "cache_inner_not_contiguous": lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)),
    "device": lambda a: a.update(slot_mapping=a["slot_mapping"].to("meta")),
}


@pytest.mark.parametrize("breaker", list(WRITE_BREAKERS))
def test_write_kv_rejects_bad_inputs(breaker: str) -> None:
    args = _good_write_args()
    write_kv(**args)  # sanity: the unbroken arguments are accepted
    WRITE_BREAKERS[breaker](args)
    with pytest.raises(ValueError):
        write_kv(**args)


def test_triton_on_cpu_requires_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _good_attention_args()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_attention(**args, impl="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        write_kv(**_good_write_args(), impl="triton")


def test_import_does_not_load_triton() -> None:
    """pdserve.engine.kernels must import on machines without triton (it is loaded lazily)."""
    import subprocess
    import sys

    code = "import sys, pdserve.engine.kernels; sys.exit('triton' in sys.modules)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert subprocess.run([sys.executable, "-c", code], cwd=root, env=env).returncode == 0
