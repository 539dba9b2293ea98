"""io_uring against the disk tier's thread pool, on the tier's own file shape (issue 26's "io_uring
or a thread pool, whichever measures better here").

    python bench/disk_uring.py --dir /var/tmp/xkv-uring --files 128 --json out.json

No new dependency: io_uring is driven through its three system calls with ctypes (``syscall``
425/426 on x86-64, the rings mmap'ed), because no Python binding installs here (the PyPI
``liburing`` wheel died with SIGILL on this CPU, bench/RESULTS.md "Disk tier"; the distribution's
``liburing2`` C library is not on this machine). Per round, on ``--files`` files of one tier
object each (a 4 KiB header + ``--shards`` x ``--shard-size``, O_DIRECT, page-aligned buffers):

* ``dd``: one sequential stream, ``bs=4M`` O_DIRECT, over a file of the same total size (the
  disk's own figure, as bench/disk_tier.py takes it);
* ``pool``: ``--threads`` threads, each opening a file, one ``preadv`` of the whole file,
  closing it (the disk tier's read, without its crc32); writes: a new file, one ``pwritev``,
  ``fdatasync``, close (the tier's write, without rename and directory sync);
* ``uring``: one thread and one ring, ``--depth`` reads (or write + linked ``fdatasync``) in
  flight, files opened and closed by the thread as their I/O is submitted and completes.

The page cache plays no part (O_DIRECT everywhere). Rounds alternate the methods so the disk's
minute-to-minute swings hit all of them; every round is reported.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xkv.gateway.config import parse_size  # noqa: E402
from xkv.gateway.disk_depth import timed_threads  # noqa: E402
from xkv.gateway.disk_format import file_bytes  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
NR_SETUP, NR_ENTER = 425, 426  # x86-64 (and every arch since 5.1 but alpha)
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
OP_READ, OP_WRITE, OP_FSYNC = 22, 23, 3
ENTER_GETEVENTS, SQE_IO_LINK, FSYNC_DATASYNC = 1, 4, 1


class _SqOff(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries",
                                               "flags", "dropped", "array", "resv1")] + [
        ("user_addr", ctypes.c_uint64)]


class _CqOff(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries",
                                               "overflow", "cqes", "flags", "resv1")] + [
        ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags",
                                               "sq_thread_cpu", "sq_thread_idle", "features",
                                               "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOff), ("cq_off", _CqOff)]


class Ring:
    """A bare io_uring (no SQPOLL): :meth:`push` queues an SQE, :meth:`submit_wait` submits
    them and waits for ``n`` completions, :meth:`reap` yields (user_data, res)."""

    def __init__(self, entries: int):
        p = _Params()
        fd = _libc.syscall(NR_SETUP, entries, ctypes.byref(p))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_setup: {os.strerror(e)}")
        self.fd, self.p = fd, p
        self.sq = mmap.mmap(fd, p.sq_off.array + p.sq_entries * 4, offset=OFF_SQ_RING)
        self.cq = mmap.mmap(fd, p.cq_off.cqes + p.cq_entries * 16, offset=OFF_CQ_RING)
        self.sqes = mmap.mmap(fd, p.sq_entries * 64, offset=OFF_SQES)
        self.sq_mask = struct.unpack_from("<I", self.sq, p.sq_off.ring_mask)[0]
        self.cq_mask = struct.unpack_from("<I", self.cq, p.cq_off.ring_mask)[0]
        self.pending = 0

    def push(self, op: int, fd: int, addr: int, length: int, off: int, user: int,
             flags: int = 0, rw_flags: int = 0) -> None:
        so = self.p.sq_off
        tail = struct.unpack_from("<I", self.sq, so.tail)[0]
        i = tail & self.sq_mask
        struct.pack_into("<BBHiQQIIQ24x", self.sqes, i * 64, op, flags, 0, fd, off, addr,
                         length, rw_flags, user)
        struct.pack_into("<I", self.sq, so.array + 4 * i, i)
        # x86 keeps stores in order: the SQE is written before the kernel can see the new tail
        struct.pack_into("<I", self.sq, so.tail, (tail + 1) & 0xFFFFFFFF)
        self.pending += 1

    def submit_wait(self, n: int) -> None:
        r = _libc.syscall(NR_ENTER, self.fd, self.pending, n, ENTER_GETEVENTS if n else 0,
                          None, 0)
        if r < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_enter: {os.strerror(e)}")
        self.pending -= r

    def reap(self):
        co = self.p.cq_off
        head = struct.unpack_from("<I", self.cq, co.head)[0]
        tail = struct.unpack_from("<I", self.cq, co.tail)[0]
        while head != tail:
            user, res, _ = struct.unpack_from("<QiI", self.cq, co.cqes + 16 * (head & self.cq_mask))
            head = (head + 1) & 0xFFFFFFFF
            struct.pack_into("<I", self.cq, co.head, head)
            yield user, res

    def close(self) -> None:
        for m in (self.sq, self.cq, self.sqes):
            m.close()
        os.close(self.fd)


def _addr(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def uring_read(paths: list[str], nbytes: int, depth: int, bufs: list[mmap.mmap]) -> float:
    ring = Ring(depth)
    addrs = [_addr(b) for b in bufs]
    free, fds, todo, t0 = list(range(depth)), {}, list(reversed(paths)), time.perf_counter()
    try:
        while todo or fds:
            while todo and free:
                slot = free.pop()
                fd = os.open(todo.pop(), os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
                fds[slot] = fd
                ring.push(OP_READ, fd, addrs[slot], nbytes, 0, slot)
            ring.submit_wait(1)
            for slot, res in ring.reap():
                if res != nbytes:
                    raise OSError(-res if res < 0 else 5, f"io_uring read gave {res}")
                os.close(fds.pop(slot))
                free.append(slot)
        return time.perf_counter() - t0
    finally:
        ring.close()


def uring_write(paths: list[str], nbytes: int, depth: int, bufs: list[mmap.mmap]) -> float:
    ring = Ring(2 * depth)
    addrs = [_addr(b) for b in bufs]
    free, fds, left = list(range(depth)), {}, {}
    todo, t0 = list(reversed(paths)), time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC
    try:
        while todo or fds:
            while todo and free:
                slot = free.pop()
                fd = os.open(todo.pop(), flags, 0o600)
                fds[slot], left[slot] = fd, 2
                ring.push(OP_WRITE, fd, addrs[slot], nbytes, 0, 2 * slot, flags=SQE_IO_LINK)
                ring.push(OP_FSYNC, fd, 0, 0, 0, 2 * slot + 1, rw_flags=FSYNC_DATASYNC)
            ring.submit_wait(1)
            for user, res in ring.reap():
                slot = user // 2
                if res < 0 or (user % 2 == 0 and res != nbytes):
                    raise OSError(-res if res < 0 else 5, f"io_uring write/fsync gave {res}")
                left[slot] -= 1
                if not left[slot]:
                    os.close(fds.pop(slot))
                    free.append(slot)
        return time.perf_counter() - t0
    finally:
        ring.close()


def pool(paths: list[str], nbytes: int, threads: int, bufs: list[mmap.mmap], write: bool) -> float:
    todo, lock = list(paths), threading.Lock()
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY) | os.O_DIRECT

    def work(buf):
        while True:
            with lock:
                if not todo:
                    return
                path = todo.pop()
            fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
            try:
                got = os.pwritev(fd, [buf], 0) if write else os.preadv(fd, [buf], 0)
                if write:
                    os.fdatasync(fd)
                if got != nbytes:
                    raise OSError(5, f"short I/O {got}")
            finally:
                os.close(fd)

    return timed_threads(work, bufs[:threads])  # the tier's own thread timing (disk_depth.py)


def dd(args: list[str]) -> float:
    p = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    return float(re.search(r"copied, ([\d.]+) s", p.stderr).group(1))


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp/xkv-uring")
    ap.add_argument("--files", type=int, default=128)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--shard-size", type=parse_size, default="2M")
    ap.add_argument("--threads", type=int, default=4, help="pool threads (the tier's default)")
    ap.add_argument("--depth", default="4,8", help="io_uring queue depths to try")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    nbytes = file_bytes(args.shards, args.shard_size)
    depths = [int(x) for x in args.depth.split(",")]
    width = max([args.threads, *depths])
    d = args.dir
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d, mode=0o700)
    bufs = [mmap.mmap(-1, nbytes) for _ in range(width)]
    for b in bufs:
        b.write(os.urandom(nbytes))
    paths = [os.path.join(d, f"obj{i:05d}") for i in range(args.files)]
    total = nbytes * args.files
    out = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip(),
           "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
           "command": " ".join(sys.argv), "file_bytes": nbytes, "files": args.files,
           "rounds": []}
    big = os.path.join(d, "dd-test")
    try:
        try:
            Ring(4).close()
        except OSError as e:
            raise SystemExit(f"io_uring is not available here: {e}") from None
        for _ in range(args.rounds):
            row = {"loadavg": loadavg()}
            count = total // (4 << 20)
            row["dd_write_Bps"] = count * (4 << 20) / dd(
                ["if=/dev/zero", f"of={big}", "bs=4M", f"count={count}", "oflag=direct",
                 "conv=fdatasync"])
            row["dd_read_Bps"] = count * (4 << 20) / dd([f"if={big}", "of=/dev/null", "bs=4M",
                                                         "iflag=direct"])
            os.unlink(big)
            row[f"pool{args.threads}_write_Bps"] = total / pool(paths, nbytes, args.threads,
                                                                bufs, True)
            for q in depths:
                row[f"uring{q}_write_Bps"] = total / uring_write(paths, nbytes, q, bufs)
            row[f"pool{args.threads}_read_Bps"] = total / pool(paths, nbytes, args.threads,
                                                               bufs, False)
            for q in depths:
                row[f"uring{q}_read_Bps"] = total / uring_read(paths, nbytes, q, bufs)
            row["loadavg_end"] = loadavg()
            out["rounds"].append(row)
            print(json.dumps({k: (round(v / 1e6) if k.endswith("Bps") else v)
                              for k, v in row.items()}), "(MB/s)", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
