"""A tensor-parallel rank's process (``python -m pdserve.engine.parallel.rank_main``), started by
:mod:`engine.parallel.ranks`.

Its standard input carries frames (``step_plan.read_frame``): first the rank's spec (JSON), then
one step plan per step. It loads its shard, maps the worker's shared KV cache (the memfd it
inherits), reports one JSON line on standard output (``{"loaded": true}`` or ``{"error": ...}``),
joins the group, and then runs every step it is sent. It ends when its input ends (the driver
closed it, or died) and exits non-zero when a step fails (a peer died or timed out).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, BinaryIO

import torch

logger = logging.getLogger("pdserve.engine.parallel.rank")


def _report(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _load(spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.Tensor]:
    from pdserve.engine.kv_tensor import KVLayout, KVTensor
    from pdserve.engine.model.loader import load_model
    from pdserve.engine.parallel.shard import TPShard

    torch.set_num_threads(int(spec["threads"]))
    model = load_model(spec["model"], dtype=getattr(torch, spec["dtype"]), device="cpu",
                       shard=TPShard(int(spec["rank"]), int(spec["size"])))  # fmt: skip
    if spec["onednn"]:
        model.pack_onednn()
    model.kv_scales(quantized=bool(spec["quantized"]))
    lay = spec["layout"]
    layout = KVLayout(lay["num_layers"], lay["num_kv_heads"], lay["head_dim"], lay["block_size"],
                      getattr(torch, lay["dtype"]), tuple(lay["kv_scales"]), lay["kind"], lay["rope_dim"])  # fmt: skip
    kv = KVTensor.attach(int(spec["kv_fd"]), layout, int(spec["num_blocks"]))
    return model, kv.tensor


def _serve(model: torch.nn.Module, kv: torch.Tensor, stream: BinaryIO, block_size: int) -> int:
    from pdserve.engine.kernels import plan_attention
    from pdserve.engine.parallel.step_plan import StepPlan, read_frame

    sliding = model.config.sliding_window
    while (frame := read_frame(stream)) is not None:
        plan = StepPlan.decode(frame)
        m = plan.meta
        m.torch_plan = plan_attention(m.block_tables, m.seq_lens, m.query_start_loc, block_size, sliding)
        with torch.inference_mode():
            hidden = model(plan.input_ids, plan.positions, kv, m)
            if plan.sample_rows:
                model.compute_logits(hidden[plan.sample_rows])
    return 0


def main() -> int:
    from pdserve.engine.parallel.group import TPGroup
    from pdserve.engine.parallel.step_plan import read_frame

    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(levelname)s %(message)s")
    stream = sys.stdin.buffer
    first = read_frame(stream)
    if first is None:
        return 1
    spec = json.loads(first)
    try:
        model, kv = _load(spec)
    except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it
        _report({"error": f"{type(e).__name__}: {e}"})
        return 1
    _report({"loaded": True})
    try:
        group = TPGroup(spec["store"], int(spec["rank"]), int(spec["size"]), float(spec["timeout_s"]))
        group.barrier()  # every rank has joined: the driver removes the rendezvous file after this
        model.join(group)
        return _serve(model, kv, stream, int(spec["layout"]["block_size"]))
    except Exception:  # a peer died or timed out: this rank's worker cannot step any more
        logger.exception("tensor-parallel rank %s failed", spec["rank"])
        return 1


if __name__ == "__main__":
    sys.exit(main())
