"""``pdserve up``: start the service and serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading

from router.launcher import Service
from router.service_config import ServiceConfig


def run_up(args: argparse.Namespace) -> int:
    config = ServiceConfig.load(
        args.config,
        model=args.model,
        prefill=args.prefill if args.prefill != 1 or args.config is None else None,
        decode=args.decode if args.decode != 1 or args.config is None else None,
        port=args.port if args.port != 50051 or args.config is None else None,
        redis_url=args.redis_url,
        ray_address=args.ray_address,
        hash_seed=args.hash_seed,
        block_size=args.block_size if args.block_size != 16 or args.config is None else None,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    service = Service(config)
    try:
        address, redis_url = service.start()
        print(f"router listening on {address}", flush=True)
        print(f"redis at {redis_url}", flush=True)
        stop.wait()
        print("stopping...", flush=True)
    finally:
        service.stop()
    return 0
