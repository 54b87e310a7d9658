"""Tokens from a decode worker to the router: one Ray stream per request against one event channel
per worker (``decode_worker/outbox.py``, ``router/decode_channel.py``).

A synthetic decode actor advances ``--streams`` requests together, one token each per step (a step
every ``--step-ms``, as an engine's steps advance its batch), for ``--tokens`` tokens each. It sends
them two ways, alternating round after round: ``per_request``, each request its own streaming call
(``DecodeWorker.generate``, read as the router read it before: one Ray object per event); and
``channel``, each request a ``run`` call whose events go out on the worker's event channel, read by
the router's own ``RayWorkers.decode`` (one Ray object per step for all streams). No model runs: what
is measured is the transport alone. Reported per way (medians over ``--repeats`` rounds): CPU time
per token in the decode actor's process and in the reading (router) process, all their threads
counted, and the wall time of the round.

Run: ``python -m pdserve.benchmarks.streams [--streams 16] [--tokens 64] [--step-ms 20] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.benchmarks.common import emit


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _actor_class() -> Any:
    import ray

    from pdserve.decode_worker.outbox import Outboxes
    from pdserve.worker.messages import DecodeEvent, RequestSpec

    @ray.remote(num_cpus=0)
    class SyntheticDecode:
        """Every request it runs gets a token per step; one step every ``step_s``."""

        def __init__(self, step_s: float) -> None:
            self.outboxes = Outboxes()
            self.step_s = step_s
            self.tick = asyncio.Event()
            self.ticker: asyncio.Task[None] | None = None

        async def _ticks(self) -> None:
            while True:
                await asyncio.sleep(self.step_s)
                self.tick.set()
                self.tick = asyncio.Event()

        async def _tokens(self, spec: RequestSpec) -> AsyncIterator[DecodeEvent]:
            if self.ticker is None:
                self.ticker = asyncio.ensure_future(self._ticks())
            n = spec.params.max_tokens
            for k in range(1, n + 1):
                await self.tick.wait()
                yield DecodeEvent(spec.request_id, (k,), k == n, "length" if k == n else None)

        async def generate(self, spec: RequestSpec, prefill: object = None) -> AsyncIterator[DecodeEvent]:
            async for event in self._tokens(spec):
                yield event

        async def events(self, channel: str, ttl_s: float) -> AsyncIterator[list[tuple[str, DecodeEvent]]]:
            async for batch in self.outboxes.serve(channel, ttl_s):
                yield batch

        async def renew(self, channel: str) -> bool:
            return self.outboxes.renew(channel)

        async def run(self, spec: RequestSpec, prefill: object, channel: str) -> int:
            return await self.outboxes.send(channel, spec.request_id, self._tokens(spec))

        async def drop(self, request_id: str) -> bool:
            return False

        def cpu_s(self) -> float:
            return time.process_time()

    return SyntheticDecode


async def _read_per_request(handle: Any, spec: Any) -> int:
    n = 0
    async for ref in handle.generate.options(num_returns="streaming").remote(spec, None):
        n += len((await ref).token_ids)
    return n


async def _read_channel(workers: Any, spec: Any) -> int:
    return sum([len(ev.token_ids) async for ev in workers.decode("decode-0", spec, None)])


def _round(way: str, handle: Any, workers: Any, streams: int, tokens: int, tag: str) -> dict[str, float]:
    import ray

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.worker.messages import RequestSpec

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    specs = [RequestSpec(f"{tag}-{i}", (1,), params) for i in range(streams)]

    async def main() -> int:
        if way == "per_request":
            counts = await asyncio.gather(*(_read_per_request(handle, s) for s in specs))
        else:
            counts = await asyncio.gather(*(_read_channel(workers, s) for s in specs))
        return sum(counts)

    actor0, here0, wall0 = ray.get(handle.cpu_s.remote()), time.process_time(), time.perf_counter()
    got = asyncio.run(main())
    actor1, here1, wall1 = ray.get(handle.cpu_s.remote()), time.process_time(), time.perf_counter()
    if got != streams * tokens:
        raise RuntimeError(f"{way}: {got} tokens arrived, {streams * tokens} sent")
    return {"actor_us_per_token": 1e6 * (actor1 - actor0) / got, "router_us_per_token": 1e6 * (here1 - here0) / got,
            "wall_s": wall1 - wall0}  # fmt: skip


def run(streams: int, tokens: int, step_ms: float, repeats: int) -> dict[str, Any]:
    import ray

    from pdserve.cluster.launcher import start_local_ray
    from pdserve.router.ray_workers import RayWorkers

    start_local_ray(2, progress=log)
    handle = _actor_class().remote(step_ms / 1000)
    ways = ("per_request", "channel")
    rounds: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    try:
        for r in range(repeats + 1):  # round 0 warms both ways up, not counted
            for way in ways:
                workers = RayWorkers({}, {"decode-0": handle})  # a new channel each round, as a new router
                result = _round(way, handle, workers, streams, tokens, f"{way}-{r}")
                workers.close()
                if r:
                    rounds[way].append(result)
                    log(f"[bench streams] round {r}/{repeats} {way}: {result['actor_us_per_token']:.0f} us/token "
                        f"in the actor, {result['router_us_per_token']:.0f} in the router")  # fmt: skip
    finally:
        ray.kill(handle)
    out: dict[str, Any] = {"streams": streams, "tokens": tokens, "step_ms": step_ms, "repeats": repeats}
    for way in ways:
        out[way] = {k: statistics.median(x[k] for x in rounds[way]) for k in rounds[way][0]}
    for side in ("actor_us_per_token", "router_us_per_token"):
        out[f"{side}_ratio"] = out["per_request"][side] / max(out["channel"][side], 1e-9)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench streams", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--streams", type=int, default=16, help="requests decoded together")
    p.add_argument("--tokens", type=int, default=64, help="tokens of each")
    p.add_argument("--step-ms", type=float, default=20.0, help="one step (a token for every stream) this often")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.streams < 1 or args.tokens < 1 or args.repeats < 1 or not args.step_ms > 0:
        p.error("--streams, --tokens and --repeats must be >= 1 and --step-ms > 0")
    out = run(args.streams, args.tokens, args.step_ms, args.repeats)
    rows = [("workload", f"{args.streams} streams x {args.tokens} tokens, a step every {args.step_ms:g} ms, "
                         f"medians of {args.repeats} rounds")]  # fmt: skip
    for way in ("per_request", "channel"):
        r = out[way]
        rows.append((way, f"decode actor {r['actor_us_per_token']:.0f} us/token, router {r['router_us_per_token']:.0f} "
                          f"us/token, round {r['wall_s']:.2f} s"))  # fmt: skip
    rows.append(("per_request / channel", f"actor {out['actor_us_per_token_ratio']:.2f}x, "
                                          f"router {out['router_us_per_token_ratio']:.2f}x CPU per token"))  # fmt: skip
    emit(out, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
