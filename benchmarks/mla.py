"""MLA benchmark: KV bytes per token against GQA and MHA, and decode steps absorbed vs naive.

1. KV bytes per token, as the engine allocates them (``KVLayout.block_nbytes / block_size``, all
   layers): a DeepSeek config against the same-size model with MHA (one K/V head per query head,
   ``qk_nope_head_dim`` wide: the MLA paper's comparison) and with GQA (8 KV heads; 2 for the
   tiny 4-head model). Shown for the tiny test model (float32) and DeepSeek-V3's shape (bf16).
2. Decode-step time, absorbed vs naive attention, at several context lengths: a DeepSeek-shaped
   model with random weights (``--heads`` heads, latent ``--rank``), ``--batch`` sequences that
   each decode one token over ``context`` cached tokens. Both forms run on the same cache and
   weights, alternating, ``--repeats`` times; medians of the whole model step and of the
   attention call alone, and the ratio naive / absorbed measured side by side.

Run: ``pdserve bench mla [--quick] [--json]``. CPU only (the torch paths).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from pdserve.benchmarks.common import emit
from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.kernels.mla import absorb_query, expand_latent, mla_attention, mla_attention_naive
from pdserve.engine.kernels.torch_paged import plan_attention
from pdserve.engine.kv_tensor import KVLayout
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.deepseek import DeepseekForCausalLM

BLOCK = 16

TINY = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, kv_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, q_lora_rank=24)  # fmt: skip  # tests/support/deepseek_models.py
V3 = dict(hidden_size=7168, num_attention_heads=128, num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
          qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536)  # fmt: skip


def log(msg: str) -> None:
    print(f"[bench mla] {msg}", file=sys.stderr, flush=True)


def deepseek_dict(shape: dict[str, int], **extra: Any) -> dict[str, Any]:
    return dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=512, intermediate_size=4 * shape["hidden_size"],
                moe_intermediate_size=shape["hidden_size"], n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=16384,
                **shape, **extra)  # fmt: skip


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    layout = KVLayout(cfg.num_hidden_layers, cfg.kv_cache_heads, cfg.kv_cache_head_dim, BLOCK, dtype,
                      kind=cfg.kv_cache_kind, rope_dim=cfg.kv_cache_rope_dim)  # fmt: skip
    return layout.block_nbytes // BLOCK


def kv_bytes(shape: dict[str, int], gqa_heads: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes per token of the MLA model and of Llama-style models of the same size."""
    mla = ModelConfig.from_dict(deepseek_dict(shape))

    def llama(kv_heads: int) -> ModelConfig:
        return ModelConfig.from_dict(dict(
            architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=shape["hidden_size"],
            intermediate_size=4 * shape["hidden_size"], num_hidden_layers=shape["num_hidden_layers"],
            num_attention_heads=shape["num_attention_heads"], num_key_value_heads=kv_heads,
            head_dim=shape["qk_nope_head_dim"]))  # fmt: skip

    return {"mla": bytes_per_token(mla, dtype), f"gqa{gqa_heads}": bytes_per_token(llama(gqa_heads), dtype),
            "mha": bytes_per_token(llama(shape["num_attention_heads"]), dtype)}  # fmt: skip


@torch.no_grad()
def random_model(cfg: ModelConfig, seed: int) -> DeepseekForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekForCausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)
    return model.eval()


