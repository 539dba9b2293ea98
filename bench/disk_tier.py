"""Disk tier benchmark: write-behind and restores of a real xkv-gateway against the disk's own
bandwidth, measured in the same run on the same directory.

    python bench/disk_tier.py --dir /var/tmp/xkv-bench --size 512M --json bench/results/disk.json

1. The disk: ``dd`` with O_DIRECT (oflag=direct conv=fdatasync / iflag=direct, 4 MiB blocks)
   writes and reads a file of ``--size`` bytes of random data (copied from /dev/shm) in ``--dir``,
   ``--dd-reps`` times (median) before the gateway's turn and again right after it; the tier is
   compared with the mean of the two medians (this virtual disk's speed drifts by tens of
   percent from one minute to the next), and
   /proc/loadavg is recorded at both ends (other users of the machine's CPUs and disk).
2. Per ``--threads`` value and ``--read-depths`` value (``--disk-read-depth``: ``auto``, the
   default, measures at start; the bench waits for that before timing anything), a gateway
   with ``--disk DIR`` and a card that holds every object:
   * write-behind: ``--size`` bytes of objects (``--shards`` x ``--shard-size``, random bytes)
     are reserved and filled, then committed in one burst; time from the first COMMIT until the
     disk tier reports every object written (fdatasync'd, renamed, directory synced);
   * restore: the gateway is stopped and started again on the same directory (an empty card),
     and ``--size`` bytes of objects are looked up, ``--batch`` chunks per LOOKUP, one LOOKUP at a time; time
     of all lookups (each answered after its read and checksum); plus the latency of single
     LOOKUPs of 1, 4 and 16 chunks from disk (what a vLLM lookup waits for);
   * paired (``--restore-reps`` N, default 3): the bulk restore N times in all, the later ones
     each after a gateway restart (an empty card) and between two ``dd`` reads of a file of
     ``--size`` in the same directory (the first: after the before-run ``dd`` samples);
     ``restore_vs_dd_paired`` = median tier / median dd of those reads (the tier and the disk
     sampled in the same minutes);
   * meanwhile another client (its own process and connection) sends LOOKUPs that hit the
     card, back to back: their latency p50 / p99 / max with the gateway idle, while ``dd``
     (not the gateway) writes and reads the disk (the machine's own share), while the tier
     writes and while it restores.
Numbers from a shared 2-core VM are lower bounds; the disk is whatever backs ``--dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xkv.gateway.client import GatewayClient  # noqa: E402
from xkv.gateway.config import parse_size  # noqa: E402
from xkv.gateway.disk_format import file_bytes  # noqa: E402
from xkv.gateway.testing import spawn_gateway, stop_gateway  # noqa: E402

GATEWAY_ARGS: list[str] = []  # --gateway-args


def loadavg() -> list[float]:
    """The machine's 1/5/15-minute load averages (/proc/loadavg): other users' work that shares
    the CPUs and the disk with the run (2 cores here: a load above 2 means waiting for a core)."""
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def dd(args: list[str]) -> float:
    """Seconds dd reports for one run."""
    p = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([\d.]+) s", p.stderr)
    return float(m.group(1))


def random_source(size: int) -> str:
    """A file of ``size`` random bytes (whole 4 MiB blocks) in /dev/shm for dd to copy from."""
    src = f"/dev/shm/xkv-bench-src-{os.getpid()}"
    with open(src, "wb") as f:
        for _ in range(size // (4 << 20)):
            f.write(os.urandom(4 << 20))
    return src


def bulk_restore(c, lid: int, keys: list, batch: int) -> float:
    """Seconds to look ``keys`` up (each restored from disk), ``batch`` per LOOKUP, one at a
    time, every chunk a hit."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        r = c.lookup([(lid, keys[i:i + batch])])
        assert r.num_chunks == len(keys[i:i + batch]), r.num_chunks
        c.release(r.lease_id)
    return time.perf_counter() - t0


def disk_bandwidth(d: str, size: int, reps: int = 1) -> dict:
    """dd's O_DIRECT write and read of ``size`` bytes in ``d``, ``reps`` times (a write, then
    a read of what it wrote): the medians, and every sample (this disk's speed swings by tens of
    percent from one run to the next)."""
    src, dst = random_source(size), os.path.join(d, "dd-test")
    count = size // (4 << 20)
    ws, rs = [], []
    try:
        for _ in range(max(1, reps)):
            ws.append(dd([f"if={src}", f"of={dst}", "bs=4M", f"count={count}", "oflag=direct",
                          "conv=fdatasync"]))
            rs.append(dd([f"if={dst}", "of=/dev/null", "bs=4M", "iflag=direct"]))
    finally:
        for p in (src, dst):
            if os.path.exists(p):
                os.unlink(p)
    n = count * (4 << 20)
    return {"bytes": n, "write_Bps": n / statistics.median(ws),
            "read_Bps": n / statistics.median(rs), "reps": len(rs),
            "write_samples_Bps": [n / w for w in ws], "read_samples_Bps": [n / r for r in rs],
            "tool": "dd bs=4M O_DIRECT"}


