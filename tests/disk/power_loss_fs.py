"""A file system model for power-loss tests of the disk tier: it records the file operations the
code under test makes (through :class:`RecordingOs`, a stand-in for the ``os`` module of
xkv/gateway/disk_store.py and disk_dir.py), and draws what a power loss after any of them may
leave on the disk.

Why a model: a SIGKILL (tests/disk/test_disk_crash.py) keeps the page cache, so every write the
process made survives it. A power loss keeps only what was made durable. The rules here are the
strict POSIX ones (no file system's extra ordering is assumed):

* a file's data and size are durable up to its last ``fdatasync``/``fsync``; every later write
  may be absent, present, or torn at :data:`BLOCK` (4 KiB) granularity, and its size may be any
  size it had since (zeros where no write landed);
* a directory's entries (create, mkdir, rename, unlink in it) are durable up to its last
  ``fsync``; each later name operation may or may not have happened, independently. A rename
  that happened can expose a file whose data did not (the case checksums exist for); a new
  directory whose parent was not synced may be gone with all it holds.

Every operation is applied to the real directory as well, so the code runs normally, and logged
as the model call it made: a test replays the log into a fresh :class:`Model` and draws states
after each operation (:meth:`Model.lost_power`).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from dataclasses import dataclass, field

BLOCK = 4096


@dataclass
class Inode:
    """A file or directory of the model: what it holds now, and what survives a power loss."""

    is_dir: bool
    data: bytearray = field(default_factory=bytearray)  # file: now
    durable: bytes = b""  # file: at its last sync
    pending: list = field(default_factory=list)  # file: ("w", off, bytes) / ("t", size) since
    entries: dict = field(default_factory=dict)  # dir: name -> ino, now
    durable_entries: dict = field(default_factory=dict)  # dir: at its last fsync
    names: list = field(default_factory=list)  # dir: name operations since its last fsync


class Model:
    """The file system below ``base`` (a directory taken as durable and empty at the start)."""

    def __init__(self, base: str):
        self.base = os.path.abspath(base)
        self.inodes = [Inode(True)]  # ino 0: base

    def lookup(self, path: str) -> tuple[int, str]:
        """(directory ino, name) of ``path``; raises KeyError outside the model."""
        rel = os.path.relpath(os.path.abspath(path), self.base)
        parts = rel.split(os.sep)
        if parts[0] == "..":
            raise KeyError(path)
        d = 0
        for p in parts[:-1]:
            d = self.inodes[d].entries[p]
        return d, parts[-1]

    def ino(self, path: str) -> int:
        if os.path.abspath(path) == self.base:
            return 0
        d, name = self.lookup(path)
        return self.inodes[d].entries[name]

    # ------------------------------------------------------------------ operations

    def create(self, path: str, is_dir: bool) -> int:
        d, name = self.lookup(path)
        self.inodes.append(Inode(is_dir))
        ino = len(self.inodes) - 1
        self._name_op(d, ("link", name, ino))
        return ino

    def rename(self, src: str, dst: str) -> None:
        (d, a), (d2, b) = self.lookup(src), self.lookup(dst)
        assert d == d2, f"rename across directories is not modelled: {src} -> {dst}"
        self._name_op(d, ("rename", a, b, self.inodes[d].entries[a]))

    def unlink(self, path: str) -> None:
        d, name = self.lookup(path)
        self._name_op(d, ("unlink", name))

    def _name_op(self, d: int, op: tuple) -> None:
        _apply_name(self.inodes[d].entries, op)
        self.inodes[d].names.append(op)

    def write(self, ino: int, off: int, data: bytes) -> None:
        f = self.inodes[ino]
        if len(f.data) < off + len(data):
            f.data.extend(bytes(off + len(data) - len(f.data)))
        f.data[off:off + len(data)] = data
        f.pending.append(("w", off, data))

    def truncate(self, ino: int, size: int) -> None:
        f = self.inodes[ino]
        del f.data[size:]
        f.data.extend(bytes(size - len(f.data)))
        f.pending.append(("t", size))

    def sync(self, ino: int) -> None:
        f = self.inodes[ino]
        if f.is_dir:
            f.durable_entries, f.names = dict(f.entries), []
        else:
            f.durable, f.pending = bytes(f.data), []

    # ------------------------------------------------------------------ a power loss

    def lost_power(self, rng: random.Random, out: str, keep: float = 0.5) -> None:
        """Write into ``out`` (an empty directory: the new ``base``) one state a power loss now
        may leave: what was synced, and each later operation kept with probability ``keep``
        (data: per 4 KiB block)."""
        self._dir(0, out, rng, keep)

    def _dir(self, ino: int, path: str, rng: random.Random, keep: float) -> None:
        d = self.inodes[ino]
        entries = dict(d.durable_entries)
        for op in d.names:
            if rng.random() < keep:
                _apply_name(entries, op)
        for name, child in sorted(entries.items(), key=lambda e: e[1]):  # not by random names
            p = os.path.join(path, name)
            if self.inodes[child].is_dir:
                os.mkdir(p, 0o700)
                self._dir(child, p, rng, keep)
            else:
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, self._file(child, rng, keep))
                finally:
                    os.close(fd)

    def _file(self, ino: int, rng: random.Random, keep: float) -> bytes:
        f = self.inodes[ino]
        data = bytearray(f.durable)
        sizes = [len(f.durable)]
        for op in f.pending:
            if op[0] == "t":
                sizes.append(op[1])
                _resize(data, max(len(data), op[1]))
                continue
            _, off, buf = op
            end = off + len(buf)
            sizes.append(max(sizes[-1], end))
            _resize(data, max(len(data), end))
            blk = off - off % BLOCK
            while blk < end:  # each 4 KiB block of the write lands or not
                lo, hi = max(blk, off), min(blk + BLOCK, end)
                if rng.random() < keep:
                    data[lo:hi] = buf[lo - off:hi - off]
                blk += BLOCK
        size = rng.choice(sizes)
        _resize(data, size)
        return bytes(data)


def _resize(data: bytearray, size: int) -> None:
    del data[size:]
    data.extend(bytes(size - len(data)))


def _apply_name(entries: dict, op: tuple) -> None:
    if op[0] == "link":
        entries[op[1]] = op[2]
    elif op[0] == "unlink":
        entries.pop(op[1], None)
    else:  # rename: the target names the inode, whether or not its creation survived
        _, a, b, ino = op
        if entries.get(a) == ino:
            del entries[a]
        entries[b] = ino


class RecordingOs:
    """Stands in for the ``os`` module of the code under test: the file operations that change
    what a power loss leaves are applied to the real file system and to a :class:`Model`, and
    logged as the Model calls they made (``("write", ino, offset, data)``...), so a fresh Model
    replays them; :meth:`mark` logs other events (``("mark", ...)``, e.g. acknowledgements).
    Everything else is the real ``os``."""

    def __init__(self, model: Model):
        self._model = model
        self._fds: dict[int, int] = {}  # fd -> ino
        self._lock = threading.RLock()  # one order of operations, whatever the threads
        self.log: list[tuple] = []

    def __getattr__(self, name):
        return getattr(os, name)

    def _do(self, op: str, *args):
        out = getattr(self._model, op)(*args)  # KeyError outside the model: not logged
        self.log.append((op, *args))
        return out

    def mark(self, *event) -> None:
        with self._lock:
            self.log.append(("mark", *event))

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        assert dir_fd is None
        with self._lock:
            new = flags & os.O_CREAT and not os.path.lexists(path)
            fd = os.open(path, flags, mode)
            with contextlib.suppress(KeyError):  # outside the model's directory: not followed
                self._fds[fd] = self._do("create", path, False) if new else self._model.ino(path)
            return fd

    def close(self, fd):
        with self._lock:
            self._fds.pop(fd, None)
            os.close(fd)

    def mkdir(self, path, mode=0o777):
        with self._lock:
            os.mkdir(path, mode)
            self._do("create", path, True)

    def makedirs(self, path, mode=0o777, exist_ok=False):
        head = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(head):
            self.makedirs(head, mode, exist_ok=True)
        try:
            self.mkdir(path, mode)
        except FileExistsError:
            if not (exist_ok and os.path.isdir(path)):
                raise

    def pwrite(self, fd, data, offset):
        return self.pwritev(fd, [data], offset)

    def pwritev(self, fd, buffers, offset):
        with self._lock:
            n = os.pwritev(fd, buffers, offset)
            if fd in self._fds:
                self._do("write", self._fds[fd], offset, b"".join(bytes(b) for b in buffers)[:n])
            return n

    def ftruncate(self, fd, size):
        with self._lock:
            os.ftruncate(fd, size)
            if fd in self._fds:
                self._do("truncate", self._fds[fd], size)

    def fdatasync(self, fd):
        with self._lock:
            os.fdatasync(fd)
            if fd in self._fds:
                self._do("sync", self._fds[fd])

    fsync = fdatasync  # a file's metadata beyond its size is not modelled

    def rename(self, src, dst):
        with self._lock:
            os.rename(src, dst)
            self._do("rename", src, dst)

    replace = rename

    def unlink(self, path):
        with self._lock:
            os.unlink(path)
            self._do("unlink", path)

    remove = unlink
