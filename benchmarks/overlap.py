"""Transfer overlapped with prefill: a long prompt's handover from a prefill worker to a decode worker,
with and without the decode worker's prefetch (``decode_worker/prefetch.py``), in one sitting.

A prefill worker and a decode worker (``WorkerRuntime``s in this process, as ``pdserve up`` builds them:
engines, KV-transfer servers on loopback, an embedded Redis) take the same prompt of ``--prompt-tokens``
new tokens in each mode, one mode after the other and in alternating order from round to round; the
prefill worker computes it ``--chunk`` tokens per step. ``off``: the decode worker pulls the whole
prompt's KV by lease once the prefill ended (the path without overlap). ``on``: the decode worker is
asked to prefetch when the prefill starts, as the router does for long prompts, and pulls blocks as
the prefill worker's steps cache them; the lease pull after the prefill takes only the rest.
The two modes' requests carry different ``cache_salt``s, so neither finds the other's blocks.

Reported per mode, medians over ``--repeats`` rounds (after one warm-up round):
``prefill_ms`` (the prefill worker's first token: the time to first token, the same in both modes),
``handover_ms`` (from the prefill's result to the decode worker's first token: the lease pull, then
one decode step), ``second_token_ms`` (from the start to that token) and the prompt tokens the lease
pull moved after the prefill (``pulled_after_prefill``) and the decode worker had already
(``prefetched``). The greedy tokens must be the same in both modes: the run fails otherwise.
``--transport grpc`` (default) pulls over the gRPC stream, as between hosts; ``shm`` through shared
memory. Both workers share this process (and its GIL): on separate hosts the prefetch's pulls would
not compete with the prefill for the same cores.

Run: ``pdserve bench overlap [--prompt-tokens 2048 --chunk 256 --repeats 3] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import statistics
import sys
import time
from typing import Any

from pdserve.benchmarks.common import emit
from pdserve.benchmarks.steps import smollm2
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.model import ModelConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.embedded import EmbeddedRedis
from pdserve.kvtransfer.config import TransferConfig
from pdserve.prefill_worker.service import PrefillService
from pdserve.worker.config import WorkerConfig
from pdserve.worker.messages import RequestSpec
from pdserve.worker.runtime import WorkerRuntime

BLOCK = 16
MODES = ("off", "on")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def runtime(args: argparse.Namespace, url: str, worker_id: str, role: str) -> WorkerRuntime:
    blocks = 2 * (args.prompt_tokens + args.max_tokens) // BLOCK + 64
    engine = EngineConfig(args.model, device="cpu", dtype=args.dtype, cache=CacheConfig(BLOCK, blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk))  # fmt: skip
    transfer = TransferConfig(shm=args.transport == "shm", cluster_secret=args.secret)
    index = IndexConfig(url, namespace=f"bench-overlap-{os.getpid()}")
    return WorkerRuntime(WorkerConfig(worker_id, role, engine, index, transfer, bind_host="127.0.0.1"))


async def handover(prefill: PrefillService, decode: DecodeService, address: str, spec: RequestSpec,
                   prefetch: bool) -> dict[str, Any]:  # fmt: skip
    """One request through both workers; its timings, token counts and tokens."""
    t0 = time.perf_counter()
    running = asyncio.ensure_future(prefill.prefill(spec))
    if prefetch and not decode.prefetch(spec, address):
        raise RuntimeError("the decode worker declined the prefetch")
    result = await running
    t1 = time.perf_counter()
    t2, tokens, last = None, [result.first_token], None
    async for event in decode.generate(spec, result):
        if t2 is None and event.token_ids:
            t2 = time.perf_counter()
        tokens += event.token_ids
        last = event
    assert t2 is not None and last is not None
    return {"prefill_ms": (t1 - t0) * 1e3, "handover_ms": (t2 - t1) * 1e3, "second_token_ms": (t2 - t0) * 1e3,
            "pulled_after_prefill": last.num_transferred_tokens, "prefetched": last.num_local_hit_tokens,
            "tokens": tokens}  # fmt: skip


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    prt = runtime(args, url, "prefill-0", "prefill")
    drt = runtime(args, url, "decode-0", "decode")
    prefill, decode = PrefillService(prt), DecodeService(drt)
    rng = random.Random(0)
    vocab = ModelConfig.from_path(args.model).vocab_size
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    try:
        for r in range(args.repeats + 1):  # round 0 warms both workers up
            prompt = tuple(rng.randrange(vocab // 8, vocab) for _ in range(args.prompt_tokens))  # no special tokens
            outs = {}
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                spec = RequestSpec(f"{mode}-{r}", prompt, params, cache_salt=f"{mode}-{r}")
                outs[mode] = asyncio.run(handover(prefill, decode, prt.address, spec, mode == "on"))
                log(f"round {r} {mode}: " + ", ".join(f"{k} {v:.0f}" for k, v in outs[mode].items() if k != "tokens"))
            if outs["on"]["tokens"] != outs["off"]["tokens"]:
                raise RuntimeError(f"round {r}: the two modes generated different tokens")
            if r:
                for mode in MODES:
                    rows[mode].append(outs[mode])
    finally:
        decode.close()
        drt.close()
        prt.close()
    keys = ("prefill_ms", "handover_ms", "second_token_ms", "pulled_after_prefill", "prefetched")
    medians = {m: {k: statistics.median(row[k] for row in rows[m]) for k in keys} for m in MODES}
    return {"benchmark": "overlap", "model": args.model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
            "chunk": args.chunk, "transport": args.transport, "repeats": args.repeats, "modes": medians,
            "handover_saved_ms": medians["off"]["handover_ms"] - medians["on"]["handover_ms"],
            "second_token_ratio": medians["on"]["second_token_ms"] / medians["off"]["second_token_ms"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256, help="the prefill worker's tokens per step")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transport", choices=("grpc", "shm"), default="grpc")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.prompt_tokens < 2 * args.chunk:
        ap.error("--prompt-tokens must span at least two --chunk steps: there is nothing to overlap otherwise")
    args.model = args.model or smollm2()
    args.secret = secrets.token_hex(16)  # the two workers' KV plane authenticates, as in a service
    redis = EmbeddedRedis().start()
    try:
        result = run(args, redis.url)
    finally:
        redis.stop()
    setup = (f"{result['model']} ({result['dtype']}), {result['prompt_tokens']} prompt tokens in steps of "
             f"{result['chunk']}, pulls by {result['transport']}")
    rows = [("model", setup)]
    for mode in MODES:
        m = result["modes"][mode]
        line = (f"prefill {m['prefill_ms']:.0f} ms, handover {m['handover_ms']:.0f} ms, second token "
                f"{m['second_token_ms']:.0f} ms; pulled after the prefill {m['pulled_after_prefill']:.0f} tokens, "
                f"prefetched {m['prefetched']:.0f}")
        rows.append((f"prefetch {mode}", line))
    saved = f"{result['handover_saved_ms']:.0f} ms (second token at {result['second_token_ratio']:.2f}x)"
    rows.append(("handover saved", saved))
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
