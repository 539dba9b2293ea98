"""Does the disk tier's file layout cost read speed against ``dd``'s one big file?

    python bench/disk_layout.py --dir /var/tmp/xkv-layout --objects 128 --rounds 5 [--json F]

Writes ``--objects`` files of 4 MiB + 4 KiB (an object and its header) three ways: as the tier's
write-behind does (4 threads at once, O_DIRECT, ``fdatasync``, rename, ``<key[:2]>/``
subdirectories), one thread into one directory in order, and the same bytes as one big file;
then reads each set whole, one O_DIRECT read at a time (as ``dd``), ``--rounds`` interleaved
rounds; prints the median MB/s of each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import secrets
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xkv.gateway.disk_depth import timed_threads  # noqa: E402

SIZE = (4 << 20) + 4096
FLAGS = os.O_WRONLY | os.O_CREAT | os.O_DIRECT


def write_tier_like(d: str, n: int, src) -> list[str]:
    keys, lock, paths = [secrets.token_hex(32) for _ in range(n)], threading.Lock(), []

    def work(_):
        while True:
            with lock:
                if not keys:
                    return
                k = keys.pop()
                p = os.path.join(d, k[:2], k)
                paths.append(p)  # read back in the order written (a lookup's order)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            fd = os.open(p + ".tmp", FLAGS, 0o600)
            os.pwritev(fd, [src], 0)
            os.fdatasync(fd)
            os.close(fd)
            os.rename(p + ".tmp", p)

    timed_threads(work, range(4))
    return paths


def write_in_order(d: str, n: int, src) -> list[str]:
    os.makedirs(d, exist_ok=True)
    paths = [os.path.join(d, f"o{i}") for i in range(n)]
    for p in paths:
        fd = os.open(p, FLAGS, 0o600)
        os.pwritev(fd, [src], 0)
        os.fdatasync(fd)
        os.close(fd)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/xkv-layout")
    ap.add_argument("--objects", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir, 0o700)
    src, dst = mmap.mmap(-1, SIZE), mmap.mmap(-1, SIZE)
    src.write(os.urandom(SIZE))
    try:
        tier = write_tier_like(os.path.join(a.dir, "tier"), a.objects, src)
        flat = write_in_order(os.path.join(a.dir, "flat"), a.objects, src)
        big = os.path.join(a.dir, "big")
        fd = os.open(big, FLAGS, 0o600)
        for i in range(a.objects):
            os.pwritev(fd, [src], i * SIZE)
        os.fdatasync(fd)
        os.close(fd)

        def files(paths):
            t0 = time.perf_counter()
            for p in paths:
                f = os.open(p, os.O_RDONLY | os.O_DIRECT)
                os.preadv(f, [dst], 0)
                os.close(f)
            return a.objects * SIZE / (time.perf_counter() - t0)

        def one_file():
            f = os.open(big, os.O_RDONLY | os.O_DIRECT)
            t0 = time.perf_counter()
            for i in range(a.objects):
                os.preadv(f, [dst], i * SIZE)
            os.close(f)
            return a.objects * SIZE / (time.perf_counter() - t0)

        rates: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            rates.setdefault("tier layout (4 writers, key subdirectories)", []).append(files(tier))
            rates.setdefault("one directory, written in order", []).append(files(flat))
            rates.setdefault("one big file", []).append(one_file())
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    for k, v in rates.items():
        print(f"{k}: median {statistics.median(v) / 1e6:.0f} MB/s, samples "
              f"{[round(x / 1e6) for x in v]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "command": " ".join(sys.argv), "objects": a.objects,
                       "rates_Bps": rates}, f, indent=1)


if __name__ == "__main__":
    main()
