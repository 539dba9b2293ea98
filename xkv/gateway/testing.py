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
    pub._cap.close()  # no subscriber can connect to the capture
    pub.sock.close(linger=0)
    pub.sock = cap = FrameCapture()
    return pub, cap
