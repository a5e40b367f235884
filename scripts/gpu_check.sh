#!/usr/bin/env bash
# One device call that checks and times everything GPU-side (see /work/.library/device/METHOD.md):
#   the gpu-marked tests, then the benchmarks, writing logs and JSON under $OUT (default: ./gpu_out).
# The GPU image lacks gguf (and fastapi, uvicorn, pydantic): carry wheels in .whl/ (README of the
# device tool) and this script installs them first. A device call runs 10 minutes at most, so name
# the parts to run: bash scripts/gpu_check.sh tests spec kv   /   bash scripts/gpu_check.sh read decode
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STRATA_NO_PROGRESS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
log="$OUT/gpu_check.log"
parts=${*:-tests spec kv read decode}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
  for part in $parts; do
    case $part in
      # Only the GPU test files: the others import packages the GPU image may lack (openai).
      tests) timeout 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py tests/test_moe_packed.py ;;
      spec) timeout 400 python3 -m strata.cli bench spec --repeats 4 --out "$OUT/spec_cuda.json" ;;
      kv) timeout 200 python3 -m strata.cli bench kv --out "$OUT/kv_int8_cuda.json" ;;
      read) timeout 500 python3 -m strata.cli bench read --lengths 4096,32768 --out "$OUT/read_qwen3-8b_cuda.json" ;;
      decode) timeout 500 python3 -m strata.cli bench decode --batch 1,2 --out "$OUT/decode_qwen3-8b_cuda.json" ;;
      *) echo "unknown part $part" ;;
    esac
  done
} 2>&1 | tee -a "$log"
