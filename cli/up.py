"""``pdserve up``: start the service, keep it up, and drain and stop it on SIGINT/SIGTERM.

While it runs it restarts what dies (the router on its port, the embedded Redis) and says so.
On the first signal the router stops taking requests (health NOT_SERVING, new calls refused),
those in flight get ``router.drain_timeout_s`` to finish, then everything stops; a second
signal stops at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import threading
from typing import Any

from pdserve.cli.state import remove_state, write_state
from pdserve.cluster.config import ServiceConfig
from pdserve.kvindex.config import redact_url

SUPERVISE_INTERVAL_S = 2.0

# vLLM's flags that pdserve cannot honour: refused with the reason, never accepted and ignored.
REFUSED_FLAGS: dict[str, str] = {}


def build_config(args: argparse.Namespace) -> ServiceConfig:
    """The ServiceConfig ``pdserve up`` runs with: defaults, then ``--config`` FILE, then the flags
    (each flag one dotted field, docs/cli.md has the table); then the model settled for every
    process: a Hub id resolved to its local snapshot (``engine.revision``, ``engine.download_dir``;
    its served name the id, as in vLLM, unless ``router.served_model_name`` says otherwise) and a
    chat template file read into its text. ValueError (one line) for anything refused."""
    for name, why in REFUSED_FLAGS.items():
        if getattr(args, name, None) is not None:
            raise ValueError(why)
    names = args.served_model_name
    if names is not None and len(names) > 1:
        raise ValueError(f"--served-model-name: the router serves its model under one name, got {len(names)}: "
                         f"{' '.join(names)}")  # fmt: skip
    config = ServiceConfig.load(
        args.config,
        prefill=args.prefill,
        decode=args.decode,
        prefill_resources=args.prefill_resources,
        decode_resources=args.decode_resources,
        host=args.host,
        port=args.port,
        http_port=None if args.http_port == "off" else args.http_port,
        metrics_port=args.metrics_port,
        ray_address=args.ray_address,
        engine__model=args.model,
        engine__revision=args.revision,
        engine__download_dir=args.download_dir,
        engine__dtype=args.dtype,
        engine__seed=args.seed,
        engine__chat_template=args.chat_template,
        engine__disable_cascade_attn=args.disable_cascade_attn,
        engine__cpu_fp32_gemm=args.cpu_fp32_gemm,
        engine__cache__hash_seed=args.hash_seed,
        engine__cache__block_size=args.block_size,
        engine__cache__kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        engine__cache__gpu_memory_utilization=args.gpu_memory_utilization,
        engine__cache__kv_cache_dtype=args.kv_cache_dtype,
        engine__cache__kv_offload_gb=args.kv_offload_gb,
        engine__cache__kv_offload_disk_gb=args.kv_offload_disk_gb,
        # Workers resolve it in their own working directory: make it absolute here.
        engine__cache__kv_offload_disk_dir=os.path.abspath(os.path.expanduser(args.kv_offload_disk_dir))
        if args.kv_offload_disk_dir else None,
        engine__parallel__tensor_parallel_size=args.tensor_parallel_size,
        prefill_tensor_parallel_size=args.prefill_tp,
        decode_tensor_parallel_size=args.decode_tp,
        prefill_cpus_per_worker=args.prefill_cpus,
        decode_cpus_per_worker=args.decode_cpus,
        share_idle_cpus=args.share_idle_cpus,
        core_reclaim_wait_s=args.core_reclaim_wait_s,
        engine__scheduler__max_model_len=args.max_model_len,
        engine__scheduler__max_num_seqs=args.max_num_seqs,
        engine__scheduler__max_num_batched_tokens=args.max_num_batched_tokens,
        index__url=args.redis_url,
        index__namespace=args.namespace,
        transfer__port_range=args.kv_transfer_ports,
        log_level=args.log_level,
        log_json=args.log_json,
        router__served_model_name=names[0] if names else None,
        router__api_key=args.api_key,
    )
    if args.http_port == "off":
        config = dataclasses.replace(config, http_port=None)
    return settle_model(config)


def settle_model(config: ServiceConfig) -> ServiceConfig:
    """``config`` with ``engine.model`` a local checkpoint (``resolve_model``) and
    ``engine.chat_template`` template text (``load_chat_template``), as every process needs them."""
    from pdserve.engine.chat_template import load_chat_template
    from pdserve.engine.model.hub import resolve_model

    engine, router = config.engine, config.router
    if engine.model is not None:
        local = resolve_model(engine.model, engine.revision, engine.download_dir)
        if local != engine.model and router.served_model_name is None:  # vLLM serves a Hub model by its id
            router = dataclasses.replace(router, served_model_name=engine.model)
        engine = dataclasses.replace(engine, model=local)
    if engine.chat_template is not None:
        engine = dataclasses.replace(engine, chat_template=load_chat_template(engine.chat_template))
    return dataclasses.replace(config, engine=engine, router=router)


def config_json(config: ServiceConfig) -> dict[str, Any]:
    """``config`` as its JSON file form, secrets hidden: the API key and the cluster secret as
    ``"***"`` when set, the Redis URL's password redacted."""
    data = dataclasses.asdict(config)
    for section, name in (("router", "api_key"), ("transfer", "cluster_secret")):
        if data[section].get(name) is not None:
            data[section][name] = "***"
    if data["index"].get("url"):
        data["index"]["url"] = redact_url(data["index"]["url"])
    return data


def run_up(args: argparse.Namespace) -> int:
    config = build_config(args)
    if args.print_config:
        print(json.dumps(config_json(config), indent=2))
        return 0
    from pdserve.cluster.launcher import Service

    stop = threading.Event()
    phase = ["starting"]  # starting -> serving -> stopping
    interrupted = threading.Event()  # a signal gave up the start or the drain: no further one counts
    service = Service(config)

    def on_signal(*_: object) -> None:
        # Starting: give the start up (it stops what it started). Serving: the first signal drains,
        # the second skips the drain. After that (and while stopping) the stop runs to its end: it
        # removes the state file, and what it stops would be left running.
        if phase[0] == "stopping" or interrupted.is_set():
            return
        if phase[0] == "starting" or stop.is_set():
            interrupted.set()
            raise KeyboardInterrupt
        stop.set()

    # Before the start, and again by the launcher after ray.init, which installs a handler of its own.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        address, redis_url = service.start()
        phase[0] = "serving"
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
                  "(/health, /ping and /metrics open)", flush=True)  # fmt: skip
        while not stop.wait(SUPERVISE_INTERVAL_S):
            for note in service.supervise():
                print(note, flush=True)
        print(f"draining: new requests refused, up to {config.router.drain_timeout_s:.0f}s for those in flight",
              flush=True)  # fmt: skip
        cut = service.drain()
        print(f"stopping{f' ({cut} requests cut off)' if cut else ''}...", flush=True)
    finally:
        phase[0] = "stopping"
        try:
            service.stop()
        finally:
            remove_state(os.getpid())
    return 0
