#!/usr/bin/env bash
# Runs the whole test suite; pytest's "no tests collected" (exit 5) is a failure too.
set -uo pipefail
PY=${1:-python}
export PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
# the scale-out tier is installed by scripts/install.sh: its tests must run, not skip
export XKV_REQUIRE_MOONCAKE=${XKV_REQUIRE_MOONCAKE:-1}
"$PY" -m pytest -q "${@:2}"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
