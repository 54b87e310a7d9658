"""The Redis index against a real redis-server (started by EmbeddedRedis; nothing is mocked)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cbor2
import pytest
import redis
import xxhash

from pdserve.engine.kvcache import BlockPool, block_hashes
from pdserve.engine.kvcache.events import BlockStored
from pdserve.kvindex import stats as stats_module
from pdserve.kvindex.config import IndexConfig, redact_url, tenant_digest
from pdserve.kvindex.embedded import EmbeddedRedis, sweep_stale_workdirs
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvindex.publisher import KVEventPublisher, remove_worker_blocks
from pdserve.kvindex.registry import WorkerRegistry
from pdserve.kvindex.stats import STATS_FIELDS, StatsRecorder, read_stats, read_window
from tests.support import REPO
from tests.support.polling import process_gone, wait_until
from tests.support.redis import running_redis, unique_namespace

BS = 16
FAST = dict(socket_timeout_s=0.5, retry_initial_s=0.02, retry_max_s=0.2)


@pytest.fixture()
def cfg(redis_server: EmbeddedRedis) -> IndexConfig:
    return IndexConfig(redis_server.url, namespace=unique_namespace(), **FAST)


@pytest.fixture()
def client(redis_server: EmbeddedRedis):
    c = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield c
    c.close()


def contract_hash(parent: bytes | None, tokens: list[int], extra: tuple | None = None, seed: str = "0") -> bytes:
    """The contract's block hash (docs/block-hashes.md), recomputed here without engine code."""

    def h(x: object) -> bytes:
        return xxhash.xxh3_128_digest(cbor2.dumps(x, canonical=True))

    return h((parent if parent is not None else h(seed), tuple(tokens), extra))


def store_chain(pool: BlockPool, tokens: list[int], salt: str | None = None) -> list:
    """Allocate blocks for ``tokens`` and cache their full blocks, like a finished prefill."""
    hashes = block_hashes(tokens, BS, cache_salt=salt)
    blocks = pool.get_new_blocks(-(-len(tokens) // BS))
    pool.cache_full_blocks(blocks, hashes, 0, len(hashes), BS, tokens)
    return blocks


def holders(client: redis.Redis, ns: str, h: bytes) -> dict[str, str]:
    return client.hgetall(f"{ns}:block:{h.hex()}")


# -- launcher -------------------------------------------------------------------------------
def test_embedded_redis_starts_answers_and_frees_its_port() -> None:
    server = EmbeddedRedis()
    with server:
        assert server.running and server.url == f"redis://pdserve:{server.password}@127.0.0.1:{server.port}/0"
        c = redis.Redis.from_url(server.url, decode_responses=True)
        assert c.ping()
        c.close()
    assert not server.running
    server.stop()  # idempotent
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", server.port))


def test_embedded_redis_is_locked_down() -> None:
    """An attacker on the machine: no password, no way in; with the password, no command that
    touches the server itself (writing files, loading modules, shutting it down, reading keys in bulk)."""
    with running_redis() as server:
        port = server.port
        anyone = redis.Redis(port=port, socket_timeout=5)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            anyone.hset("pdserve:x", "a", 1)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            anyone.config_set("dir", "/tmp")
        member = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=5)
        assert member.hset("pdserve:x", "a", 1) == 1 and member.info("server")["run_id"]
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "SET", "dbfilename", "x.rdb"), ("SAVE",),
                        ("BGSAVE",), ("MODULE", "LOAD", "/tmp/x.so"), ("DEBUG", "SLEEP", "0"), ("SHUTDOWN",),
                        ("FLUSHALL",), ("KEYS", "*"), ("ACL", "SETUSER", "evil", "on"), ("MONITOR",)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                member.execute_command(*command)
        assert server.running and member.ping()  # SHUTDOWN did not take it down
        # The password is in a private config file, not on a command line every user can read.
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert server.password.encode() not in cmdline
        conf = Path(server.config_path)
        assert conf.stat().st_mode & 0o777 == 0o600 and conf.parent.stat().st_mode & 0o777 == 0o700
        assert 'save ""' in conf.read_text() and "appendonly no" in conf.read_text()
        member.close()
        anyone.close()


