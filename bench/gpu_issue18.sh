#!/bin/bash
# Issue 18's GPU checks (vLLM 0.26, dummy weights, eager), one case per call so each fits a short
# device command. From the repository root on the H200 machine with .gpucarry/ carried:
#   OUT=/dir bash bench/gpu_issue18.sh CASE [CASE...]
# Cases (each: a fresh gateway per xkv kind, restores compared with the no-connector run):
#   hybrid_all / hybrid_all_verify       bench/models/nemotronh_small, vLLM's default mode ('all')
#   hybrid_align / hybrid_align_verify   the same with --mamba-cache-mode align
#   fp8 / fp8_verify                     Llama-3-8B shape, --kv-cache-dtype fp8 (fixed scales)
#   fp8_runtime_scales                   ... with --calculate-kv-scales: must be refused at start
#   mla / mla_verify                     bench/models/dsv2_mla16 (TRITON_MLA)
# *_verify: verify_restores, state pages checked before the forward, the ref prompt restored by a
# second engine (a restart). Tables land in $OUT/CASE/run.txt (printed too).
set -u
OUT=${OUT:-out/issue18}
eval "$(bash .gpucarry/install.sh)" >/dev/null 2>&1 || { echo "install of .gpucarry failed"; exit 1; }
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
COMMON=(--mode eager --lens 4096 --reps 1 --cold-reps 1 --multi 0 --multi-len 4096 --card-gib 8
        --child-timeout 140)
HYB=(--model bench/models/nemotronh_small --chunk-size 0 --ref-chunks 4)
FP8=(--model bench/models/llama8b --backend TRITON_ATTN --kv-cache-dtype fp8)
MLA=(--model bench/models/dsv2_mla16 --backend TRITON_MLA --vocab 100000)
VER=(--kinds none,verify --verify-lens 4096 --verify-fresh-engine)
run() {  # name seconds e2e-args...
  local name=$1 secs=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$secs" python3 bench/e2e_ttft.py --out "$OUT/$name" "${COMMON[@]}" "$@" \
    > "$OUT/$name/run.txt" 2>&1
  echo "=== $name (rc $?)"; sed -n '/^TTFT, ms/,$p' "$OUT/$name/run.txt"
  grep -h "Mamba cache mode is set\|Setting attention block size\|KV cache registry" \
    "$OUT/$name"/*.log 2>/dev/null | sort -u | cut -c1-240
  rm -f "$OUT/$name"/*.png
}
for case in "$@"; do
  case $case in
    hybrid_all) run "$case" 170 "${HYB[@]}" --kinds none,xkv ;;
    hybrid_all_verify) run "$case" 170 "${HYB[@]}" "${VER[@]}" ;;
    hybrid_align) run "$case" 170 "${HYB[@]}" --mamba-cache-mode align --kinds none,xkv ;;
    hybrid_align_verify) run "$case" 170 "${HYB[@]}" --mamba-cache-mode align "${VER[@]}" ;;
    fp8) run "$case" 170 "${FP8[@]}" --kinds none,xkv ;;
    fp8_verify) run "$case" 170 "${FP8[@]}" "${VER[@]}" ;;
    fp8_runtime_scales)
      run "$case" 120 "${FP8[@]}" --calculate-kv-scales --kinds xkv
      if grep -q "with calculate_kv_scales: vLLM computes the k/v scales" "$OUT/$case/xkv.log"; then
        echo "fp8_runtime_scales: refused at start with the connector's message (expected)"
      else
        echo "fp8_runtime_scales: NOT refused with the expected message"
      fi ;;
    mla) run "$case" 170 "${MLA[@]}" --kinds none,xkv ;;
    mla_verify) run "$case" 170 "${MLA[@]}" "${VER[@]}" ;;
    *) echo "unknown case $case"; exit 2 ;;
  esac
done
