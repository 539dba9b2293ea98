#!/bin/bash
# Issue 24's GPU calls (vLLM 0.26, dummy weights, vLLM's default runner), from the repository root on
# the H200 machine with .gpucarry/ carried:
#   OUT=/dir bash bench/gpu_issue24.sh STEP[:SECONDS] ...
# Steps:
#   profile_llama   bench/profile_steps.py, Llama-3-8B shape, FLASH_ATTN, chunk 256, CUDA graphs:
#                   none / xkv / offload, 2k and 16k: hook host time, CUDA events around every hook
#                   (GPU position, stall on each layer's copy), a torch.profiler view per case
#   profile_mla     the same on bench/models/dsv2_mla16 (TRITON_MLA); profile_mla_xkv: xkv only
#   profile_mla_ab  the MLA model, xkv checked and xkv@verify_checksums=off (issue 25: stop 49's
#                   same-engine 32k ratio 1.067), LENS (default 32768), 5 reps each
#   profile_qwen_2k  the same on bench/models/qwen3_8b at 2048 only, 5 reps: its restores took 25 or 42 ms
#                   with the same copy (stop 41): where do the other 17 ms go
#   profile_llama_2k  xkv (unchecked, checked) and the GPU hit at 2k only, 5 reps: where the
#                   engine time of a full-hit restore goes beyond copy + issue (stop 33 note)
#   profile_multi   profile_steps.py --multi 8 --multi-len 16384 on the Llama shape (MULTI_KINDS,
#                   default xkv,offload): 8 x 16k restores beside 4 decoding requests under the
#                   profiler (stop 46: xkv's step took ~100 ms beyond its 360 ms copy), hooks' host
#                   and GPU positions; needs PROF_ARGS='--start-together --kv-gib 18 --gpu-util 0.1'
#   stores_llama / stores_mla   profile_steps.py with kinds none, xkv@layer, xkv@step (save_mode,
#                   issue 24 point 4): cold prefill with stores (and restores) in both store modes,
#                   LENS (default 4096,16384)
#   checksums       bench/page_mover.py --checksums: Triton restore/save GB/s with vs without checksums at 4-32 programs
#   kernel_ab       bench/page_mover.py --checksums (pages AB_SIZES KiB, default 4,8,18,32; budgets 4 and
#                   CHECK_BUDGETS, default 16,64) three times: XKV_CHECK_SPLIT=1 (the default), =8 (partial checksum sums), and
#                   XKV_MIN_EVEN_ROW_BYTES=65536 (the masked rows 18 KiB pages had before stop 39)
#   gputests        pytest -m gpu of the tail fence, the CUDA transfer handler (every checksum pass),
#                   prepared copies, warmup, the two-pass restore, the card in pieces and the async
#                   loads' worker half; then test_group_copies.py with its `device` on the GPU
#   e2e_llama_graphs / e2e_llama_eager / e2e_mla_graphs / e2e_qwen_graphs   bench/e2e_ttft.py,
#                   every connector and the correctness checks (logprobs vs no connector, verify
#                   child, gateway kill); qwen: bench/models/qwen3_8b (36 layers, 8 KV heads),
#                   TRITON_ATTN, chunk 128 (the issue's second GQA family)
#   graph_waits_llama / graph_waits_qwen  full graphs with graph waits (xkv's default since stop
#                   53) against piecewise graphs: e2e_ttft.py at 2k and 8k, 5 reps, decode ms per
#                   token, kinds GW_KINDS (default none, xkv, xkv@full_cuda_graphs=false, offload;
#                   stop 53 ran none, xkv, xkv@full_cuda_graphs=true, offload when xkv was
#                   piecewise), engines together in waves that fit this GPU (22 GiB each)
#   e2e_hybrid_graphs  the same on bench/models/nemotronh_small (Mamba2 hybrid, chunk = one block,
#                   4-chunk ref prompt)
#   shared_prefix   bench/shared_prefix.py on the Llama shape (issue 24 point 5): 16 prefixes of 8k in a
#                   2048-block GPU cache, rounds of 16 requests, kinds none,xkv,offload, outputs
#                   compared with no connector (SP_ARGS: more options, e.g. --mode graphs)
#   all_llama / all_mla / all_qwen   issue 24's whole table for one model, engines started together
#                   (KV_GIB per engine, default 12): CUDA graphs and eager at 2k-32k with none, xkv
#                   and Offloading (cold with stores, restores, first restore, logprobs, gateway
#                   kill), the 8 x 16k case, and for Llama the shared-prefix workload; SECONDS per
#                   part (a GPU without the device's 600 s limit: give each 600); engines start
#                   in waves that fit this GPU's memory (--together-max from nvidia-smi: an
#                   H100 takes two Llama engines with 12 GiB of KV each, an H200 three; KV_GIB:
#                   KV per engine, default 12, the MLA model 4: 32k tokens are 0.6 GB there)
#   caches          sizes of the compile caches the engines built (vLLM's, Triton's): could a carry
#                   hold them and spare the next session's engine starts?
#   host_issue_cuda bench/host_issue.py --cuda (no vLLM), once per engine of HOST_ENGINES (default
#                   "staged triton"): the CUDA handler's restore issue path, checked
#                   and unchecked steps alternating, 128 and 2048 blocks of 64 KiB x 32 layers and
#                   2048 of 18 KiB x 16 (the MLA model's 32k restore: stop 44's was host-bound on
#                   the ring), a cProfile of each side
#   cpu_edges       no GPU: bench/host_issue.py (a restore's host issue path, 1024 and 128 blocks),
#                   the gateway benches of issues 26 and 27 on this machine's quiet cores
#                   (bench/disk_tier.py: write-behind, restores and another client's lookup p99
#                   against dd on the same directory; bench/gateway_edges.py reserve and replay);
#                   shares of SECONDS 30 / 55 / 15 %: the reserve bench fills a 1 and a 4 GiB
#                   index twice (one-page objects) and needs ~150 s (stop 34: 42 s cut it), so
#                   give the step >= 280 (DISK_THREADS: the tier's I/O threads per round, "4";
#                   DISK_DEPTHS: --disk-read-depth values per round, "auto,4"; then
#                   bench/disk_reads.py: the disk's O_DIRECT rate by reads in flight)
# Engine starts (70-105 s each on the H200) are most of a call: E2E_ARGS / SP_ARGS / PROF_ARGS='--start-together
# --kv-gib G --gpu-util 0.1' starts every kind's engine at once and measures them one at a time
# (bench/engine_children.py; all engines must fit the GPU: Llama-3-8B ~15 GiB weights + G + ~2.5 each).
# Two versions of the worker in one call: `git archive <commit> xkv xkv_vllm_connector | (mkdir -p
# .base && tar -x -C .base)` here, carry ".base" (ignored), and add the kind xkv@XKV_TREE=.base
# (bench/e2e_kinds.py: that engine imports xkv from .base; its gateway is this tree's).
# Each step's folder is packed into $OUT/STEP.tar.xz (the device returns at most 8 files).
set -u
OUT=${OUT:-out/issue24}
mkdir -p "$OUT"
eval "$(bash .gpucarry/install.sh)" >/dev/null 2>&1 || { echo "install of .gpucarry failed"; exit 1; }
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 XKV_TIMING=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys,torch,triton;print(sys.version.split()[0],torch.__version__,triton.__version__)"
  (cd bench && python3 -c "import e2e_ttft;print('copy-engine H2D GB/s', e2e_ttft._h2d_gbps())")
} 2>&1 | tee -a "$OUT/summary.txt"
LL=(--model bench/models/llama8b --backend FLASH_ATTN --chunk-size 256)
MLA=(--model bench/models/dsv2_mla16 --backend TRITON_MLA --chunk-size 256)
QW=(--model bench/models/qwen3_8b --backend TRITON_ATTN --chunk-size 128)
HYB=(--model bench/models/nemotronh_small --chunk-size 0 --ref-chunks 4)
prof() {  # name seconds args...
  local name=$1 secs=$2 d="$OUT/$1"; shift 2
  mkdir -p "$d"
  timeout "$secs" python3 bench/profile_steps.py --out "$d" --modes graphs --lens 2048,16384 \
    --reps 3 --child-timeout 170 --runner default --tag "${TAG:-now}" "$@" ${PROF_ARGS:-} > "$d/run.txt" 2>&1
  echo "=== $name: rc $?" | tee -a "$OUT/summary.txt"
  cat "$d/profile.md" >> "$OUT/summary.txt" 2>/dev/null
  profile_lines "$d"
}
profile_lines() {  # dir: XKV_PROFILE_ISSUE=N (xkv/connector/issue_profile.py): each engine's summed
  # cProfile of its restores' issue, checked and unverified steps apart, into the summary
  grep -H 'XKV_PROFILE_ISSUE' "$1"/*.log 2>/dev/null | sed "s#^$1/##; s#^\([^:]*\):.*XKV_PROFILE_ISSUE#\1:#" \
    | cut -c1-220 >> "$OUT/summary.txt"
}
e2e() {  # name seconds args...
  local name=$1 secs=$2 d="$OUT/$1"; shift 2
  mkdir -p "$d"
  timeout "$secs" python3 bench/e2e_ttft.py --out "$d" --runner default --card-gib 24 \
    --offload-gib 24 --gpu-util 0.55 "$@" > "$d/run.txt" 2>&1
  local rc=$?
  echo "=== $name: rc $rc" | tee -a "$OUT/summary.txt"
  if [ "$rc" -ne 0 ] && [ -f "$d/e2e_ttft.json" ] && ! grep -q '^TTFT, ms' "$d/run.txt"; then
    # cut (the step's limit): the report of the kinds measured before the cut, from their JSON
    python3 bench/e2e_ttft.py --report-only "$d/e2e_ttft.json" --out "$d" >> "$d/run.txt" 2>&1
  fi
  sed -n '/^TTFT, ms/,$p' "$d/run.txt" >> "$OUT/summary.txt"
  # each xkv engine's start-up verdict on the ring (xkv.kernels.ring_choice) and long collections
  grep -H -o 'XKV: restores [^(]*([^)]*)' "$d"/*.log 2>/dev/null | sed "s#^$d/##" >> "$OUT/summary.txt"
  # XKV_EARLY_ISSUE's auto: where it stays off, the reason (early_issue.OFF_LINE)
  grep -H -o 'XKV: XKV_EARLY_ISSUE has no effect here ([^)]*)' "$d"/*.log 2>/dev/null \
    | sed "s#^$d/##" >> "$OUT/summary.txt"
  grep -H -c 'XKV_TIMING gc' "$d"/*.log 2>/dev/null | grep -v ':0$' | sed "s#^$d/#gc lines >= 2 ms: #" >> "$OUT/summary.txt"
  profile_lines "$d"  # with XKV_PROFILE_ISSUE in the environment
  rm -f "$d"/*.png
}
# GiB of this GPU; fit G: how many engines of G GiB each start together on it (at least 1)
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
GPU_GIB=$(( ${GPU_MIB:-0} / 1024 ))
fit() { local n=$(( GPU_GIB * 9 / 10 / $1 )); [ "$n" -lt 1 ] && n=1; echo "$n"; }
allmodel() {  # step seconds base-GiB kv-GiB model-args...: issue 24's table for one model (all_llama)
  # base: an engine's GPU memory at its start-up peak without its KV cache (H100 of stop 39:
  # Llama-3-8B shape ~18 GiB, the MLA model 24-38 with its KV: 37.7 GiB at kv 4 on stop 40's H100);
  # engines start in waves that fit
  local step=$1 secs=$2 base=$3 kv=${KV_GIB:-$4}; shift 4
  local T=(--start-together --gpu-util 0.1 --reps 3 --cold-reps 3 --after-kill 1 --child-timeout "$secs")
  local L=(--lens 2048,4096,8192,16384,32768 --multi 0 --kinds none,xkv,offload)
  local W=(--kv-gib "$kv" --card-gib 16 --together-max "$(fit $((base + kv + 2)))")
  e2e "$step/graphs" "$secs" "$@" --mode graphs "${T[@]}" "${W[@]}" "${L[@]}"
  e2e "$step/eager" "$secs" "$@" --mode eager "${T[@]}" "${W[@]}" "${L[@]}"
  e2e "$step/multi" "$secs" "$@" --mode graphs "${T[@]}" --kv-gib 24 --card-gib 24 --lens 2048 \
    --together-max "$(fit $((base + 26)))" --multi 8 --kinds none,xkv,offload
}
for spec in "$@"; do
  step=${spec%%:*}; secs=${spec#*:}; [ "$secs" = "$spec" ] && secs=280
  case $step in
    profile_llama) prof "$step" "$secs" "${LL[@]}" --kinds none,xkv,offload ;;
    profile_mla) prof "$step" "$secs" "${MLA[@]}" --kinds none,xkv,offload ;;
    profile_qwen_2k) prof "$step" "$secs" "${QW[@]}" --kinds none,xkv,offload --lens 2048 --reps 5 ;;
    profile_mla_xkv) prof "$step" "$secs" "${MLA[@]}" --kinds xkv ;;
    profile_mla_ab) prof "$step" "$secs" "${MLA[@]}" --kinds xkv,xkv@verify_checksums=off \
      --lens "${LENS:-32768}" --reps 5 ;;
    profile_llama_2k) prof "$step" "$secs" "${LL[@]}" --kinds none,xkv@verify_checksums=off,xkv --lens 2048 --reps 5 ;;
    profile_multi) prof "$step" "$secs" "${LL[@]}" --kinds "${MULTI_KINDS:-xkv,offload}" --lens 16384 \
      --reps 1 --multi 8 --multi-len 16384 ;;
    stores_llama) prof "$step" "$secs" "${LL[@]}" --kinds none,xkv@layer,xkv@step --lens "${LENS:-4096,16384}" --child-timeout 185 ;;
    stores_mla) prof "$step" "$secs" "${MLA[@]}" --kinds none,xkv@layer,xkv@step --lens "${LENS:-4096,16384}" --child-timeout 185 ;;
    gputests) mkdir -p "$OUT/$step"
      timeout "$secs" python3 -m pytest -q -m gpu -p no:cacheprovider tests/connector/test_tail_fence.py \
        tests/connector/test_transfer.py tests/kernels/test_prepared.py tests/kernels/test_warmup.py \
        tests/kernels/test_hashed_restore.py tests/connector/test_card_pin.py tests/kernels/test_pinned.py \
        tests/kernels/test_hash_pages.py tests/kernels/test_verify.py tests/kernels/test_page_copy.py \
        tests/kernels/test_staged.py tests/kernels/test_staged_restore.py tests/kernels/test_fault_injection.py \
        tests/kernels/test_ring_choice.py tests/connector/test_async_worker.py tests/connector/test_graph_waits.py \
        tests/kernels/test_stream_reserve.py \
        > "$OUT/$step/pytest.txt" 2>&1
      echo "=== $step: rc $? $(tail -1 "$OUT/$step/pytest.txt")" | tee -a "$OUT/summary.txt"
      # unmarked tests whose `device` fixture is the GPU here: a full hit's tail under the forced ring
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/connector/test_group_copies.py \
        > "$OUT/$step/pytest_cuda_device.txt" 2>&1
      echo "=== $step (device=cuda): rc $? $(tail -1 "$OUT/$step/pytest_cuda_device.txt")" | tee -a "$OUT/summary.txt" ;;
    checksums) mkdir -p "$OUT/$step"
      timeout "$secs" python3 bench/page_mover.py --checksums --connector-budget 4 \
        --check-budgets "${CHECK_BUDGETS:-8,16,32}" --out "$OUT/$step" \
        > "$OUT/$step/run.txt" 2>&1
      echo "=== $step: rc $?" | tee -a "$OUT/summary.txt"; grep -v '^{' "$OUT/$step/run.txt" >> "$OUT/summary.txt" ;;
    kernel_ab) mkdir -p "$OUT/$step"  # stop 39's two kernel switches, each against its default
      for ab in "XKV_CHECK_SPLIT=1" "XKV_CHECK_SPLIT=8" "XKV_MIN_EVEN_ROW_BYTES=65536"; do
        env "$ab" timeout $((secs / 3)) python3 bench/page_mover.py --checksums --connector-budget 4 \
          --check-budgets "${CHECK_BUDGETS:-16,64}" --check-sizes "${AB_SIZES:-4,8,18,32}" --out "$OUT/$step/$ab" \
          > "$OUT/$step/$ab.txt" 2>&1
        echo "=== $step $ab: rc $?" | tee -a "$OUT/summary.txt"; grep -v '^{' "$OUT/$step/$ab.txt" >> "$OUT/summary.txt"
      done ;;
    e2e_llama_graphs) e2e "$step" "$secs" "${LL[@]}" --mode graphs ${E2E_ARGS:-} ;;
    e2e_llama_eager) e2e "$step" "$secs" "${LL[@]}" --mode eager ${E2E_ARGS:-} ;;
    e2e_mla_graphs) e2e "$step" "$secs" "${MLA[@]}" --vocab 100000 --mode graphs ${E2E_ARGS:-} ;;
    e2e_qwen_graphs) e2e "$step" "$secs" "${QW[@]}" --mode graphs ${E2E_ARGS:-} ;;
    e2e_hybrid_graphs) e2e "$step" "$secs" "${HYB[@]}" --mode graphs ${E2E_ARGS:-} ;;
    graph_waits_llama|graph_waits_qwen)  # full against piecewise graphs (stop 53's decision)
      if [ "$step" = graph_waits_llama ]; then M=("${LL[@]}"); else M=("${QW[@]}"); fi
      e2e "$step" "$secs" "${M[@]}" --mode graphs --start-together --together-max "$(fit 22)" \
        --kv-gib 4 --gpu-util 0.1 --card-gib 12 --lens 2048,8192 --reps 5 --cold-reps 1 --multi 0 \
        --after-kill 0 --decode-tokens 32 --child-timeout $((secs - 20)) \
        --kinds "${GW_KINDS:-none,xkv,xkv@full_cuda_graphs=false,offload}" ;;
    shared_prefix) d="$OUT/$step"; mkdir -p "$d"
      timeout "$secs" python3 bench/shared_prefix.py --model bench/models/llama8b --out "$d" \
        --kinds none,xkv,offload --gpu-util 0.55 ${SP_ARGS:-} > "$d/run.txt" 2>&1
      echo "=== $step: rc $?" | tee -a "$OUT/summary.txt"; tail -8 "$d/run.txt" >> "$OUT/summary.txt" ;;
    host_issue_cuda) d="$OUT/$step"; mkdir -p "$d"
      # no start-up probe runs here, so `auto` would take the ring: each engine named
      # (HOST_ENGINES, default "staged triton": the ring, and the Triton kernel a probe keeps
      # where SMs read host memory near the copy engine's rate)
      engines=(${HOST_ENGINES:-staged triton})
      for eng in "${engines[@]}"; do
        for shape in "128 32 64" "2048 32 64" "2048 16 18"; do
          read -r nb nl kib <<< "$shape"  # blocks, layers, page KiB (the last: MLA's 32k restore)
          f="$d/${eng}_blocks_${nb}_${nl}x${kib}k.txt"
          XKV_LOAD_ENGINE=$eng timeout $((secs / 3 / ${#engines[@]})) python3 bench/host_issue.py \
            --cuda --blocks "$nb" --layers "$nl" --page-kib "$kib" --reps 20 --profile > "$f" 2>&1
          echo "=== $step $eng $nb x $nl x $kib KiB: rc $?" | tee -a "$OUT/summary.txt"
          grep -A2 ' blocks x ' "$f" >> "$OUT/summary.txt"
        done
      done ;;
    cpu_edges) d="$OUT/$step"; mkdir -p "$d"; nproc > "$d/nproc.txt"; uptime >> "$d/nproc.txt"
      for nb in 1024 128; do timeout 60 python3 bench/host_issue.py --blocks $nb; done > "$d/host_issue.txt" 2>&1
      cat "$d/host_issue.txt" >> "$OUT/summary.txt"
      timeout 30 python3 bench/host_issue.py --blocks 1024 --profile > "$d/host_issue_profile.txt" 2>&1
      timeout $((secs * 3 / 10)) python3 bench/disk_tier.py --dir /var/tmp/xkv26/b --size 512M \
        --threads "${DISK_THREADS:-4}" --read-depths "${DISK_DEPTHS:-auto,4}" \
        --json "$d/disk_tier.json" > "$d/disk_tier.txt" 2>&1
      echo "=== $step disk_tier: rc $?" | tee -a "$OUT/summary.txt"; tail -15 "$d/disk_tier.txt" >> "$OUT/summary.txt"
      timeout 30 python3 bench/disk_reads.py --dir /var/tmp/xkv26/r --json "$d/disk_reads.json" \
        > "$d/disk_reads.txt" 2>&1
      echo "=== $step disk_reads: rc $?" | tee -a "$OUT/summary.txt"; cat "$d/disk_reads.txt" >> "$OUT/summary.txt"
      rm -rf /var/tmp/xkv26
      timeout $((secs * 11 / 20)) python3 bench/gateway_edges.py reserve --cards 1,4 --json "$d/reserve.json" > "$d/reserve.txt" 2>&1
      echo "=== $step reserve: rc $?" | tee -a "$OUT/summary.txt"; tail -12 "$d/reserve.txt" >> "$OUT/summary.txt"
      timeout $((secs * 3 / 20)) python3 bench/gateway_edges.py replay --json "$d/replay.json" > "$d/replay.txt" 2>&1
      echo "=== $step replay: rc $?" | tee -a "$OUT/summary.txt"; tail -8 "$d/replay.txt" >> "$OUT/summary.txt" ;;
    all_llama) allmodel "$step" "$secs" 18 12 "${LL[@]}"; d="$OUT/$step/shared_prefix"; mkdir -p "$d"
      timeout "$secs" python3 bench/shared_prefix.py --model bench/models/llama8b --out "$d" \
        --kinds none,xkv,offload --start-together --kv-gib 5 --gpu-util 0.1 --rounds 6 \
        --together-max "$(fit 25)" \
        > "$d/run.txt" 2>&1
      echo "=== $step/shared_prefix: rc $?" | tee -a "$OUT/summary.txt"; tail -8 "$d/run.txt" >> "$OUT/summary.txt" ;;
    # all_mla: vLLM 0.26's own full-graph capture of this model at 32k context died in the
    # no-connector engine (stops 41, 42, 51); xkv's full-graph engine (its default since stop 53)
    # captured and ran 32k at stop 54. Should it die: --none-graphs piecewise and an
    # xkv@full_cuda_graphs=false kind (E2E_ARGS / the e2e_mla_graphs step)
    all_mla) allmodel "$step" "$secs" 34 4 "${MLA[@]}" --vocab 100000 ;;  # stop 40: two at 26 OOMed (37.7 GiB each)
    all_qwen) allmodel "$step" "$secs" 19 12 "${QW[@]}" ;;
    caches) d="$OUT/$step"; mkdir -p "$d"  # what a carried compile cache would weigh (run last)
      du -sh ~/.cache/vllm/torch_compile_cache ~/.cache/vllm ~/.triton/cache ~/.cache/flashinfer \
        2>&1 | tee "$d/sizes.txt" >> "$OUT/summary.txt" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  (cd "$OUT" && tar cJf "$step.tar.xz" "$step" && rm -rf "$step")
done
