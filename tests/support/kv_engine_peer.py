"""A prefill peer for the round-trip test: a real engine prefills a prompt in this process
(``handoff``) and serves the held KV under a lease over gRPC.

    python -m tests.support.kv_engine_peer MODEL PROMPT_JSON OUT_DIR MAX_TOKENS [KV_CACHE_DTYPE]

Prints one JSON line: {"address", "lease_id", "first_token", "continuation", "blocks_file"}, then
serves until killed. ``continuation`` is this process's own greedy decode of the same prompt.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.server import start_transfer_server
from pdserve.kvtransfer.source import BlockSource


def run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def main() -> None:
    model_dir, prompt_json, out_dir, max_tokens = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    kv_cache_dtype = sys.argv[5] if len(sys.argv) > 5 else "auto"
    prompt = json.loads(prompt_json)
    engine = LLMEngine(EngineConfig(model_dir, cache=CacheConfig(block_size=8, num_blocks=64,
                                                                 kv_cache_dtype=kv_cache_dtype)))  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.enqueue(engine.make_request(prompt, params, "prefilled", handoff=True))
    done = run(engine)[-1]
    held = done.kv_handoff
    assert held is not None
    source = BlockSource(engine.handover, model_fingerprint=engine.model_config.fingerprint, worker_id="peer")
    blocks = b"".join(engine.kv_tensor.block_bytes(b).numpy().tobytes() for b in held.block_ids)
    (out_dir / "blocks.bin").write_bytes(blocks)
    lease = source.lease(held)
    # The reference: decode the same prompt here, greedily, without any transfer.
    engine.add_request(prompt, params, "reference")
    continuation = [t for o in run(engine) for t in o.new_token_ids]
    server = start_transfer_server(source, port=0)
    print(json.dumps({"address": server.address, "lease_id": lease, "first_token": done.new_token_ids[0],
                      "continuation": continuation, "blocks_file": str(out_dir / "blocks.bin")}), flush=True)  # fmt: skip
    threading.Event().wait()  # serve until killed


if __name__ == "__main__":
    main()