def test_embedded_redis_allows_only_the_commands_pdserve_sends() -> None:
    """An allow-list, not a deny-list: scripting (EVAL's Lua crashed 6.2.14, CVE-2024-31449) and
    every other command pdserve never sends are refused with NOPERM and the server stays up. That
    the list covers what pdserve does send is the rest of this file (it runs on this ACL)."""
    with running_redis() as server:
        member = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=5)
        major = int(member.info("server")["redis_version"].split(".")[0])
        refused = [("EVAL", "return bit.tohex(65535,-2147483648)", "0"), ("EVALSHA", "0" * 40, "0"),
                   ("SCRIPT", "LOAD", "return 1"), ("SCRIPT", "FLUSH"), ("CONFIG", "GET", "*"),
                   ("MODULE", "LIST"), ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"),
                   # Unused everyday commands too: nothing outside the list.
                   ("GET", "k"), ("SET", "k", "v"), ("DEL", "k"), ("PUBLISH", "c", "m"), ("SELECT", "1"),
                   ("CLIENT", "LIST"), ("FUNCTION", "LIST")]  # fmt: skip
        for command in refused:
            if command[0] == "FUNCTION" and major < 7:
                # Redis 6 has no FUNCTION command at all: refused before any ACL check.
                with pytest.raises(redis.ResponseError, match="unknown command"):
                    member.execute_command(*command)
                continue
            with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
                member.execute_command(*command)
        assert server.running and member.ping()  # the EVAL that would crash it never ran
        member.close()


_OWNER = """
import signal, sys, time
from pdserve.kvindex.embedded import EmbeddedRedis
server = EmbeddedRedis().start()
# A handler, not SIG_IGN: an ignored signal would stay ignored in the server across exec.
signal.signal(signal.SIGINT, lambda *_: print("owner got SIGINT", flush=True))
print(server.pid, server.url, flush=True)
sys.stdin.read()  # until the test closes stdin
server.stop()
"""


