"""The disk tier's I/O side: the directory's checks and the threads that move objects between the
card and files, so the gateway's loop never touches the disk.

Files and header: :mod:`xkv.gateway.disk_format`. Bytes move straight between the card's slots
and the file (``preadv``/``pwritev`` with one iovec per shard; no bounce buffer): with O_DIRECT
when the directory accepts it (probed at start, like vLLM's file tier does) and the card's slot
alignment is a multiple of :data:`BLOCK`; buffered I/O otherwise. O_DIRECT reads go in pieces of
at most 4 MiB through a gate that bounds the reads in flight (``--disk-read-depth``, measured at
start by default: :mod:`xkv.gateway.disk_depth`). A thread pool, not io_uring:
the syscalls release the GIL, and io_uring (driven through its system calls,
``bench/disk_uring.py``) moved the tier's files no faster here: at 4 MiB per request the CPU goes
to the checksum and the kernel's page pinning, which io_uring does not change (bench/RESULTS.md
"Disk tier"). The payload checksum: :mod:`xkv.gateway.disk_crc`.

Jobs (the loop's side calls :meth:`DiskStore.read`, :meth:`write`, :meth:`delete`; results come
back on :attr:`done`, a SimpleQueue the loop drains):

* ``read(token, items)``: each item's file into its slots, checked (owner, size, header, crc32);
  items are spread over the threads; one ``("read", token, [status], bytes, seconds)`` when all
  are done. Status: ``ok``, ``lost`` (no file), ``truncated``, ``corrupt`` (header or checksum;
  the file is removed), ``foreign`` (not this uid's regular file; left alone) or ``error``.
* ``write(items)``: each object from its slots to a temporary file, ``fdatasync``, rename, and
  its directory synced; then ``("written", items, [status], bytes, seconds)``; status ``ok``,
  ``full`` (ENOSPC) or ``error``.
* ``delete(names)``: unlink (evicted from the disk); ``("deleted", names)``.
* the scan at start: ``("scanned", [(digest hex, name, bytes, mtime)], skipped, removed)``.

Reads are served first, then deletes, then writes; no write starts while a delete runs: the
loop deletes files to make room for the writes it queues after them, and on a full disk a write
that overtook its delete would fail (ENOSPC) with the room about to be there.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import re
import secrets
import stat
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass

from xkv.gateway import disk_depth as depth
from xkv.gateway.disk_crc import SlotCrc
from xkv.gateway.disk_dir import DiskError, check_dir, sync_dir
from xkv.gateway.disk_format import (
    BLOCK,
    TMP_MARK,
    check_header,
    checks_offset,
    file_bytes,
    pack_header,
    rel_path,
    stride,
)

log = logging.getLogger("xkv.gateway")

_HEX32 = re.compile(r"[0-9a-f]{32}")  # a layout digest's directory
_NAME = re.compile(r"(?:[0-9a-f]{2}){1,64}|h[0-9a-f]{64}")  # disk_format.file_name
_WRITE_BATCH = 8  # objects one thread writes before it syncs their directories once


@dataclass(frozen=True)
class DiskItem:
    """One object to move: its identity, geometry and where its shards are in the card."""

    digest: bytes
    key: bytes
    name: str
    num_shards: int
    shard_bytes: int
    offsets: tuple[int, ...]  # byte offset of each shard's slot in the card
    ref: object = None  # the loop's handle; never touched by the threads
    #: The object's checksum words (issue 25; disk_format.py): the bytes to write, or for a
    #: read the STAGED object's buffer of ``check_bytes`` that the read fills. None: no words.
    checks: bytes | bytearray | None = None

    @property
    def check_bytes(self) -> int:
        return len(self.checks) if self.checks is not None else 0

    @property
    def rel(self) -> str:
        return rel_path(self.digest, self.name)

    @property
    def nbytes(self) -> int:
        return file_bytes(self.num_shards, self.shard_bytes, self.check_bytes)


def _pwrite_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """``pwritev`` until every byte is written. A file system that fills up mid-write returns
    a short count first and raises ENOSPC only on the next call: the loop turns the one into
    the other, so a full disk is reported as such (ENOSPC), not as a generic error. O_DIRECT:
    a short count is a multiple of the block size, so the rest stays aligned."""
    total = sum(len(b) for b in bufs)
    done = 0
    while done < total:
        n = os.pwritev(fd, bufs, offset + done)
        if n <= 0:
            raise OSError(5, f"write made no progress ({done} of {total} bytes)")
        done += n
        while n and bufs:  # drop what was written
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs = bufs[1:]
            else:
                bufs = [bufs[0][n:], *bufs[1:]]
                n = 0


class _Read:
    """One read job spread over the threads: the last item done posts the result."""

    def __init__(self, token, n: int):
        self.token, self.left, self.status = token, n, ["error"] * n
        self.nbytes, self.t0, self.lock = 0, time.perf_counter(), threading.Lock()


class DiskStore:
    """Owns the tier's directory and I/O threads. ``card``: the card's arena (an mmap);
    ``alignment``: its slot alignment; ``direct``: None = O_DIRECT where the probe allows;
    ``nice``: how much lower the I/O threads' CPU priority is than the gateway's (0: same);
    ``read_depth``: O_DIRECT reads in flight at most (None: one per thread; ``"auto"``: measured
    after the scan, one per thread until then: :mod:`xkv.gateway.disk_depth`)."""

    def __init__(self, path: str, card: mmap.mmap, alignment: int, *, threads: int = 4,
                 direct: bool | None = None, nice: int = 10,
                 read_depth: int | str | None = None):
        threads = max(threads, 1)
        limit, depths = depth.plan(read_depth, threads)  # before anything is opened: a bad value
        self.root, can_direct = check_dir(path)
        self.direct = can_direct and alignment % BLOCK == 0 and direct is not False
        if direct and not self.direct:
            raise DiskError(f"--disk {path}: O_DIRECT was asked for but "
                            + ("the file system refuses it" if not can_direct else
                               f"the slot alignment {alignment} is not a multiple of {BLOCK}"))
        self._view = memoryview(card)
        self._crc = SlotCrc(card)  # libdeflate's CRC-32 where the system has it (disk_crc.py)
        self._uid = os.geteuid()
        self._nice = nice  # added to the I/O threads' nice value (Linux: per thread)
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._reads: deque = deque()
        self._writes: deque = deque()
        self._deletes: deque = deque()
        self._stop = False
        self._unlinking = 0  # delete jobs running: writes wait for them
        self._threads = [threading.Thread(target=self._main, name=f"xkv-disk-{i}", daemon=True)
                         for i in range(threads)]
        self._gate = depth.ReadGate(limit)
        self.read_unit = depth.READ_UNIT  # bytes per read at most (tests cut objects finer)
        #: "fixed", "auto: measuring", "measured" or "auto, not measured: <why>"; the rates
        self.depth_source = "fixed"
        self.depth_rates: dict[int, list[float]] = {}
        self._reads.append(("scan",))
        if depths and self.direct:
            self.depth_source = "auto: measuring"
            self._reads.append(("calibrate", depths))
        elif depths:
            self.depth_source = "auto, not measured: buffered I/O (the page cache serves reads)"

    @property
    def read_depth(self) -> int:
        """O_DIRECT reads in flight at most (the gate's limit)."""
        return self._gate.limit

    @property
    def depth_measuring(self) -> bool:  # the start-up measurement still runs
        return self.depth_source == "auto: measuring"

    def start(self) -> None:
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ loop-side API

    def read(self, token, items: list[DiskItem]) -> None:
        job = _Read(token, len(items))
        with self._cv:
            self._reads.extend(("read", job, i, it) for i, it in enumerate(items))
            self._cv.notify(len(items))

    def write(self, items: list[DiskItem]) -> None:
        with self._cv:
            self._writes.extend(items)
            self._cv.notify(len(items))

    def delete(self, names: list[tuple[bytes, str]]) -> None:
        with self._cv:
            self._deletes.append(names)
            self._cv.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the writes under way (their objects stay), drop queued ones, stop."""
        with self._cv:
            self._stop = True
            self._writes.clear()
            self._cv.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout_s)
        if any(t.is_alive() for t in self._threads):  # stuck in I/O: keep the card mapped
            log.warning("disk tier: I/O threads still busy after %g s at close", timeout_s)
            return
        self._crc.close()
        with contextlib.suppress(BufferError):
            self._view.release()

    # ------------------------------------------------------------------ threads

    def _next(self):
        with self._cv:
            while not self._stop:
                if self._reads:
                    return self._reads.popleft()
                if self._deletes:
                    self._unlinking += 1
                    return ("delete", self._deletes.popleft())
                if self._writes and not self._unlinking:
                    n = min(len(self._writes), _WRITE_BATCH)
                    return ("write", [self._writes.popleft() for _ in range(n)])
                self._cv.wait()
            return None

    def _main(self) -> None:
        if self._nice:  # bulk work: the loop thread (latency) gets the CPU first
            tid = threading.get_native_id()
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid,
                               min(os.getpriority(os.PRIO_PROCESS, tid) + self._nice, 19))
        hdr = mmap.mmap(-1, BLOCK)  # page-aligned: O_DIRECT takes it as is
        while (job := self._next()) is not None:
            try:
                if job[0] == "read":
                    self._read_one(job[1], job[2], job[3], hdr)
                elif job[0] == "write":
                    self.done.put(self._write(job[1], hdr))
                elif job[0] == "delete":
                    try:
                        for digest, name in job[1]:
                            with contextlib.suppress(OSError):
                                os.unlink(os.path.join(self.root, rel_path(digest, name)))
                    finally:
                        with self._cv:
                            self._unlinking -= 1
                            self._cv.notify_all()  # writes held back for the room
                    self.done.put(("deleted", job[1]))
                elif job[0] == "calibrate":
                    self.depth_source, self.depth_rates = depth.measure(self.root, job[1],
                                                                       self._gate)
                else:
                    self.done.put(self._scan())
            except Exception:  # a bug must not kill a thread silently
                log.exception("disk tier: %s job failed", job[0])
                if job[0] == "write":
                    self.done.put(("written", job[1], ["error"] * len(job[1]), 0, 0.0))
                elif job[0] == "scan":
                    self.done.put(("scanned", [], 0, 0))
                elif job[0] == "read":
                    self._read_done(job[1], job[2], "error", 0)

    # ------------------------------------------------------------------ scan

    def _scan(self) -> tuple:
        """Every object file (this uid's regular files with an object's name); temporary files
        of writes a crash cut short are removed; anything else is skipped and counted."""
        found, skipped, removed = [], 0, 0
        with os.scandir(self.root) as top:
            for d in top:
                if not (d.is_dir(follow_symlinks=False) and _HEX32.fullmatch(d.name)):
                    skipped += not d.name.startswith("probe")
                    continue
                with os.scandir(d.path) as mid:
                    for sub in mid:
                        if not sub.is_dir(follow_symlinks=False):
                            skipped += 1
                            continue
                        with os.scandir(sub.path) as files:
                            for f in files:
                                st = f.stat(follow_symlinks=False)
                                if (st.st_uid != self._uid or not stat.S_ISREG(st.st_mode)
                                        or st.st_size % BLOCK):
                                    skipped += 1
                                elif TMP_MARK in f.name:
                                    with contextlib.suppress(OSError):
                                        os.unlink(f.path)
                                    removed += 1
                                elif not _NAME.fullmatch(f.name) or f.name[:2] != sub.name:
                                    skipped += 1
                                else:
                                    found.append((d.name, f.name, st.st_size, st.st_mtime))
        found.sort(key=lambda e: e[3])  # least recently written (or restored) first
        if skipped:
            log.warning("disk tier: skipped %d entries in %s that are not this uid's (%d) object "
                        "files; they are never read", skipped, self.root, self._uid)
        return ("scanned", found, skipped, removed)

    # ------------------------------------------------------------------ read

    def _iov(self, it: DiskItem):
        """The card's slots of ``it`` as buffers in file order (after the header)."""
        n = stride(it.shard_bytes) if self.direct else it.shard_bytes
        return [self._view[o:o + n] for o in it.offsets]

    def _read_one(self, job: _Read, i: int, it: DiskItem, hdr) -> None:
        status, nbytes = self._read(it, hdr), 0
        if status == "ok":
            nbytes = it.nbytes
        self._read_done(job, i, status, nbytes)

    def _read_done(self, job: _Read, i: int, status: str, nbytes: int) -> None:
        with job.lock:
            job.status[i] = status
            job.nbytes += nbytes
            job.left -= 1
            last = job.left == 0
        if last:
            self.done.put(("read", job.token, job.status, job.nbytes,
                           time.perf_counter() - job.t0))

    def _read(self, it: DiskItem, hdr) -> str:
        path = os.path.join(self.root, it.rel)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return "lost"
        except OSError as e:
            log.warning("disk tier: cannot open %s (%s): a miss", path, e.strerror)
            return "foreign" if e.errno == 40 else "error"  # ELOOP: a symlink
        try:
            st = os.fstat(fd)
            if st.st_uid != self._uid or not stat.S_ISREG(st.st_mode):
                log.warning("disk tier: %s is not a regular file of uid %d: never read, a miss",
                            path, self._uid)
                return "foreign"
            if st.st_size != it.nbytes:
                log.warning("disk tier: %s has %d bytes, expected %d: removed, a miss", path,
                            st.st_size, it.nbytes)
                self._unlink(path)
                return "truncated"
            iov = self._iov(it)
            words = self._words_buffer(it)
            if self.direct:  # pieces of at most READ_UNIT, each through the gate
                got, want = 0, it.nbytes
                for bufs, at in depth.pieces([hdr, *iov, *words], self.read_unit):
                    with self._gate.hold():
                        n = os.preadv(fd, bufs, at)
                    got += n
                    if n != sum(len(b) for b in bufs):
                        break
            else:
                got = os.preadv(fd, [hdr], 0)
                want = BLOCK + it.num_shards * it.shard_bytes + it.check_bytes
                s = stride(it.shard_bytes)
                for r, buf in enumerate(iov):
                    got += os.preadv(fd, [buf], BLOCK + r * s)
                if words:
                    got += os.preadv(fd, words, checks_offset(it.num_shards, it.shard_bytes))
            if words and words[0] is not it.checks:  # O_DIRECT: read into an aligned buffer
                it.checks[:] = words[0][:it.check_bytes]
            if got != want:
                log.warning("disk tier: %s gave %d of %d bytes: removed, a miss", path, got, want)
                self._unlink(path)
                return "truncated"
            try:
                crc = check_header(hdr, it.digest, it.key, it.num_shards, it.shard_bytes,
                                   it.check_bytes)
            except ValueError as e:
                log.warning("disk tier: %s: %s: removed, a miss", path, str(e))  # str: no frames kept
                self._unlink(path)
                return "corrupt"
            if self.crc(it) != crc:
                log.warning("disk tier: %s fails its checksum: removed, a miss", path)
                self._unlink(path)
                return "corrupt"
            with contextlib.suppress(OSError):
                os.utime(fd)  # a use: the scan at the next start orders by this time
            return "ok"
        except OSError as e:
            log.warning("disk tier: reading %s failed (%s): a miss", path, e.strerror)
            return "error"
        finally:
            os.close(fd)

    @staticmethod
    def _unlink(path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)

    @property
    def crc_kind(self) -> str:
        """Which CRC-32 code runs: ``libdeflate`` or ``zlib`` (same values)."""
        return self._crc.kind

    def crc(self, it: DiskItem) -> int:
        """CRC-32 of the object's shards (``shard_bytes`` of each slot, in order)."""
        crc, fn = 0, self._crc.crc
        for off in it.offsets:
            crc = fn(off, it.shard_bytes, crc)  # releases the GIL
        return zlib.crc32(it.checks, crc) if it.checks else crc  # a few KiB: zlib is fine

    def _words_buffer(self, it: DiskItem) -> list:
        """[] without checksum words; else the buffer the words' region moves through: the
        item's own with buffered I/O, a page-aligned copy of the whole region with O_DIRECT."""
        if not it.check_bytes:
            return []
        if not self.direct:
            return [it.checks]
        buf = mmap.mmap(-1, stride(it.check_bytes))
        buf[:it.check_bytes] = it.checks
        return [buf]

    # ------------------------------------------------------------------ write

    def _write(self, items: list[DiskItem], hdr) -> tuple:
        t0 = time.perf_counter()
        out, nbytes, dirs = [], 0, set()
        for it in items:
            status = self._write_one(it, hdr, dirs)
            out.append(status)
            nbytes += it.nbytes if status == "ok" else 0
        for d in dirs:  # the renames are durable before the loop learns of them
            try:
                sync_dir(d)
            except OSError as e:
                log.warning("disk tier: syncing %s failed (%s)", d, e.strerror)
                out = ["error" if s == "ok" and os.path.dirname(os.path.join(self.root, it.rel))
                       == d else s for it, s in zip(items, out, strict=True)]
        return ("written", items, out, nbytes, time.perf_counter() - t0)

    def _open_tmp(self, path: str) -> tuple[int, str]:
        tmp = f"{path}{TMP_MARK}{secrets.token_hex(4)}"
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                 | (os.O_DIRECT if self.direct else 0))
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileNotFoundError:  # first object of its layout or prefix (or the dir was removed)
            d = os.path.dirname(tmp)
            os.makedirs(d, 0o700, exist_ok=True)
            # a new directory's name is durable only once its parent is synced (issue 26)
            sync_dir(os.path.dirname(d))
            sync_dir(os.path.dirname(os.path.dirname(d)))
            return os.open(tmp, flags, 0o600), tmp

    def _write_one(self, it: DiskItem, hdr, dirs: set) -> str:
        path = os.path.join(self.root, it.rel)
        tmp = None
        try:
            hdr[:] = pack_header(it.digest, it.key, it.num_shards, it.shard_bytes, self.crc(it),
                                 it.check_bytes)
            fd, tmp = self._open_tmp(path)
            try:
                iov = self._iov(it)
                words = self._words_buffer(it)
                if self.direct:
                    _pwrite_all(fd, [memoryview(hdr), *iov, *(memoryview(w) for w in words)], 0)
                else:
                    os.ftruncate(fd, it.nbytes)
                    _pwrite_all(fd, [memoryview(hdr)], 0)
                    s = stride(it.shard_bytes)
                    for r, buf in enumerate(iov):
                        _pwrite_all(fd, [buf], BLOCK + r * s)
                    if words:
                        _pwrite_all(fd, [memoryview(words[0])],
                                    checks_offset(it.num_shards, it.shard_bytes))
                os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            dirs.add(os.path.dirname(path))
            return "ok"
        except OSError as e:
            if tmp is not None:
                self._unlink(tmp)
            if e.errno == 28:  # ENOSPC
                return "full"
            log.warning("disk tier: writing %s failed (%s)", path, e.strerror or e)
            return "error"