class Prober:
    """Another client, in its own process (``--probe``): LOOKUPs of card-resident chunks, back
    to back, each recorded as (monotonic end time, latency); :meth:`window` picks a span."""

    def __init__(self, port: int, out: str):
        self.out = out
        self.proc = subprocess.Popen([sys.executable, __file__, "--probe", str(port), out])
        while not os.path.exists(out + ".ready"):
            assert self.proc.poll() is None, "prober died"
            time.sleep(0.01)
        self.samples: list = []

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        with open(self.out) as f:
            self.samples = json.load(f)
        for p in (self.out, self.out + ".ready"):
            os.unlink(p)

    def window(self, t0: float, t1: float) -> dict:
        lat = sorted(dt for t, dt in self.samples if t0 <= t <= t1)
        if not lat:
            return {}
        return {"n": len(lat), "p50_ms": 1e3 * lat[len(lat) // 2],
                "p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
                "max_ms": 1e3 * lat[-1]}


def probe_main(port: int, out: str) -> None:
    import signal

    c = GatewayClient("127.0.0.1", port, timeout_s=5)
    lid = c.register_layout("probe", "fp", 1, 4096).layout_id
    keys = [b"probe-%d" % i for i in range(4)]
    samples, stop = [], []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    open(out + ".ready", "w").close()
    while not stop:
        t0 = time.perf_counter()
        r = c.lookup([(lid, keys)], lease=False)
        dt = time.perf_counter() - t0
        assert r.num_chunks == len(keys), "probe chunks left the card"
        samples.append((time.monotonic(), dt))
        time.sleep(0.0005)
    with open(out, "w") as f:
        json.dump(samples, f)
    c.close()


def wait_stats(c, pred, timeout_s=600.0, poll_s=0.005) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = c.stats()
        if pred(s):
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {s}")
        time.sleep(poll_s)


def gateway(card: int, d: str, threads: int, depth: str, log, cold: bool = False) -> tuple:
    """A gateway on ``d``; its card pre-faulted unless ``cold`` (a card whose pages were never
    touched makes every restore pay the page allocation: measured apart)."""
    prefault = [] if cold else ["--prefault"]
    return spawn_gateway(card, extra_args=["--disk", d, "--disk-threads", str(threads),
                                           "--disk-read-depth", depth,
                                           "--disk-wait-ms", "60000", "--disk-backlog",
                                           str(2 * card), "--disk-capacity", str(4 * card),
                                           "--log-level", "INFO", *prefault,
                                           *GATEWAY_ARGS], stderr=log)


def one(args, threads: int, depth: str, d: str, log) -> dict:
    shards, sb = args.shards, args.shard_size
    obj = shards * sb
    n = args.size // obj + 2 * (1 + 4 + 16)  # --size for the bulk restore, + the single ones
    card = (n + 16) * obj + (64 << 20)
    keys = [os.urandom(32) for _ in range(n)]
    probe_keys = [b"probe-%d" % i for i in range(4)]
    out = {"threads": threads, "read_depth_flag": depth, "gateway_args": GATEWAY_ARGS,
           "objects": n, "cold_card": args.cold_card, "object_bytes": obj,
           "file_bytes": file_bytes(shards, sb)}
    parent = os.path.dirname(os.path.abspath(d))
    samples = os.path.join(parent, f"xkv-probe-{os.getpid()}.json")

    def probe_keys_stored(c):
        plid = c.register_layout("probe", "fp", 1, 4096).layout_id
        c.commit(plid, 0, c.reserve(plid, probe_keys))
        wait_stats(c, lambda s: s["disk_write_backlog_bytes"] == 0)

    proc, port = gateway(card, d, threads, depth, log)
    c = GatewayClient("127.0.0.1", port, timeout_s=60)
    probe = None
    try:
        lid = c.register_layout("bench", "fp", shards, sb).layout_id
        view = c.map_card()
        wait_stats(c, lambda s: not s["disk_depth_measuring"])  # its disk work is not timed
        probe_keys_stored(c)
        res = []
        for i in range(0, n, 256):
            res += c.reserve(lid, keys[i:i + 256])
        for r in res:
            for off in r.offsets:
                view[off:off + sb] = os.urandom(sb)
        probe = Prober(port, samples)
        i0 = time.monotonic()
        time.sleep(1.0)  # the probe alone: the loop's baseline
        i1 = time.monotonic()
        # control: the same disk work by dd, not by the gateway (what the machine alone costs)
        out["disk_during_probe"] = disk_bandwidth(d, min(args.size, 256 << 20))
        d1 = t0m = time.monotonic()
        base = c.stats()["disk_written"]
        t0 = time.perf_counter()
        for i in range(0, n, 256):
            for s in range(shards):
                c.commit(lid, s, res[i:i + 256])
        s = wait_stats(c, lambda s: s["disk_written"] - base == n and
                       s["disk_write_backlog_bytes"] == 0)
        dt = time.perf_counter() - t0
        t1m = time.monotonic()
        probe.stop()
        out["probe_idle"] = probe.window(i0, i1)
        out["probe_dd"] = probe.window(i1, d1)
        out["write"] = {"seconds": dt, "Bps": n * out["file_bytes"] / dt,
                        "dropped": s["disk_write_dropped"], "errors": s["disk_write_errors"],
                        "probe": probe.window(t0m, t1m)}
    finally:
        if probe is not None and probe.proc.poll() is None:
            probe.proc.kill()
        c.close()
        stop_gateway(proc)
    proc, port = gateway(card, d, threads, depth, log, cold=args.cold_card)
    c = GatewayClient("127.0.0.1", port, timeout_s=120)
    probe = None
    try:
        lid = c.register_layout("bench", "fp", shards, sb).layout_id
        # the start-up measurement of reads in flight (auto) done before anything is timed
        st0 = wait_stats(c, lambda s: s["disk_scanned"] == 1 and not s["disk_depth_measuring"])
        out["read_depth"] = st0["disk_read_depth"]
        probe_keys_stored(c)  # card-resident chunks for the prober (stored anew)
        single = {}
        pos = args.size // obj  # keys[:pos]: the bulk restore; the rest: single lookups
        for k in (1, 4, 16):  # latency of one lookup restoring k chunks, twice each
            lat = []
            for _ in range(2):
                t0 = time.perf_counter()
                r = c.lookup([(lid, keys[pos:pos + k])])
                lat.append(time.perf_counter() - t0)
                assert r.num_chunks == k, (r.num_chunks, k)
                c.release(r.lease_id)
                pos += k
            single[k] = {"median_ms": 1e3 * statistics.median(lat), "mib": k * obj / 2**20}
        out["restore_latency"] = single
        rest = keys[:args.size // obj]
        probe = Prober(port, samples)
        s0 = c.stats()
        t0m = time.monotonic()
        dt = bulk_restore(c, lid, rest, args.batch)
        t1m = time.monotonic()
        probe.stop()
        s = c.stats()
        nb = len(rest) * out["file_bytes"]
        out["restore"] = {"seconds": dt, "objects": len(rest), "Bps": nb / dt,
                          "read_seconds": s["disk_read_seconds"] - s0["disk_read_seconds"],
                          "corrupt": s["disk_corrupt"], "direct": s["disk_direct"],
                          "probe": probe.window(t0m, t1m)}
    finally:
        if probe is not None and probe.proc.poll() is None:
            probe.proc.kill()
        c.close()
        stop_gateway(proc)
    if args.restore_reps > 1:
        out["paired"] = paired(args, card, d, threads, depth, log, keys[:args.size // obj],
                               out["file_bytes"], out["restore"]["Bps"])
    return out


def paired(args, card: int, d: str, threads: int, depth: str, log, rest: list, fb: int,
           first_Bps: float) -> dict:
    """The bulk restore ``--restore-reps`` times in all (a gateway restarted on the same
    directory before each: an empty card), each between two ``dd`` reads of a file of the same
    size in the same directory: tier and disk sampled in the same minutes, so the ratio of
    their medians does not depend on which minute the disk was fast in."""
    size = args.size // (4 << 20) * (4 << 20)
    ddf = os.path.join(d, "dd-paired")
    src = random_source(size)
    tier, ddr = [first_Bps], []
    try:
        dd([f"if={src}", f"of={ddf}", "bs=4M", "oflag=direct", "conv=fdatasync"])
        os.unlink(src)
        read = ["if=" + ddf, "of=/dev/null", "bs=4M", "iflag=direct"]
        for _ in range(args.restore_reps - 1):
            ddr.append(size / dd(read))
            proc, port = gateway(card, d, threads, depth, log)
            try:
                with GatewayClient("127.0.0.1", port, timeout_s=120) as c:
                    lid = c.register_layout("bench", "fp", args.shards, args.shard_size).layout_id
                    wait_stats(c, lambda s: s["disk_scanned"] == 1
                               and not s["disk_depth_measuring"])
                    tier.append(len(rest) * fb / bulk_restore(c, lid, rest, args.batch))
            finally:
                stop_gateway(proc)
        ddr.append(size / dd(read))
    finally:
        for p in (src, ddf):
            if os.path.exists(p):
                os.unlink(p)
    return {"tier_Bps": tier, "dd_read_Bps": ddr,
            "ratio": statistics.median(tier) / statistics.median(ddr)}


def main():
    if sys.argv[1:2] == ["--probe"]:
        return probe_main(int(sys.argv[2]), sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp/xkv-disk-bench")
    ap.add_argument("--size", type=parse_size, default="512M")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--shard-size", type=parse_size, default="2M")
    ap.add_argument("--batch", type=int, default=16, help="chunks per restore LOOKUP")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--read-depths", default="auto",
                    help="--disk-read-depth values run per thread count (e.g. 'auto,4'; a "
                         "number above the thread count is skipped)")
    ap.add_argument("--cold-card", action="store_true",
                    help="restore into a card that was not pre-faulted (no --prefault)")
    ap.add_argument("--gateway-args", default="", help="more xkv-gateway flags, e.g. "
                    "'--disk-io-nice 0'")
    ap.add_argument("--crc", choices=["auto", "zlib"], default="auto",
                    help="the tier's CRC-32 code: libdeflate where present (auto) or zlib "
                         "(XKV_DISK_CRC=zlib), for an A/B")
    ap.add_argument("--restore-reps", type=int, default=3,
                    help="bulk restores per run (the first after the single lookups, each "
                         "later one after a gateway restart), each between two dd reads: "
                         "restore_vs_dd_paired is the ratio of their medians")
    ap.add_argument("--dd-reps", type=int, default=3,
                    help="dd runs before and after each tier run (their median is the baseline)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.crc == "zlib":
        os.environ["XKV_DISK_CRC"] = "zlib"  # inherited by the gateways this run spawns
    from xkv.gateway.disk_crc import libdeflate_crc32
    GATEWAY_ARGS.extend(args.gateway_args.split())
    d = args.dir
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d, mode=0o700)
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip(),
              "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
              "command": " ".join(sys.argv), "runs": [],
              "crc": "libdeflate" if libdeflate_crc32 is not None else "zlib"}
    parent = os.path.dirname(os.path.abspath(d))
    log_path = os.path.join(parent, f"xkv-disk-bench-{os.getpid()}.log")  # kept on failure
    log = open(log_path, "wb")  # noqa: SIM115
    ok = False
    try:
        runs = [(int(t), dp) for t in args.threads.split(",") for dp in
                args.read_depths.split(",") if dp == "auto" or int(dp) <= int(t)]
        for t, dp in runs:
            load0 = loadavg()
            disk = disk_bandwidth(d, args.size, args.dd_reps)
            shutil.rmtree(os.path.join(d, "xkv-disk-1"), ignore_errors=True)
            run = one(args, t, dp, d, log)
            after = disk_bandwidth(d, args.size, args.dd_reps)  # again, right after the tier
            run["disk"], run["disk_after"] = disk, after
            run["loadavg_start"], run["loadavg_end"] = load0, loadavg()
            # against the mean of dd before and after: the disk's speed drifts minute to minute
            dd_w = (disk["write_Bps"] + after["write_Bps"]) / 2
            dd_r = (disk["read_Bps"] + after["read_Bps"]) / 2
            run["write_vs_dd"] = run["write"]["Bps"] / dd_w
            run["restore_vs_dd"] = run["restore"]["Bps"] / dd_r
            if "paired" in run:
                run["restore_vs_dd_paired"] = run["paired"]["ratio"]
            result["runs"].append(run)
            print(json.dumps({k: run.get(k) for k in (
                      "threads", "read_depth_flag", "read_depth", "write_vs_dd", "restore_vs_dd",
                      "restore_vs_dd_paired")}),
                  f"dd w {disk['write_Bps'] / 1e6:.0f}/{after['write_Bps'] / 1e6:.0f} MB/s r "
                  f"{disk['read_Bps'] / 1e6:.0f}/{after['read_Bps'] / 1e6:.0f} MB/s (before/after);"
                  f" tier w {run['write']['Bps'] / 1e6:.0f} MB/s r "
                  f"{run['restore']['Bps'] / 1e6:.0f} MB/s; probe p99 w "
                  f"{run['write']['probe'].get('p99_ms', 0):.2f} ms r "
                  f"{run['restore']['probe'].get('p99_ms', 0):.2f} ms (idle "
                  f"{run['probe_idle'].get('p99_ms', 0):.2f} ms, while dd runs "
                  f"{run['probe_dd'].get('p99_ms', 0):.2f} ms); single "
                  f"{ {k: round(v['median_ms'], 1) for k, v in run['restore_latency'].items()} }"
                  f"; load {run['loadavg_start'][0]:.2f} -> {run['loadavg_end'][0]:.2f}",
                  flush=True)
        ok = True
    finally:
        log.close()
        shutil.rmtree(d, ignore_errors=True)
        if ok:
            os.unlink(log_path)
        else:
            print(f"gateway logs: {log_path}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
