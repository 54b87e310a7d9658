"""GPU benchmark of the Triton paged attention (decode) with correctness checks first.

Usage: ``python -m pdserve.benchmarks.attention_gpu [--json] [--reps N] [--no-torch]``

1. Checks Triton against the float32 reference on a few mixed/decode shapes (fp32
   and bf16, one long decode that takes the split-KV path, head_dim 96, a sliding
   window); exits 1 on a mismatch.
2. Times decode attention for batch {1, 8, 32, 128} x context {512, 2048, 8192},
   head_dim 128, 32 query / 8 KV heads, bf16, block size 16, blocks shuffled in a
   2-layer block-major cache (so the layer views are strided as in the engine).
   Kernel time is the median of CUDA-event timings of CUDA-graph replays with L2
   flushed in between; ``eager_us`` is one eager wrapper call (host overhead
   included); ``torch_us`` is the torch SDPA path on the same GPU, for scale.
   GB/s counts K+V of every context plus q and out.

Needs CUDA; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kernels import paged_attention, paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 2048, 8192)


@dataclass
class Problem:
    """Arguments of one paged_attention call (positional order of the wrapper)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_query_len: int
    max_seq_len: int

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

    def head(self, n: int) -> Problem:
        """The sub-problem of the first ``n`` sequences (rows of q are per-sequence prefixes)."""
        end = int(self.query_start_loc[n])
        return Problem(
            self.q[:end],
            self.k_cache,
            self.v_cache,
            self.block_tables[:n],
            self.seq_lens[:n],
            self.query_start_loc[: n + 1],
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )


def make_problem(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Problem:
    """Random problem from ``(context_len, q_len)`` pairs, physical blocks shuffled."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 1
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32, device="cuda")
    start = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = perm[start : start + n]
        start += n
    kv = torch.randn(
        num_blocks, 2, 2, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen
    )
    q_lens = [n for _, n in seqs]
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32, device="cuda")
    qsl[1:] = torch.tensor(q_lens, device="cuda").cumsum(0)
    return Problem(
        q=torch.randn(sum(q_lens), num_heads, head_dim, device="cuda", dtype=dtype, generator=gen),
        k_cache=kv[:, 1, 0],
        v_cache=kv[:, 1, 1],
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=qsl,
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def check_correctness() -> list[dict]:
    """Triton vs reference on a few shapes; returns one result row per shape."""
    cases = [
        ("mixed fp32 gqa4 d128 bs16", [(0, 37), (100, 1), (60, 17), (5, 1)], 32, 8, 128, 16, torch.float32, 1e-3),
        ("chunked bf16 gqa2 d64 bs32", [(300, 64), (31, 33), (0, 1)], 8, 4, 64, 32, torch.bfloat16, 2e-2),
        ("decode bf16 mqa d128 bs16", [(c, 1) for c in (1, 15, 16, 17, 500)], 16, 1, 128, 16, torch.bfloat16, 2e-2),
        ("long decode bf16 gqa4 split-kv", [(6000, 1)], 32, 8, 128, 16, torch.bfloat16, 2e-2),
        ("mixed bf16 gqa4 d96 bs16", [(0, 37), (100, 1), (60, 17)], 32, 8, 96, 16, torch.bfloat16, 2e-2),
        ("mixed bf16 gqa4 window 100", [(0, 300), (500, 1), (260, 40), (3000, 1)], 32, 8, 128, 16, torch.bfloat16,
         2e-2),
    ]
    rows = []
    for name, seqs, nh, nkv, d, bs, dtype, tol in cases:
        p = make_problem(seqs, nh, nkv, d, bs, dtype, seed=len(rows))
        window = 100 if "window" in name else None
        out = paged_attention(*p.args(), impl="triton", sliding_window=window)
        err = rel_err(out, paged_attention_ref(*p.args()[:7], sliding_window=window))
        rows.append({"case": name, "rel_err": err, "tol": tol, "ok": err < tol})
    return rows


def _median_event_us(run: Callable[[], None], reps: int, flush: torch.Tensor | None) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()  # evict L2 so each rep reads K/V from HBM, as decode does
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_triton(p: Problem, reps: int, flush: torch.Tensor) -> tuple[float, float]:
    """(graph-replay kernel us, eager wrapper us) medians."""
    call = lambda: paged_attention(*p.args(), impl="triton")  # noqa: E731
    call()  # compile
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    kernel_us = _median_event_us(graph.replay, reps, flush)
    eager_us = _median_event_us(call, max(reps // 5, 3), flush)
    return kernel_us, eager_us


def bench(reps: int, with_torch: bool) -> list[dict]:
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    elem = torch.tensor([], dtype=torch.bfloat16).element_size()
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            p = make_problem([(context - 1, 1)] * batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16)
            kernel_us, eager_us = time_triton(p, reps, flush)
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem
            qo_bytes = 2 * batch * NUM_HEADS * HEAD_DIM * elem
            gbps = (kv_bytes + qo_bytes) / (kernel_us * 1e-6) / 1e9
            # Accuracy on up to 4 sequences (rows of other sequences are independent).
            sub = p.head(min(batch, 4))
            out = paged_attention(*p.args(), impl="triton")[: sub.q.shape[0]]
            err = rel_err(out, paged_attention_ref(*sub.args()[:7]))
            row = {
                "batch": batch,
                "context": context,
                "us": round(kernel_us, 2),
                "GB/s": round(gbps, 1),
                "eager_us": round(eager_us, 2),
                "rel_err": err,
            }
            if with_torch:
                torch_call = lambda p=p: paged_attention(*p.args(), impl="torch")  # noqa: E731
                torch_call()
                row["torch_us"] = round(_median_event_us(torch_call, max(reps // 5, 3), flush), 2)
            rows.append(row)
            del p
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.2e}" if c in ("rel_err", "tol") else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--reps", type=int, default=50, help="timed repeats per shape")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch SDPA baseline column")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_gpu.py needs a CUDA GPU; none found, nothing to do.", file=sys.stderr)
        return 2

    checks = check_correctness()
    if not all(c["ok"] for c in checks):
        print(json.dumps({"correctness": checks}, indent=2) if args.json else markdown(checks))
        print("correctness check FAILED; not benchmarking", file=sys.stderr)
        return 1
    rows = bench(args.reps, with_torch=not args.no_torch)
    import triton

    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if args.json:
        print(json.dumps({"info": info, "correctness": checks, "decode": rows}, indent=2))
    else:
        print(f"# Paged attention decode on {info['device']} (torch {info['torch']}, triton {info['triton']})\n")
        print(
            f"bf16, {NUM_HEADS} q heads / {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}; "
            "us = median CUDA-graph replay, L2 flushed\n"
        )
        print("## Correctness (triton vs reference)\n")
        print(markdown(checks) + "\n")
        print("## Decode timing\n")
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
