"""Who can reach the gateway: where its sockets live and how peers are authenticated.

Default (no keys configured): the control socket is a Unix socket,
``<base>/xkv-<uid>/gateway-<port>/control.sock``, next to the card hand-over socket
``card.sock`` and a ``lock`` file. ``<base>`` is ``$XKV_GATEWAY_SOCKET_DIR``, else the user's
runtime directory (``$XDG_RUNTIME_DIR``, ``/run/user/<uid>``), else ``/tmp`` (sockdir.py: how a
planted directory or a fake gateway of another user is refused by both sides);
``<uid>`` is the user both the gateway and vLLM run as; ``<port>`` is ``xkv_gateway_port``
(5557), which only names the instance here (no TCP port is opened). ``xkv-<uid>`` is mode 0700,
so other users cannot even reach the socket; on top of that the gateway's ZAP handler checks the
connecting process's uid (SO_PEERCRED, which libzmq reports as ``localhost:uid:gid:pid``) and
refuses every uid other than its own and root, so a directory opened by mistake still lets
nobody in. A refused peer gets no reply at all.

TCP (other hosts, other containers without a shared socket directory) only with CURVE: the
gateway's secret certificate *and* a directory of allowed client public certificates; the ZAP
handler admits only those keys. Clients need the gateway's public key and their own key pair.

The ``lock`` file is held with ``flock`` for the gateway's whole life: it, not a pid, tells
whether a gateway is alive (pids are meaningless across PID namespaces sharing /tmp or
/dev/shm), so a second gateway on the same port fails at start and a dead one's leftovers are
removed safely.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import secrets
import socket
import threading
import time

import zmq
from zmq.utils import z85

# where the sockets live and whose they are (re-exported: the names callers always used)
from xkv.gateway.sockdir import (  # noqa: F401
    check_base,
    check_private_dir,
    control_path,
    instance_dir,
    socket_base,
    user_dir,
)

log = logging.getLogger("xkv.gateway")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: The connector's ``xkv_gateway_port`` and the gateway's ``--port`` when not given (vLLM's
#: KV-events publisher defaults to tcp://*:5557 too: the clash is detected and named).
DEFAULT_PORT = 5557
#: The gateway's host when ``XKV_GATEWAY_HOSTNAME`` is unset.
DEFAULT_HOST = "localhost"
IPC_DOMAIN, TCP_DOMAIN = b"xkv-ipc", b"xkv-tcp"
#: Seconds between two log lines about refused connections (each line counts all refusals).
REFUSAL_LOG_INTERVAL_S = 10.0
_SUN_PATH_MAX = 107


def gateway_host(env=None) -> str:
    """``XKV_GATEWAY_HOSTNAME`` (stripped), else :data:`DEFAULT_HOST`: the one reading of it for
    the connector, the client and the gateway's CLI. Set but blank is a ``ValueError``, never
    quietly the default (a typo'd deployment must not talk to the wrong gateway)."""
    env = os.environ if env is None else env
    host = env.get("XKV_GATEWAY_HOSTNAME", DEFAULT_HOST).strip()
    if not host:
        raise ValueError("XKV_GATEWAY_HOSTNAME is set but empty; unset it or name the host")
    return host


class InstanceDir:
    """Gateway side: the 0700 directory of one gateway instance, locked for its life."""

    def __init__(self, port: int):
        self.port = port
        udir = user_dir()
        os.makedirs(os.path.dirname(udir), exist_ok=True)
        check_base(os.path.dirname(udir))
        check_private_dir(udir, create=True)
        self.path = instance_dir(port)
        check_private_dir(self.path, create=True)
        if len(os.path.join(self.path, "control.sock")) > _SUN_PATH_MAX:
            raise OSError(f"socket path {self.path}/control.sock is longer than "
                          f"{_SUN_PATH_MAX} bytes; set XKV_GATEWAY_SOCKET_DIR to a shorter "
                          f"directory")
        self.lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock_fd)
            raise FileExistsError(
                f"another xkv-gateway runs on port {port} for this user (it holds "
                f"{self.path}/lock); stop it or pick another --port") from None
        for name in ("control.sock", "card.sock"):  # a dead gateway's leftovers
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, name))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        for name in ("control.sock", "card.sock", "lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.file(name))
        with contextlib.suppress(OSError):
            os.rmdir(self.path)
        os.close(self.lock_fd)


def is_locked(path: str) -> bool:
    """True while a live process holds an flock on ``path`` (False if it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class Authenticator:
    """ZAP handler of the gateway's context: on the Unix socket (domain IPC_DOMAIN, NULL
    mechanism) admit peers whose uid is in ``uids``; on TCP (TCP_DOMAIN, CURVE) admit client
    public keys in ``curve_keys`` (z85). Everything else is refused (no reply reaches it)."""

    def __init__(self, ctx: zmq.Context, uids: set[int], curve_keys: set[bytes] | None = None):
        self.uids = set(uids)
        self.curve_keys = set(curve_keys or ())
        self.refused = 0
        self._next_log = 0.0
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xkv-zap", daemon=True)
        self._thread.start()

    def admit(self, domain: bytes, address: bytes, mechanism: bytes,
              credentials: list[bytes]) -> bytes | None:
        """The peer's name when admitted, else None. The name is what the peer cannot choose:
        ``uid:<uid>:pid:<pid>`` on the Unix socket (SO_PEERCRED, as libzmq reports it) or
        ``curve:<z85 public key>`` on TCP; ZMQ attaches it to every message of the connection
        (property ``User-Id``), and the gateway keys its per-client limits by it."""
        if domain == IPC_DOMAIN and mechanism == b"NULL":
            parts = address.decode("ascii", "replace").split(":")
            try:
                uid, pid = int(parts[-3]), int(parts[-1])  # "localhost:uid:gid:pid"
            except (IndexError, ValueError):
                return None
            return b"uid:%d:pid:%d" % (uid, pid) if uid in self.uids else None
        if domain == TCP_DOMAIN and mechanism == b"CURVE" and credentials:
            key = z85.encode(credentials[0])
            return b"curve:" + key if key in self.curve_keys else None
        return None

    def _run(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(200):
                continue
            try:
                msg = sock.recv_multipart()
                version, rid, domain, address, _identity, mechanism, *creds = msg
            except (zmq.ZMQError, ValueError):
                continue
            peer = self.admit(domain, address, mechanism, creds)
            if peer is None:
                self.refused += 1
                self._log_refusal(domain, mechanism, address)
            sock.send_multipart([version, rid, b"400" if peer is None else b"200",
                                 b"refused" if peer is None else b"OK", peer or b"", b""])

    def _log_refusal(self, domain: bytes, mechanism: bytes, address: bytes) -> None:
        """One warning per REFUSAL_LOG_INTERVAL_S at most (a stranger retrying its handshake
        must not flood the log); the line counts the refusals it stands for."""
        now = time.monotonic()
        if now < self._next_log:
            return
        log.warning("refused a connection (%s, %s, %s); %d refused so far (at most one line "
                    "per %gs)", domain.decode(errors="replace"), mechanism.decode(errors="replace"),
                    address.decode(errors="replace"), self.refused, REFUSAL_LOG_INTERVAL_S)
        self._next_log = now + REFUSAL_LOG_INTERVAL_S

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


def load_client_keys(directory: str) -> set[bytes]:
    """z85 public keys of every certificate in ``directory`` (zmq.auth format)."""
    import zmq.auth

    keys = set(zmq.auth.load_certificates(directory).keys())
    if not keys:
        raise ValueError(f"no client public certificates (*.key) in {directory}")
    return keys


def tcp_peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid owning the other end of a loopback TCP connection (from /proc/net/tcp{,6}:
    the peer's socket is the one whose local address is ``peer`` and remote is ``local``);
    None when not found (not loopback, or another network namespace)."""
    def enc(addr: tuple[str, int], v6: bool) -> str:
        ip = ipaddress.ip_address(addr[0])
        if v6 and ip.version == 4:
            ip = ipaddress.IPv6Address("::ffff:" + addr[0])
        raw = ip.packed
        words = [raw[i:i + 4][::-1].hex().upper() for i in range(0, len(raw), 4)]
        return "".join(words) + f":{addr[1]:04X}"

    for name, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            want_l, want_r = enc(peer, v6), enc(local, v6)
        except ValueError:
            continue
        if not v6 and ":" in peer[0]:
            continue
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[1] == want_l and cols[2] == want_r:
                        return int(cols[7])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return None


# ---------------------------------------------------------------- client side


def is_local(host: str) -> bool:
    if host in ("localhost", "ip6-localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def load_curve(server, client):
    """(server public key, (client public, client secret)) from certificate paths (or keys)."""
    import zmq.auth

    # a certificate file, or a z85 key given as text
    server = zmq.auth.load_certificate(server)[0] if os.path.isfile(server) else server.encode()
    if isinstance(client, str):
        public, secret = zmq.auth.load_certificate(client)
        if not secret:
            raise ValueError(f"{client} has no secret key: pass the *.key_secret certificate")
        client = (public, secret)
    return server, client


def routing_id() -> bytes:
    return b"\x01" + secrets.token_bytes(15)  # libzmq: a routing id must not start with 0
