"""Command-line flags of the disk tier (``--disk DIR`` and friends), kept apart from config.py."""

from __future__ import annotations

import argparse


def add_disk_args(p: argparse.ArgumentParser, parse_size) -> None:
    d = p.add_argument_group(
        "local disk tier (xkv/gateway/disk_tier.py; docs/operations.md \"Disk tier\")",
        "Objects committed to the card are also written to files under --disk (write-behind, by "
        "I/O threads); a lookup that misses in the card restores what the disk holds into card "
        "slots before it answers. The files survive restarts: a restarted gateway serves them. "
        "Off without --disk.")
    d.add_argument("--disk", dest="disk_path", metavar="DIR", default=None,
                   help="directory of the disk tier (created if missing; objects go to "
                        "DIR/xkv-disk-1, mode 0700, which must belong to this user)")
    d.add_argument("--disk-capacity", type=parse_size, default=0, metavar="SIZE",
                   help="bytes of files the tier keeps, least recently used deleted first "
                        "(default: 90%% of the file system's free space at start)")
    d.add_argument("--disk-namespace-quota", type=parse_size, default=0, metavar="SIZE",
                   help="bytes of disk files any one namespace may keep (default 0 = no quota); "
                        "a namespace at its quota deletes its own oldest files, and never "
                        "another namespace's within its quota")
    d.add_argument("--disk-quota", type=lambda t: _quota(t, parse_size), action="append",
                   default=[], metavar="NS=SIZE",
                   help="disk quota of one namespace, overrides --disk-namespace-quota "
                        "(repeatable)")
    d.add_argument("--disk-threads", type=int, default=4, metavar="N",
                   help="I/O threads (default 4)")
    d.add_argument("--disk-read-depth", type=_depth, default="auto", metavar="N|auto",
                   help="O_DIRECT reads in flight at most, 1..--disk-threads (default auto: "
                        "measured at each start with a temporary file of 32 MiB for 4 threads: "
                        "some disks read fastest one request at a time, others want several; "
                        "bench/RESULTS.md \"Disk tier: reads in flight\")")
    d.add_argument("--disk-wait-ms", type=float, default=20.0, metavar="MS",
                   help="longest a lookup waits for a restore from disk before it is answered "
                        "from the card (default 20; keep it below the connector's "
                        "lookup_timeout_ms, 50 by default); the read still lands as a prefetch")
    d.add_argument("--disk-backlog", type=parse_size, default="256M", metavar="SIZE",
                   help="bytes of objects queued for writing at most (they stay pinned in the "
                        "card until written); more are not written and counted (default 256M)")
    d.add_argument("--disk-io-nice", type=int, default=10, metavar="N",
                   help="the I/O threads run N nice levels below the gateway's loop (0..19, "
                        "default 10): on a busy CPU the loop, which answers lookups, comes "
                        "first (bench/RESULTS.md \"Disk tier\")")
    d.add_argument("--disk-direct", action=argparse.BooleanOptionalAction, default=None,
                   help="O_DIRECT I/O (default: when the file system accepts it and the slot "
                        "alignment is a multiple of 4096; --disk-direct makes it a requirement, "
                        "--no-disk-direct uses the page cache)")


def _depth(text: str) -> int | str:
    """``N`` or ``auto`` of --disk-read-depth."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid --disk-read-depth {text!r}: expected a "
                                         "number of reads or 'auto'") from None


def _quota(text: str, parse_size) -> tuple[str, int]:
    """``NS=SIZE`` of --disk-quota (the card's --quota syntax)."""
    ns, sep, size = text.partition("=")
    if not sep or not ns:
        raise argparse.ArgumentTypeError(f"invalid disk quota {text!r}: expected NAMESPACE=SIZE")
    return ns, parse_size(size)


def disk_options(args: argparse.Namespace) -> dict:
    """GatewayConfig fields from the parsed flags; refuses bad values with a clear message."""
    if args.disk_path is None:
        extra = [f for f, v in (("--disk-capacity", args.disk_capacity),
                                ("--disk-direct", args.disk_direct),
                                ("--disk-namespace-quota", args.disk_namespace_quota),
                                ("--disk-quota", args.disk_quota)) if v]
        if extra:
            raise SystemExit(f"xkv-gateway: {', '.join(extra)} needs --disk DIR")
        return {}
    if not args.disk_path:
        raise SystemExit("xkv-gateway: --disk needs a directory")
    if not 1 <= args.disk_threads <= 64:
        raise SystemExit(f"xkv-gateway: --disk-threads must be 1..64, got {args.disk_threads}")
    if args.disk_read_depth != "auto" and not 1 <= args.disk_read_depth <= args.disk_threads:
        raise SystemExit(f"xkv-gateway: --disk-read-depth must be 1..--disk-threads "
                         f"({args.disk_threads}) or auto, got {args.disk_read_depth}")
    if not 0 <= args.disk_io_nice <= 19:
        raise SystemExit(f"xkv-gateway: --disk-io-nice must be 0..19, got {args.disk_io_nice}")
    if args.disk_wait_ms < 0 or args.disk_backlog < 0:
        raise SystemExit("xkv-gateway: --disk-wait-ms and --disk-backlog must be >= 0")
    if args.disk_capacity and args.disk_capacity < 1 << 20:
        raise SystemExit(f"xkv-gateway: --disk-capacity must be at least 1M, got "
                         f"{args.disk_capacity}")
    quotas = dict(args.disk_quota)
    for what, size in [("--disk-namespace-quota", args.disk_namespace_quota),
                       *((f"--disk-quota {ns}", q) for ns, q in quotas.items())]:
        if size and size < 1 << 20:
            raise SystemExit(f"xkv-gateway: {what} must be 0 or at least 1M, got {size}")
        if size and args.disk_capacity and size > args.disk_capacity:
            raise SystemExit(f"xkv-gateway: {what} {size} is more than --disk-capacity "
                             f"{args.disk_capacity}")
    return dict(disk_path=args.disk_path, disk_capacity_bytes=args.disk_capacity,
                disk_threads=args.disk_threads, disk_read_depth=args.disk_read_depth,
                disk_wait_ms=args.disk_wait_ms,
                disk_backlog_bytes=args.disk_backlog, disk_direct=args.disk_direct,
                disk_io_nice=args.disk_io_nice,
                disk_namespace_quota_bytes=args.disk_namespace_quota, disk_quotas=quotas)
