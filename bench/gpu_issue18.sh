#!/bin/bash
# Issue 18's GPU checks (vLLM 0.26, dummy weights), several cases per device call. From the
# repository root on the H200 machine with .gpucarry/ carried:
#   OUT=/dir [MODE=eager|graphs] bash bench/gpu_issue18.sh CASE[:SECONDS] [CASE[:SECONDS]...]
# Cases (kinds none, xkv, verify: a fresh gateway per xkv kind; the xkv child compares its restored
# and gateway-killed first-token logprobs with the no-connector run; the verify child checks every
# restored / saved page (and state page, before the forward) against the card, and restores the
# ref prompt in a second engine: a restart):
#   hybrid_all     bench/models/nemotronh_small, vLLM's default Mamba mode on 0.26 ('all')
#   hybrid_align   the same with --mamba-cache-mode align
#   fp8            Llama-3-8B shape, --kv-cache-dtype fp8 (fixed scales: the checkpoint's / 1.0)
#   fp8_runtime_scales   ... with --calculate-kv-scales: the connector must refuse it at start
#   mla            bench/models/dsv2_mla16 (TRITON_MLA)
# MODE=graphs runs vLLM's default mode (CUDA graphs, torch.compile) instead of enforce_eager.
# Each case's folder is packed into $OUT/CASE.tar.xz (the device returns at most 8 files);
# every case's table is appended to $OUT/summary.txt.
set -u
OUT=${OUT:-out/issue18}
MODE=${MODE:-eager}
mkdir -p "$OUT"
eval "$(bash .gpucarry/install.sh)" >/dev/null 2>&1 || { echo "install of .gpucarry failed"; exit 1; }
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
COMMON=(--mode "$MODE" --lens 4096 --verify-lens 4096 --reps 1 --cold-reps 1 --multi 0
        --multi-len 4096 --card-gib 8 --gpu-util 0.35 --child-timeout 200 --verify-fresh-engine)
ALL=(--kinds none,xkv,verify)
HYB=(--model bench/models/nemotronh_small --chunk-size 0 --ref-chunks 4)
FP8=(--model bench/models/llama8b --backend TRITON_ATTN --kv-cache-dtype fp8)
MLA=(--model bench/models/dsv2_mla16 --backend TRITON_MLA --vocab 100000)
run() {  # name seconds e2e-args...
  local name=$1 secs=$2 d="$OUT/$1_$MODE"; shift 2
  mkdir -p "$d"
  local t0=$SECONDS
  timeout "$secs" python3 bench/e2e_ttft.py --out "$d" "${COMMON[@]}" "$@" > "$d/run.txt" 2>&1
  local rc=$?
  {
    echo "=== $name ($MODE): rc $rc in $((SECONDS - t0)) s"
    sed -n '/^TTFT, ms/,$p' "$d/run.txt"
    grep -h "Mamba cache mode is set\|Setting attention block size\|KV cache registry\|XKV: vLLM\|refus" \
      "$d"/*.log 2>/dev/null | sort -u | cut -c1-300
  } | tee -a "$OUT/summary.txt"
  rm -f "$d"/*.png
}
for spec in "$@"; do
  case=${spec%%:*}; secs=${spec#*:}; [ "$secs" = "$spec" ] && secs=280
  case $case in
    hybrid_all) run "$case" "$secs" "${HYB[@]}" "${ALL[@]}" ;;
    hybrid_align) run "$case" "$secs" "${HYB[@]}" --mamba-cache-mode align "${ALL[@]}" ;;
    fp8) run "$case" "$secs" "${FP8[@]}" "${ALL[@]}" ;;
    fp8_runtime_scales)
      run "$case" "$secs" "${FP8[@]}" --calculate-kv-scales --kinds xkv
      if grep -q "with calculate_kv_scales: vLLM computes the k/v scales" "$OUT/${case}_$MODE/xkv.log"; then
        echo "fp8_runtime_scales: refused at start with the connector's message (expected)"
      else
        echo "fp8_runtime_scales: NOT refused with the expected message"
      fi | tee -a "$OUT/summary.txt" ;;
    mla) run "$case" "$secs" "${MLA[@]}" "${ALL[@]}" ;;
    *) echo "unknown case $case"; exit 2 ;;
  esac
  (cd "$OUT" && tar cJf "${case}_$MODE.tar.xz" "${case}_$MODE" && rm -rf "${case}_$MODE")
done
