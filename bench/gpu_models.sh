#!/bin/bash
# Issue 13's second GPU call: the MLA model and a second GQA model in vLLM's default mode, and the
# Llama shape in eager mode, each with every connector of its comparison in the same call.
# From the repository root on the H200 machine with .gpucarry/ carried:  OUT=/dir bash bench/gpu_models.sh
set -u
OUT=${OUT:-out/models}
eval "$(bash .gpucarry/install.sh)" >/dev/null 2>&1 || { echo "install of .gpucarry failed"; exit 1; }
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 XKV_TIMING=1
run() {  # name seconds e2e-args...
  local name=$1 secs=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$secs" python3 bench/e2e_ttft.py --out "$OUT/$name" "$@" > "$OUT/$name/run.txt" 2>&1
  echo "=== $name (rc $?)"; sed -n '/^TTFT, ms/,$p' "$OUT/$name/run.txt"
  rm -f "$OUT/$name"/*.png
}
run mla_graphs 210 --model bench/models/dsv2_mla16 --backend TRITON_MLA --mode graphs \
  --lens 4096,16384 --reps 3 --cold-reps 3 --kinds none,xkv,verify --verify-lens 4096 --multi 0 \
  --card-gib 16 --child-timeout 100 --vocab 100000
run llama_eager 160 --model bench/models/llama8b --mode eager --lens 4096,16384,32768 --reps 3 \
  --cold-reps 3 --kinds none,xkv,offload --multi 8 --card-gib 40 --child-timeout 75
run qwen3_graphs 170 --model bench/models/qwen3_8b --backend TRITON_ATTN --chunk-size 128 \
  --mode graphs --lens 2048,4096 --reps 3 --cold-reps 3 --kinds none,xkv,offload --multi 0 \
  --card-gib 16 --child-timeout 80
(cd "$OUT" && tar czf results.tar.gz */ && rm -rf */)
