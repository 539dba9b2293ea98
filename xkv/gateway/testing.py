"""Embedded gateway for tests and demos: a real ``xkv-gateway`` subprocess on a loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from xkv.gateway.client import GatewayClient, GatewayUnavailable


def spawn_gateway(capacity: int | str = "256M", port: int = 0, *, host: str = "127.0.0.1",
                  extra_args: list[str] | tuple[str, ...] = (), timeout_s: float = 30.0,
                  stderr=None) -> tuple[subprocess.Popen, int]:
    """Start ``python -m xkv.gateway`` and wait until it answers PING.

    ``capacity``: bytes or a size string ('64M'); ``port`` 0 lets the gateway pick a free port.
    ``extra_args``: more command-line flags (e.g. ``["--lease-ttl", "1"]``). The readiness
    probe uses the Unix socket (``GatewayClient("localhost", port)``), which is always bound.
    Returns (process, port). Stop it with :func:`stop_gateway` (SIGTERM, then SIGKILL).
    Raises RuntimeError, with the gateway's exit code, if it does not come up in ``timeout_s``.
    """
    fd, port_file = tempfile.mkstemp(prefix="xkv-gateway-port-")
    os.close(fd)
    os.unlink(port_file)
    cmd = [sys.executable, "-m", "xkv.gateway", "--capacity", str(capacity), "--host", host,
           "--port", str(port), "--port-file", port_file, "--log-level", "WARNING",
           *extra_args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + timeout_s
    try:
        while not os.path.exists(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"xkv-gateway did not start (exit code {proc.poll()}): "
                                   f"{' '.join(cmd)}")
            time.sleep(0.02)
        with open(port_file) as f:
            bound = int(f.read())
        # The Unix socket is always there (also with CURVE/TCP on): probe it.
        with GatewayClient("localhost", bound, timeout_s=0.5) as probe:
            while True:
                try:
                    probe.ping()
                    break
                except GatewayUnavailable:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"xkv-gateway on port {bound} never answered PING "
                                           f"(exit code {proc.poll()})") from None
    except BaseException:
        stop_gateway(proc)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(port_file)
    return proc, bound


def stop_gateway(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """SIGTERM (clean shutdown: the card's names are removed), SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def running_gateway(capacity: int | str = "256M", **kwargs) -> Iterator[int]:
    """``with running_gateway("64M") as port: ...`` — spawn_gateway + stop_gateway."""
    proc, port = spawn_gateway(capacity, **kwargs)
    try:
        yield port
    finally:
        stop_gateway(proc)


def curve_certificates(directory, clients=(), admitted=None) -> tuple[str, str, dict]:
    """CURVE key files for a TCP gateway in ``directory``: the gateway's certificate pair, one pair
    per name in ``clients``, and ``allowed/`` holding the public keys of ``admitted`` (default:
    every client). Returns (gateway secret certificate path, allowed dir, {name: (public,
    secret)}) — what ``--curve-secret-key`` / ``--curve-allowed-clients`` and the client take."""
    import zmq.auth

    d = os.fspath(directory)
    zmq.auth.create_certificates(d, "gateway")
    allowed = os.path.join(d, "allowed")
    os.mkdir(allowed)
    keys = {}
    for name in clients:
        zmq.auth.create_certificates(d, name)
        if admitted is None or name in admitted:
            os.replace(os.path.join(d, f"{name}.key"), os.path.join(allowed, f"{name}.key"))
        keys[name] = zmq.auth.load_certificate(os.path.join(d, f"{name}.key_secret"))
    return os.path.join(d, "gateway.key_secret"), allowed, keys


def wait_tier_result(backend, kind: str, timeout_s: float = 20.0, poll_s: float = 0.0002):
    """The next message of a Mooncake tier backend's ``done`` queue (``xkv.gateway.tier_store``),
    which must be of ``kind``; ``RuntimeError`` when none came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not backend.done.empty():
            msg = backend.done.get_nowait()
            if msg[0] != kind:
                raise RuntimeError(f"expected a {kind} result, got {msg!r}")
            return msg
        time.sleep(poll_s)
    raise RuntimeError(f"no {kind} result in {timeout_s} s")


class FrameCapture:
    """A stand-in for a publisher's ZMQ socket: keeps every multipart message sent."""

    def __init__(self) -> None:
        self.frames: list = []

    def send_multipart(self, frames, flags: int = 0) -> None:
        self.frames.append(frames)

    def close(self, linger: int | None = None) -> None:
        """Nothing to close."""


def capturing_publisher(ctx, **kw):
    """An ``EventPublisher`` on a free loopback port whose frames land in a
    :class:`FrameCapture` instead of the socket: (publisher, capture). ``kw``: its options."""
    from xkv.gateway.events import EventPublisher

    pub = EventPublisher(ctx, "127.0.0.1", 0, **kw)
    pub.sock.close(linger=0)
    pub.sock = cap = FrameCapture()
    return pub, cap


# ------------------------------------------------------------------ fault injection (issue 25)
#
# For the verified-restore fault suite: each helper makes one fault the restore path must detect
# (its checksum words no longer match the bytes a reader copies) or that must stay harmless.
# The index-level helpers act on an ``Index``; for a gateway served by a thread of the test
# process (:func:`gateway_in_thread`) run them on its loop with :func:`on_loop`. Each returns a
# function that undoes the fault, so one stored object can take many faults in turn.


@contextlib.contextmanager
def gateway_in_thread(capacity: int | str = "64M", extra_args=()):
    """A :class:`xkv.gateway.server.Gateway` whose loop runs in a daemon thread of this process
    (clients connect to ``gw.port`` as usual); the test can reach ``gw.index`` and
    ``gw.card.arena`` — but change the index only through :func:`on_loop`."""
    import threading

    from xkv.gateway.config import parse_args
    from xkv.gateway.server import Gateway

    gw = Gateway(parse_args(["--capacity", str(capacity), "--port", "0", "--log-level",
                             "WARNING", *extra_args]))
    loop = threading.Thread(target=gw.serve, name="xkv-gateway-loop", daemon=True)
    loop.start()
    try:
        yield gw
    finally:
        gw.stop()
        loop.join(10)
        gw.close()


def on_loop(gw, fn, timeout_s: float = 10.0):
    """``fn()`` run on ``gw``'s loop thread between two requests (the index has one writer);
    returns its result or raises what it raised. A PING wakes the loop at once."""
    import threading

    done, box = threading.Event(), {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            box["error"] = e
        done.set()

    gw.loop_calls.append(call)
    with GatewayClient("localhost", gw.port, timeout_s=timeout_s) as poke, \
            contextlib.suppress(GatewayUnavailable):
        poke.ping()
    if not done.wait(timeout_s):
        raise RuntimeError(f"the gateway loop did not run the call within {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _obj(index, layout_id: int, key: bytes):
    obj = index.layout(layout_id).objects.get(key)
    if obj is None or not obj.ready:
        raise KeyError(f"key {key.hex()[:32]} of layout {layout_id} is not a committed object")
    return obj


def flip_bit(card, offset: int, bit: int):
    """(a) Flip bit ``bit`` (0 = lowest bit of the byte at ``offset``) of the card: e.g. offset
    = a committed object's ``slots.offsets[shard]``, bit < shard_bytes * 8 (a bit flip in host
    memory). ``card``: the gateway's ``card.arena`` or a client's ``map_card()``. Returns the
    undo."""
    pos = offset + bit // 8
    if not 0 <= pos < len(card):
        raise ValueError(f"byte {pos} is outside the card of {len(card)} bytes")
    mask = 1 << (bit % 8)

    def undo():
        card[pos] ^= mask

    card[pos] ^= mask
    return undo


def misdirect(index, layout_id: int, key: bytes, other_key: bytes):
    """(b) The index entry of ``key`` points at ``other_key``'s slots (offsets and generations,
    so the generation check passes): lookups of ``key`` return another object's bytes with
    ``key``'s checksum words. Both must be committed objects of the layout. Returns the undo."""
    obj, other = _obj(index, layout_id, key), _obj(index, layout_id, other_key)
    saved = (obj.slots, obj.packed)

    def undo():
        obj.slots, obj.packed = saved

    obj.slots, obj.packed = other.slots, other.packed
    return undo


def reuse_under_stale_generation(index, card, layout_id: int, key: bytes, donor_key: bytes):
    """(c) ``key``'s slots get the bytes of another object (``donor_key``, same layout) as if
    the slots had been handed to a new occupant while their generations stayed what readers
    noted (a stale generation; also what a writer past write TTL + quarantine leaves). Every
    shard's ``slot_bytes`` are overwritten; generations do not move. Returns the undo."""
    obj, donor = _obj(index, layout_id, key), _obj(index, layout_id, donor_key)
    n = obj.layout.slot_bytes
    saved = [bytes(card[o:o + n]) for o in obj.slots.offsets]
    for o, d in zip(obj.slots.offsets, donor.slots.offsets, strict=True):
        card[o:o + n] = card[d:d + n]

    def undo():
        for o, b in zip(obj.slots.offsets, saved, strict=True):
            card[o:o + n] = b

    return undo


def bump_generation(index, layout_id: int, key: bytes, shard: int = 0):
    """(c') The generation of ``key``'s slot of ``shard`` moves while the object stays (what a
    reuse does): a reader's token from before is stale, its copy must not count. Returns the
    undo (the generation goes back)."""
    obj = _obj(index, layout_id, key)
    page = obj.slots.offsets[shard] // index.alignment
    index.generations[page] += 1

    def undo():
        index.generations[page] -= 1

    return undo


def torn_commit(client, layout_id: int, ref, data, checksums, written) -> int:
    """(d) A torn or truncated object: for each shard r of the reservation ``ref`` (a
    ChunkRef from ``client.reserve``), only the first ``written[r]`` bytes of ``data[r]`` reach
    its slot (0: the shard is never written; len(data[r]) - k: its tail is cut) — the rest
    keeps whatever the slot held — and every shard is committed with the checksum words of the
    full bytes (``checksums[r]``, as the connector computed them). Returns the shards committed."""
    card = client.map_card()
    if not len(data) == len(checksums) == len(written) == len(ref.offsets):
        raise ValueError(f"one data, checksum and written count per shard ({len(ref.offsets)}), "
                         f"got {len(data)}, {len(checksums)}, {len(written)}")
    done = 0
    for r, (off, d, n) in enumerate(zip(ref.offsets, data, written, strict=True)):
        if not 0 <= n <= len(d):
            raise ValueError(f"written[{r}] = {n}: expected 0..{len(d)}")
        card[off:off + n] = d[:n]
        done += client.commit(layout_id, r, [ref], checksums=[checksums[r]])
    return done
