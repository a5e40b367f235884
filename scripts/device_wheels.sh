#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels the GPU machine lacks, for Python 3.12 on x86-64, and
# .cache/ with llama.cpp's vocabularies (the grammar-cost step's tokenizer). Run here (it needs the
# package index), then carry ".whl" (and ".cache" for grammar-cost) in the device call;
# scripts/gpu_round.sh installs the wheels first. The pins are a set that runs on the device image: fastapi, uvicorn, pydantic and the openai client with every dependency the image lacks,
# gguf, llguidance, and fla-core with einops (installed apart: see gpu_round.sh).
#   bash scripts/device_wheels.sh [--vocab]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 importlib-metadata==10.2.0
  zipp==4.1.2 lazy-importer==0.1.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  distro==1.9.0 httpx==0.28.1 httpcore==1.0.9 certifi idna==3.20 gguf==0.19.0 llguidance==1.9.1
  fla-core==0.6.0 einops==0.8.2
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
echo "$(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
if [ "${1:-}" = "--vocab" ]; then
  PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
  "$PY" -c "import sys; sys.path.insert(0, 'tests'); import fetch_vocab; print(fetch_vocab.fetch())"
fi
