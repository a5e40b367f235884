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
# A prebuilt llama.cpp (.peerbin) links the CUDA runtime and cuBLAS that torch's wheels bring.
NV=$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, d, 'lib') for p in nvidia.__path__ for d in os.listdir(p) if os.path.isdir(os.path.join(p, d, 'lib'))))" 2>/dev/null)
export LD_LIBRARY_PATH=/tmp/llama/build/bin:${NV}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
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
BI="env STRATA_LOG_LEVEL=INFO $B"  # the memory plan, start-up phases and placement lines in the log
# A test running past faulthandler_timeout has every thread's stack printed (a hang shows where it waits).
T="python3 -m pytest -q -s -m gpu -p no:cacheprovider -o faulthandler_timeout=${FAULT_S:-150}"
FLA="env PYTHONPATH=/tmp/fla:$PYTHONPATH setsid -w"  # fla-core on the path, in a session of its own
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  local t0=$SECONDS
  # The whole output goes into results.tgz (logs/): the tail below is what a call shows.
  mkdir -p "$R/logs"
  # Into a file, not a pipe: a process the command leaves behind (a pipeline stage's worker) holds no
  # pipe open, and is ended after the step so the next one has the card.
  timeout "$secs" "$@" >"$R/logs/$name.txt" 2>&1
  local rc=$?
  pkill -f "strata[.]dist[.]worker"
  grep -v "^\s*$" "$R/logs/$name.txt" | tail -${TAIL:-40}
  echo "--- $name: rc $rc in $((SECONDS - t0)) s"
  tar czf "$OUT/results.tgz" -C "$R" .  # after every step: a call cut short still brings back what ran
}
wait_next_gguf() {  # llama.cpp built (unless NO_PEER) and the 80B file written (offload-next-gguf), at most 15 minutes
  local t0=$SECONDS
  while { [ -z "${NO_PEER:-}" ] && [ ! -f /tmp/peer/built ]; } || [ ! -f /tmp/peer/next_gguf ]; do
    [ $((SECONDS - t0)) -gt 900 ] && break; sleep 5; done
  tail -n 3 /tmp/peer/next_gguf.log; ls -la /tmp/next_IQ3_S.gguf; free -g | head -2
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
      # One step per file of FILES, FILES_S seconds each: a file cut short still leaves the others' tracebacks.
      files-each) for f in $FILES; do step "$(basename "$f" .py)" ${FILES_S:-300} $T "$f" -rf --tb=short; done ;;
      # The benchmarks the docs quote (bench/results/README.md names each file's command).
      host-layers) step host-layers 300 python3 benchmarks/kernels/host_expert_kernels.py --layers-only ;;
      host-kernels) step host-kernels 400 bash -c "python3 benchmarks/kernels/host_expert_kernels.py | tee $R/host_expert_kernels_cuda.txt" ;;
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
      # 64 streaming clients for 10 minutes against a --batch-invariant server (model load and drain on top).
      soak) step soak 750 $B soak --shape qwen3-8b --clients 64 --seconds 600 --out $R/soak_qwen3-8b_cuda.json ;;
      # SIGTERM on CUDA with long streams and whole completions in flight: each ends whole or with an error event.
      gpu-shutdown) step gpu-shutdown 300 $T tests/gpu/test_gpu_shutdown.py ;;
      # The soak beside other steps: capped at SOAK_GPU GiB so the test files after it fit the same card
      # (its figures are lost requests, memory growth and greedy answers, none a speed). soak-wait ends it.
      soak-bg)
        setsid nohup bash -c "$B soak --shape qwen3-8b --clients 64 --seconds 600 --gpu-memory ${SOAK_GPU:-36} \
          --out $R/soak_qwen3-8b_cuda.json; touch /tmp/soak_done" >/tmp/soak.log 2>&1 </dev/null &
        echo "soak started" ;;
      soak-wait) step soak-wait 900 bash -c "while [ ! -f /tmp/soak_done ]; do sleep 5; done; tail -60 /tmp/soak.log" ;;
      kv-tier) step kv-tier 900 $BI kv-tier --device cuda --shape qwen3-8b-128k --context ${KV_CONTEXT:-130944} \
        --decode 64 --resident 16384 ${KV_PROFILE:+--profile} ${KV_TIER_GRAPHS:+--kv-tier-graphs} --out $R/kv_tier_qwen3-8b_cuda.json ;;
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
        if [ -f .peerbin/parts ]; then
          # Built off the device (scripts/peer_build_local.sh), in parts that may come over several calls
          # (a call carries 64 MiB): each call copies the parts it carries into /tmp/peerparts; the build
          # counts as done once they are all there and their sum checks.
          mkdir -p /tmp/peerparts /tmp/llama/build/bin && cp .peerbin/parts .peerbin/bin.tar.xz.* /tmp/peerparts/ 2>/dev/null
          setsid nohup bash -c "cd /tmp/peerparts; until [ \$(tail -n +2 parts | while read f; do [ -f \$f ] && echo; done | wc -l) \
            = \$(tail -n +2 parts | wc -l) ]; do sleep 5; done; cat \$(tail -n +2 parts) > bin.tar.xz; \
            [ \$(sha256sum bin.tar.xz | cut -d' ' -f1) = \$(head -1 parts | cut -d' ' -f1) ] && tar xJf bin.tar.xz -C /tmp/llama/build/bin \
            && /tmp/llama/build/bin/llama-bench --help | head -2; touch /tmp/peer/built" >/tmp/peer/build.log 2>&1 </dev/null &
          echo "prebuilt llama.cpp: $(ls /tmp/peerparts | grep -c tar.xz) of $(($(wc -l < .peerbin/parts) - 1)) parts here"
        else
          setsid nohup bash -c "cd /tmp/llama && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF >/tmp/peer/cmake.log 2>&1 \
            && cmake --build build -j${PEER_JOBS:-12} --target llama-bench llama-server llama-quantize >/tmp/peer/build.log 2>&1; touch /tmp/peer/built" >/dev/null 2>&1 </dev/null &
        fi
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
      # Experts in host RAM: a Qwen3-30B-A3B-shaped Q8_0 GGUF (OFFLOAD_LAYERS of its 48 layers), written in the
      # background beside peer-build; offload waits for both, then times llama.cpp and Strata on it, alone.
      offload-gguf)  # the disk holds the 30B file or the 80B one: this step removes the 80B one
        mkdir -p /tmp/peer; rm -f /tmp/next_IQ3_S.gguf; V=/tmp/llama/models/ggml-vocab-qwen2.gguf; [ -f $V ] || V=.cache/llama-cpp-vocab-0.3.16/ggml-vocab-qwen2.gguf
        # On the CPU: tests beside it size their KV pools from the GPU's free memory.
        setsid nohup bash -c "CUDA_VISIBLE_DEVICES= python3 scripts/quant_gguf.py /tmp/moe_Q8_0.gguf Q8_0 --shape qwen3-30b-a3b \
          --layers ${OFFLOAD_LAYERS:-48} --vocab $V; touch /tmp/peer/moe_gguf" \
          >/tmp/peer/moe_gguf.log 2>&1 </dev/null &
        echo "MoE GGUF write started" ;;
      offload)  # NO_PEER=1 (no peer-build before it): Strata alone
        t0=$SECONDS; while { [ -z "${NO_PEER:-}" ] && [ ! -f /tmp/peer/built ]; } || [ ! -f /tmp/peer/moe_gguf ]; do
          [ $((SECONDS - t0)) -gt 600 ] && break; sleep 5; done
        tail -n 3 /tmp/peer/build.log /tmp/peer/moe_gguf.log; ls -la /tmp/moe_Q8_0.gguf; free -g | head -2
        PEER_ARGS="--llamacpp $R/llamacpp_offload.json --llamacpp-more $R/llamacpp_offload_ub4096.json"
        [ -n "${NO_PEER:-}" ] && PEER_ARGS="" || step offload-llamacpp 400 bash -c "/tmp/llama/build/bin/llama-bench -m /tmp/moe_Q8_0.gguf -ngl 99 -fa 1 -ncmoe 99 \
          -p 4096 -n 64 -r 2 -o json > $R/llamacpp_offload.json; /tmp/llama/build/bin/llama-bench -m /tmp/moe_Q8_0.gguf \
          -ngl 99 -fa 1 -ncmoe 99 -p 4096 -n 0 -ub 4096 -b 4096 -r 1 -o json > $R/llamacpp_offload_ub4096.json; \
          python3 -c 'import json,sys; [print(r[\"n_prompt\"], r[\"n_gen\"], r[\"n_ubatch\"], round(r[\"avg_ts\"], 1)) for f in sys.argv[1:] for r in json.load(open(f))]' \
          $R/llamacpp_offload.json $R/llamacpp_offload_ub4096.json"
        N=qwen3-30b-a3b-q8_0-${OFFLOAD_LAYERS:-48}l
        step offload-strata 900 $BI offload --model /tmp/moe_Q8_0.gguf --name $N --cpu-moe \
          --formats ${OFFLOAD_FORMATS:-compiled+graphs,fbgemm+graphs} --crossover 2,4,8,16,32,64 $PEER_ARGS --out $R/offload_${N}_cuda.json ;;
      # Qwen3-Next-80B-A3B, all 48 layers, IQ3_S, under a 16 GiB cap: Strata's memory plan against llama.cpp's
      # automatic fit to 16 GiB (-fitt: all but 16 GiB of the card left free) and the same explicit --n-cpu-moe.
      offload-next-gguf)  # the disk holds the 80B file or the 30B one: this step removes the 30B one
        mkdir -p /tmp/peer /tmp/llama; rm -f /tmp/moe_Q8_0.gguf
        # The vocabulary alone when peer-build has not unpacked llama.cpp (NO_PEER rounds).
        [ -f /tmp/llama/models/ggml-vocab-qwen2.gguf ] || tar xJf .peer/llama.tar.xz -C /tmp/llama models/ggml-vocab-qwen2.gguf
        setsid nohup bash -c "python3 scripts/next_gguf.py /tmp/next_IQ3_S.gguf --shape qwen3-next-80b-a3b --type IQ3_S \
          --vocab /tmp/llama/models/ggml-vocab-qwen2.gguf; touch /tmp/peer/next_gguf" >/tmp/peer/next_gguf.log 2>&1 </dev/null &
        echo "80B IQ3_S GGUF write started" ;;
      offload-next)
        wait_next_gguf
        FITT=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) - 16384 ))
        # The card's memory in use every half second while the fitted run goes: its peak is llama.cpp's VRAM use.
        step offload-next-llamacpp 500 bash -c "(while :; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; \
          sleep 0.5; done) > $R/llamacpp_offload_next_fit_vram.txt & W=\$!; \
          /tmp/llama/build/bin/llama-bench -m /tmp/next_IQ3_S.gguf -ngl 99 -fa 1 \
          -fitt $FITT -p 4096 -n 64 -r 2 -o json > $R/llamacpp_offload_next_fit.json; kill \$W; \
          echo fitted run: peak VRAM \$(sort -n $R/llamacpp_offload_next_fit_vram.txt | tail -1) MiB; \
          grep -E 'avg_ts|n_prompt|n_gen' $R/llamacpp_offload_next_fit.json"
        # NEXT_FORMATS: compiled+graphs for decode graphs in pieces (the same engine's eager decode is timed too).
        step offload-next-strata 900 $BI offload --model /tmp/next_IQ3_S.gguf --name qwen3-next-80b-a3b-iq3_s-16g \
          --gpu-memory 16 --formats ${NEXT_FORMATS:-auto} --llamacpp $R/llamacpp_offload_next_fit.json \
          --out $R/offload_qwen3-next-80b-a3b-iq3_s-16g_cuda.json
        # Where every +graphs arm failed (no file written), the same arms without graphs.
        [ -f $R/offload_qwen3-next-80b-a3b-iq3_s-16g_cuda.json ] || [ "${NEXT_FORMATS:-auto}" = "${NEXT_FORMATS//+graphs/}" ] \
          || step offload-next-strata-eager 900 $BI offload --model /tmp/next_IQ3_S.gguf --name qwen3-next-80b-a3b-iq3_s-16g \
          --gpu-memory 16 --formats ${NEXT_FORMATS//+graphs/} \
          --llamacpp $R/llamacpp_offload_next_fit.json --out $R/offload_qwen3-next-80b-a3b-iq3_s-16g_cuda.json ;;
      # The same placement in both engines: llama.cpp's -ncmoe and Strata's --n-cpu-moe, NEXT_NCMOE layers.
      offload-next-ncmoe)
        wait_next_gguf
        K=${NEXT_NCMOE:-36}
        step offload-next-llamacpp-ncmoe 300 bash -c "/tmp/llama/build/bin/llama-bench -m /tmp/next_IQ3_S.gguf -ngl 99 -fa 1 \
          -ncmoe $K -p 4096 -n 64 -r 2 -o json > $R/llamacpp_offload_next_ncmoe.json; \
          grep -E 'n_cpu_moe|avg_ts|n_prompt|n_gen' $R/llamacpp_offload_next_ncmoe.json"
        step offload-next-strata-ncmoe 600 $BI offload --model /tmp/next_IQ3_S.gguf --name qwen3-next-80b-a3b-iq3_s-16g-ncmoe$K \
          --gpu-memory 16 --n-cpu-moe $K --formats ${NEXT_FORMATS:-auto} --llamacpp $R/llamacpp_offload_next_ncmoe.json \
          --out $R/offload_qwen3-next-80b-a3b-iq3_s-16g-ncmoe${K}_cuda.json ;;
      # The same 80B file with its MTP layer (llama.cpp refuses such a file, and the disk holds one of
      # them): Strata alone under the same cap, with --spec 3 (random weights: it shows the seed's
      # configuration starting and serving, not what speculation buys).
      offload-next-mtp)
        rm -f /tmp/next_IQ3_S.gguf /tmp/moe_Q8_0.gguf
        step next-mtp-gguf 300 python3 scripts/next_gguf.py /tmp/next_mtp_IQ3_S.gguf --shape qwen3-next-80b-a3b \
          --type IQ3_S --mtp --vocab /tmp/llama/models/ggml-vocab-qwen2.gguf
        step offload-next-mtp 900 $BI offload --model /tmp/next_mtp_IQ3_S.gguf --name qwen3-next-80b-a3b-iq3_s-mtp-16g \
          --gpu-memory 16 --formats auto --spec 3 --out $R/offload_qwen3-next-80b-a3b-iq3_s-mtp-16g_cuda.json ;;
      # The host KV tier on the seed's model and placement (needs peer-build and offload-next-gguf before it):
      # llama-server with every K/V in RAM (-nkvo) timing one KV_NEXT_CONTEXT-token prompt and its decode, then
      # Strata's resident window on the same file and ids; then a 262,144-token context read and decoded.
      kv-tier-next)
        wait_next_gguf
        C=${KV_NEXT_CONTEXT:-130944}; NKVO=$R/llamacpp_nkvo_next.json
        # KV_NEXT_ONLY_262K=1: the 262,144-token context alone, no llama.cpp (its -nkvo read of 128K runs
        # 15-30 minutes); NKVO_READ_S=S: llama.cpp's read given up after S seconds, its rate so far kept.
        # Beside llama.cpp both engines keep the first NEXT_NCMOE layers' experts in RAM; alone, the memory
        # plan places them where the offload-next step's plan served.
        TIER="$BI kv-tier --model /tmp/next_IQ3_S.gguf --arms tier --gpu-memory 16 --parallel 2 --ctx 262144 --kv int8 \
          --resident 32768 ${KV_PROFILE:+--profile} ${KV_TIER_GRAPHS:+--kv-tier-graphs} ${KV_HOST_EXPERTS:+--host-experts $KV_HOST_EXPERTS}"
        if [ -z "${KV_NEXT_ONLY_262K:-}" ]; then
          step kv-tier-next-llamacpp ${NKVO_S:-900} python3 scripts/llama_server_once.py --tokens $C --decode 32 --out $NKVO \
            ${NKVO_READ_S:+--read-timeout $NKVO_READ_S} \
            -- /tmp/llama/build/bin/llama-server -m /tmp/next_IQ3_S.gguf -ngl 99 -fa on -nkvo -ncmoe ${NEXT_NCMOE:-36} -c $((C + 256))
          step kv-tier-next-strata 900 $TIER --n-cpu-moe ${NEXT_NCMOE:-36} --context $C --decode 32 \
            $([ -f $NKVO ] && echo --llamacpp $NKVO) --out $R/kv_tier_qwen3-next-80b-a3b-iq3_s-16g_cuda.json
        fi
        PLACE="--n-cpu-moe ${NEXT_NCMOE:-36}"; [ -f $R/offload_qwen3-next-80b-a3b-iq3_s-16g_cuda.json ] && PLACE=""
        # KV_NEXT_SKIP_262K=1: the 128K comparison alone.
        [ -n "${KV_NEXT_SKIP_262K:-}" ] || step kv-tier-next-262k 900 $TIER $PLACE --context 262000 --decode 16 --no-alloc-check \
          --out $R/kv_tier_qwen3-next-80b-a3b-iq3_s-16g-262k_cuda.json ;;
      host-probe) step host-probe 200 python3 .probe/host_probe.py ;;
      host-span) step host-span 200 bash -c "python3 benchmarks/kernels/host_span_attention.py | tee $R/host_span_attention_cuda.txt" ;;
      pcie-reads) step pcie-reads 200 bash -c "python3 benchmarks/kernels/pcie_reads.py | tee $R/pcie_reads_cuda.txt" ;;
      host-int4) step host-int4 300 bash -c "python3 benchmarks/kernels/host_int4_compiled.py | tee $R/host_int4_compiled_cuda.txt" ;;
      profile1) step profile1 120 python3 scripts/profile_step.py --batch 1 ;;
      *) echo "unknown step $s" ;;
    esac
  done
} 2>&1 | tee "$OUT/round.log"
