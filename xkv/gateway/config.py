"""Command line of ``xkv-gateway`` (also ``python -m xkv.gateway``)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field

from xkv.gateway import transport
from xkv.gateway.disk_config import add_disk_args, disk_options

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512M', '1G', '1.5GiB', '64k' (binary units, case-insensitive)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a number of bytes with an optional K/M/G/T suffix, "
            f"e.g. 512M or 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _quota(text: str) -> tuple[str, int]:
    ns, sep, size = text.partition("=")
    if not sep or not ns:
        raise argparse.ArgumentTypeError(f"invalid quota {text!r}: expected NAMESPACE=SIZE")
    return ns, parse_size(size)


@dataclass
class GatewayConfig:
    capacity_bytes: int = 1 << 30
    host: str = "localhost"
    bind_address: str = "127.0.0.1"
    port: int = 5557
    slot_alignment: int = 4096
    metrics_port: int | None = None
    log_level: str = "INFO"
    lease_ttl_s: float = 30.0
    write_ttl_s: float = 60.0
    quarantine_s: float = 60.0
    namespace_quota_bytes: int = 0
    quotas: dict[str, int] = field(default_factory=dict)
    curve_secret_key: bytes | None = None
    curve_allowed_clients: str | None = None
    card_kind: str = "auto"
    prefault: bool = False
    stats_interval_s: float = 60.0
    port_file: str | None = None
    kv_events_port: int | None = None  # None: no KV events (xkv.gateway.events)
    kv_events_topic: str = ""
    kv_events_medium: str = "CPU"
    kv_events_int_hashes: bool = True
    kv_events_replay_port: int | None = None
    # scale-out tier on Mooncake Store (off unless mooncake_master is set): xkv/gateway/tier.py
    mooncake_master: str | None = None
    mooncake_metadata: str = ""
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_local_hostname: str = ""
    mooncake_segment_bytes: int = 1 << 30
    mooncake_write_through: bool = True
    mooncake_wait_ms: float = 20.0
    mooncake_backlog: int = 4096
    mooncake_secret: bytes | None = None
    metrics_allowed_uids: tuple[int, ...] = ()
    # local disk tier (off unless disk_path is set): xkv/gateway/disk_tier.py, disk_config.py
    disk_path: str | None = None
    disk_capacity_bytes: int = 0  # 0: 90 % of the free space at start
    disk_threads: int = 4
    disk_read_depth: int | str = "auto"  # O_DIRECT reads in flight: N or measured at start
    disk_wait_ms: float = 20.0
    disk_backlog_bytes: int = 256 << 20
    disk_direct: bool | None = None  # None: O_DIRECT where it works
    disk_io_nice: int = 10
    disk_namespace_quota_bytes: int = 0  # per-namespace disk quotas, as the card's
    disk_quotas: dict[str, int] = field(default_factory=dict)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xkv-gateway",
        description="xkv gateway: owns the card (a shared-memory arena of KV slots) and its index. "
                    "vLLM workers on this host map the card; the connector talks to the gateway "
                    "over ZMQ on a Unix socket only this user reaches "
                    "($XKV_GATEWAY_SOCKET_DIR, else $XDG_RUNTIME_DIR or /run/user/<uid>, else /tmp)"
                    "/xkv-<uid>/gateway-<port>/control.sock; "
                    "TCP only with CURVE keys and an allow-list of clients.")
    p.add_argument("--capacity", type=parse_size, default="1G",
                   help="bytes of the card, e.g. 512M, 64G (default 1G); rounded down to the "
                        "slot alignment")
    p.add_argument("--host", default=None,
                   help="TCP address to bind when CURVE is on (default $XKV_GATEWAY_HOSTNAME, "
                        "else localhost); without --curve-secret-key no TCP port is opened "
                        "and a non-loopback address is refused")
    p.add_argument("--port", type=int, default=transport.DEFAULT_PORT,
                   help="instance number (default 5557, the connector's xkv_gateway_port): "
                        "names the socket directory gateway-<port>, and is the TCP port when "
                        "CURVE is on (vLLM's KV-events publisher defaults to TCP 5557 too); "
                        "0 picks a free one")
    p.add_argument("--slot-alignment", type=parse_size, default=4096,
                   help="slot sizes are rounded up to this many bytes (power of two, default 4096)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics "
                        "(default: off; 0 picks a free port); only this user, root and "
                        "--metrics-allow-uid get an answer")
    p.add_argument("--metrics-allow-uid", type=int, action="append", default=[], metavar="UID",
                   help="another local uid (e.g. the Prometheus agent's) that may scrape "
                        "/metrics (repeatable)")
    p.add_argument("--log-level", default=os.environ.get("XKV_LOG_LEVEL", "INFO").upper(),
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level (default $XKV_LOG_LEVEL, else INFO)")
    p.add_argument("--lease-ttl", type=float, default=30.0, metavar="SECONDS",
                   help="a lookup's lease on its slots ends after this long unless released "
                        "earlier (default 30)")
    p.add_argument("--write-ttl", type=float, default=60.0, metavar="SECONDS",
                   help="a reserved object not committed by every shard within this long is "
                        "freed (default 60)")
    p.add_argument("--quarantine", type=float, default=None, metavar="SECONDS",
                   help="pages of a reservation that expired or was aborted stay unused this "
                        "long after its write deadline, so a late writer cannot hit a new "
                        "object (default: the write TTL)")
    p.add_argument("--namespace-quota", type=parse_size, default=0, metavar="SIZE",
                   help="bytes of the card any one namespace may hold (default 0 = no quota)")
    p.add_argument("--quota", type=_quota, action="append", default=[], metavar="NS=SIZE",
                   help="quota for one namespace, overrides --namespace-quota (repeatable)")
    p.add_argument("--curve-secret-key", metavar="FILE",
                   help="ZMQ CURVE certificate of the gateway (zmq.auth.create_certificates "
                        "format, with its secret key); opens TCP on --host:--port with "
                        "encryption, needs --curve-allowed-clients. Clients need its public key.")
    p.add_argument("--curve-allowed-clients", metavar="DIR",
                   help="directory of client public certificates (*.key): only those clients "
                        "are served over TCP (required with --curve-secret-key)")
    p.add_argument("--card", dest="card_kind", choices=["auto", "memfd", "shm"], default="auto",
                   help="how the card is shared: memfd handed over a unix socket (default on "
                        "Linux) or a 0600 file in /dev/shm")
    p.add_argument("--prefault", action="store_true",
                   help="touch every page of the card at start (slower start, no page faults "
                        "later)")
    p.add_argument("--stats-interval", type=float, default=60.0, metavar="SECONDS",
                   help="log one stats line this often (default 60; 0 = never)")
    p.add_argument("--port-file", metavar="PATH",
                   help="write the bound port to PATH once listening (useful with --port 0)")
    ev = p.add_argument_group("KV events (vLLM's wire format, for prefix-aware routers)")
    ev.add_argument("--kv-events", action="store_true",
                    help="publish stored/removed blocks on tcp://HOST:5657 (ZMQ PUB, the address "
                         "of --host: loopback unless CURVE keys are given); default off")
    ev.add_argument("--kv-events-port", type=int, default=None, metavar="PORT",
                    help="port of the KV-events socket (implies --kv-events; default 5657, not "
                         "vLLM's 5557; 0 picks a free port)")
    ev.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                    help="ZMQ topic of every message (default empty, as vLLM's)")
    ev.add_argument("--kv-events-medium", default="CPU", metavar="MEDIUM",
                    help="medium named in the events: the card's tier (default CPU)")
    ev.add_argument("--kv-events-replay-port", type=int, default=None, metavar="PORT",
                    help="also answer vLLM-style replay requests (ZMQ ROUTER) on PORT: the "
                         "batches of the last 64 MiB from a sequence number on (default off)")
    t = p.add_argument_group(
        "scale-out tier (Mooncake Store; needs pip install xkv[mooncake])",
        "Objects committed to the card are written through to Mooncake; a lookup that misses in "
        "the card asks Mooncake and pulls what it finds into the card. Off without "
        "--mooncake-master.")
    t.add_argument("--mooncake-master", metavar="HOST:PORT",
                   help="mooncake_master RPC address (enables the tier), e.g. 10.0.0.5:50051")
    t.add_argument("--mooncake-metadata", metavar="URL", default="",
                   help="transfer-engine metadata server (default "
                        "http://<master host>:8080/metadata, the master's embedded HTTP server)")
    t.add_argument("--mooncake-protocol", choices=["tcp", "rdma"], default="tcp",
                   help="how objects move between hosts (default tcp)")
    t.add_argument("--mooncake-device", default="", metavar="NAMES",
                   help="RDMA device names for --mooncake-protocol rdma, e.g. mlx5_0,mlx5_1")
    t.add_argument("--mooncake-local-hostname", default="", metavar="ADDR",
                   help="address other hosts reach this gateway's segment at (default "
                        "127.0.0.1 when the master is on loopback, else this host's address)")
    t.add_argument("--mooncake-segment-size", type=parse_size, default="1G", metavar="SIZE",
                   help="memory this gateway contributes to the shared Mooncake pool (default 1G)")
    t.add_argument("--mooncake-write-through", action=argparse.BooleanOptionalAction,
                   default=True, help="write committed objects to Mooncake (default on); with "
                                      "--no-mooncake-write-through this host only reads")
    t.add_argument("--mooncake-wait-ms", type=float, default=20.0, metavar="MS",
                   help="longest a lookup that missed in the card waits for Mooncake before it "
                        "is answered from the card (default 20; keep it below the connector's "
                        "lookup_timeout_ms, 50 by default); a pull still running then lands "
                        "as a prefetch")
    t.add_argument("--mooncake-backlog", type=int, default=4096, metavar="OBJECTS",
                   help="objects queued for write-through at most; more are dropped and "
                        "counted (default 4096)")
    t.add_argument("--mooncake-secret-file", metavar="PATH",
                   help="a secret shared by every gateway of the cluster (mode 0600, at least 16 "
                        "bytes): objects carry a keyed MAC and objects without a valid one are "
                        "misses (default: crc32 only)")
    add_disk_args(p, parse_size)  # disk tier (issue 26)
    return p


def _secret(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise SystemExit(f"xkv-gateway: cannot read --mooncake-secret-file: {e}") from None
    if st.st_mode & 0o077:
        raise SystemExit(f"xkv-gateway: --mooncake-secret-file {path} is readable by others "
                         f"(mode {st.st_mode & 0o777:o}); chmod 600 it")
    if len(secret) < 16:
        raise SystemExit(f"xkv-gateway: --mooncake-secret-file {path} holds {len(secret)} bytes, "
                         f"expected at least 16 (e.g. head -c 32 /dev/urandom | base64)")
    return secret


def _mooncake(args) -> dict:
    if not args.mooncake_master:
        return {}
    host, sep, port = args.mooncake_master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"xkv-gateway: --mooncake-master must be HOST:PORT, got "
                         f"{args.mooncake_master!r}")
    try:  # before the card exists: a missing library is a start-up error, not a crash later
        import mooncake.store  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"xkv-gateway: --mooncake-master needs Mooncake Store: pip install "
                         f"'xkv[mooncake]' ('xkv[mooncake-cpu]' without CUDA) and, on "
                         f"Debian/Ubuntu, apt-get install libibverbs1 librdmacm1: {e}") from None
    if args.mooncake_wait_ms < 0 or args.mooncake_backlog < 0:
        raise SystemExit("xkv-gateway: --mooncake-wait-ms and --mooncake-backlog must be >= 0")
    if args.mooncake_segment_size < 1 << 20:
        raise SystemExit(f"xkv-gateway: --mooncake-segment-size must be at least 1M, got "
                         f"{args.mooncake_segment_size}")
    local = args.mooncake_local_hostname
    if not local:
        try:
            loopback = ipaddress.ip_address(socket.gethostbyname(host.strip("[]"))).is_loopback
            local = "127.0.0.1" if loopback else socket.gethostbyname(socket.gethostname())
        except OSError as e:
            raise SystemExit(f"xkv-gateway: cannot resolve the --mooncake-master host {host!r} "
                             f"or this host's name (give --mooncake-local-hostname): {e}") from None
        if not loopback and ipaddress.ip_address(local).is_loopback:
            raise SystemExit(f"xkv-gateway: this host's name resolves to {local}, which other "
                             f"hosts cannot reach; give --mooncake-local-hostname ADDR (the "
                             f"address the master and the other gateways reach this host at)")
    return dict(mooncake_master=args.mooncake_master,
                mooncake_metadata=args.mooncake_metadata or f"http://{host}:8080/metadata",
                mooncake_protocol=args.mooncake_protocol, mooncake_device=args.mooncake_device,
                mooncake_local_hostname=local, mooncake_segment_bytes=args.mooncake_segment_size,
                mooncake_write_through=args.mooncake_write_through,
                mooncake_wait_ms=args.mooncake_wait_ms, mooncake_backlog=args.mooncake_backlog,
                mooncake_secret=_secret(args.mooncake_secret_file))


def _resolve(host: str) -> str:
    if host in ("*", ""):
        return "0.0.0.0"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise SystemExit(f"xkv-gateway: cannot resolve --host {host!r}: {e}") from None


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    args = build_parser().parse_args(argv)
    try:
        args.host = args.host or transport.gateway_host()
    except ValueError as e:
        raise SystemExit(f"xkv-gateway: {e}") from None
    align = args.slot_alignment
    if align < 64 or align & (align - 1):
        raise SystemExit(f"xkv-gateway: --slot-alignment must be a power of two >= 64, got {align}")
    if args.capacity < align:
        raise SystemExit(f"xkv-gateway: --capacity {args.capacity} is smaller than one slot "
                         f"alignment ({align} bytes)")
    if not 0 <= args.port < 65536:
        raise SystemExit(f"xkv-gateway: --port must be 0..65535, got {args.port}")
    events_port = _events_port(args)
    if args.lease_ttl <= 0 or args.write_ttl <= 0:
        raise SystemExit("xkv-gateway: --lease-ttl and --write-ttl must be > 0 seconds")
    address = _resolve(args.host)
    secret = None
    if args.curve_secret_key:
        import zmq.auth

        try:
            _, secret = zmq.auth.load_certificate(args.curve_secret_key)
        except (OSError, ValueError) as e:
            raise SystemExit(f"xkv-gateway: cannot read --curve-secret-key: {e}") from None
        if not secret:
            raise SystemExit(f"xkv-gateway: {args.curve_secret_key} has no secret key (pass the "
                             f"*.key_secret certificate)")
    if args.curve_allowed_clients and not secret:
        raise SystemExit("xkv-gateway: --curve-allowed-clients needs --curve-secret-key")
    if secret and not args.curve_allowed_clients:
        raise SystemExit(
            "xkv-gateway: --curve-secret-key needs --curve-allowed-clients DIR: CURVE without an "
            "allow-list lets in anyone who knows the gateway's public key")
    if secret:
        from xkv.gateway.transport import load_client_keys

        try:
            load_client_keys(args.curve_allowed_clients)
        except (OSError, ValueError) as e:
            raise SystemExit(f"xkv-gateway: --curve-allowed-clients: {e}") from None
    if args.quarantine is not None and args.quarantine < 0:
        raise SystemExit("xkv-gateway: --quarantine must be >= 0 seconds")
    if not ipaddress.ip_address(address).is_loopback and secret is None:
        raise SystemExit(
            f"xkv-gateway: refusing to bind {args.host} ({address}): it is not a loopback address "
            f"and no --curve-secret-key was given. Anyone who can reach the port could read and "
            f"fill the cache. Bind localhost, or create keys with "
            f"python -c 'import zmq.auth; zmq.auth.create_certificates(\".\", \"gateway\")' and "
            f"pass --curve-secret-key gateway.key_secret --curve-allowed-clients DIR.")
    return GatewayConfig(
        capacity_bytes=args.capacity, host=args.host, bind_address=address, port=args.port,
        slot_alignment=align, metrics_port=args.metrics_port, log_level=args.log_level,
        lease_ttl_s=args.lease_ttl, write_ttl_s=args.write_ttl,
        quarantine_s=args.write_ttl if args.quarantine is None else args.quarantine,
        metrics_allowed_uids=tuple(args.metrics_allow_uid),
        namespace_quota_bytes=args.namespace_quota, quotas=dict(args.quota),
        curve_secret_key=secret, curve_allowed_clients=args.curve_allowed_clients,
        card_kind=args.card_kind, prefault=args.prefault, stats_interval_s=args.stats_interval,
        port_file=args.port_file, kv_events_port=events_port, kv_events_topic=args.kv_events_topic,
        kv_events_medium=args.kv_events_medium, kv_events_replay_port=_replay_port(args),
        kv_events_int_hashes=os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0",
        **_mooncake(args), **disk_options(args))


def _replay_port(args: argparse.Namespace) -> int | None:
    port = args.kv_events_replay_port
    if port is None:
        return None
    if args.kv_events_port is None and not args.kv_events:
        raise SystemExit("xkv-gateway: --kv-events-replay-port needs --kv-events")
    if not 0 <= port < 65536 or (port and port in (args.port, args.kv_events_port)):
        raise SystemExit(f"xkv-gateway: --kv-events-replay-port {port}: expected 0..65535, "
                         f"not the control or events port")
    return port


def _events_port(args: argparse.Namespace) -> int | None:
    """The KV-events port, None when events are off; refuses the control port."""
    from xkv.gateway.events import DEFAULT_EVENTS_PORT

    if args.kv_events_port is None and not args.kv_events:
        return None
    port = DEFAULT_EVENTS_PORT if args.kv_events_port is None else args.kv_events_port
    if not 0 <= port < 65536:
        raise SystemExit(f"xkv-gateway: --kv-events-port must be 0..65535, got {port}")
    if port and port == args.port:
        raise SystemExit(f"xkv-gateway: --kv-events-port {port} is the control port (--port); "
                         f"pick another (default {DEFAULT_EVENTS_PORT})")
    return port
