"""``pdserve demo``: the whole system on an embedded default and a shared-system-prompt workload.

Local Ray, an embedded redis-server, a tiny model (random weights: its text is noise; the point
is the serving path), 1 prefill + 1 decode worker. Three
tenants (each its own ``cache_salt``) share one system prompt among three users each;
each user sends two turns. The demo prints every request's TTFT, output and usage,
then the prefix hit rates read back from Redis, and exits 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import time

import grpc

from pdserve.cli.client import GenerateResult, build_request, generate
from pdserve.cli.stats import format_stats
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvindex.config import tenant_digest
from pdserve.kvindex.stats import read_stats
from pdserve.v1 import router_pb2_grpc as pb_grpc

TENANTS = {
    "acme": "You are the support assistant of ACME Rockets. Answer briefly and politely, cite the manual "
    "section when you can, never promise delivery dates, and escalate safety questions to a human. ",
    "globex": "You are Globex's internal HR helper. Keep answers factual, point to the policy page, "
    "and do not give legal advice; suggest contacting HR for anything about contracts or pay. ",
    "initech": "You are a code reviewer for Initech. Comment on correctness first, then readability; "
    "keep each remark to one sentence and quote the line you mean. ",
}
QUESTIONS = ["How do I reset my password?", "What is the refund policy?", "Can you summarise the last update?"]


def _workload() -> list[tuple[str, str, str]]:
    """(tenant, user, prompt) for every request: two turns per user, turn 2 extends turn 1."""
    out = []
    for turn in range(2):
        for tenant, system in TENANTS.items():
            for u, q in enumerate(QUESTIONS):
                prompt = system + f"User {u}: {q}"
                if turn == 1:
                    prompt += " Assistant: (answer) User: Thanks, and one more detail please?"
                out.append((tenant, f"user{u}", prompt))
    return out


def run_demo(args: argparse.Namespace) -> int:
    engine = EngineConfig(model=args.model, cache=CacheConfig(kv_cache_memory_bytes=64 * 1024**2))
    service = Service(ServiceConfig(port=0, engine=engine))
    try:
        address, redis_url = service.start()
        print(f"router listening on {address}")
        print(f"redis at {redis_url}")
        params = SamplingParams(max_tokens=12)
        work = _workload()
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.RouterStub(channel)
            print(f"\n{'tenant':<8} {'user':<6} {'ttft_ms':>8} {'prompt':>6} {'cached':>6} {'moved':>6}  output")
            for turn in range(2):
                batch = work[turn * len(work) // 2 : (turn + 1) * len(work) // 2]
                # The first user of each tenant goes alone so the others can hit its prefix.
                for tenant, user, prompt in batch[:: len(QUESTIONS)]:
                    _show(tenant, user, generate(stub, build_request(prompt, params, cache_salt=tenant)))
                rest = [w for i, w in enumerate(batch) if i % len(QUESTIONS)]
                with cf.ThreadPoolExecutor(4) as pool:
                    futures = [
                        (t, u, pool.submit(generate, stub, build_request(p, params, cache_salt=t))) for t, u, p in rest
                    ]
                    for t, u, f in futures:
                        _show(t, u, f.result())
        time.sleep(0.5)  # the stats writers flush asynchronously
        index = service.index_config()
        stats = read_stats(index.client(), index)
        print("\nprefix hit rates from Redis (prefix_hit_tokens / prompt_tokens):")
        print(format_stats(stats, {tenant_digest(t): t for t in TENANTS}))
        print(f"\ncluster hit rate: {stats['hit_rate']:.1%}")
        return 0
    except grpc.RpcError as e:
        print(f"pdserve demo: request failed: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        service.stop()


def _show(tenant: str, user: str, r: GenerateResult) -> None:
    u = r.usage
    text = r.text.encode("unicode_escape").decode()[:40]
    print(
        f"{tenant:<8} {user:<6} {r.ttft_ms or 0:8.1f} {u.get('prompt_tokens', 0):6d} "
        f"{u.get('cached_tokens', 0):6d} {u.get('transferred_tokens', 0):6d}  {text}"
    )
