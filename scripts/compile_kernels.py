"""Compile the Triton kernels ahead of time for NVIDIA GPUs, without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts things the real
compiler refuses (globals that are not ``tl.constexpr``, some ``tl.dot`` shapes). This
compiles every kernel for each target architecture with the tile sizes the host wrappers
pick for common model shapes, and checks the shared memory each launch needs against
what one thread block may use on that architecture.

Usage: ``python scripts/compile_kernels.py [--arch 80,86,89,90] [--quick] [--jobs N]``; exits 1
when a kernel fails to compile or needs more shared memory than the architecture allows.
Compiles run in ``--jobs`` processes (default: every CPU); identical configurations (the KV
write and merge kernels do not depend on the GQA group) are compiled once.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.engine.kernels import mla_triton as mt  # noqa: E402
from pdserve.engine.kernels import triton_kernels as tk  # noqa: E402

# Integer arguments real launches pass as multiples of 16 (strides of 16-element-aligned tensors):
# Triton specializes on that at launch, and so does this check (it changes tiling and shared memory).
DIVISIBLE_BY_16 = {"stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h", "stride_kc_b", "stride_kc_o",
                   "stride_kc_h", "stride_vc_b", "stride_vc_o", "stride_vc_h", "stride_bt_s", "stride_key_t",
                   "stride_key_h", "stride_value_t", "stride_value_h", "stride_qt", "stride_qh", "stride_cb",
                   "stride_co", "stride_ot", "stride_oh", "stride_bt", "stride_lt"}

# Shared memory one thread block may use (opt-in maximum), by compute capability.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
E4M3_MIN_ARCH = 89
# (query heads per KV head, head_dim): MHA, Llama-3-8B, Llama-3-70B, Qwen2-7B (28/4), Phi-3.
SHAPES = [(1, 64), (4, 128), (8, 128), (7, 128), (1, 96)]
QUICK_SHAPES = [(4, 128), (7, 128)]
# MLA (kv_lora_rank, qk_rope_head_dim): DeepSeek-V2/V3 (512 + 64), and a small latent.
MLA_SHAPES = [(512, 64), (128, 32)]


def _signature(fn: triton.JITFunction, pointers: dict[str, str], wide: tuple[str, ...], floats: tuple[str, ...],
               consts: dict[str, object]) -> dict[str, str]:
    """Argument types: named pointers, int64 block strides, float scalars, int32 for the rest."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in wide:
            sig[name] = "i64"
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def configs(quick: bool) -> list[tuple[str, triton.JITFunction, dict[str, str], dict[str, object]]]:
    """Every configuration to compile, each once (the first label of a duplicate is kept)."""
    out = []
    shapes = QUICK_SHAPES if quick else SHAPES
    dtypes = ["bf16", "fp32"] if quick else list(DTYPES)
    # (activation dtype, KV-cache dtype): float caches, and the FP8 caches of kv_cache_dtype.
    pairs = [(dt, dt) for dt in dtypes] + [("bf16", "fp8e4nv"), ("bf16", "fp8e5")]
    for (dt, cache), (group, head_dim) in itertools.product(pairs, shapes):
        pad = max(16, triton.next_power_of_2(head_dim))
        kv_heads = 8
        fp8 = cache.startswith("fp8")
        mant, min_exp = {"fp8e4nv": (3, -6), "fp8e5": (2, -14)}.get(cache, (0, 0))
        consts = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, HEADS_PAD=kv_heads, HEAD_DIM_PAD=pad,
                      FP8_MAX={"fp8e4nv": 448.0, "fp8e5": 57344.0}.get(cache, 0.0), FP8_MANT_BITS=mant,
                      FP8_MIN_EXP=min_exp)  # fmt: skip
        ptrs = {n: f"*{dt}" for n in ("key_ptr", "value_ptr")}
        ptrs.update({n: f"*{cache}" for n in ("k_cache_ptr", "v_cache_ptr")})
        ptrs["slot_mapping_ptr"] = "*i64"
        sig = _signature(tk._write_kv_kernel, ptrs, ("stride_kc_b", "stride_vc_b"), ("k_scale", "v_scale"), consts)
        kv_label = f" kv-{cache}" if fp8 else ""
        out.append((f"write_kv {dt}{kv_label} hd{head_dim}", tk._write_kv_kernel, sig, consts))
        for max_query_len, segments, window in ((1, 1, False), (1, 4, False), (512, 1, False), (1, 4, True),
                                                (512, 1, True)):
            block_m, block_n = tk.attention_tile_sizes(group, head_dim, DTYPES[dt], max_query_len)
            consts = dict(GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n, BLOCK_SIZE=16,
                          HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, NUM_SEGMENTS=segments, HAS_WINDOW=window,
                          DOT_F32=False, KV_FP8=fp8)
            ptrs = {n: f"*{dt}" for n in ("q_ptr", "out_ptr")}
            ptrs.update({n: f"*{cache}" for n in ("k_cache_ptr", "v_cache_ptr")})
            ptrs.update(acc_part_ptr="*fp32", ml_part_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                        query_start_loc_ptr="*i32")
            sig = _signature(tk._paged_attention_kernel, ptrs, ("stride_kc_b", "stride_vc_b"), ("qk_scale", "v_scale"),
                             consts)  # fmt: skip
            kind = "decode" if max_query_len == 1 else "prefill"
            label = (f"attention {dt}{kv_label} group{group} hd{head_dim} {kind} m{block_m} n{block_n} seg{segments}"
                     + (" sliding-window" if window else ""))
            out.append((label, tk._paged_attention_kernel, sig, consts))
        consts = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, NUM_SEGMENTS=4)
        ptrs = dict(out_ptr=f"*{dt}", acc_part_ptr="*fp32", ml_part_ptr="*fp32", query_start_loc_ptr="*i32")
        sig = _signature(tk._merge_segments_kernel, ptrs, (), ("v_scale",), consts)
        out.append((f"merge {dt} hd{head_dim}", tk._merge_segments_kernel, sig, consts))
    mla_pairs = [(dt, dt) for dt in dtypes] + [("bf16", "fp8e4nv"), ("bf16", "fp8e5")]
    for (dt, cache), (rank, rope) in itertools.product(mla_pairs, MLA_SHAPES[:1] if quick else MLA_SHAPES):
        fp8 = cache.startswith("fp8")
        consts = dict(RANK=rank, ROPE=rope, BLOCK_SIZE=16, BLOCK_H=mt.MLA_BLOCK_H, BLOCK_L=mt.mla_pad(rank),
                      BLOCK_R=mt.mla_pad(rope), BLOCK_N=mt.MLA_BLOCK_N, DOT_F32=dt == "fp32", KV_FP8=fp8)  # fmt: skip
        ptrs = dict(q_ptr=f"*{dt}", cache_ptr=f"*{cache}", out_ptr=f"*{dt}", block_tables_ptr="*i32",
                    seq_lens_ptr="*i32", query_start_loc_ptr="*i32")  # fmt: skip
        sig = _signature(mt._mla_decode_kernel, ptrs, ("stride_cb",), ("qk_scale", "kv_scale"), consts)
        kv_label = f" kv-{cache}" if fp8 else ""
        out.append((f"mla {dt}{kv_label} rank{rank} rope{rope}", mt._mla_decode_kernel, sig, consts))
        consts = dict(DIM=rank + rope, BLOCK_D=triton.next_power_of_2(rank + rope), BLOCK_SIZE=16)
        ptrs = dict(latent_ptr=f"*{cache}", cache_ptr=f"*{cache}", slot_mapping_ptr="*i64")
        sig = _signature(mt._write_latent_kernel, ptrs, ("stride_cb",), (), consts)
        out.append((f"write_latent {cache} dim{rank + rope}", mt._write_latent_kernel, sig, consts))
    unique: dict[tuple, tuple] = {}
    for entry in out:
        _, fn, sig, consts = entry
        unique.setdefault((fn.__name__, tuple(sig.items()), tuple(consts.items())), entry)
    return list(unique.values())


