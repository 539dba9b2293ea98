"""bench/fanout.py runs end to end (CPU dry run over gloo, 2 ranks) and writes its JSON/CSV."""

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dry_run(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "fanout.py"), "--out", str(tmp_path), "--dry-run-cpu",
           "--tp", "2", "--tokens", "256", "--sweep-tokens", "128", "--layers", "2", "--iters", "1",
           "--warmup", "0", "--staging-mib", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 2 | 256 | 294912 |" in done.stdout
    doc = json.loads((tmp_path / "fanout.json").read_text())
    (row,) = doc["rows"]
    assert row["tp"] == 2 and row["layer_bytes"] == 256 * 1152 and row["bit_exact"] is True
    assert row["fan_layer_us"] > 0 and row["base_pipe_us"] > 0 and "ag_busbw_GBs" in row
    assert len(doc["sweep"]) == 1 and set(doc["break_even_bytes"]) == {"2"}
    with open(tmp_path / "fanout.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and rows[1]["sweep"] == "True"
