#!/usr/bin/env bash
# One device call that runs named steps (GPU tests, sweeps, benchmarks; see the case list) and packs
# every JSON/PNG they write into $OUT/results.tgz (a device call brings back at most 8 files), the
# combined log into $OUT/round.log (/work/.library/device/METHOD.md: check and time everything at once).
# The GPU image lacks gguf, fastapi, uvicorn, pydantic, openai and fla-core: `bash
# scripts/device_wheels.sh --vocab` puts their wheels in .whl/ (and the grammar-cost step's vocab in
# .cache/); carry ".whl" (and ".cache") and this script installs them first.
#   bash scripts/gpu_round.sh tests kernels decode read ...
set -uo pipefail
OUT=${OUT:-gpu_out}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1 STRATA_NO_PROGRESS=1
# fla-core (and its einops) stay off the common path: transformers' qwen3_next swaps its CPU reference
# for fla-core whenever it can import it, which would break every HF comparison. The `fla` steps add it.
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
      gpu-kernels) step gpu-kernels 560 $T tests/test_kernel_*.py tests/test_kernels_*.py tests/runner/test_device_sampling.py --durations=10 ;;
      gpu-engine) step gpu-engine 560 $T tests/gpu/test_gpu.py tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_graphs.py tests/models/test_moe_packed.py tests/server/test_api_logprobs_n.py tests/models/test_quantize_fp8.py tests/grammar/test_grammar_engine.py --durations=10 ;;
      # ... and the files neither half lists (the three steps together are the whole -m gpu suite).
      gpu-rest) step gpu-rest 560 $T tests/engine/test_batch_invariance.py tests/engine/test_batch_read.py tests/models/test_qwen3_next.py --durations=10 ;;
      gpu-all) step gpu-all ${GPU_ALL_S:-900} $T tests/ --durations=20 --continue-on-collection-errors ;;
      # llama.cpp (../shared/tools/llamacpp; carry .peer) and the quantized 8B GGUFs, in the background;
      # PEER_QUANTS= writes none of those (~16 GiB of disk that peer-next's 38 GiB file needs).
      peer-build)
        mkdir -p /tmp/llama /tmp/peer && tar xJf .peer/llama.tar.xz -C /tmp/llama
        setsid nohup bash -c "cd /tmp/llama && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF >/tmp/peer/cmake.log 2>&1 \
          && cmake --build build -j12 --target llama-bench >/tmp/peer/build.log 2>&1; touch /tmp/peer/built" >/dev/null 2>&1 </dev/null &
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
      graphs-final) step graphs-final 200 $T tests/kernels/test_token_mask.py tests/gpu/test_gpu_graphs.py -k "not bf16_agreement and not int8_backend" ;;
      grammar-cost)
        V=.cache/llama-cpp-vocab-0.3.16/ggml-vocab-qwen2.gguf
        G="$B decode --batch 8 --no-hf --no-ceilings --tokens 48 --repeats 1"
        step grammar-plain 80 $G --out $R/decode_grammar-off_qwen3-8b_cuda.json
        step grammar-masked 80 $G --tokenizer $V --out $R/decode_grammar-masked_qwen3-8b_cuda.json
        step grammar-json-array 80 $G --tokenizer $V --grammar json-array --out $R/decode_grammar-json-array_qwen3-8b_cuda.json ;;
      prefix) step prefix 100 $B prefix --out $R/prefix_cuda.json ;;
      new) step new 420 $T tests/kernels/test_attention.py tests/kernels/test_attention_splits.py tests/kernels/test_moe_routing.py tests/kernels/test_small.py tests/kernels/test_token_mask.py tests/gpu/test_gpu_graphs.py ;;
      s1-tests) step s1-tests 420 $T tests/kernels/test_gemv.py tests/kernels/test_attention.py tests/kernels/test_attention_splits.py tests/gpu/test_gpu_graphs.py -k "prefetch or matches_linear or on_off or allocates or attention" ;;
      prefetch-sweep)
        step prefetch-sweep-b1 200 python3 scripts/profile_step.py --batch 1 --top 8 --prefetch-sweep 0,8,16,32,64
        step prefetch-sweep-b8 200 python3 scripts/profile_step.py --batch 8 --top 8 --prefetch-sweep 0,16,32 ;;
      sweep-prefill) step sweep-prefill 240 python3 scripts/sweep_attention.py --only prefill --prefill-configs "64,128,4,4;64,128,4,3;64,256,8,2;64,256,8,3;128,256,8,2" ;;
      s2-tests) step s2-tests 300 $T tests/kernels/test_attention.py tests/kernels/test_attention_splits.py tests/kernels/test_kv_dequant.py tests/gpu/test_gpu_graphs.py -k "attention or splits or dequant or int8 or bf16_agreement" ;;
      dp4a-sweep) TAIL=80 step dp4a-sweep 400 python3 -m strata.kernels.quant.dp4a
        TAIL=80 step q4k-dp4a-sweep 400 python3 -m strata.kernels.quant.q4_k_dp4a
        TAIL=80 step iq3s-dp4a-sweep 400 python3 -m strata.kernels.quant.iq3_s_dp4a ;;
      q6k-dp4a-sweep) TAIL=80 step q6k-dp4a-sweep 500 python3 -m strata.kernels.quant.q6_k_dp4a ;;
      quant-dp4a) STRATA_Q8_DECODE=dp4a STRATA_Q4K_DECODE=dp4a STRATA_IQ3S_DECODE=dp4a STRATA_Q6K_DECODE=dp4a \
        step quant-dp4a 200 $B quant --shape qwen3-8b --formats Q8_0,Q4_K,Q4_K_M,IQ3_S,Q6_K \
        --out $R/quant_dp4a_qwen3-8b_cuda.json ;;
      q8-sweep) TAIL=80 step q8-sweep 300 python3 -m strata.kernels.quant.q8_0 --sweep ;;
      quant-tests) TAIL=80 step quant-tests 400 $T tests/kernels/test_quant_dp4a.py tests/kernels/test_quant_q8_0.py tests/kernels/test_quant_q4_k.py tests/kernels/test_quant_iq3_s.py tests/kernels/test_quant_streamk.py tests/models/test_quant_weight.py \
          tests/kernels/test_quant_q6_k.py tests/kernels/test_quant_q6k_dp4a.py tests/kernels/test_quant_moe.py tests/kernels/test_quant_dequant.py ;;
      # Reads through dequantize-into-buffer + cuBLAS: the kernels' GB/s and the row threshold, then the
      # engine with the switch off (the fused GEMMs) beside `quant` (on).
      dequant-bench) TAIL=80 step dequant-bench 300 python3 -m strata.kernels.quant.dequant ;;
      quant-nodq) STRATA_QUANT_DEQUANT_ROWS=0 step quant-nodq 400 $B quant --shape qwen3-8b --formats bf16,Q8_0,Q4_K,Q4_K_M,IQ3_S,Q6_K \
          --out $R/quant_nodq_qwen3-8b_cuda.json ;;
      quant-moe) step quant-moe 400 $B quant --shape qwen3-30b-a3b --formats bf16,Q8_0,IQ3_S,FP8 --out $R/quant_qwen3-30b-a3b_cuda.json ;;
      qmoe-bench) TAIL=80 step qmoe-bench 300 python3 -m strata.kernels.quant.moe_decode_q ;;
      # Split-K past 8 for the batch-1 dp4a GEMVs: kernels per format and shape, then whole-model decode.
      dp4a-splits) TAIL=90 step dp4a-splits 540 python3 scripts/dp4a_splits.py --formats ${SPLIT_FORMATS:-Q8_0,Q4_K,IQ3_S,Q6_K} \
          --model ${SPLIT_ARGS:-} ;;
      attn-ab) TAIL=60 step attn-ab 500 python3 scripts/attn_tiles_ab.py --formats ${AB_FORMATS:-bf16,Q4_K,Q8_0} --pdl ${AB_PDL:-both} \
          ${AB_TILES:---tile 128,4,2} ;;
      quant-moe-grouped) STRATA_QMOE_DECODE=grouped step quant-moe-grouped 400 $B quant --shape qwen3-30b-a3b \
          --formats ${QMOE_FORMATS:-Q8_0,IQ3_S,FP8} --out $R/quant_qwen3-30b-a3b_grouped_cuda.json ;;
      profile-moe-quant) for q in ${PROFILE_QUANTS:-Q8_0 IQ3_S}; do TAIL=30 step profile-moe-$q 150 env ${PROFILE_ENV:-} \
          python3 scripts/profile_step.py --shape qwen3-30b-a3b --batch 1 --top 20 --quant $q; done ;;
      quant-fp8) step quant-fp8 200 $B quant --shape qwen3-8b --formats bf16,FP8 --out $R/quant_qwen3-8b_fp8_cuda.json ;;
      quant) step quant 400 $B quant --shape qwen3-8b --formats ${QUANT_FORMATS:-bf16,Q8_0,Q4_K,Q4_K_M,IQ3_S,Q6_K,FP8} --out $R/quant_qwen3-8b_cuda.json ;;
      prefix8b) step prefix8b 200 $B prefix --shape qwen3-8b --out $R/prefix_qwen3-8b_cuda.json ;;
      # A second slot decoding throughout: solo reads (prompt-chunk graph steps) against shared eager steps.
      prefix8b-busy) step prefix8b-busy 300 $B prefix --shape qwen3-8b --busy --out $R/prefix_busy_qwen3-8b_cuda.json ;;
      sweep-wide-head) TAIL=20 step sweep-wide-head 300 python3 scripts/sweep_attention.py --only decode-wide-head ;;
      sweep-decode) step sweep-decode 200 python3 scripts/sweep_attention.py --only decode --json $R/attn_sweep_decode.json ;;
      sweep-decode-short) TAIL=60 step sweep-decode-short 300 python3 scripts/sweep_attention.py --only decode-short \
          ${SHORT_ARGS:-} ;;
      moe-route-bench) step moe-route-bench 150 python3 -m strata.kernels.moe_routing
        TAIL=60 step moe-route-sweep 300 python3 -m strata.kernels.moe_routing --sweep ;;
      decode-nopdl) STRATA_PDL=0 step decode-nopdl 150 $B decode --batch 1,8 --no-hf --tokens 64 --repeats 1 --out $R/decode_quick_nopdl.json ;;
      decode-sync) step decode-sync 150 $B decode --batch 1,8 --no-hf --tokens 64 --repeats 1 --no-async-scheduling --out $R/decode_quick_sync.json ;;
      moe-decode1) step moe-decode1 150 $B decode --shape qwen3-30b-a3b --batch 1,8 --no-hf --repeats 1 --out $R/decode_moe_quick.json ;;
      speed) step speed 120 $T -k "speed_report or cuda_graph_replay" tests/kernels/test_attention.py ;;
      gemv) step gemv 240 $T tests/kernels/test_gemv.py ;;
      gemv-sweep) step gemv-sweep 300 python3 -m strata.kernels.gemv --sweep 6144x4096 4096x4096 2048x4096 5120x2048 ;;
      sweep-attn) step sweep-attn 300 python3 scripts/sweep_attention.py ;;
      graphs) step graphs 300 $T tests/gpu/test_gpu_graphs.py tests/kernels/test_kv_dequant.py ;;
      profile-next) step profile-next 200 python3 scripts/profile_step.py --shape qwen3-next-80b-a3b-36l --batch 1 --top 30 ;;
      profile-moe) step profile-moe 150 python3 scripts/profile_step.py --shape qwen3-30b-a3b --batch 1 --top 30 ;;
      int8-check) step int8-check 120 $T -k "int8" tests/kernels/test_attention_splits.py tests/gpu/test_gpu_graphs.py ;;
      kernels) step kernels 300 $T tests/kernels/test_attention.py tests/kernels/test_small.py tests/kernels/test_gemv.py tests/kernels/test_moe_decode.py tests/kernels/test_kv_dequant.py ;;
      tests-final) step tests-final 150 $T tests/gpu/test_gpu.py tests/kernels/test_moe_decode.py ;;
      tests) step tests 500 $T tests/gpu/test_gpu.py tests/gpu/test_gpu_engine.py tests/models/test_moe_packed.py tests/gpu/test_gpu_graphs.py tests/runner/test_device_sampling.py tests/kernels/test_kv_dequant.py ;;
      moe-kernel) step moe-kernel 200 $T tests/kernels/test_moe_decode.py ;;
      files) step files ${FILES_S:-300} $T $FILES ;;  # FILES="tests/a.py tests/b.py -k ...": any tests by name
      moe-tests) step moe-tests 300 $T tests/kernels/test_moe_decode.py tests/models/test_moe_packed.py tests/kernels/test_moe_routing.py --durations=5 ;;
      profile1) step profile1 120 python3 scripts/profile_step.py --batch 1 ;;
      profile8) step profile8 120 python3 scripts/profile_step.py --batch 8 --top 12 ;;
      # Where a batch-1 decode step's time goes with weights kept quantized (bf16 beside them).
      # PROFILE_ENV="STRATA_PDL=0": kernel times without PDL's early launches (their waits count as kernel time).
      # Where a 4K prompt read's time goes, per format (kernels grouped by name; READ_QUANTS, bf16 = no --quant).
      profile-read) for q in ${READ_QUANTS:-bf16 FP8}; do TAIL=30 step profile-read-$q 200 env ${PROFILE_ENV:-} python3 scripts/profile_step.py \
          --read ${READ_TOKENS:-4096} --top 25 $([ $q != bf16 ] && echo --quant $q); done ;;
      profile-quant) for q in ${PROFILE_QUANTS:-bf16 Q8_0 Q4_K}; do TAIL=30 step profile-$q 150 env ${PROFILE_ENV:-} python3 scripts/profile_step.py \
          --batch 1 --top 20 $([ $q != bf16 ] && echo --quant $q); done ;;
      # IQ3_S's grid gathered from shared memory against the global table: bits, kernel times, batch-1 decode.
      iq3s-grid) TAIL=30 step iq3s-grid-tests 300 $T tests/kernels/test_quant_dp4a.py tests/kernels/test_quant_iq3_s.py \
          tests/kernels/test_quant_dequant.py -k "iq3s or dequantize_exactly or (real_shapes and IQ3_S)"
        TAIL=30 step iq3s-grid-bench 300 python3 -m strata.kernels.quant.iq3_s_dp4a --shared-grid
        for g in global shared; do STRATA_IQ3S_GRID=$g step iq3s-grid-$g 200 $B quant --shape qwen3-8b --formats IQ3_S \
          --out $R/quant_qwen3-8b_iq3s_${g}_cuda.json; done
        for g in global shared; do STRATA_IQ3S_GRID=$g step iq3s-grid-moe-$g 300 $B quant --shape qwen3-30b-a3b \
          --formats IQ3_S --out $R/quant_qwen3-30b-a3b_iq3s_${g}_cuda.json; done ;;
      # IQ3_S with interleaved sign planes: every IQ3_S GPU test, the dp4a configurations, batch-1 decode.
      iq3s) TAIL=40 step iq3s-tests 300 $T tests/kernels/test_quant_dp4a.py tests/kernels/test_quant_iq3_s.py \
          tests/kernels/test_quant_dequant.py tests/kernels/test_quant_moe.py -k "iq3s or IQ3_S or iq3_s"
        TAIL=60 step iq3s-sweep 300 python3 -m strata.kernels.quant.iq3_s_dp4a
        step iq3s-quant 200 $B quant --shape qwen3-8b --formats IQ3_S --out $R/quant_qwen3-8b_iq3s_cuda.json
        step iq3s-quant-moe 300 $B quant --shape qwen3-30b-a3b --formats IQ3_S --out $R/quant_qwen3-30b-a3b_iq3s_cuda.json ;;
      iq3s-regs) TAIL=30 step iq3s-regs 200 python3 scripts/iq3s_registers.py ;;
      # The batch-invariant quantized GEMM against the formats' own kernels and cuBLAS (issue 15's cost).
      invariant-q-bench) TAIL=60 step invariant-q-bench 300 python3 -m strata.kernels.quant.invariant ${INV_MS:-1,8,512,4096} ;;
      read) step read 240 $B read --chunks 512,2048,8192 --lengths 4096,32768 --repeats 1 --out $R/read_qwen3-8b_cuda.json ;;
      read-int8) step read-int8 200 $B read --kv int8 --chunks 512,8192 --lengths 32768 --no-hf --repeats 1 --out $R/read_qwen3-8b_int8_cuda.json ;;
      decode) step decode 300 $B decode --batch 1,8,32 --tokens 64 --repeats 1 --http --out $R/decode_qwen3-8b_cuda.json ;;
      decode-quick) step decode-quick 150 $B decode --batch 1,8 --no-hf --tokens 64 --repeats 1 --out $R/decode_quick.json ;;
      decode32k) step decode32k 200 $B decode --prompt 32000 --batch 1,8 --tokens 48 --no-hf --repeats 1 --out $R/decode32k_qwen3-8b_cuda.json ;;
      decode32k-int8) step decode32k-int8 200 $B decode --kv int8 --prompt 32000 --batch 1,8 --tokens 48 --no-hf --repeats 1 --out $R/decode32k_qwen3-8b_int8_cuda.json ;;
      read128k) step read128k 200 $B read --shape qwen3-8b-128k --lengths 131072 --no-hf --repeats 1 --out $R/read_qwen3-8b-128k_cuda.json ;;
      moe-decode) step moe-decode 240 $B decode --shape qwen3-30b-a3b --batch 1,8,32 --no-hf --repeats 1 --out $R/decode_qwen3-30b-a3b_cuda.json ;;
      moe-read) step moe-read 200 $B read --shape qwen3-30b-a3b --lengths 4096,32768 --no-hf --repeats 1 --out $R/read_qwen3-30b-a3b_cuda.json ;;
      http) step http 200 $B decode --batch 1 --no-hf --http --repeats 1 --out $R/http_qwen3-8b_cuda.json ;;
      spec) step spec 400 $B spec --repeats 4 --out $R/spec_cuda.json ;;
      kv) step kv 200 $B kv --out $R/kv_int8_cuda.json ;;
      concurrent-tests) step concurrent-tests 400 $T tests/engine/test_batch_read.py ;;
      concurrent) step concurrent 500 $B concurrent --shape qwen3-8b --http --out $R/concurrent_qwen3-8b_cuda.json ;;
      # The read in a green context of N SMs (STRATA_READ_SMS), the decode keeping the rest.
      concurrent-sms) for n in ${READ_SMS_LIST:-64 80}; do step concurrent-sms$n 300 $B concurrent --shape qwen3-8b --pairs ${SMS_PAIRS:-1} \
          --read-sms $n --out $R/concurrent_qwen3-8b_sms${n}_cuda.json; done ;;
      # The read in a green context with long chunks, the decode on the planned graphs (STRATA_BESIDE_READ_GRAPHS).
      concurrent-split) for n in ${READ_SMS_LIST:-104}; do step concurrent-split$n 400 env ${SPLIT_ENV:-} $B concurrent \
          --shape qwen3-8b --pairs 1 --read-sms $n --chunk ${SPLIT_CHUNK:-16384} --lengths 32768 --giveway-tokens 32768 \
          --out $R/concurrent_qwen3-8b_sms${n}_chunk${SPLIT_CHUNK:-16384}${SPLIT_NAME:-}_cuda.json; done ;;
      beside-tests) step beside-tests 300 $T tests/bench/test_sm_split.py tests/engine/test_batch_read.py -k "bits or planned or green" ;;
      # The embedded model: acceptance with and without STRATA_SPLIT_MTP_BATCH, and the needle.
      concurrent-q8) step concurrent-q8 400 $B concurrent --shape qwen3-8b --quant Q8_0 --pairs ${SMS_PAIRS:-3} \
          --read-sms ${READ_SMS:-64} --out $R/concurrent_qwen3-8b_Q8_0_sms${READ_SMS:-64}_cuda.json ;;
      concurrent-128k) step concurrent-128k 560 $B concurrent --shape qwen3-8b-128k --lengths 32768,131072 \
          --pairs ${SMS_PAIRS:-3} --read-sms ${READ_SMS:-64} --out $R/concurrent_qwen3-8b-128k_sms${READ_SMS:-64}_cuda.json ;;
      # Issue 11's zero growth, both weight formats, one pair (the 3-pair steps above measure the rest).
      # Issue 11's two goals under every split of the SMs, bf16 and Q8_0 (strata bench sm-split).
      sm-split) step sm-split-test 120 $T tests/bench/test_sm_split.py
        for q in ${SPLIT_QUANTS:-bf16 Q8_0}; do step sm-split-$q 400 $B sm-split --shape qwen3-8b $([ $q = Q8_0 ] && echo --quant Q8_0) \
          ${SPLIT_ARGS:-} --out $R/sm_split_qwen3-8b$([ $q = Q8_0 ] && echo _Q8_0)${SPLIT_NAME:-}_cuda.json; done ;;
      # Each decode GEMV alone on the SMs a read leaves, tuned and candidate configurations.
      gemv-few-sms) TAIL=${TAIL:-140} step gemv-few-sms 500 python3 scripts/gemv_few_sms.py --held ${GEMV_HELD:-0,104,112} \
          --out $R/gemv_few_sms_cuda.json ;;
      # The decode graph's kernels with the SMs a read would take kept busy (scripts/profile_step.py --held).
      profile-held) for q in ${HELD_QUANTS:-bf16 Q8_0}; do TAIL=${TAIL:-150} step profile-held-$q 240 env ${PROFILE_ENV:-} \
          python3 scripts/profile_step.py --batch 1 --top 14 --held ${PROFILE_HELD:-0,64,104,112} \
          $([ $q = bf16 ] || echo --quant $q); done ;;
      sm-split-carveout) step sm-split-carveout 300 $B sm-split --shape qwen3-8b --carveout ${SPLIT_ARGS:-} \
          --out $R/sm_split_qwen3-8b_carveout_cuda.json ;;
      sm-split-profile) step sm-split-profile 300 $B sm-split --shape qwen3-8b --profile --held ${PROFILE_HELD:-8,64} \
          --out $R/sm_split_qwen3-8b_profile_cuda.json ;;
      # The decode planned for the SMs a split leaves it (strata.kernels.plan), bf16 and Q8_0.
      sm-split-plan) for q in ${PLAN_QUANTS:-bf16 Q8_0}; do step sm-split-plan-$q 400 $B sm-split --shape qwen3-8b --plan-sms \
          $([ $q = Q8_0 ] && echo --quant Q8_0) --held ${PLAN_HELD:-64,96,104,112} \
          --out $R/sm_split_qwen3-8b$([ $q = Q8_0 ] && echo _Q8_0)_planned_cuda.json; done ;;
      # Each decode product alone on the SMs a hold leaves (where a decode on few SMs loses its time).
      sm-split-kernels) for q in bf16 Q8_0; do step sm-split-kernels-$q 300 $B sm-split --shape qwen3-8b --kernels \
          $([ $q = Q8_0 ] && echo --quant Q8_0) --read 4096 --held ${KERNELS_HELD:-64,104,112} \
          --out $R/sm_split_qwen3-8b$([ $q = Q8_0 ] && echo _Q8_0)_kernels_cuda.json; done ;;
      sm-split-dequant) STRATA_Q8_DECODE=dequant step sm-split-dequant 300 $B sm-split --shape qwen3-8b --quant Q8_0 \
          --held ${DEQUANT_HELD:-32,64,96} --out $R/sm_split_qwen3-8b_Q8_0_dequant_cuda.json ;;
      growth-check) for q in bf16 Q8_0; do step growth-$q 200 $B concurrent --shape qwen3-8b $([ $q = Q8_0 ] && echo --quant Q8_0) \
          --pairs 1 --read-sms 64 --lengths 4096,32768 --out $R/concurrent_growth_${q}_cuda.json; done ;;
      concurrent-default) step concurrent-default 400 $B concurrent --model default --spec 3 --out $R/concurrent_default_cuda.json ;;
      # qwen3_next: the engine against HF (no fla on the path), then fla-core against the reference.
      next-tests) step next-tests 300 $T tests/models/test_qwen3_next.py tests/gpu/test_gpu.py tests/kernels/test_causal_conv.py tests/kernels/test_gated_delta_decode.py tests/kernels/test_qwen3_next_kernels.py -k "next or causal or decode" ;;
      # setsid: both fla steps of 2026-12-02 ended the whole round at their start (run alone, the fla tests
      # passed), so they run in a session of their own.
      fla) PYTHONPATH=/tmp/fla:$PYTHONPATH step fla 300 setsid -w $T tests/kernels/test_gated_delta_fla.py ;;
      next-read) for k in ref fla; do PYTHONPATH=/tmp/fla:$PYTHONPATH STRATA_GDN_KERNEL=$k step next-read-$k 300 \
          setsid -w $B read --shape qwen3-next-80b-a3b-36l --lengths 4096,32768 --no-hf --repeats 1 \
          --out $R/read_qwen3-next-80b-a3b-36l_${k}_cuda.json; done ;;
      # Issue 12's long reads: 128K and (nearly) 256K tokens through fla-core, the default when installed.
      next-long) PYTHONPATH=/tmp/fla:$PYTHONPATH step next-long 560 setsid -w $B read --shape qwen3-next-80b-a3b-36l \
          --lengths 131072,262000 --no-hf --repeats 1 --out $R/read_qwen3-next-80b-a3b-36l_long_cuda.json ;;
      next-decode) step next-decode 300 $B decode --shape qwen3-next-80b-a3b-36l --batch 1,8 --no-hf --repeats 1 \
          --out $R/decode_qwen3-next-80b-a3b-36l_cuda.json ;;
      # Issue 12's peer comparison at one shape: Strata (fla on the path, as in next-read) and llama.cpp
      # (after peer-build) on a random bf16 qwen3next GGUF of the same 12 layers (scripts/next_gguf.py).
      next-12l) PYTHONPATH=/tmp/fla:$PYTHONPATH step next-12l-read 300 setsid -w $B read --shape qwen3-next-80b-a3b-12l \
          --lengths 4096,32768 --no-hf --repeats 1 --out $R/read_qwen3-next-80b-a3b-12l_cuda.json
        PYTHONPATH=/tmp/fla:$PYTHONPATH step next-12l-decode 300 setsid -w $B decode --shape qwen3-next-80b-a3b-12l \
          --batch 1,8 --no-hf --repeats 1 --out $R/decode_qwen3-next-80b-a3b-12l_cuda.json ;;
      peer-next)
        [ -d /tmp/llama ] || { echo "peer-next: run peer-build first (it unpacks llama.cpp and its vocab)"; continue; }
        df -h /tmp | tail -n 1
        [ -f /tmp/peer_next.gguf ] || step peer-next-gguf 400 python3 scripts/next_gguf.py /tmp/peer_next.gguf --shape qwen3-next-80b-a3b-12l \
          --type bf16 --vocab /tmp/llama/models/ggml-vocab-qwen2.gguf
        t0=$SECONDS; while [ ! -f /tmp/peer/built ]; do [ $((SECONDS - t0)) -gt 420 ] && break; sleep 5; done
        tail -n 3 /tmp/peer/build.log
        step peer-next 300 bash -c "/tmp/llama/build/bin/llama-bench -m /tmp/peer_next.gguf -ngl 99 -fa 1 -p 4096 -n 128 -r 2 \
          -o json > $R/llamacpp_qwen3-next-12l_cuda.json; \
          python3 -c 'import json,sys; [print(r[\"model_type\"], r[\"n_prompt\"], r[\"n_gen\"], round(r[\"avg_ts\"], 1)) for r in json.load(open(sys.argv[1]))]' \
          $R/llamacpp_qwen3-next-12l_cuda.json" ;;
      # Issue 15: the invariant GEMM / attention against their claims, the engine matrix, then the bench.
      invariant-tests) step invariant-tests 500 $T tests/kernels/test_matmul.py tests/kernels/test_attention_invariant.py tests/kernels/test_row_lse.py \
          tests/kernels/test_quant_invariant.py tests/kernels/test_moe_invariant.py tests/engine/test_batch_invariance.py ;;
      matmul-sweep) TAIL=80 step matmul-sweep 400 python3 -m strata.kernels.matmul --sweep ;;
      determinism) for m in off on; do step determinism-$m 500 $B determinism --shape qwen3-8b --clients 64 --parallel 8 \
          --chunk 512 $([ $m = on ] && echo "--batch-invariant --costs") --out $R/determinism_${m}_cuda.json; done ;;
      # Issue 15 over weights kept quantized: the server matrix and the mode's costs, per format.
      determinism-quant) for q in ${DET_QUANTS:-Q8_0 FP8}; do for m in off on; do step determinism-$q-$m 500 $B determinism \
          --shape qwen3-8b --quant $q --clients 64 --parallel 8 --chunk 512 $([ $m = on ] && echo "--batch-invariant --costs") \
          --out $R/determinism_${q}_${m}_cuda.json; done; done ;;
      # Issue 11's Q8_0 arm at smaller read contexts (its decode ITL was 1.71x idle at 64 SMs).
      concurrent-q8-sms) for n in ${READ_SMS_LIST:-48 32}; do step concurrent-q8-sms$n 300 $B concurrent --shape qwen3-8b \
          --quant Q8_0 --pairs ${SMS_PAIRS:-1} --read-sms $n --lengths 32768 --out $R/concurrent_qwen3-8b_Q8_0_sms${n}_cuda.json; done ;;
      # The Q8_0 GEMM with the dp4a GEMV's arithmetic: bitwise against the GEMV's rows, then timed.
      mmq) step mmq-tests 200 $T tests/kernels/test_quant_mmq.py
        TAIL=60 step mmq-bench 300 python3 -m strata.kernels.quant.q8_0_mmq ;;
      fp8-tests) step fp8-tests 300 $T tests/models/test_quantize_fp8.py tests/kernels/test_fp8_rows.py ;;
      # The K/V store fused into q/k-norm + RoPE (STRATA_FUSED_KV_STORE): its kernel tests on CUDA (not
      # `gpu`-marked) and the engine's tokens with it on and off; then (fused-store-ab) whole-model decode
      # and 4K reads fused against the separate store launch, interleaved.
      rope-store) step rope-store 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_small.py \
          -k "qk_norm_rope or kv_store"
        step rope-store-engine 300 $T tests/gpu/test_gpu_graphs.py -k fused_kv_store ;;
      fused-store-ab) TAIL=20 step fused-store-ab ${AB_S:-400} python3 scripts/fused_store_ab.py \
          --formats ${AB_FORMATS:-bf16,Q4_K} --rounds ${AB_ROUNDS:-2} ;;
      fp8-parts) TAIL=20 step fp8-parts 200 python3 scripts/fp8_read_parts.py ;;
      fp8-sweep) TAIL=80 step fp8-sweep 300 python3 -m strata.kernels.quant.fp8 --sweep ;;
      *) echo "unknown step $s" ;;
    esac
  done
} 2>&1 | tee "$OUT/round.log"
rm -rf "$R"