def compile_one(arch: int, index: int, quick: bool) -> tuple[str, int | None, str]:
    """Compile configuration ``index`` of ``configs(quick)`` for ``arch``: (label, shared bytes or None, error)."""
    label, fn, sig, consts = configs(quick)[index]
    # As at launch: pointers 16-byte aligned, stride arguments divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name in DIVISIBLE_BY_16}
    try:
        kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32))
    except Exception as exc:  # noqa: BLE001 - report every failing config, then exit 1
        return label, None, f"{type(exc).__name__}: {exc}"
    return label, kernel.metadata.shared, ""



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="80,86,89,90", help="compute capabilities, comma-separated")
    ap.add_argument("--quick", action="store_true", help="two model shapes, bf16 and fp32 only")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel processes")
    args = ap.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",")]
    unknown = [a for a in archs if a not in SHARED_LIMIT]
    if unknown:
        ap.error(f"unknown arch {unknown}; known: {sorted(SHARED_LIMIT)}")
    todo = configs(args.quick)
    # Triton has fp8e4nv (e4m3) on sm_89 and newer only; the engine refuses it below.
    jobs = [(arch, i, args.quick) for arch in archs for i in range(len(todo))
            if arch >= E4M3_MIN_ARCH or "fp8e4nv" not in todo[i][0]]  # fmt: skip
    bad = 0
    t0 = time.monotonic()
    with ProcessPoolExecutor(max(1, args.jobs), mp_context=multiprocessing.get_context("fork")) as pool:
        for (arch, i, _), (label, shared, error) in zip(jobs, pool.map(compile_one, *zip(*jobs))):
            if shared is None:
                bad += 1
                print(f"sm_{arch} FAIL {label}: {error}", flush=True)
                continue
            over = shared > SHARED_LIMIT[arch]
            bad += over
            status = "OVER" if over else "ok  "
            print(f"sm_{arch} {status} [{i + 1}/{len(todo)}] {label}: {shared / 1024:.1f} KiB shared "
                  f"(limit {SHARED_LIMIT[arch] // 1024} KiB)", flush=True)
    print(f"{len(jobs)} compiles in {time.monotonic() - t0:.0f}s, {bad} failed or over the limit")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
