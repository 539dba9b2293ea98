"""``make demo`` (examples/store_and_restore.py): progress while engines start, then the table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_demo_prints_progress_and_the_table():
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "store_and_restore.py"),
                        "--tokens", "600"], env=env, capture_output=True, text=True,
                       timeout=600)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    for step in ("starting xkv-gateway", "engine 1: starting", "engine 2 (a fresh process)",
                 "initializing vLLM", "engine ready", "prefill with the restore from the card"):
        assert step in out, step
    assert len(re.findall(r"\[\s*\d+\.\d s\]", out)) >= 6  # time-stamped milestones
    rows = {ln.split("  ")[0]: ln.split() for ln in out.splitlines()
            if ln.startswith(("without the restore", "with the restore", "saved"))}
    recompute, restore = rows["without the restore (recompute)"], rows["with the restore from the card"]
    assert recompute[-3:-2] == ["0"] and recompute[-1] == "ms"
    assert int(restore[-3]) == 512  # 4 full chunks of 128 tokens of the 600-token prompt
    assert "same first token: True" in out