def test_ctrl_c_in_the_owners_terminal_does_not_reach_the_embedded_redis() -> None:
    """The owner runs in a process group of its own, as a shell's foreground job; SIGINT to that
    group (what Ctrl-C does) reaches the owner only: the server, in its own session, is stopped by
    its owner's shutdown (after the drain), not by the keystroke."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)  # fmt: skip
    try:
        pid_text, url = owner.stdout.readline().split()
        pid = int(pid_text)
        assert os.getpgid(pid) != os.getpgid(owner.pid) and os.getsid(pid) == pid
        os.killpg(owner.pid, signal.SIGINT)
        assert owner.stdout.readline().strip() == "owner got SIGINT"
        time.sleep(0.3)  # redis-server exits on SIGINT at once when it gets one
        client = redis.Redis.from_url(url, socket_timeout=5)
        assert client.ping() and int(client.info("server")["process_id"]) == pid
        client.close()
        owner.stdin.close()  # the owner's own shutdown stops it
        assert owner.wait(timeout=20) == 0
        assert wait_until(lambda: not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), timeout=10)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (Z: a zombie, i.e. exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "Z"


def test_embedded_redis_reports_a_bad_start() -> None:
    with pytest.raises(RuntimeError, match="bogus"):  # the server's own output is in the error
        EmbeddedRedis(extra_args=["--bogus-option", "1"]).start()


def test_embedded_redis_without_any_binary_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="no redis-server binary"):
        EmbeddedRedis()


def test_embedded_redis_is_stopped_at_interpreter_exit() -> None:
    code = "from pdserve.kvindex.embedded import EmbeddedRedis; r = EmbeddedRedis().start(); print(r.pid, r.port)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    pid, port = map(int, out.stdout.split())

    assert wait_until(lambda: process_gone(pid), timeout=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# -- hashes and keys ----------------------------------------------------------------------------
def test_contract_vectors_match_engine_hashes() -> None:
    toks = list(range(32))
    h0 = contract_hash(None, toks[:16])
    assert h0.hex() == "209f5d549fc07c8e39d823615ede61ce"
    assert contract_hash(h0, toks[16:]).hex() == "03888914ee75b87e89df867a21beb72b"
    assert contract_hash(None, toks[:16], ("tenant-a",)).hex() == "bfbfafff3fa6ee68c398534127fa2299"
    assert block_hashes(toks, BS) == [h0, contract_hash(h0, toks[16:])]


def test_publisher_writes_design_keys_events_and_counters(cfg: IndexConfig, client: redis.Redis) -> None:
    ns = cfg.namespace
    pool = BlockPool(4)
    pub = KVEventPublisher(cfg, "prefill-0")
    pool.add_event_sink(pub)
    toks = list(range(40))  # 2 full blocks + a partial one
    t0 = int(time.time() * 1000)
    blocks = store_chain(pool, toks)
    assert pub.flush(5)
    h0, h1 = contract_hash(None, toks[:16]), contract_hash(contract_hash(None, toks[:16]), toks[16:32])
    assert h0.hex() == "209f5d549fc07c8e39d823615ede61ce"
    for h in (h0, h1):
        held = holders(client, ns, h)
        assert list(held) == ["prefill-0"] and t0 <= int(held["prefill-0"]) <= int(time.time() * 1000)
    assert sorted(client.scan_iter(f"{ns}:block:*")) == sorted(f"{ns}:block:{h.hex()}" for h in (h0, h1))

    [(_, entry)] = client.xrange(f"{ns}:events")
    assert entry["type"] == "BlockStored" and entry["worker"] == "prefill-0" and entry["medium"] == "GPU"
    assert json.loads(entry["block_hashes"]) == [h0.hex(), h1.hex()]
    assert entry["parent_block_hash"] == "" and entry["lora_name"] == ""
    assert "token_ids" not in entry and entry["block_size"] == "16"  # the prompt stays out of Redis

    # Free, then take every block: the two cached ones are evicted.
    pool.free_blocks(reversed(blocks))
    pool.free_blocks(pool.get_new_blocks(4))
    assert pub.flush(5)
    assert holders(client, ns, h0) == {} and holders(client, ns, h1) == {}
    last = client.xrevrange(f"{ns}:events", count=1)[0][1]
    assert last["type"] == "BlockRemoved" and sorted(json.loads(last["block_hashes"])) == sorted([h0.hex(), h1.hex()])
    for key in (f"{ns}:stats", f"{ns}:stats:worker:prefill-0"):
        assert client.hgetall(key) == {"blocks_stored": "2", "blocks_evicted": "2"}

    # A continuation block names its parent; a reset clears the worker's fields.
    pool.free_blocks(store_chain(pool, toks[:16]))
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, [h0, h1], 1, 2, BS, toks[:32])
    pool.free_blocks(b)
    assert pub.flush(5)
    stored = [e for _, e in client.xrange(f"{ns}:events") if e["type"] == "BlockStored"]
    assert stored[-1]["parent_block_hash"] == h0.hex()
    assert pub.held_hashes == {h0, h1}
    assert pool.reset_prefix_cache()
    assert pub.flush(5)
    assert list(client.scan_iter(f"{ns}:block:*")) == [] and pub.held_hashes == set()
    last = client.xrevrange(f"{ns}:events", count=1)[0][1]
    assert last == {"type": "AllBlocksCleared", "worker": "prefill-0", "medium": "GPU", "ts_ms": last["ts_ms"]}
    pub.close()


def test_token_ids_reach_the_stream_only_when_the_operator_opts_in(redis_server: EmbeddedRedis,
                                                                    client: redis.Redis) -> None:
    """A reader of ``{ns}:events`` (any Redis client) learns block hashes, never the prompt, by default."""
    secret = [4, 4, 1, 7] * 8  # a tenant's "PIN is 4417..."
    for opt_in in (False, True):
        cfg = IndexConfig(redis_server.url, namespace=unique_namespace(), events_include_token_ids=opt_in, **FAST)
        with KVEventPublisher(cfg, "w") as pub:
            pub(BlockStored(block_hashes(secret, BS), None, secret, BS))
            assert pub.flush(5)
        [(_, entry)] = client.xrange(f"{cfg.namespace}:events")
        assert ("token_ids" in entry) == opt_in
        if opt_in:
            assert json.loads(entry["token_ids"]) == secret


def test_events_stream_is_capped(redis_server: EmbeddedRedis, client: redis.Redis) -> None:
    cfg = IndexConfig(redis_server.url, namespace=unique_namespace(), events_maxlen=10, batch_max=32, **FAST)
    with KVEventPublisher(cfg, "w") as pub:
        for i in range(500):
            pub(BlockStored([i.to_bytes(16, "big")], None, list(range(BS)), BS))
        assert pub.flush(10)
    # MAXLEN ~ trims whole stream nodes (100 entries each by default).
    assert 10 <= client.xlen(f"{cfg.namespace}:events") <= 10 + 100


def test_stats_add_up_across_workers_and_tenants(cfg: IndexConfig, client: redis.Redis) -> None:
    ns = cfg.namespace
    a, b = StatsRecorder(cfg, "prefill-0"), StatsRecorder(cfg, "prefill-1")
    a.record({"requests": 1, "prompt_tokens": 100, "prefix_hit_tokens": 90}, cache_salt="tenant-a")
    b.record({"requests": 1, "prompt_tokens": 10, "prefix_hit_tokens": 0}, cache_salt="tenant-b")
    b.record({"requests": 1, "prompt_tokens": 10, "prefix_hit_tokens": 5, "transfer_failures": 1}, cache_salt="tenant-a")
    with pytest.raises(ValueError, match="unknown stats"):
        a.record({"prompt_tokns": 1})
    assert a.flush(5) and b.flush(5)
    stats = read_stats(client, cfg)
    assert set(stats["cluster"]) == set(STATS_FIELDS)
    assert stats["cluster"]["requests"] == 3 and stats["cluster"]["prompt_tokens"] == 120
    assert stats["hit_rate"] == pytest.approx(95 / 120)  # ratio of sums, not the mean 0.45 of ratios
    assert stats["workers"]["prefill-0"]["prompt_tokens"] == 100 and stats["workers"]["prefill-1"]["prompt_tokens"] == 20
    ta, tb = tenant_digest("tenant-a"), tenant_digest("tenant-b")
    assert ta == xxhash.xxh3_64_hexdigest(b"tenant-a") and len(ta) == 16
    assert client.exists(f"{ns}:stats:tenant:{ta}") and not list(client.scan_iter(f"{ns}:*tenant-a*"))
    assert stats["tenants"][ta]["prefix_hit_tokens"] == 95 and stats["tenants"][tb]["prompt_tokens"] == 10
    assert stats["tenants"][ta]["transfer_failures"] == 1
    # Tenants' counters expire a while after their last write; the cluster's and workers' never.
    assert 0 < client.ttl(f"{ns}:stats:tenant:{ta}") <= cfg.stats_tenant_ttl_s
    assert client.ttl(f"{ns}:stats") == client.ttl(f"{ns}:stats:worker:prefill-0") == -1
    for kind in ("workers", "tenants"):
        assert sum(d["prompt_tokens"] for d in stats[kind].values()) == stats["cluster"]["prompt_tokens"]
    a.close()
    b.close()


def test_windowed_stats_count_only_recent_increments_and_expire(cfg: IndexConfig, client: redis.Redis) -> None:
    now = 1_800_000_000.0
    clock = iter([now - 7200, now - 100, now - 30, now - 5, now - 5]).__next__
    rec = StatsRecorder(cfg, "decode-0", clock=clock)
    rec.record({"requests": 1, "prompt_tokens": 1000, "prefix_hit_tokens": 1000})  # two hours ago
    rec.record({"requests": 1, "prompt_tokens": 100, "prefix_hit_tokens": 0})  # 100 s ago
    rec.record({"requests": 1, "prompt_tokens": 50, "prefix_hit_tokens": 25}, cache_salt="tenant-a")  # 30 s ago
    rec.record({"requests": 2, "prompt_tokens": 30, "prefix_hit_tokens": 30}, cache_salt="tenant-a")  # 5 s ago
    rec.record({"transferred_tokens": 16}, worker_id="prefill-0")  # 5 s ago, credited to another worker
    assert rec.flush(5)
    rec.close()
    last_min = read_window(client, cfg, 60, now=now)
    assert 50 <= last_min["seconds"] <= 60
    assert last_min["cluster"]["requests"] == 3 and last_min["cluster"]["prompt_tokens"] == 80
    assert last_min["hit_rate"] == pytest.approx(55 / 80)  # a ratio of sums over the window
    assert last_min["workers"]["decode-0"]["prompt_tokens"] == 80
    assert last_min["workers"]["prefill-0"]["transferred_tokens"] == 16
    assert last_min["tenants"] == {tenant_digest("tenant-a"): {**dict.fromkeys(STATS_FIELDS, 0), "requests": 3,
                                                               "prompt_tokens": 80, "prefix_hit_tokens": 55}}
    assert read_window(client, cfg, 300, now=now)["cluster"]["prompt_tokens"] == 180
    # The lifetime totals have everything; every bucket expires by itself (a TTL is set on each write).
    assert read_stats(client, cfg)["cluster"]["prompt_tokens"] == 1180
    keys = list(client.scan_iter(f"{cfg.namespace}:stats:window:*"))
    assert len(keys) == 4 and all(0 < client.ttl(k) <= cfg.stats_retention_s + cfg.stats_bucket_s for k in keys)
    with pytest.raises(ValueError, match="window"):
        read_window(client, cfg, 0)


# -- lookup, registry, namespaces ---------------------------------------------------------------
def test_longest_prefix_over_workers_with_different_prefixes(cfg: IndexConfig, client: redis.Redis) -> None:
    toks = list(range(64))
    chain = block_hashes(toks, BS)  # 4 blocks
    pools = {w: BlockPool(8) for w in ("w-long", "w-short", "w-gap")}
    pubs = {w: KVEventPublisher(cfg, w) for w in pools}
    for w, pool in pools.items():
        pool.add_event_sink(pubs[w])
    store_chain(pools["w-long"], toks[:48])
    store_chain(pools["w-short"], toks[:16])
    b = pools["w-gap"].get_new_blocks(3)  # caches blocks 1 and 2 but not block 0
    pools["w-gap"].cache_full_blocks(b, chain, 1, 3, BS, toks)
    assert all(p.flush(5) for p in pubs.values())
    lookup = PrefixLookup(cfg)
    assert lookup.longest_prefix(chain) == {"w-long": 3, "w-short": 1}
    assert lookup.longest_prefix(chain[:1]) == {"w-long": 1, "w-short": 1}
    assert lookup.longest_prefix(chain, worker_ids=["w-short", "w-gap", "w-none"]) == {"w-short": 1, "w-gap": 0, "w-none": 0}
    assert lookup.longest_prefix(block_hashes(list(range(100, 132)), BS)) == {}
    assert lookup.longest_prefix([]) == {}
    assert remove_worker_blocks(client, cfg, "w-long") == 3
    assert lookup.longest_prefix(chain) == {"w-short": 1}
    for p in pubs.values():
        p.close()
    lookup.close()


def test_registry_heartbeat_and_staleness(cfg: IndexConfig, client: redis.Redis) -> None:
    reg = WorkerRegistry(cfg)
    free = iter(range(1000, 0, -1))
    info = {"role": "decode", "grpc_address": "127.0.0.1:50061", "model_fingerprint": "abc",
            "block_size": 16, "num_blocks": 1000}  # fmt: skip
    reg.start_heartbeat("decode-0", lambda: {**info, "free_blocks": next(free)}, interval_s=0.05)
    assert reg.register("prefill-9", {"role": "prefill", "grpc_address": "127.0.0.1:50051"})

    def entry() -> dict:
        return json.loads(client.hget(f"{cfg.namespace}:workers", "decode-0") or "{}")

    assert wait_until(lambda: entry().get("free_blocks", 1000) <= 997)  # it beat again, with fresh info
    assert entry()["role"] == "decode"
    assert set(reg.workers()) == {"decode-0", "prefill-9"}
    # prefill-9 never beats again: it ages out of the live view while decode-0 stays fresh.
    assert wait_until(lambda: set(reg.workers(max_age_s=0.4)) == {"decode-0"})
    reg.stop_heartbeat("decode-0")
    assert reg.unregister("prefill-9") and set(reg.workers()) == {"decode-0"}
    reg.close()


def test_namespace_isolates_keys(redis_server: EmbeddedRedis, client: redis.Redis) -> None:
    a = IndexConfig(redis_server.url, namespace=unique_namespace("a"), **FAST)
    b = IndexConfig(redis_server.url, namespace=unique_namespace("b"), **FAST)
    chain = block_hashes(list(range(32)), BS)
    with KVEventPublisher(a, "w") as pub:
        pub(BlockStored(chain, None, list(range(32)), BS))
        assert pub.flush(5)
    assert PrefixLookup(a).longest_prefix(chain) == {"w": 2}
    assert PrefixLookup(b).longest_prefix(chain) == {}
    assert list(client.scan_iter(f"{b.namespace}:*")) == []
    assert all(k.startswith(f"{a.namespace}:") for k in client.scan_iter(f"{a.namespace}*"))
    assert read_stats(client, b)["cluster"]["blocks_stored"] == 0


# -- outages, auth, config ----------------------------------------------------------------------
def test_outage_never_blocks_callers_and_index_is_republished(caplog: pytest.LogCaptureFixture) -> None:
    with running_redis() as server:
        cfg = IndexConfig(server.url, namespace="pdserve", **FAST)
        pool = BlockPool(8)
        pub, stats, lookup = KVEventPublisher(cfg, "p0"), StatsRecorder(cfg, "p0"), PrefixLookup(cfg)
        pool.add_event_sink(pub)
        kept = store_chain(pool, list(range(32)))
        evict_me = store_chain(pool, list(range(500, 532)))
        assert pub.flush(5)
        stats.record({"requests": 1, "prompt_tokens": 32})
        assert stats.flush(5)

        caplog.set_level(logging.WARNING, logger="kvtransfer")
        server.stop()
        t0 = time.perf_counter()
        pool.free_blocks(evict_me)
        pool.free_blocks(pool.get_new_blocks(6))  # evicts evict_me's 2 blocks while Redis is down
        new = store_chain(pool, list(range(900, 932)))
        for _ in range(200):
            stats.record({"requests": 1, "prompt_tokens": 10, "prefix_hit_tokens": 5})
        assert lookup.longest_prefix(block_hashes(list(range(32)), BS)) == {}
        assert time.perf_counter() - t0 < 0.5  # nothing waited on Redis
        assert wait_until(lambda: pub.outages == 1 and stats.outages == 1)
        assert lookup.outages == 1 and not pub.flush(0.1)
        failed = pub.failed_attempts
        assert wait_until(lambda: pub.failed_attempts >= failed + 2)  # it keeps retrying ...
        assert pub.outages == 1 and pub.dropped_batches >= 1  # ... still one outage, logged once
        assert sum("Redis unavailable" in r.getMessage() and "p0" in r.getMessage() for r in caplog.records) == 2

        server.restart()  # same port, empty database
        assert pub.flush(10) and stats.flush(10)
        assert pub.resyncs >= 1
        c = redis.Redis.from_url(server.url, decode_responses=True)
        expect = set(block_hashes(list(range(32)), BS) + block_hashes(list(range(900, 932)), BS))
        assert pub.held_hashes == expect
        assert {k.split(":")[-1] for k in c.scan_iter("pdserve:block:*")} == {h.hex() for h in expect}
        assert all(list(c.hgetall(f"pdserve:block:{h.hex()}")) == ["p0"] for h in expect)
        counters = read_stats(c, cfg)["cluster"]
        assert counters["prompt_tokens"] == 2000 and counters["prefix_hit_tokens"] == 1000  # lost increments replayed
        assert counters["blocks_evicted"] == 2
        assert wait_until(lambda: lookup.longest_prefix(block_hashes(list(range(32)), BS)) == {"p0": 2})
        pool.free_blocks(kept + new)
        for x in (pub, stats, lookup):
            x.close()
        c.close()


def test_an_outage_under_many_tenants_keeps_the_totals_in_bounded_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Increments lost to an outage are kept for the resync: the cluster's and the worker's whole,
    tenants' only up to the bound (a client may send a new cache_salt with every request)."""
    monkeypatch.setattr(stats_module, "MAX_LOST_COUNTERS", 40)
    with running_redis() as server:
        cfg = IndexConfig(server.url, namespace="pdserve", **FAST)
        stats = StatsRecorder(cfg, "p0")
        server.stop()
        for i in range(200):
            stats.record({"requests": 1, "prompt_tokens": 10}, cache_salt=f"tenant-{i}")
        assert wait_until(lambda: stats.outages == 1 and stats.unsaved > 0)
        server.restart()
        assert stats.flush(10)
        c = redis.Redis.from_url(server.url, decode_responses=True)
        totals = read_stats(c, cfg)
        assert totals["cluster"]["requests"] == 200 and totals["workers"]["p0"]["prompt_tokens"] == 2000
        assert 0 < len(totals["tenants"]) <= 40  # the rest was counted as unsaved, not kept
        stats.close()
        c.close()