def decode_case(model: DeepseekForCausalLM, batch: int, context: int, seed: int) -> tuple[Any, ...]:
    """A cache holding ``batch`` sequences of ``context`` tokens (random latents) and the metadata
    of one decode step that appends token ``context`` to each."""
    c = model.config
    per_seq = context // BLOCK + 1
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(batch * per_seq, c.num_hidden_layers, 1, BLOCK, 1, c.kv_cache_head_dim, generator=g)
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    meta = AttentionMetadata(
        slot_mapping=(tables[:, context // BLOCK].long() * BLOCK + context % BLOCK),
        block_tables=tables, seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), max_query_len=1, max_seq_len=context + 1,
    )  # fmt: skip
    meta.torch_plan = plan_attention(meta.block_tables, meta.seq_lens, meta.query_start_loc, BLOCK)
    ids = torch.randint(0, c.vocab_size, (batch,), generator=g)
    return kv, meta, ids, torch.full((batch,), context, dtype=torch.int64)


@torch.inference_mode()
def time_decode(model: DeepseekForCausalLM, batch: int, context: int, repeats: int, seed: int) -> dict[str, float]:
    kv, meta, ids, pos = decode_case(model, batch, context, seed)
    attn = model.model.layers[0].self_attn
    h = attn.num_heads
    g = torch.Generator().manual_seed(seed + 1)
    q_nope = torch.randn(batch, h, attn.nope, generator=g)
    q_pe = torch.randn(batch, h, attn.rope, generator=g)
    w = attn.kv_b_proj.weight.view(h, attn.nope + attn.v_dim, attn.rank)
    cache = kv[:, 0, 0]
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, attn.scale)

    def absorbed_attention() -> torch.Tensor:
        latent = mla_attention(absorb_query(q_nope, q_pe, w), cache, *args, attn.rank, plan=meta.torch_plan)
        return expand_latent(latent, w, attn.nope)

    def naive_attention() -> torch.Tensor:
        return mla_attention_naive(q_nope, q_pe, cache, w, *args)

    def step(form: str):
        def run() -> None:
            model.set_mla_form(form)
            model(ids, pos, kv, meta)
        return run

    torch.testing.assert_close(absorbed_attention(), naive_attention(), atol=1e-3, rtol=1e-3)
    fns = {"step_absorbed": step("absorbed"), "step_naive": step("naive"),
           "attn_absorbed": absorbed_attention, "attn_naive": naive_attention}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):  # alternating, so drift on a shared machine hits both forms alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    med["step_ratio"] = med["step_naive"] / med["step_absorbed"]
    med["attn_ratio"] = med["attn_naive"] / med["attn_absorbed"]
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench mla", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--contexts", default="256,1024,4096", help="context lengths (comma-separated)")
    ap.add_argument("--batch", type=int, default=8, help="decoding sequences per step")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rank", type=int, default=256, help="kv_lora_rank of the timed model")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="contexts 128,512; 3 repeats")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    contexts = [128, 512] if args.quick else [int(x) for x in args.contexts.split(",")]
    repeats = 3 if args.quick else args.repeats
    torch.set_num_threads(max(1, torch.get_num_threads()))

    sizes = {"tiny": kv_bytes(TINY, 2, torch.float32), "deepseek_v3": kv_bytes(V3, 8, torch.bfloat16)}
    shape = dict(hidden_size=32 * args.heads, num_attention_heads=args.heads, num_hidden_layers=2,
                 kv_lora_rank=args.rank, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)  # fmt: skip
    model = random_model(ModelConfig.from_dict(deepseek_dict(shape)), args.seed)
    decode: dict[int, dict[str, float]] = {}
    for ctx in contexts:
        log(f"decode: batch {args.batch}, context {ctx}")
        decode[ctx] = time_decode(model, args.batch, ctx, repeats, args.seed)

    result = {"kv_bytes_per_token": sizes, "decode_ms": {str(k): v for k, v in decode.items()},
              "timed_model": shape, "batch": args.batch, "repeats": repeats}  # fmt: skip
    rows: list[tuple[str, str]] = []
    for name, s in sizes.items():
        gqa = next(k for k in s if k.startswith("gqa"))
        rows.append((f"{name}: KV bytes/token", f"MLA {s['mla']:,}  {gqa.upper()} {s[gqa]:,}  MHA {s['mha']:,}  "
                     f"(MHA/MLA {s['mha'] / s['mla']:.1f}x, {gqa.upper()}/MLA {s[gqa] / s['mla']:.1f}x)"))  # fmt: skip
    for ctx, d in decode.items():
        rows.append((f"decode ctx {ctx}: step ms", f"absorbed {d['step_absorbed']:.2f}  naive {d['step_naive']:.2f}  "
                     f"naive/absorbed {d['step_ratio']:.2f}x"))  # fmt: skip
        rows.append((f"decode ctx {ctx}: attention ms", f"absorbed {d['attn_absorbed']:.2f}  naive "
                     f"{d['attn_naive']:.2f}  naive/absorbed {d['attn_ratio']:.2f}x"))  # fmt: skip
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
