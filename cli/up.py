"""``pdserve up``: start the service, keep it up, and drain and stop it on SIGINT/SIGTERM.

While it runs it restarts what dies (the router on its port, the embedded Redis) and says so.
On the first signal the router stops taking requests (health NOT_SERVING, new calls refused),
those in flight get ``router.drain_timeout_s`` to finish, then everything stops; a second
signal stops at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading

from pdserve.cli.state import remove_state, write_state
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.kvindex.config import redact_url

SUPERVISE_INTERVAL_S = 2.0


def run_up(args: argparse.Namespace) -> int:
    config = ServiceConfig.load(
        args.config,
        prefill=args.prefill,
        decode=args.decode,
        prefill_resources=args.prefill_resources,
        decode_resources=args.decode_resources,
        port=args.port,
        http_port=None if args.http_port == "off" else args.http_port,
        metrics_port=args.metrics_port,
        ray_address=args.ray_address,
        engine__model=args.model,
        engine__cache__hash_seed=args.hash_seed,
        engine__cache__block_size=args.block_size,
        engine__cache__kv_cache_dtype=args.kv_cache_dtype,
        engine__cache__kv_offload_gb=args.kv_offload_gb,
        engine__cache__kv_offload_disk_gb=args.kv_offload_disk_gb,
        # Workers resolve it in their own working directory: make it absolute here.
        engine__cache__kv_offload_disk_dir=os.path.abspath(os.path.expanduser(args.kv_offload_disk_dir))
        if args.kv_offload_disk_dir else None,
        index__url=args.redis_url,
        index__namespace=args.namespace,
        transfer__port_range=args.kv_transfer_ports,
        log_level=args.log_level,
        log_json=args.log_json,
        router__api_key=args.api_key,
    )
    if args.http_port == "off":
        config = dataclasses.replace(config, http_port=None)
    stop = threading.Event()
    service = Service(config)

    def on_signal(*_: object) -> None:
        if stop.is_set():  # the second signal: no more draining
            raise KeyboardInterrupt
        stop.set()

    try:
        address, redis_url = service.start()
        # After start: ray.init installs its own SIGTERM handler, which would skip the clean stop.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        print(f"router listening on {address}", flush=True)
        if service.http_address is not None:
            print(f"http listening on {service.http_address}", flush=True)
        if service.metrics_url is not None:
            print(f"metrics at {service.metrics_url}", flush=True)
        print(f"redis at {redact_url(redis_url)}", flush=True)
        state = write_state({"pid": os.getpid(), "router": address, "http": service.http_address,
                             "redis_url": redis_url, "namespace": config.index.namespace})  # fmt: skip
        print(f"state in {state} (pdserve stats reads the Redis URL there)", flush=True)
        if config.router.api_key:  # never the key itself, here or in the state file
            print("API key required: HTTP 'Authorization: Bearer KEY', gRPC metadata 'authorization: Bearer KEY' "
                  "(/health and /metrics open)", flush=True)  # fmt: skip
        while not stop.wait(SUPERVISE_INTERVAL_S):
            for note in service.supervise():
                print(note, flush=True)
        print(f"draining: new requests refused, up to {config.router.drain_timeout_s:.0f}s for those in flight",
              flush=True)  # fmt: skip
        cut = service.drain()
        print(f"stopping{f' ({cut} requests cut off)' if cut else ''}...", flush=True)
    finally:
        service.stop()
        remove_state(os.getpid())
    return 0