def test_an_idle_writer_counts_one_outage_while_redis_stays_down(caplog: pytest.LogCaptureFixture) -> None:
    """A writer with nothing to write notices the outage by its restart check; with nothing to
    resync either, it must not call Redis reachable again (and count a new outage at the next
    check) without an answer from it."""
    caplog.set_level(logging.INFO, logger="pdserve.kvindex")
    with running_redis() as server:
        stats = StatsRecorder(IndexConfig(server.url, namespace="pdserve", restart_check_s=0.1, **FAST), "p0")
        server.stop()
        assert wait_until(lambda: stats.failed_attempts >= 4, timeout=30)
        assert stats.outages == 1
        assert not any("reachable again" in r.getMessage() for r in caplog.records)
        server.restart()
        assert wait_until(lambda: any("reachable again" in r.getMessage() for r in caplog.records), timeout=30)
        assert stats.outages == 1
        stats.close()


def test_quiet_restart_is_noticed_and_index_republished() -> None:
    """Redis restarts (empty) while the worker writes nothing: no write ever fails, yet the
    holder fields come back within restart_check_s, and the router's lookup finds them again."""
    with running_redis() as server:
        cfg = IndexConfig(server.url, namespace="pdserve", restart_check_s=0.2, **FAST)
        pool, pub = BlockPool(8), KVEventPublisher(cfg, "p0")
        pool.add_event_sink(pub)
        lookup = PrefixLookup(cfg)
        tokens = list(range(48))
        kept = store_chain(pool, tokens)
        assert pub.flush(5)
        assert lookup.longest_prefix(block_hashes(tokens, BS)) == {"p0": 3}
        server.restart()  # same port, empty database; the publisher's queue stays empty
        # (A check that lands while the server is down counts an outage: also fine, same outcome.)
        assert wait_until(lambda: lookup.longest_prefix(block_hashes(tokens, BS)) == {"p0": 3}, timeout=10)
        assert wait_until(lambda: pub.resyncs >= 1)
        pool.free_blocks(kept)
        pub.close()
        lookup.close()


