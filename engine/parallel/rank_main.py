"""A tensor-parallel rank: what ranks 1..N-1 of a worker run, in a process of their own
(``python -m pdserve.engine.parallel.rank_main``, started by :mod:`engine.parallel.rank_processes`)
or in a Ray actor (:mod:`engine.parallel.rank_actors`).

:func:`run_rank` reads frames (``step_plan.read_frame``) from its driver: first the rank's spec
(JSON), then one step plan per step. It loads its shard, maps the worker's shared KV cache (the
memfd ``spec["kv_fd"]``), reports one JSON object (``{"loaded": true, "pid": ...}`` or
``{"error": ...}``), joins the group, and then runs every step it is sent. It returns when the
frames end (the driver closed them, or died): 0, or 1 when loading or a step failed (a peer died or
timed out).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

logger = logging.getLogger("pdserve.engine.parallel.rank")

Report = Callable[[dict[str, Any]], None]


def _load(spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.Tensor]:
    from pdserve.engine.kv_tensor import KVLayout, KVTensor
    from pdserve.engine.model.loader import load_model
    from pdserve.engine.parallel.shard import TPShard

    torch.set_num_threads(int(spec["threads"]))
    model = load_model(spec["model"], dtype=getattr(torch, spec["dtype"]), device="cpu",
                       shard=TPShard(int(spec["rank"]), int(spec["size"])))  # fmt: skip
    if spec["onednn"]:
        model.pack_onednn(spec["fp32_gemm"])
    model.kv_scales(quantized=bool(spec["quantized"]))
    lay = spec["layout"]
    layout = KVLayout(lay["num_layers"], lay["num_kv_heads"], lay["head_dim"], lay["block_size"],
                      getattr(torch, lay["dtype"]), tuple(lay["kv_scales"]), lay["kind"], lay["rope_dim"])  # fmt: skip
    kv = KVTensor.attach(int(spec["kv_fd"]), layout, int(spec["num_blocks"]))
    return model, kv.tensor


def _serve(model: torch.nn.Module, kv: torch.Tensor, frames: BinaryIO, block_size: int, cascade: bool) -> int:
    from pdserve.engine.kernels import cpu_decode, plan_attention
    from pdserve.engine.parallel.step_plan import StepPlan, read_frame

    sliding = model.config.sliding_window
    fused = cpu_decode.supports_model(model.config, next(model.parameters()).dtype, kv.dtype)
    while (frame := read_frame(frames)) is not None:
        plan = StepPlan.decode(frame)
        m = plan.meta
        m.torch_plan = plan_attention(m.block_tables, m.seq_lens, m.query_start_loc, block_size, sliding, cascade, fused)
        with torch.inference_mode():
            hidden = model(plan.input_ids, plan.positions, kv, m)
            if plan.sample_rows:
                model.compute_logits(hidden[plan.sample_rows])
    return 0


def run_rank(spec: dict[str, Any], frames: BinaryIO, report: Report) -> int:
    """Load rank ``spec["rank"]``'s shard, report, join the group and run the steps ``frames``
    carries until they end. Never raises: a failure is reported (before loading) or logged."""
    from pdserve.engine.parallel.group import TPGroup

    try:
        model, kv = _load(spec)
    except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it
        report({"error": f"{type(e).__name__}: {e}"})
        return 1
    report({"loaded": True, "pid": os.getpid()})
    try:
        group = TPGroup(spec["store"], int(spec["rank"]), int(spec["size"]), float(spec["timeout_s"]))
        group.barrier()  # every rank has joined: the driver removes the rendezvous file after this
        model.join(group)
        return _serve(model, kv, frames, int(spec["layout"]["block_size"]), bool(spec["cascade"]))
    except Exception:  # a peer died or timed out: this rank's worker cannot step any more
        logger.exception("tensor-parallel rank %s failed", spec["rank"])
        return 1


def main() -> int:
    from pdserve.engine.parallel.step_plan import read_frame

    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(levelname)s %(message)s")
    stream = sys.stdin.buffer
    first = read_frame(stream)
    if first is None:
        return 1

    def report(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    return run_rank(json.loads(first), stream, report)


if __name__ == "__main__":
    sys.exit(main())
