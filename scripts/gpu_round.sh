#!/usr/bin/env bash
# One device call that runs named steps (the GPU test suite in three parts, the benchmarks the docs
# quote, llama.cpp beside them) and packs every JSON/PNG they write into $OUT/results.tgz (a device
# call brings back at most 8 files) and the combined log into $OUT/round.log.
# The GPU image lacks gguf, fastapi, uvicorn, pydantic, openai and fla-core: `bash
# scripts/device_wheels.sh --vocab` puts their wheels in .whl/ (and the grammar-cost step's vocab in
# .cache/); carry ".whl" (and ".cache") and this script installs them first. scripts/gpu_detached.sh
# runs it detached, so one round may outlast a device call.
#   bash scripts/gpu_round.sh gpu-kernels gpu-engine gpu-rest decode read ...
set -uo pipefail
OUT=${OUT:-gpu_out}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1 STRATA_NO_PROGRESS=1
# fla-core (and its einops) stay off the common path: transformers' qwen3_next swaps its CPU reference
# for fla-core whenever it can import it, which would break every HF comparison. The fla steps add it.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $(ls .whl/*.whl | grep -v -e fla_core -e einops) || exit 1
  ls .whl/fla_core*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/fla .whl/fla_core*.whl .whl/einops*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
B="python3 -m strata.cli bench"
T="python3 -m pytest -q -s -m gpu -p no:cacheprovider"
FLA="env PYTHONPATH=/tmp/fla:$PYTHONPATH setsid -w"  # fla-core on the path, in a session of its own
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  local t0=$SECONDS
  timeout "$secs" "$@" 2>&1 | grep -v "^\s*$" | tail -${TAIL:-40}
  echo "--- $name: rc ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
  tar czf "$OUT/results.tgz" -C "$R" .  # after every step: a call cut short still brings back what ran
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
  for s in "$@"; do
    case $s in
      # The whole -m gpu suite takes longer than one device call: gpu-kernels, gpu-engine, gpu-rest.
      gpu-kernels) step gpu-kernels 560 $T tests/kernels tests/runner --durations=10 ;;
      gpu-engine) step gpu-engine 560 $T tests/gpu tests/models tests/server tests/grammar --durations=10 ;;
      gpu-rest) step gpu-rest 560 $T tests/engine tests/loaders tests/speculative tests/bench --durations=10 ;;
      fla) step fla 300 $FLA $T tests/kernels/test_gated_delta_fla.py ;;
      files) step files ${FILES_S:-300} $T $FILES ;;  # FILES="tests/a.py tests/b.py -k ...": any tests by name
      # The benchmarks the docs quote (bench/results/README.md names each file's command).
      decode) step decode 300 $B decode --batch 1,8,32 --tokens 64 --repeats 1 --http --out $R/decode_qwen3-8b_cuda.json ;;
      decode-quick) step decode-quick 150 $B decode --batch 1,8 --no-hf --tokens 64 --repeats 1 --out $R/decode_quick_cuda.json ;;
      decode32k) step decode32k 200 $B decode --prompt 32000 --batch 1,8 --tokens 48 --no-hf --repeats 1 --out $R/decode32k_qwen3-8b_cuda.json ;;
      decode32k-int8) step decode32k-int8 200 $B decode --kv int8 --prompt 32000 --batch 1,8 --tokens 48 --no-hf --repeats 1 --out $R/decode32k_qwen3-8b_int8_cuda.json ;;
      read) step read 240 $B read --chunks 512,2048,8192 --lengths 4096,32768 --repeats 1 --out $R/read_qwen3-8b_cuda.json ;;
      read-int8) step read-int8 200 $B read --kv int8 --chunks 512,8192 --lengths 32768 --no-hf --repeats 1 --out $R/read_qwen3-8b_int8_cuda.json ;;
      read128k) step read128k 200 $B read --shape qwen3-8b-128k --lengths 131072 --no-hf --repeats 1 --out $R/read_qwen3-8b-128k_cuda.json ;;
      moe-decode) step moe-decode 240 $B decode --shape qwen3-30b-a3b --batch 1,8,32 --no-hf --repeats 1 --out $R/decode_qwen3-30b-a3b_cuda.json ;;
      moe-read) step moe-read 200 $B read --shape qwen3-30b-a3b --lengths 4096,32768 --no-hf --repeats 1 --out $R/read_qwen3-30b-a3b_cuda.json ;;
      quant) step quant 400 $B quant --shape qwen3-8b --formats ${QUANT_FORMATS:-bf16,Q8_0,Q4_K,Q4_K_M,IQ3_S,Q6_K,FP8} --out $R/quant_qwen3-8b_cuda.json ;;
      quant-moe) step quant-moe 400 $B quant --shape qwen3-30b-a3b --formats bf16,Q8_0,IQ3_S,FP8 --out $R/quant_qwen3-30b-a3b_cuda.json ;;
      spec) step spec 400 $B spec --repeats 4 --out $R/spec_cuda.json ;;
      kv) step kv 200 $B kv --out $R/kv_int8_cuda.json ;;
      prefix) step prefix 200 $B prefix --shape qwen3-8b --out $R/prefix_qwen3-8b_cuda.json ;;
      prefix-busy) step prefix-busy 300 $B prefix --shape qwen3-8b --busy --out $R/prefix_busy_qwen3-8b_cuda.json ;;
      concurrent) step concurrent 500 $B concurrent --shape qwen3-8b --http --out $R/concurrent_qwen3-8b_cuda.json ;;
      concurrent-default) step concurrent-default 400 $B concurrent --model default --spec 3 --out $R/concurrent_default_cuda.json ;;
      determinism) for m in off on; do step determinism-$m 500 $B determinism --shape qwen3-8b --clients 64 --parallel 8 \
          --chunk 512 $([ $m = on ] && echo "--batch-invariant --costs") --out $R/determinism_${m}_cuda.json; done ;;
      next-read) step next-read 300 $FLA $B read --shape qwen3-next-80b-a3b-36l --lengths 4096,32768 --no-hf --repeats 1 \
          --out $R/read_qwen3-next-80b-a3b-36l_fla_cuda.json ;;
      next-decode) step next-decode 300 $B decode --shape qwen3-next-80b-a3b-36l --batch 1,8 --no-hf --repeats 1 \
          --out $R/decode_qwen3-next-80b-a3b-36l_cuda.json ;;
      grammar-cost)
        V=.cache/llama-cpp-vocab-0.3.16/ggml-vocab-qwen2.gguf
        G="$B decode --batch 8 --no-hf --no-ceilings --tokens 48 --repeats 1"
        step grammar-off 80 $G --out $R/decode_grammar-off_qwen3-8b_cuda.json
        step grammar-masked 80 $G --tokenizer $V --out $R/decode_grammar-masked_qwen3-8b_cuda.json
        step grammar-json-array 80 $G --tokenizer $V --grammar json-array --out $R/decode_grammar-json-array_qwen3-8b_cuda.json ;;
      # llama.cpp (../shared/tools/llamacpp/pack.sh writes .peer/; carry it) and the quantized 8B GGUFs,
      # built in the background; peer-quant waits for both and runs llama-bench on the same files.
      peer-build)
        mkdir -p /tmp/llama /tmp/peer && tar xJf .peer/llama.tar.xz -C /tmp/llama
        setsid nohup bash -c "cd /tmp/llama && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF >/tmp/peer/cmake.log 2>&1 \
          && cmake --build build -j12 --target llama-bench llama-server llama-quantize >/tmp/peer/build.log 2>&1; touch /tmp/peer/built" >/dev/null 2>&1 </dev/null &
        setsid nohup bash -c "for f in ${PEER_QUANTS-Q8_0 Q4_K IQ3_S}; do python3 scripts/quant_gguf.py /tmp/peer_\$f.gguf \$f \
          --vocab /tmp/llama/models/ggml-vocab-qwen2.gguf; done; touch /tmp/peer/ggufs" >/tmp/peer/gguf.log 2>&1 </dev/null &
        echo "peer build and GGUF writes started" ;;
      peer-quant)
        t0=$SECONDS; while [ ! -f /tmp/peer/built ] || [ ! -f /tmp/peer/ggufs ]; do
          [ $((SECONDS - t0)) -gt 420 ] && break; sleep 5; done
        tail -n 3 /tmp/peer/build.log /tmp/peer/gguf.log
        step peer-quant 300 bash -c "/tmp/llama/build/bin/llama-bench -m /tmp/peer_Q8_0.gguf -m /tmp/peer_Q4_K.gguf \
          -m /tmp/peer_IQ3_S.gguf -ngl 99 -fa 1 -p 4096 -n 128 -r 3 -o json > $R/llamacpp_quant_qwen3-8b_cuda.json; \
          python3 -c 'import json,sys; [print(r[\"model_type\"], r[\"n_prompt\"], r[\"n_gen\"], round(r[\"avg_ts\"], 1)) for r in json.load(open(sys.argv[1]))]' \
          $R/llamacpp_quant_qwen3-8b_cuda.json" ;;
      profile1) step profile1 120 python3 scripts/profile_step.py --batch 1 ;;
      *) echo "unknown step $s" ;;
    esac
  done
} 2>&1 | tee "$OUT/round.log"
