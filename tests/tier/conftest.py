"""Scale-out tier tests: a real mooncake_master on loopback, started and stopped by the tests.

They skip only when Mooncake Store cannot be imported, and never under `make test`
(scripts/test.sh sets XKV_REQUIRE_MOONCAKE=1; scripts/install.sh installs it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

if os.environ.get("XKV_REQUIRE_MOONCAKE") == "1":  # make test / CI: installed, so never skipped
    import mooncake.store  # noqa: F401
else:
    pytest.importorskip("mooncake.store",
                        reason="Mooncake Store not installed (pip install 'xkv[mooncake]')")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "models"))
sys.path.insert(0, str(HERE.parent / "e2e"))  # e2e_harness + engine_driver: reused, not copied

from mooncake_master import Master  # noqa: E402


@pytest.fixture
def master(tmp_path):
    m = Master(str(tmp_path / "mooncake_master.log")).start()
    yield m
    m.stop()


@pytest.fixture(scope="session")
def models():
    from tiny_models import ensure_model

    return {"llama": str(ensure_model("llama"))}
