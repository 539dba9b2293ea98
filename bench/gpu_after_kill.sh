#!/bin/bash
# Issue 27 item 1 on the H200: the requests right after the gateway is SIGKILLed, on two models
# (Llama-3-8B shape with a 40 GiB card, the DeepSeek-V2-like MLA model with a 30 GiB card), V2
# runner, CUDA graphs: bench/e2e_ttft.py's `after_kill_ref` (the first request) and
# `after_kill_cold` rows (6 more, one by one) against the same engine's cold TTFT.
# From the repository root on the H200 machine with .gpucarry/ carried:
#   OUT=/dir bash bench/gpu_after_kill.sh after             # this tree
#   OUT=/dir BEFORE=DIR bash bench/gpu_after_kill.sh before # the library of DIR (e.g. the tree of
#       b33136a: `git archive b33136a xkv xkv_vllm_connector | tar -x -C DIR`), this bench script
# Each call runs both models (~4-5 min; MODELS="llama8b" or "mla" for one); the table lines land
# in $OUT/<which>_<model>/run.txt. With LOCK_GIB=N (e.g. 16) it first runs
# bench/cuda_register_lock.py on an N GiB card with 1 GiB segments (SEGMENT_MIB to change):
# the engine's worst CUDA iteration beside the whole-card and the one-segment-per-step calls
# ($OUT/lock.json, ~30 s). "after" first runs the GPU tests of the segmented card (GPUTESTS=0 to
# skip): copies across segment boundaries bit-exact with every engine ($OUT/gputests.txt).
set -u
WHICH=${1:-after}
OUT=${OUT:-out/after_kill}
eval "$(bash .gpucarry/install.sh)" >/dev/null 2>&1 || { echo "install of .gpucarry failed"; exit 1; }
TREE=$PWD
if [ "$WHICH" = before ]; then
  TREE=$(realpath "${BEFORE:?BEFORE=DIR with the old xkv and xkv_vllm_connector packages}")
fi
export PYTHONPATH=$TREE:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import xkv, sys; print('xkv from', xkv.__file__)"
COMMON=(--kinds xkv --runner v2 --mode graphs --lens 4096 --reps 1 --cold-reps 5 --multi 0
        --after-kill 6 --child-timeout 250)
run() {  # name seconds e2e-args...
  local name=$1 secs=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$secs" python3 bench/e2e_ttft.py --out "$OUT/$name" "$@" > "$OUT/$name/run.txt" 2>&1
  echo "=== $name (rc $?)"
  grep -E "after_kill|after gateway SIGKILL| cold " "$OUT/$name/run.txt" | tail -12
  rm -f "$OUT/$name"/*.png
}
if [ "$WHICH" = after ] && [ "${GPUTESTS:-1}" = 1 ]; then  # the segmented card on a real GPU
  mkdir -p "$OUT"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/connector/test_card_pin.py \
    tests/kernels/test_host.py > "$OUT/gputests.txt" 2>&1
  echo "=== gputests (rc $?)"; tail -3 "$OUT/gputests.txt"
fi
if [ -n "${LOCK_GIB:-}" ]; then
  mkdir -p "$OUT"
  timeout 240 python3 bench/cuda_register_lock.py --gib "$LOCK_GIB" \
    --segment-mib "${SEGMENT_MIB:-1024}" > "$OUT/lock.json" 2>&1
  echo "=== lock (rc $?)"; cat "$OUT/lock.json"
fi
for m in ${MODELS:-llama8b mla}; do
  case $m in
    llama8b) run "${WHICH}_llama8b" 270 --model bench/models/llama8b --card-gib 40 "${COMMON[@]}" ;;
    mla) run "${WHICH}_mla" 270 --model bench/models/dsv2_mla16 --backend TRITON_MLA --card-gib 30 \
           --vocab 100000 "${COMMON[@]}" ;;
  esac
done
