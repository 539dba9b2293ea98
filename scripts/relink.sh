#!/usr/bin/env bash
# Points the environment's editable xkv install at THIS checkout when it points elsewhere.
# The shared venv under ~/.cache/xkv is built once (its stamp hashes only the recipe) by whichever
# clone ran `make` first; another clone, or the same one moved, would import that first clone's
# code, or nothing once it is deleted. Checking costs one interpreter start; re-pointing is
# `pip install --no-deps --no-build-isolation -e .` (setuptools of the venv, no download) when the
# venv's setuptools is one pyproject.toml's build-system accepts (>= 77: bdist_wheel built in, SPDX
# license string; the venv python3.11 creates holds 65.5, which cannot even build a wheel), else an
# isolated build (pip fetches setuptools).
set -euo pipefail
VENV=${1:?usage: relink.sh VENV [CHECKOUT]}
ROOT=$(cd "${2:-$(dirname "$0")/..}" && pwd -P)
PY="$VENV/bin/python"
# -I: ignore PYTHONPATH and the current directory, so this sees what the venv itself imports
where() {
  "$PY" -I -c '
import importlib.util, os, sys
for name in ("xkv", "xkv_vllm_connector"):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        print("none"); sys.exit()
    print(os.path.realpath(os.path.dirname(os.path.dirname(spec.origin))))'
}
have=$(where | sort -u)
if [ "$have" = "$ROOT" ]; then
  exit 0
fi
echo "xkv: pointing $VENV at $ROOT (it imported xkv from: ${have//$'\n'/, })"
if "$PY" -I -c 'import sys, setuptools; v = tuple(int(x) for x in setuptools.__version__.split(".")[:2]); sys.exit(v < (77, 0))' 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
else
  "$PY" -m pip install -q --no-deps -e "$ROOT"
fi
have=$(where | sort -u)
if [ "$have" != "$ROOT" ]; then
  echo "xkv: $VENV still imports xkv from $have, not $ROOT" >&2
  exit 1
fi
