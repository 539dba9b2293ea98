"""The Mooncake side of the scale-out tier: object format, keys, and the two threads that talk to
Mooncake Store so the gateway's loop never does.

Object format. One card object (one chunk of one layout: ``num_shards`` shards of
``shard_bytes`` each) is one Mooncake object of ``HEADER_BYTES + num_shards * shard_bytes``
bytes: a 64-byte header, then the shards back to back (never a slot's padding, which may hold
bytes of an earlier occupant of the slot). An object of a layout with checksum words (issue 25)
has them after the shards, opaque, as the card's index holds them (``check_bytes`` = num_shards x
check_words x 4), header version 2; the crc32 and the MAC go on over them. Header,
little-endian::

    magic b"XKVT" | version u16 | flags u16 | num_shards u32 | layout digest 16 B |
    key digest 8 B | shard_bytes u64 | crc32 of the shards u32 | MAC 16 B

MAC: with a shared secret (``--mooncake-secret-file``, flags bit 0 set), a keyed BLAKE2b-128 of
the first 48 header bytes and the shards; else 16 zero bytes.

The layout digest is a 16-byte BLAKE2b of (namespace, fingerprint, num_shards, shard_bytes) —
the names, never the gateway-local layout id — and the Mooncake key is
``xkv1/<layout digest hex>/<card key hex>``, so two gateways that agree on a namespace and a
fingerprint agree on every key, and different namespaces never meet. A pull is verified before
the object becomes visible: header fields equal, crc32 equal, size exact; anything else is a miss.
crc32 catches corruption and truncation, not a malicious writer (anyone who can reach the
master can write objects: see docs/operations.md "Several hosts"); the MAC does, for writers
without the secret, when every gateway of the cluster has one.

Threads. ``pull`` runs existence checks and pulls (``batch_is_exist``, ``batch_get_into_multi_buffers``
straight into the card's slots, the header into a registered side buffer); ``push`` runs the
write-through (``batch_put_from_multi_buffers`` straight from the slots). Both post results to
``done`` (a SimpleQueue the loop drains). Mooncake calls block up to ~4.3 s each once the master
is gone, which is why none of them runs on the loop. ``setup`` is worse: while the master is
down it retries for ~90 s *holding the interpreter lock* (measured here: the loop answered one
PING in 90 s and SIGTERM went unhandled), so the pull thread calls it only after the master's
RPC port and the metadata server accept a TCP connection (:func:`unreachable`, checked again
every ``probe_interval_s`` while they do not): a master that appears later is attached within
about a second. The pull thread also owns the connection state (connecting / up /
down), logging one line per change. While idle it calls ``health_check`` once a second (it
reads the client's own heartbeat state and returns at once) to notice a lost master; while down
it also makes one real call before it says "up" again.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import logging
import mmap
import queue
import socket
import struct
import threading
import time
import urllib.parse
import zlib
from collections import deque
from dataclasses import dataclass

import msgspec

log = logging.getLogger("xkv.gateway")

HEADER = struct.Struct("<4sHHI16s8sQI16s")
SIGNED = HEADER.size - 16  # header bytes the MAC covers (all but itself)
FLAG_MAC = 1
HEADER_BYTES = HEADER.size  # 64
MAGIC, VERSION = b"XKVT", 1
VERSION_CHECKS = 2  # checksum words follow the shards
RPC_FAIL = -900  # Mooncake ErrorCode: the master did not answer
OBJECT_ALREADY_EXISTS = -705
#: Most objects in one pull or push call (and header buffers per thread).
MAX_BATCH = 4096


def layout_digest(namespace: str, fingerprint: str, num_shards: int, shard_bytes: int,
                  check_words: int = 0) -> bytes:
    """16 bytes naming a layout on every host alike (msgpack of the tuple: unambiguous).
    ``check_words`` (issue 25) is part of the layout: it joins the tuple when not 0 (so a layout
    without words keeps its digest, and its objects on disk and in Mooncake)."""
    fields = ["xkv-tier-1", namespace, fingerprint, num_shards, shard_bytes]
    blob = msgspec.msgpack.encode(fields + [check_words] if check_words else fields)
    return hashlib.blake2b(blob, digest_size=16).digest()


def mooncake_key(digest: bytes, key: bytes) -> str:
    return f"xkv1/{digest.hex()}/{key.hex()}"


def key_digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=8).digest()


def pack_header(digest: bytes, key: bytes, num_shards: int, shard_bytes: int, crc: int,
                flags: int = 0, mac: bytes = bytes(16), version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, flags, num_shards, digest, key_digest(key), shard_bytes,
                       crc, mac)


def mac_key(secret: bytes) -> bytes:
    """The BLAKE2b key (64 bytes) derived from a secret of any length."""
    return hashlib.blake2b(b"xkv-tier-mac-1" + secret).digest()


@dataclass(frozen=True)
class TierItem:
    """One object to move: where its shards are in the card (byte offsets) and its identity."""

    digest: bytes
    key: bytes
    num_shards: int
    shard_bytes: int
    offsets: tuple[int, ...]
    ref: object = None  # the loop's handle (its index object); never touched by the threads
    #: Checksum words (issue 25), a writable buffer: a copy of the index's to push, or the
    #: STAGED object's own buffer that a pull fills. None: the layout has none.
    checks: bytearray | None = None

    @property
    def name(self) -> str:
        return mooncake_key(self.digest, self.key)

    @property
    def check_bytes(self) -> int:
        return len(self.checks) if self.checks is not None else 0

    @property
    def version(self) -> int:
        return VERSION_CHECKS if self.checks is not None else VERSION

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.num_shards * self.shard_bytes + self.check_bytes


@dataclass
class MooncakeSettings:
    master: str  # host:port of mooncake_master's RPC
    metadata: str  # e.g. http://host:8080/metadata (the master's embedded HTTP metadata server)
    protocol: str = "tcp"  # tcp | rdma
    device: str = ""  # RDMA device names (rdma only)
    local_hostname: str = "127.0.0.1"  # address peers reach this gateway's segment at
    segment_bytes: int = 1 << 30  # memory this gateway contributes to the shared pool
    local_buffer_bytes: int = 16 << 20
    probe_interval_s: float = 1.0
    secret: bytes | None = None  # shared by every gateway of the cluster: objects carry a MAC


def _endpoints(s: MooncakeSettings) -> list[tuple[str, str, int]]:
    """(what, host, port) of every TCP endpoint ``setup`` needs: the master's RPC, and the
    metadata server when it names one (``http://HOST:PORT/...``, ``etcd://HOST:PORT``,
    ``HOST:PORT``; not ``P2PHANDSHAKE``)."""
    out = []
    for what, addr in (("master", s.master), ("metadata server", s.metadata)):
        scheme, sep, _ = addr.partition("://")
        u = urllib.parse.urlsplit(addr if sep else f"//{addr}")
        try:
            port = u.port or {"http": 80, "https": 443}.get(scheme)
        except ValueError:  # not a HOST:PORT
            continue
        if u.hostname and port:
            out.append((what, u.hostname, port))
    return out


def unreachable(s: MooncakeSettings, timeout_s: float = 1.0) -> str | None:
    """None when every endpoint of :func:`_endpoints` accepts a TCP connection within
    ``timeout_s`` (the connect releases the interpreter lock), else which did not and why."""
    for what, host, port in _endpoints(s):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except OSError as e:
            return f"{what} {host}:{port} unreachable ({e.strerror or e})"
    return None


def _address(buf) -> int:
    """Address of a writable buffer; the temporary ctypes export is dropped at once."""
    c = ctypes.c_char.from_buffer(buf)
    addr = ctypes.addressof(c)
    del c
    return addr


class MooncakeBackend:
    """Owns one ``MooncakeDistributedStore`` client and the pull/push threads.

    ``card``: the card's arena (an mmap). Transfers are handed slot addresses, so xkv copies no
    byte; with RDMA the arena is registered with Mooncake (the NIC needs it), with TCP it is not. The loop calls :meth:`submit` (pull-thread jobs) and
    :meth:`offer` (write-through), and drains :attr:`done`; nothing here touches the index."""

    def __init__(self, settings: MooncakeSettings, card: mmap.mmap, *, store_factory=None):
        self.settings = settings
        self._card = card
        self._view = memoryview(card)
        self._card_addr = _address(card)
        self._factory = store_factory
        self._mac_key = mac_key(settings.secret) if settings.secret else None
        self.state = "connecting"  # read by the loop without a lock (a str swap is atomic)
        self.store = None
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._push_q: deque[TierItem] = deque()
        self._push_cv = threading.Condition()
        self._stop = threading.Event()
        self._hdr = {name: mmap.mmap(-1, MAX_BATCH * HEADER_BYTES) for name in ("pull", "push")}
        self._threads = [threading.Thread(target=self._pull_main, name="xkv-tier-pull", daemon=True),
                         threading.Thread(target=self._push_main, name="xkv-tier-push", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def backlog(self) -> int:
        return len(self._push_q)

    # ------------------------------------------------------------------ loop-side API

    def submit(self, job: tuple) -> None:
        """("exists", token, [names]) -> done gets ("exists", token, [0/1 per name]);
        ("pull", token, [TierItem]) -> ("pull", token, [status per item], bytes, seconds);
        status is "ok", "lost", "corrupt", "truncated" or "error";
        ("remove", token, [names]) -> ("removed", token, [Mooncake's return code per name])."""
        self._jobs.put(job)

    def offer(self, items: list[TierItem]) -> None:
        """Queue objects for write-through (the caller bounds the backlog); ``done`` gets
        ("pushed", items, [ok bool per item], bytes)."""
        with self._push_cv:
            self._push_q.extend(items)
            self._push_cv.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._jobs.put(None)
        with self._push_cv:
            self._push_cv.notify()
        alive = False
        for t in self._threads:
            if t.is_alive():
                t.join(timeout_s)
                alive |= t.is_alive()
        if self.store is not None and not alive:  # a thread stuck in a call keeps the client
            try:
                self.store.close()
            except Exception as e:  # closing must not fail the gateway's shutdown
                log.debug("mooncake close: %s", e)
        with contextlib.suppress(BufferError):  # a thread still inside a call keeps it
            self._view.release()

    # ------------------------------------------------------------------ connection state

    def _set_state(self, state: str, why: str = "") -> None:
        if state == self.state:
            return
        old, self.state = self.state, state
        s = self.settings
        if state == "up":
            log.info("mooncake tier up: master %s, metadata %s, %s, segment %d B%s",
                     s.master, s.metadata, s.protocol, s.segment_bytes,
                     " (reconnected)" if old == "down" else "")
        else:
            log.warning("mooncake tier %s: %s; serving the card only", state, why)

    def _connect(self) -> bool:
        s = self.settings
        why = unreachable(s) if self._factory is None else None
        if why is not None:
            # never call setup then: it retries for ~90 s holding the interpreter lock (every
            # thread of the gateway, the loop and signal handling included, stops meanwhile)
            self._set_state("down", f"{why}; setup not attempted, checked again every "
                                    f"{s.probe_interval_s:g} s")
            return False
        if self._factory is not None:
            store = self._factory()
        else:
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
        rc = store.setup(s.local_hostname, s.metadata, s.segment_bytes, s.local_buffer_bytes,
                         s.protocol, s.device, s.master)
        if rc != 0:
            self._set_state("down", f"setup with master {s.master} returned {rc}")
            return False
        # RDMA NICs can only move registered memory; registering also publishes the buffer to
        # every peer of the cluster, so over TCP (which moves any address) the card stays private.
        regs = []
        if s.protocol == "rdma":
            regs = [store.register_buffer(self._card_addr, len(self._card))]
            regs += [store.register_buffer(_address(h), len(h)) for h in self._hdr.values()]
        if any(regs):
            self._set_state("down", f"register_buffer returned {regs}")
            store.close()
            return False
        self.store = store
        self._set_state("up")
        return True

    def _probe(self) -> None:
        """While down: the client reconnects by itself; up again once the master answers."""
        if self.store.health_check() == 0 and self.store.batch_is_exist(["xkv1/probe"])[0] >= 0:
            self._set_state("up")

    def _failed(self, what: str, rc) -> None:
        self._set_state("down", f"{what} failed ({rc}): master {self.settings.master} unreachable")

    # ------------------------------------------------------------------ pull thread

    def _pull_main(self) -> None:
        while not self._stop.is_set():
            if self.store is None:
                if not self._connect():
                    self._stop.wait(self.settings.probe_interval_s)
                continue
            try:
                job = self._jobs.get(timeout=self.settings.probe_interval_s)
            except queue.Empty:
                job = ()
            if job is None:
                return
            try:
                if self.state == "down":
                    self._probe()
                elif not job and self.store.health_check() != 0:  # idle: notice a lost master
                    self._failed("health_check", self.store.health_check())
                if job:
                    self.done.put(self._run(job))
            except Exception as e:  # a bug or a binding error must not kill the tier silently
                log.exception("mooncake tier: %s job failed", job[0] if job else "probe")
                if job:
                    self.done.put(self._failure(job, repr(e)))

    def _failure(self, job: tuple, why: str) -> tuple:
        if job[0] == "exists":
            return ("exists", job[1], [0] * len(job[2]))
        if job[0] == "remove":
            return ("removed", job[1], [RPC_FAIL] * len(job[2]))
        return ("pull", job[1], ["error"] * len(job[2]), 0, 0.0)

    def _run(self, job: tuple) -> tuple:
        kind, token, payload = job
        if self.state != "up":
            return self._failure(job, "down")
        if kind == "exists":
            res = self.store.batch_is_exist(payload)
            if any(r == RPC_FAIL for r in res):
                self._failed("batch_is_exist", RPC_FAIL)
            return ("exists", token, [int(r == 1) for r in res])
        if kind == "remove":
            return ("removed", token, [self.store.remove(name) for name in payload])
        return self._pull(token, payload)

    def _pull(self, token, items: list[TierItem]) -> tuple:
        hdr = self._hdr["pull"]
        ptrs, sizes = self._buffers(items, "pull")
        t0 = time.perf_counter()
        with self._words_registered(items):
            res = self.store.batch_get_into_multi_buffers([it.name for it in items], ptrs, sizes)
        seconds = time.perf_counter() - t0
        out, nbytes = [], 0
        for i, (it, rc) in enumerate(zip(items, res, strict=True)):
            if rc == it.nbytes:
                status = self._verify(it, hdr[i * HEADER_BYTES:(i + 1) * HEADER_BYTES])
                nbytes += rc
            elif rc == RPC_FAIL:
                status = "error"
            else:  # gone, or another size than the layout says: ask which, for the counters
                size = self.store.get_size(it.name)
                status = "lost" if size < 0 else "truncated"
                log.warning("mooncake tier: object %s %s (get %d, size %d, expected %d): a miss",
                            it.name, "lost" if size < 0 else "has the wrong size", rc, size,
                            it.nbytes)
            out.append(status)
        if any(r == RPC_FAIL for r in res):
            self._failed("batch_get_into", RPC_FAIL)
        return ("pull", token, out, nbytes, seconds)

    def _buffers(self, items: list[TierItem], which: str) -> tuple[list, list]:
        """Per item, the addresses and sizes of its parts in object order: header (a side
        buffer), the shards (straight in the card's slots), the checksum words if any."""
        base = _address(self._hdr[which])
        ptrs, sizes = [], []
        for i, it in enumerate(items):
            ptrs.append([base + i * HEADER_BYTES] + [self._card_addr + o for o in it.offsets])
            sizes.append([HEADER_BYTES] + [it.shard_bytes] * it.num_shards)
            if it.check_bytes:
                ptrs[-1].append(_address(it.checks))
                sizes[-1].append(it.check_bytes)
        return ptrs, sizes

    @contextlib.contextmanager
    def _words_registered(self, items: list[TierItem]):
        """RDMA moves registered memory only: the items' word buffers are registered for the
        call (TCP moves any address: nothing to do)."""
        bufs = [it.checks for it in items if it.check_bytes]
        if self.settings.protocol != "rdma" or not bufs:
            yield
            return
        addrs = [_address(b) for b in bufs]
        for a, b in zip(addrs, bufs, strict=True):
            self.store.register_buffer(a, len(b))
        try:
            yield
        finally:
            for a in addrs:
                self.store.unregister_buffer(a)

    def _verify(self, it: TierItem, header: bytes) -> str:
        magic, version, flags, shards, digest, kdig, shard_bytes, crc, mac = HEADER.unpack(header)
        want = (MAGIC, it.version, it.num_shards, it.digest, key_digest(it.key), it.shard_bytes)
        if (magic, version, shards, digest, kdig, shard_bytes) != want:
            log.warning("mooncake tier: object %s has a foreign header (layout or key differs): "
                        "a miss", it.name)
            return "corrupt"
        if self._crc(it) != crc:
            log.warning("mooncake tier: object %s fails its checksum: a miss", it.name)
            return "corrupt"
        if self._mac_key is not None and not (
                flags & FLAG_MAC and hmac.compare_digest(mac, self._mac(it, header[:SIGNED]))):
            log.warning("mooncake tier: object %s is not signed with this cluster's secret: a "
                        "miss", it.name)
            return "corrupt"
        return "ok"

    def _mac(self, it: TierItem, signed: bytes) -> bytes:
        h = hashlib.blake2b(signed, digest_size=16, key=self._mac_key)
        for off in it.offsets:
            h.update(self._view[off:off + it.shard_bytes])  # releases the GIL
        if it.checks is not None:
            h.update(it.checks)
        return h.digest()

    def _crc(self, it: TierItem) -> int:
        crc, view = 0, self._view
        for off in it.offsets:
            crc = zlib.crc32(view[off:off + it.shard_bytes], crc)  # releases the GIL
        return zlib.crc32(it.checks, crc) if it.checks is not None else crc

    # ------------------------------------------------------------------ push thread

    def _push_main(self) -> None:
        while not self._stop.is_set():
            with self._push_cv:
                while not self._push_q and not self._stop.is_set():
                    self._push_cv.wait(1.0)
                batch = [self._push_q.popleft() for _ in range(min(len(self._push_q), 256))]
            if not batch:
                continue
            try:
                self.done.put(self._push(batch))
            except Exception:
                log.exception("mooncake tier: write-through failed")
                self.done.put(("pushed", batch, [False] * len(batch), 0))

    def _push(self, items: list[TierItem]) -> tuple:
        if self.state != "up" or self.store is None:
            return ("pushed", items, [False] * len(items), 0)
        hdr = self._hdr["push"]
        for i, it in enumerate(items):
            head = pack_header(it.digest, it.key, it.num_shards, it.shard_bytes, self._crc(it),
                               FLAG_MAC if self._mac_key else 0, version=it.version)
            if self._mac_key is not None:
                head = head[:SIGNED] + self._mac(it, head[:SIGNED])
            hdr[i * HEADER_BYTES:(i + 1) * HEADER_BYTES] = head
        ptrs, sizes = self._buffers(items, "push")
        with self._words_registered(items):
            res = self.store.batch_put_from_multi_buffers([it.name for it in items], ptrs, sizes)
        if any(r == RPC_FAIL for r in res):
            self._failed("batch_put_from", RPC_FAIL)
        ok = [r in (0, OBJECT_ALREADY_EXISTS) for r in res]  # another host wrote it first
        return ("pushed", items, ok, sum(it.nbytes for it, k in zip(items, ok, strict=True) if k))