def test_restart_check_without_info_permission_is_not_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    """A Redis user denied INFO (ACL -@dangerous) can still publish; the restart check just turns off."""
    with running_redis(restricted=False) as server:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "pd", "on", ">pw", "~*", "+@all", "-@dangerous")
        url = server.url.replace("redis://", "redis://pd:pw@", 1)
        cfg = IndexConfig(url, namespace="pdserve", restart_check_s=0.1, **FAST)
        pool, pub = BlockPool(8), KVEventPublisher(cfg, "p0")
        pool.add_event_sink(pub)
        with caplog.at_level(logging.WARNING):
            kept = store_chain(pool, list(range(32)))
            assert pub.flush(5)
            assert wait_until(lambda: not pub.restart_check_enabled)
            pool.free_blocks(store_chain(pool, list(range(100, 132))))  # more writes: no further check
            assert pub.flush(5)
        assert pub.outages == 0 and pub.dropped_batches == 0
        assert sum("cannot read Redis INFO" in r.getMessage() for r in caplog.records) == 1
        assert PrefixLookup(cfg).longest_prefix(block_hashes(list(range(32)), BS)) == {"p0": 2}
        pool.free_blocks(kept)
        pub.close()
        admin.close()


def test_lookup_during_a_hung_redis_costs_little() -> None:
    """SIGSTOP'd Redis: a lookup waits at most lookup_timeout_s once, then skips Redis in backoff."""
    with running_redis() as server:
        cfg = IndexConfig(server.url, namespace="pdserve", lookup_timeout_s=0.2)
        lookup = PrefixLookup(cfg)
        hashes = block_hashes(list(range(32)), BS)
        assert lookup.longest_prefix(hashes) == {}
        os.kill(server.pid, signal.SIGSTOP)
        try:
            times = []
            for _ in range(20):
                t0 = time.monotonic()
                assert lookup.longest_prefix(hashes) == {}
                times.append(time.monotonic() - t0)
            assert max(times) < 0.5 and sum(t > 0.1 for t in times) <= 2
            assert lookup.outages == 1
        finally:
            os.kill(server.pid, signal.SIGCONT)
        lookup.close()


