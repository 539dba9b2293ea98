#!/usr/bin/env bash
# Mooncake Store for the optional scale-out tier (xkv/gateway/tier.py, tests/tier):
#   1. the system libraries its binaries link even for TCP: libibverbs.so.1 and librdmacm.so.1
#      (Debian/Ubuntu packages libibverbs1 librdmacm1 ibverbs-providers; apt-get as root, or
#      through `sudo -n`; elsewhere install rdma-core yourself);
#   2. the wheel that matches the venv's torch build, as listed in xkv's extras (pyproject.toml):
#      a CUDA torch gets `.[mooncake]` (mooncake-transfer-engine, CUDA 12), a CPU torch or none
#      gets `.[mooncake-cpu]` (mooncake-transfer-engine-non-cuda). XKV_MOONCAKE_EXTRA overrides.
#
#   bash scripts/install_mooncake.sh [VENV]       # run from the clone; scripts/install.sh calls it
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-$HOME/.cache/xkv/venv-vllm-0.29.0}

if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' \
   || ! /sbin/ldconfig -p 2>/dev/null | grep -q 'librdmacm\.so\.1 '; then
  if ! command -v apt-get >/dev/null; then
    echo "install_mooncake: libibverbs.so.1/librdmacm.so.1 are missing and there is no apt-get;" \
         "install your distribution's rdma-core (libibverbs, librdmacm) package" >&2
    exit 1
  fi
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then SUDO=(sudo -n); fi
  "${SUDO[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
    libibverbs1 librdmacm1 ibverbs-providers >/dev/null
fi

extra=${XKV_MOONCAKE_EXTRA:-}
if [ -z "$extra" ]; then
  cuda=$("$VENV/bin/python" -c "import torch; print(torch.version.cuda or '')" 2>/dev/null || true)
  if [ -n "$cuda" ]; then extra=mooncake; else extra=mooncake-cpu; fi
fi
# The extra's requirements, read from pyproject.toml (the one place for deps), without
# reinstalling xkv itself; Python < 3.11 has no tomllib: install through the extra instead.
if reqs=$("$VENV/bin/python" - "$extra" <<'PY'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"][sys.argv[1]]))
PY
); then
  mapfile -t reqs <<< "$reqs"
  "$VENV/bin/pip" install -q "${reqs[@]}"
else
  "$VENV/bin/pip" install -q -e ".[$extra]"
fi
"$VENV/bin/python" -c "import mooncake.store; print('mooncake store ready: extra $extra')"
