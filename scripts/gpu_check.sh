#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run (a few minutes): the Triton kernel tests (paged and MLA
# attention, float and FP8 caches) compiled on CUDA, the CUDA model and engine checks against transformers (Llama family and
# DeepSeek), a KV pull by NIXL from a holder whose KV lives in GPU memory (two processes on one GPU), then the
# decode-attention timing table.
# Results go to $OUT (default ./gpu-check): pytest logs and attention_gpu.{json,md}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
status=0
# Compiling the kernels' specialisations is the long part: one worker per core pair.
WORKERS=${GPU_CHECK_WORKERS:-$(( $(nproc) / 2 > 2 ? $(nproc) / 2 : 2 ))}
PYTEST="python -m pytest -q -p no:cacheprovider --timeout 300 -rfE --tb=short"
$PYTEST -n "$WORKERS" tests/engine/test_kernels.py tests/engine/test_kernels_fp8.py \
  tests/engine/test_mla_kernels.py 2>&1 \
  | tee "$OUT/kernels.log" | tail -3 || status=1
$PYTEST tests/engine/test_model.py tests/engine/test_engine.py \
  tests/engine/test_deepseek.py -k cuda 2>&1 | tee "$OUT/cuda_model.log" | tail -3 || status=1
# The nixl extra: the library, and CUDA 12's runtime that its UCX links for GPU memory (a CUDA 13 image lacks it).
python -c "import nixl_cu12, nvidia.cuda_runtime" 2>/dev/null \
  || pip install -q 'nixl-cu12>=1.5.1' 'nvidia-cuda-runtime-cu12>=12.4' >/dev/null 2>&1
$PYTEST -n 0 tests/kvtransfer/test_nixl.py -k gpu_memory -rs 2>&1 \
  | tee "$OUT/nixl_gpu.log" | tail -3 || status=1
python -m pdserve.benchmarks.attention_gpu --json > "$OUT/attention_gpu.json" 2> "$OUT/attention_gpu.err" || status=1
python - "$OUT" <<'PY' || status=1
import json, sys
from pdserve.benchmarks.attention_gpu import markdown
out = sys.argv[1]
data = json.load(open(f"{out}/attention_gpu.json"))
text = markdown(data["correctness"]) + ("\n\n" + markdown(data["decode"]) if data.get("decode") else "")
open(f"{out}/attention_gpu.md", "w").write(text)
print(text)
PY
exit $status