def test_removals_lost_in_an_outage_are_replayed_when_redis_kept_its_data() -> None:
    with running_redis(restricted=False) as server:
        cfg = IndexConfig(server.url, namespace="pdserve", **FAST)
        pool, pub = BlockPool(4), KVEventPublisher(cfg, "p0")
        pool.add_event_sink(pub)
        chain = block_hashes(list(range(32)), BS)
        pool.free_blocks(store_chain(pool, list(range(32))))
        assert pub.flush(5)
        server.stop()
        pool.free_blocks(pool.get_new_blocks(4))  # evicts the chain while Redis is down
        assert wait_until(lambda: pub.outages == 1)
    # Redis returns with its old data (a partition, not a crash) but refuses the publisher
    # until the stale fields are in place: a password only the test knows.
    with running_redis(port=server.port, password="gate", restricted=False) as back:
        admin = redis.Redis(port=back.port, password="gate", decode_responses=True)
        for h in chain:
            admin.hset(f"pdserve:block:{h.hex()}", "p0", 1)
        assert not pub.flush(0.3)
        admin.config_set("requirepass", "")
        assert pub.flush(10)
        assert list(admin.scan_iter("pdserve:block:*")) == [] and pub.outages == 1
        assert admin.hget("pdserve:stats", "blocks_evicted") == "2"
        pub.close()
        admin.close()


