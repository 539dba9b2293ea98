#!/bin/bash
# One-call GPU end-to-end run (issue 9). From the repository root on the H200 machine, with the
# git-ignored .gpucarry/ carried (built here by `bash ../shared/gpu-vllm/build_carry.sh`):
#   OUT=/some/dir bash bench/gpu_e2e.sh [bench/e2e_ttft.py options, e.g. --lens 4096 --reps 1]
# Installs the slim vLLM 0.26.0 into /tmp/site, prints the machine, runs bench/e2e_ttft.py with the
# repository on PYTHONPATH; logs, JSON and table land in $OUT (default out/e2e).
set -u
OUT=${OUT:-out/e2e}
mkdir -p "$OUT"
eval "$(bash .gpucarry/install.sh)" || { echo "install of .gpucarry failed"; exit 1; }
export PYTHONPATH=$PWD:$PYTHONPATH
{
  date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
  free -g | head -2; df -h /dev/shm | tail -1; nproc
} 2>&1 | tee "$OUT/machine.txt"
python3 bench/e2e_ttft.py --out "$OUT" "$@" 2>&1 | tee "$OUT/e2e_ttft.out"
