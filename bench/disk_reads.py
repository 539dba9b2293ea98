"""O_DIRECT read rate of a directory's disk by reads in flight: the measurement the disk tier
makes at start (``--disk-read-depth auto``, xkv/gateway/disk_depth.py), with more rounds.

    python bench/disk_reads.py --dir /var/tmp/xkv-reads --depths 1,2,4,8 --rounds 5 [--json F]

A temporary file of ``--count`` x ``--unit`` random bytes is written and read whole at each
depth, ``--rounds`` times with the depths' order rotated every round; prints the median and
every sample, and the depth the tier would choose (smallest within 5 % of the best median).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xkv.gateway.config import parse_size  # noqa: E402
from xkv.gateway.disk_depth import calibrate, choose_depth  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/xkv-reads")
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--unit", type=parse_size, default="4M")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.dir, 0o700, exist_ok=True)
    depths = [int(x) for x in a.depths.split(",")]
    rates = calibrate(a.dir, depths, unit=a.unit, count=a.count, rounds=a.rounds)
    for d, r in rates.items():
        print(f"{d} in flight: median {statistics.median(r) / 1e6:.0f} MB/s, samples "
              f"{[round(x / 1e6) for x in r]}")
    best = choose_depth(rates)
    print(f"chosen: {best}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "machine": f"{platform.node()} {os.cpu_count()} CPUs",
                       "command": " ".join(sys.argv), "unit": a.unit, "count": a.count,
                       "rates_Bps": {str(d): r for d, r in rates.items()}, "chosen": best},
                      f, indent=1)


if __name__ == "__main__":
    main()
