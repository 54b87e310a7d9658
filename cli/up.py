"""``pdserve up``: start the service and serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading

from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.kvindex.config import redact_url


def run_up(args: argparse.Namespace) -> int:
    config = ServiceConfig.load(
        args.config,
        prefill=args.prefill,
        decode=args.decode,
        port=args.port,
        ray_address=args.ray_address,
        engine__model=args.model,
        engine__cache__hash_seed=args.hash_seed,
        engine__cache__block_size=args.block_size,
        index__url=args.redis_url,
        index__namespace=args.namespace,
    )
    stop = threading.Event()
    service = Service(config)
    try:
        address, redis_url = service.start()
        # After start: ray.init installs its own SIGTERM handler, which would skip the clean stop.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"router listening on {address}", flush=True)
        print(f"redis at {redact_url(redis_url)}", flush=True)
        stop.wait()
        print("stopping...", flush=True)
    finally:
        service.stop()
    return 0
