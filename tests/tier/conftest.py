"""Scale-out tier tests: a real mooncake_master on loopback, started and stopped by the tests.

They skip only when Mooncake Store cannot be imported (CI installs it: scripts/install.sh)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mooncake.store", reason="Mooncake Store not installed (pip install 'xkv[mooncake]')")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake_master import Master  # noqa: E402


@pytest.fixture
def master(tmp_path):
    m = Master(str(tmp_path / "mooncake_master.log")).start()
    yield m
    m.stop()
