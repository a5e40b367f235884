#!/usr/bin/env bash
# Builds llama.cpp (CUDA, sm_90: llama-bench, llama-server, llama-quantize) on a machine without a GPU,
# so the device's time goes to measuring: writes .peerbin/ (bin.tar.xz in parts, and `parts`), which
# scripts/gpu_round.sh's peer-build step unpacks instead of building (carry the parts: see the step). Needs nvcc 13 (the device's torch is
# cu130) and .peer/llama.tar.xz (../shared/tools/llamacpp/pack.sh). cuBLAS comes from NVIDIA's wheel;
# the driver's libcuda is only linked against here (its real one is on the device), so a stub of
# cuda.h's functions stands in for it. About 15 minutes on 2 cores.
#   bash scripts/peer_build_local.sh [WORK_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=${1:-/tmp/peer_local}
CUDA=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$W" && cd "$W"

# A toolkit folder: the system CUDA, cuBLAS from the wheel, and the stub driver library.
TK=$W/toolkit
if [ ! -f "$TK/lib64/stubs/libcuda.so" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels "nvidia-cublas>=13,<14"
  rm -rf cublas && mkdir cublas && (cd cublas && python3 -m zipfile -e ../wheels/nvidia_cublas-*.whl .)
  mkdir -p "$TK/include" "$TK/lib64/stubs"
  ln -sfn "$CUDA/bin" "$TK/bin"; ln -sfn "$CUDA/nvvm" "$TK/nvvm"; ln -sfn "$CUDA/targets" "$TK/targets"
  cp -rs "$CUDA"/include/. "$TK/include/" 2>/dev/null || true
  cp -rs "$CUDA"/lib64/. "$TK/lib64/" 2>/dev/null || true
  cp cublas/nvidia/cu13/include/* "$TK/include/"
  for f in cublas/nvidia/cu13/lib/libcublas*.so.13; do
    cp "$f" "$TK/lib64/"; ln -sfn "$(basename "$f")" "$TK/lib64/$(basename "$f" .13)"
  done
  echo '#include <cuda.h>' > stub.c.in
  gcc -E -I"$CUDA/include" -x c stub.c.in | grep -oE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' | sed 's/\s*(//' | sort -u \
    | awk '{print "int " $1 "(void){return 999;}"}' > stub.c
  gcc -shared -fPIC -o "$TK/lib64/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 stub.c
  cp "$TK/lib64/stubs/libcuda.so" "$TK/lib64/stubs/libcuda.so.1"
fi

rm -rf src && mkdir src && tar xJf "$ROOT/.peer/llama.tar.xz" -C src
cd src
# rpath-link: the executables' link resolves libggml-cuda's cuBLAS and (stub) driver here.
CUDACXX=$TK/bin/nvcc cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF -DCUDAToolkit_ROOT="$TK" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$TK/lib64 -Wl,-rpath-link,$TK/lib64/stubs" >cmake.log
cmake --build build -j"$(nproc)" --target llama-bench llama-server llama-quantize >build.log
# In parts of 20 MB, with the whole's sum first in `parts`: a device call carries 64 MiB with the tree.
rm -rf "$ROOT/.peerbin" && mkdir -p "$ROOT/.peerbin" && cd "$ROOT/.peerbin"
(cd "$W/src/build/bin" && tar cJf - --exclude='*.a' .) > bin.tar.xz
split -b 20000000 -d bin.tar.xz bin.tar.xz.
{ sha256sum bin.tar.xz | sed 's/bin.tar.xz$/whole/'; ls bin.tar.xz.*; } > parts
ls -la
