"""How many reads the disk tier keeps in flight: the gate its I/O threads pass for each read, the
cut of an object's read into pieces of at most :data:`READ_UNIT` bytes, and the measurement at
start that picks the number (``--disk-read-depth auto``, the default).

Why a number of its own, apart from ``--disk-threads``: the best depth depends on the disk, and
the threads do more than read (open, checks, the CRC of what was read, utime). Measured with
O_DIRECT reads of 4 MiB (bench/RESULTS.md "Disk tier: reads in flight"): the dev machine's
virtual disk (``/dev/vda``, reported rotational, one request per 4 MiB) reads 1.55-2.36 GB/s with
one read in flight and 0.70-0.87 x that with 2-8 (`bench/disk_reads.py`; one file per object
reads as fast as one big file there: `bench/disk_layout.py`); the device machine's disk
restored faster with 8 threads than with 4 (bench/RESULTS.md, stop 35); NVMe drives generally
want several (not measured here). So the depth is measured where the tier runs, not guessed: a temporary file of
``count`` x ``unit`` random bytes is written and read at every candidate depth, ``rounds``
times, the candidates' order rotated each round (a virtual disk's speed drifts by tens of percent
from one minute to the next); the smallest depth within ``tolerance`` of the best median wins
(fewer reads in flight leave more of the disk to everything else). The threads still overlap
their CPU work with the reads at any depth.

Pieces: a read larger than the unit is cut into several (each through the gate), so a large
object does not put many requests in flight at once behind the gate's back (the block layer
splits one large request into ``max_sectors_kb`` parts, all in flight: 4 MiB on that disk).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import random
import secrets
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from xkv.gateway.disk_format import BLOCK, TMP_MARK

__all__ = ["READ_UNIT", "ReadGate", "calibrate", "candidates", "choose_depth", "describe",
           "measure", "pieces", "plan", "timed_threads"]

log = logging.getLogger("xkv.gateway")

#: Bytes one read moves at most (a multiple of :data:`BLOCK`).
READ_UNIT = 4 << 20


class ReadGate:
    """At most ``limit`` holders at a time; the limit may change while threads wait (the
    measurement at start sets it). ``limit`` >= 1."""

    def __init__(self, limit: int):
        self._cv = threading.Condition()
        self._limit = self._check(limit)
        self._busy = 0

    @staticmethod
    def _check(limit: int) -> int:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"reads in flight must be an integer >= 1, got {limit!r}")
        return limit

    @property
    def limit(self) -> int:
        return self._limit

    def set_limit(self, limit: int) -> None:
        with self._cv:
            self._limit = self._check(limit)
            self._cv.notify_all()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self._cv:
            while self._busy >= self._limit:
                self._cv.wait()
            self._busy += 1
        try:
            yield
        finally:
            with self._cv:
                self._busy -= 1
                self._cv.notify()


def pieces(bufs: Sequence, unit: int = READ_UNIT) -> list[tuple[list[memoryview], int]]:
    """``bufs`` (buffers that follow each other in the file from offset 0) as reads of ``unit``
    bytes: [(buffers, file offset)], in file order. A buffer is cut only where a read is full,
    at a multiple of ``unit`` bytes from the file's start, so with O_DIRECT every piece stays
    aligned when the buffers are; the last read holds the rest, and a rest under a quarter of
    the unit joins the read before it (up to 1.25 units: an object of 4 MiB + its 4 KiB header
    is one read, not two). Empty buffers are dropped; no buffers, no pieces."""
    if unit <= 0 or unit % BLOCK:
        raise ValueError(f"read unit must be a positive multiple of {BLOCK}, got {unit}")
    out: list[tuple[list[memoryview], int]] = []
    cur: list[memoryview] = []
    room, offset, start = unit, 0, 0
    for b in bufs:
        v = memoryview(b).cast("B")
        while len(v):
            take = min(room, len(v))
            cur.append(v[:take])
            v, room, offset = v[take:], room - take, offset + take
            if not room:
                out.append((cur, start))
                cur, room, start = [], unit, offset
    if cur and out and offset - start < unit // 4:  # a short rest rides with the read before
        out[-1][0].extend(cur)                          # it: not a request of its own
    elif cur:
        out.append((cur, start))
    return out


def candidates(threads: int) -> list[int]:
    """Depths worth measuring with ``threads`` I/O threads: the powers of two below it and
    ``threads`` itself (4: [1, 2, 4]; 6: [1, 2, 4, 6])."""
    if threads < 1:
        raise ValueError(f"I/O threads must be >= 1, got {threads}")
    out, d = [], 1
    while d < threads:
        out.append(d)
        d *= 2
    return out + [threads]


def plan(read_depth: int | str | None, threads: int) -> tuple[int, list[int]]:
    """The gate's first limit and the depths to measure ([] when not measured) for a
    ``read_depth`` of None (one read per thread), ``"auto"`` or 1..``threads``."""
    if read_depth is None:
        return threads, []
    if read_depth == "auto":  # one thread: nothing to choose from
        return threads, candidates(threads) if threads > 1 else []
    if isinstance(read_depth, bool) or not isinstance(read_depth, int) or not (
            1 <= read_depth <= threads):
        raise ValueError(f"disk reads in flight must be 1..{threads} (the I/O threads), 'auto' "
                         f"or None, got {read_depth!r}")
    return read_depth, []


def choose_depth(rates: dict[int, Sequence[float]], tolerance: float = 0.05) -> int:
    """The smallest depth whose median rate is within ``tolerance`` (a fraction) of the best
    median. ``rates``: depth -> measured bytes per second (one or more samples each)."""
    meds = {d: statistics.median(r) for d, r in rates.items() if r}
    if not meds:
        raise ValueError("no read rates measured: nothing to choose a depth from")
    best = max(meds.values())
    return min(d for d, m in meds.items() if m >= (1.0 - tolerance) * best)


def describe(rates: dict[int, Sequence[float]]) -> str:
    """The measurement for a log line: median GB/s by reads in flight."""
    return "measured at start, median GB/s by reads in flight: " + ", ".join(
        f"{d}: {statistics.median(r) / 1e9:.2f}" for d, r in rates.items() if r)


def calibrate(root: str, depths: Sequence[int], *, unit: int = READ_UNIT, count: int = 0,
              rounds: int = 3) -> dict[int, list[float]]:
    """Read rates (bytes/s) of O_DIRECT reads of ``unit`` bytes at each depth in ``depths``:
    a temporary file of ``count`` units (0: twice the largest depth, at least 8; for 4 threads
    32 MiB, read 9 times in all: 0.3-0.4 s on the dev box) in ``root``, named as the start-up probe
    (a crash's leftover is removed at the next start), written and made durable, then read
    whole at each depth ``rounds`` times, and removed. Raises OSError (disk full, ...)."""
    count = count or max(8, 2 * max(depths, default=1))
    if not depths or min(depths) < 1 or count < 1 or rounds < 1:
        raise ValueError(f"calibrate: depths {list(depths)} (>= 1 each), count {count} and "
                         f"rounds {rounds} (>= 1) expected")
    path = os.path.join(root, f"probe{TMP_MARK}depth-{secrets.token_hex(4)}")
    bufs = [mmap.mmap(-1, unit) for _ in range(max(depths))]  # page-aligned, as O_DIRECT wants
    rng = random.Random(secrets.randbits(64))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_DIRECT, 0o600)
        try:
            for i in range(count):  # random bytes: no storage layer can skip or dedup them
                bufs[0][:] = rng.randbytes(unit)
                if os.pwritev(fd, [bufs[0]], i * unit) != unit:
                    raise OSError(5, "short write while measuring the disk")
            os.fdatasync(fd)
            rates: dict[int, list[float]] = {d: [] for d in depths}
            order = list(depths)
            for r in range(rounds):
                for d in order[r % len(order):] + order[:r % len(order)]:
                    rates[d].append(count * unit / _read_all(fd, bufs[:d], unit, count))
            return rates
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        for b in bufs:
            b.close()


def measure(root: str, depths: Sequence[int], gate: ReadGate) -> tuple[str, dict]:
    """The start-up measurement (an I/O thread runs it): :func:`calibrate` ``root``'s disk,
    set ``gate`` to :func:`choose_depth` and log it. Returns (how the depth was set, the rates);
    any failure keeps the gate's limit and says why in the log and the first value."""
    try:
        rates = calibrate(root, depths)
    except Exception as e:  # noqa: BLE001 - any failure: keep serving at the old depth
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        log.warning("disk tier: measuring reads in flight failed (%s): %d at most", why,
                    gate.limit)
        return f"auto, not measured: {why}", {}
    gate.set_limit(choose_depth(rates))
    log.info("disk tier: %d O_DIRECT reads in flight at most (%s)", gate.limit, describe(rates))
    return "measured", rates


def _read_all(fd: int, bufs: list, unit: int, count: int) -> float:
    """Seconds to read units 0..count-1 of ``fd`` with len(bufs) threads, each its own buffer."""
    nxt = iter(range(count))
    lock = threading.Lock()

    def work(buf) -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            if os.preadv(fd, [buf], i * unit) != unit:
                raise OSError(5, "short read while measuring the disk")

    return max(timed_threads(work, bufs), 1e-9)


def timed_threads(work: Callable[[Any], None], args: Sequence) -> float:
    """Seconds for one thread per item of ``args``, each running ``work(item)``, all started
    together and joined; the first exception a thread raised is raised here."""
    errors: list[BaseException] = []

    def run(arg) -> None:
        try:
            work(arg)
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            errors.append(e)

    ts = [threading.Thread(target=run, args=(a,), daemon=True) for a in args]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0
