"""Where the gateway listens: its ROUTER sockets, the TCP bind, the per-instance socket
directory and the KV-events sockets, each with the error message a user can act on."""

from __future__ import annotations

import errno
import random
import secrets

import zmq

from xkv.gateway import protocol as P
from xkv.gateway.config import GatewayConfig
from xkv.gateway.events import EventPublisher
from xkv.gateway.transport import InstanceDir


def router(ctx: zmq.Context, domain: bytes) -> zmq.Socket:
    """A ROUTER for clients, in ZAP ``domain`` (transport.Authenticator decides who connects)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client that reconnects keeps its identity
    sock.zap_domain = domain
    return sock


def instance_dir(port: int) -> InstanceDir:
    """The socket directory of instance ``port`` (0: any free instance number)."""
    if port:
        try:
            return InstanceDir(port)
        except FileExistsError as e:
            raise SystemExit(f"xkv-gateway: {e}") from None
        except OSError as e:
            raise SystemExit(f"xkv-gateway: cannot use the socket directory: {e}") from None
    rng = random.Random(secrets.randbits(64))
    for _ in range(100):  # port 0 without TCP: any free instance number
        try:
            return InstanceDir(rng.randrange(20000, 60000))
        except FileExistsError:
            continue
    raise SystemExit("xkv-gateway: found no free instance number for --port 0")


def bind_tcp(sock: zmq.Socket, cfg: GatewayConfig) -> int:
    """Bind ``sock`` to ``cfg.bind_address:cfg.port`` (0 = a free port); returns the port."""
    address = cfg.bind_address
    if ":" in address:  # IPv6 literal
        sock.setsockopt(zmq.IPV6, 1)
        address = f"[{address}]"
    endpoint = f"tcp://{address}:{cfg.port or '*'}"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(
                f"xkv-gateway: port {cfg.port} on {cfg.bind_address} is already in use. "
                f"Another xkv-gateway may be running, or vLLM's KV-events publisher, which also "
                f"defaults to tcp://*:5557 (kv_events_config endpoint). Start the gateway with "
                f"--port N and set \"xkv_gateway_port\": N in kv_connector_extra_config, or move "
                f"vLLM's KV-events endpoint.") from None
        raise SystemExit(f"xkv-gateway: cannot bind {endpoint}: {e}") from None
    last = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return int(last.rsplit(":", 1)[1])


def bind_events(ctx: zmq.Context, cfg: GatewayConfig) -> EventPublisher | None:
    """The KV-events publisher (``--kv-events``), or None."""
    if cfg.kv_events_port is None:
        return None
    try:
        return EventPublisher(ctx, cfg.bind_address, cfg.kv_events_port,
                              topic=cfg.kv_events_topic, medium=cfg.kv_events_medium,
                              int_hashes=cfg.kv_events_int_hashes,
                              curve_secret_key=cfg.curve_secret_key,
                              replay_port=cfg.kv_events_replay_port)
    except zmq.ZMQError as e:
        raise SystemExit(
            f"xkv-gateway: cannot bind the KV-events sockets on {cfg.bind_address} (port "
            f"{cfg.kv_events_port}, replay port {cfg.kv_events_replay_port}): {e}. Pass "
            f"--kv-events-port N / --kv-events-replay-port N (0 picks a free port); "
            f"vLLM's own KV-events publisher uses 5557 (+1 per data-parallel rank).") from None
