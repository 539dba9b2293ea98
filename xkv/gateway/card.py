"""The card: a shared-memory arena of slots plus a read-only table of slot generations.

Two ways to share it with clients on the same host (no KV byte ever crosses the control socket):

* ``memfd`` (default on Linux): anonymous memory from ``memfd_create``, sealed against shrinking
  and growing (a peer cannot ``ftruncate`` it and SIGBUS everyone else). Clients fetch both file
  descriptors over an AF_UNIX socket (SCM_RIGHTS) in the gateway's 0700 directory (see
  transport.py); the gateway checks the peer's uid with SO_PEERCRED, and the client the gateway's. The generation table is sealed with F_SEAL_FUTURE_WRITE after the
  gateway mapped it, so clients can map it read-only only. Memory is freed when the last process
  that maps it exits, even after a SIGKILL.
* ``shm`` (fallback): two files ``/dev/shm/xkv-card-<random>`` and ``...-gen``, mode 0600,
  unlinked at clean shutdown. The gateway holds an ``flock`` on both for its life; after a
  SIGKILL the next gateway of the same user unlinks the files nobody holds locked (a lock, not a
  pid: a gateway in another PID namespace sharing /dev/shm keeps its card).

The generation table holds one little-endian uint64 per page (``slot_alignment`` bytes) of the
card: ``generation(offset) = table[offset // slot_alignment]``. It costs 8 bytes per page (0.2 %
of the card at 4 KiB alignment), and untouched pages of it are never materialised.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading

from xkv.gateway.sockdir import check_peer

log = logging.getLogger("xkv.gateway")

F_SEAL_FUTURE_WRITE = 0x10  # not exported by Python 3.11's fcntl
MADV_POPULATE_WRITE = 23
_HANDOVER_MAGIC = b"XKVCARD1"
_SHM_PREFIX = "xkv-card-"


class Card:
    """Gateway side: owns the arena and the generation table for the life of the process."""

    def __init__(self, capacity_bytes: int, slot_alignment: int, *, kind: str = "auto",
                 prefault: bool = False, epoch: int = 0, handover_path: str | None = None):
        """``handover_path``: where the memfd hand-over socket goes (inside a 0700 directory;
        default a fresh private temporary directory)."""
        if capacity_bytes < slot_alignment:
            raise ValueError(f"capacity {capacity_bytes} bytes is smaller than one slot alignment "
                             f"({slot_alignment} bytes)")
        self.capacity_bytes = capacity_bytes - capacity_bytes % slot_alignment
        self.slot_alignment = slot_alignment
        self.num_pages = self.capacity_bytes // slot_alignment
        self.gen_bytes = -(-self.num_pages * 8 // mmap.PAGESIZE) * mmap.PAGESIZE
        self.epoch = epoch
        if kind == "auto":
            kind = "memfd" if hasattr(os, "memfd_create") else "shm"
        if kind not in ("memfd", "shm"):
            raise ValueError(f"card kind must be auto, memfd or shm, got {kind!r}")
        self.kind = kind
        self._dir: str | None = None
        self._paths: list[str] = []
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if kind == "memfd":
            flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
            self.fd = os.memfd_create("xkv-card", flags)
            self.gen_fd = os.memfd_create("xkv-card-generations", flags)
        else:
            self._check_shm_space()
            _remove_stale_shm()
            base = f"/dev/shm/{_SHM_PREFIX}{secrets.token_hex(8)}"
            self.fd = os.open(base, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # "alive" for _remove_stale_shm of others
            self._paths.append(base)
            self.gen_fd = os.open(base + "-gen", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(self.gen_fd, fcntl.LOCK_EX)
            self._paths.append(base + "-gen")
            self._shm_paths = (base, base + "-gen")
        os.ftruncate(self.fd, self.capacity_bytes)
        os.ftruncate(self.gen_fd, self.gen_bytes)
        self.arena = mmap.mmap(self.fd, self.capacity_bytes)
        self._gen_map = mmap.mmap(self.gen_fd, self.gen_bytes)
        #: uint64 per page; the index bumps entries in place and clients see them at once.
        self.generations = memoryview(self._gen_map).cast("Q")
        if kind == "memfd":
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
            fcntl.fcntl(self.gen_fd, fcntl.F_ADD_SEALS,
                        seals | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            self._start_handover(handover_path)
        if prefault:
            self._prefault()

    def _check_shm_space(self) -> None:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        if free < self.capacity_bytes + self.gen_bytes:
            raise OSError(f"/dev/shm has {free} bytes free, the card needs "
                          f"{self.capacity_bytes + self.gen_bytes} (lower --capacity or enlarge "
                          f"/dev/shm, e.g. docker --shm-size)")

    def _prefault(self) -> None:
        try:
            self.arena.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            view = memoryview(self.arena)
            for off in range(0, self.capacity_bytes, mmap.PAGESIZE):
                view[off] = 0
            view.release()

    # ------------------------------------------------------------------ handover (memfd)

    def _start_handover(self, path: str | None) -> None:
        if path is None:
            self._dir = tempfile.mkdtemp(prefix="xkv-card-")  # mode 0700
            path = os.path.join(self._dir, "card.sock")
        self.socket_path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)  # 0600: only this user may connect (and SO_PEERCRED checks)
        try:
            self._listener.bind(self.socket_path)
        finally:
            os.umask(umask)
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self._thread = threading.Thread(target=self._serve, name="xkv-card-handover", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        creds = struct.calcsize("3i")
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    pid, uid, _ = struct.unpack(
                        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds))
                    if uid not in (os.geteuid(), 0):
                        log.warning("card handover refused to pid %d: uid %d is not the "
                                    "gateway's uid %d", pid, uid, os.geteuid())
                        continue
                    msg = b"%s %d" % (_HANDOVER_MAGIC, self.epoch)
                    socket.send_fds(conn, [msg], [self.fd, self.gen_fd])
                except OSError as e:
                    log.debug("card handover failed: %s", e)

    # ------------------------------------------------------------------ description

    @property
    def path(self) -> str:
        return self.socket_path if self.kind == "memfd" else self._shm_paths[0]

    @property
    def gen_path(self) -> str:
        return "" if self.kind == "memfd" else self._shm_paths[1]

    def close(self) -> None:
        """Stop handing out the card and remove every name it has; mappings stay valid."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for p in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        self._paths.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        # A view still exported elsewhere keeps its mapping alive; the names are gone either way.
        with contextlib.suppress(BufferError, ValueError):
            self.generations.release()
            self._gen_map.close()
            self.arena.close()
        os.close(self.fd)
        os.close(self.gen_fd)