def test_password_protected_redis_via_url(client: redis.Redis) -> None:
    with running_redis(password="s3cr3t") as server:
        url = f"redis://pdserve:s3cr3t@127.0.0.1:{server.port}/0"
        assert server.url == url
        cfg = IndexConfig(url, namespace="pw", **FAST)
        assert "s3cr3t" not in repr(cfg)
        chain = block_hashes(list(range(16)), BS)
        with KVEventPublisher(cfg, "w") as pub:
            pub(BlockStored(chain, None, list(range(16)), BS))
            assert pub.flush(5)
        assert PrefixLookup(cfg).longest_prefix(chain) == {"w": 1}
        bad = PrefixLookup(IndexConfig(f"redis://pdserve:wrong@127.0.0.1:{server.port}/0", **FAST))
        assert bad.longest_prefix(chain) == {} and bad.outages == 1


def test_config_validation_and_tls_url() -> None:
    for kwargs in ({"url": "http://x"}, {"url": "redis://x", "namespace": "a*"}, {"url": "redis://x", "events_maxlen": 0},
                   {"url": "redis://x", "retry_initial_s": 5.0}):  # fmt: skip
        with pytest.raises(ValueError):
            IndexConfig(**kwargs)
    with pytest.raises(ValueError, match=r"bad Redis URL 'redis://u:\*\*\*@h:notaport/0'"):
        IndexConfig("redis://u:hunter2@h:notaport/0")  # refused where it is given, the password hidden
    # Every password redis-py would read is redacted: in the netloc and in a query parameter.
    for url, shown in (("redis://u:p%40ss@h:1/0", "redis://u:***@h:1/0"),
                       ("redis://h:1/0?password=topsecret&db=2", "redis://h:1/0?password=***&db=2"),
                       ("unix:///run/r.sock?db=1&Password=s3", "unix:///run/r.sock?db=1&Password=***"),
                       ("redis://h:1/0", "redis://h:1/0")):  # fmt: skip
        assert redact_url(url) == shown and shown in repr(IndexConfig(url))
    cfg = IndexConfig("rediss://:pw@cache.example:6380/0")
    assert cfg.client().connection_pool.connection_class is redis.SSLConnection
    with pytest.raises(Exception):  # noqa: B017 - frozen
        cfg.namespace = "x"  # type: ignore[misc]


