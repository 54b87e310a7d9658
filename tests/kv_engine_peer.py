"""A prefill peer for the round-trip test: a real engine prefills a prompt in this process and
serves its KV under a lease over gRPC.

Prints one JSON line: {"address", "lease_id", "first_token", "continuation", "blocks_file"}, then
serves until killed. ``continuation`` is this process's own greedy decode of the same prompt.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer.server import start_transfer_server
from kvtransfer.source import BlockSource


def main() -> None:
    model_dir, prompt_json, out_dir, max_tokens = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    prompt = json.loads(prompt_json)
    engine = LLMEngine(EngineConfig(model_dir, cache=CacheConfig(block_size=8, num_blocks=64)))
    req = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), "prefilled")
    req.hold_kv = True
    while engine.has_unfinished():
        engine.step()
    source = BlockSource(engine.kv_cache, engine.kv, engine.lock, model_fingerprint=engine.model_config.fingerprint,
                         worker_id="peer")  # fmt: skip
    block_ids = engine.kv.get_block_ids("prefilled")
    blocks = b"".join(engine.kv_cache.block_bytes(b).numpy().tobytes() for b in block_ids)
    (out_dir / "blocks.bin").write_bytes(blocks)
    lease = source.lease_request(req, num_tokens=len(prompt))
    # The reference: decode the same prompt here, greedily, without any transfer.
    ref = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), "reference")
    while engine.has_unfinished():
        engine.step()
    server = start_transfer_server(source, port=0)
    print(json.dumps({"address": server.address, "lease_id": lease, "first_token": req.output_token_ids[0],
                      "continuation": ref.output_token_ids, "blocks_file": str(out_dir / "blocks.bin")}), flush=True)  # fmt: skip
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
