"""Is it the GIL or the CPU? A stand-in for the gateway's loop thread (sleep 1 ms, then ~30 us of
Python) and its wake-up latency while a DiskStore (4 I/O threads) reads 64 objects of 4 MiB in
a loop at full speed: in the same process (the loop competes for the GIL and the CPU), in a
child process (the CPU only), or with no disk work (the machine's own tail).

    python bench/disk_loop_contention.py same|child|none [NICE]

NICE: the I/O threads' --disk-io-nice (default 10). Prints the loop's p50/p99/max in ms, the
read bandwidth and /proc/loadavg. Used for bench/RESULTS.md "Disk tier" (issue 26).
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xkv.gateway.disk_format import file_name  # noqa: E402
from xkv.gateway.disk_store import DiskItem, DiskStore  # noqa: E402

MB, N, SECS = 1 << 20, 64, 6.0


def run_store(d: str, secs: float, nice: int, ready) -> float:
    card = mmap.mmap(-1, N * 4 * MB)
    card.write(os.urandom(N * 4 * MB))
    s = DiskStore(d, card, 4096, threads=4, nice=nice)
    s.start()
    while s.done.get()[0] != "scanned":
        pass
    items = [DiskItem(bytes(16), k, file_name(k), 2, 2 * MB, (i * 4 * MB, i * 4 * MB + 2 * MB))
             for i, k in enumerate(os.urandom(32) for _ in range(N))]
    s.write(items)
    got = 0
    while got < N:
        m = s.done.get()
        if m[0] == "written":
            assert set(m[2]) == {"ok"}, m[2]
            got += len(m[1])
    ready()
    t_end, rounds = time.monotonic() + secs, 0
    while time.monotonic() < t_end:
        s.read(1, items)
        while (m := s.done.get())[0] != "read":
            pass
        assert set(m[2]) == {"ok"}, m[2]
        rounds += 1
    s.close()
    return rounds * N * 4 * MB / secs / 1e6


def loop_latency(secs: float, out: list) -> None:
    lat = []
    t_end = time.monotonic() + secs
    while time.monotonic() < t_end:
        t0 = time.perf_counter()
        time.sleep(0.001)
        x = 0
        for i in range(300):
            x += i
        lat.append(time.perf_counter() - t0 - 0.001)
    lat.sort()
    out.append((lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3, lat[-1] * 1e3))


def main() -> None:
    if sys.argv[1] == "worker":
        bw = run_store(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]),
                       lambda: print("R", flush=True))
        print(bw)
        return
    mode = sys.argv[1]
    nice = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    d = f"/var/tmp/xkv-loop-contention-{os.getpid()}"
    os.makedirs(d)
    out: list = []
    try:
        if mode == "same":
            t = threading.Thread(target=loop_latency, args=(SECS, out))
            bw = run_store(d, SECS + 0.5, nice, t.start)
            t.join()
        elif mode == "child":
            p = subprocess.Popen([sys.executable, __file__, "worker", d, str(SECS + 0.5),
                                  str(nice)], stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "R"
            loop_latency(SECS, out)
            bw = float(p.communicate()[0])
        else:
            loop_latency(SECS, out)
            bw = 0.0
    finally:
        shutil.rmtree(d, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    p50, p99, mx = out[0]
    print(f"{mode} nice {nice}: loop p50 {p50:.3f} p99 {p99:.3f} max {mx:.1f} ms; read "
          f"{bw:.0f} MB/s; load {load}")


if __name__ == "__main__":
    main()