def test_an_embedded_redis_that_cannot_start_leaves_no_directory(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Its directory holds the config, and the config the password: a failed start removes it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(FileNotFoundError):
        EmbeddedRedis(binary=str(tmp_path / "no-such-redis-server")).start()
    assert list(tmp_path.iterdir()) == []


def test_an_embedded_redis_ends_with_its_owner_even_a_killed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-server runs in a session of its own (a terminal's Ctrl-C is for `up` to handle), so a
    signal to the owner's process group misses it: it must still end when its owner is SIGKILLed. The
    directory it leaves goes when the next server starts; a live owner's stays. (Both use a temp
    directory of the test's own: a server another test starts meanwhile would sweep a shared one.)"""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = ("from pdserve.kvindex.embedded import EmbeddedRedis\n"
              "r = EmbeddedRedis().start()\nprint(r._proc.pid, r.config_path, flush=True)\n"
              "import time\ntime.sleep(600)\n")  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        assert owner.stdout is not None
        pid_text, config = owner.stdout.readline().split()
        pid, workdir = int(pid_text), Path(config).parent
        assert os.getpgid(pid) != os.getpgid(owner.pid)
        owner.kill()
        owner.wait(timeout=30)
        assert wait_until(lambda: not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), timeout=30)
        assert workdir.is_dir() and workdir.parent == tmp_path  # no finalizer ran
        with EmbeddedRedis() as live:
            assert not workdir.exists()
            assert live.config_path is not None
            assert sweep_stale_workdirs() == 0 and Path(live.config_path).exists()
    finally:
        owner.kill()
