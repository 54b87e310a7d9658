"""``pdserve up``: start the service and serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading

from kvtransfer.redis_index import RedisIndexConfig
from router.launcher import Service
from router.service_config import ServiceConfig


def run_up(args: argparse.Namespace) -> int:
    config = ServiceConfig.load(
        args.config,
        model=args.model,
        prefill=args.prefill,
        decode=args.decode,
        port=args.port,
        redis_url=args.redis_url,
        ray_address=args.ray_address,
        hash_seed=args.hash_seed,
        block_size=args.block_size,
    )
    stop = threading.Event()
    service = Service(config)
    try:
        address, redis_url = service.start()
        # After start: ray.init installs its own SIGTERM handler, which would skip the clean stop.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"router listening on {address}", flush=True)
        print(f"redis at {RedisIndexConfig(redis_url).redacted_url}", flush=True)
        stop.wait()
        print("stopping...", flush=True)
    finally:
        service.stop()
    return 0