def _remove_stale_shm() -> None:
    """Unlink our /dev/shm/xkv-card-* files that no live gateway holds locked (mappings that
    clients still hold stay valid; only the names go)."""
    from xkv.gateway.transport import is_locked

    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(_SHM_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join("/dev/shm", name)
        try:
            if os.lstat(path).st_uid != os.geteuid() or is_locked(path):
                continue
            os.unlink(path)
            log.info("removed %s, left by a gateway that is gone", path)
        except OSError:
            continue


def open_card(kind: str, path: str, gen_path: str, capacity_bytes: int, epoch: int,
              timeout_s: float = 2.0) -> tuple[mmap.mmap, mmap.mmap]:
    """Client side: map (card read-write, generation table read-only) described by a CardInfo.

    Raises OSError when the card cannot be reached from this host or does not match."""
    if kind == "memfd":
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path)
            check_peer(s, path)  # a card served by another user is never mapped
            msg, fds, _, _ = socket.recv_fds(s, 64, 2)
        try:
            if len(fds) != 2 or msg != b"%s %d" % (_HANDOVER_MAGIC, epoch):
                raise OSError(f"card handover from {path} did not match epoch {epoch}: {msg!r}")
            return _map(fds[0], fds[1], capacity_bytes)
        finally:
            for fd in fds:
                os.close(fd)
    if kind == "shm":
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            gen_fd = os.open(gen_path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            os.close(fd)
            raise
        try:
            for f, p in ((fd, path), (gen_fd, gen_path)):
                _check_own_file(f, p)
            return _map(fd, gen_fd, capacity_bytes)
        finally:
            os.close(fd)
            os.close(gen_fd)
    raise OSError(f"unknown card kind {kind!r}")


def _check_own_file(fd: int, path: str) -> None:
    """A ``shm`` card file must be this user's and closed to others (not one planted by another
    user, whose bytes they could read and poison)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"card file {path} belongs to uid {st.st_uid} with mode "
                              f"{st.st_mode & 0o777:o}, expected uid {os.geteuid()} and mode "
                              f"600: refusing to map it")


def _map(fd: int, gen_fd: int, capacity_bytes: int) -> tuple[mmap.mmap, mmap.mmap]:
    size = os.fstat(fd).st_size
    if size != capacity_bytes:
        raise OSError(f"card is {size} bytes, the gateway announced {capacity_bytes}")
    arena = mmap.mmap(fd, capacity_bytes)
    gens = mmap.mmap(gen_fd, os.fstat(gen_fd).st_size, prot=mmap.PROT_READ)
    return arena, gens
