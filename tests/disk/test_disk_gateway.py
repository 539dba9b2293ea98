"""The disk tier inside real xkv-gateway processes: flags and their errors, a directory that cannot
be used stops the gateway with a message naming it, a restart serves what the disk holds
(bit-exact, keys unchanged) and a file damaged while the gateway was down is a counted miss."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from store_results import object_files  # noqa: E402

from xkv.gateway.client import GatewayClient
from xkv.gateway.config import parse_args
from xkv.gateway.disk_format import BLOCK, ROOT_NAME
from xkv.gateway.testing import spawn_gateway, stop_gateway

SHARDS, SHARD_BYTES = 2, 50000


def test_flags():
    cfg = parse_args([])
    assert cfg.disk_path is None
    cfg = parse_args(["--disk", "/x"])
    assert (cfg.disk_path, cfg.disk_capacity_bytes, cfg.disk_threads, cfg.disk_wait_ms,
            cfg.disk_backlog_bytes, cfg.disk_direct, cfg.disk_io_nice) == (
                "/x", 0, 4, 20.0, 256 << 20, None, 10)
    cfg = parse_args(["--disk", "/x", "--disk-capacity", "2T", "--disk-threads", "8",
                      "--disk-wait-ms", "5", "--disk-backlog", "1G", "--no-disk-direct"])
    assert (cfg.disk_capacity_bytes, cfg.disk_threads, cfg.disk_wait_ms,
            cfg.disk_backlog_bytes, cfg.disk_direct) == (2 << 40, 8, 5.0, 1 << 30, False)
    for bad, msg in ((["--disk-capacity", "1G"], "needs --disk"),
                     (["--disk", "/x", "--disk-threads", "0"], "--disk-threads must be 1..64"),
                     (["--disk", "/x", "--disk-capacity", "4k"], "at least 1M"),
                     (["--disk", "/x", "--disk-wait-ms", "-1"], ">= 0"),
                     (["--disk", "/x", "--disk-io-nice", "20"], "0..19"),
                     (["--disk-quota", "a=1G"], "needs --disk"),
                     (["--disk", "/x", "--disk-namespace-quota", "4k"], "at least 1M"),
                     (["--disk", "/x", "--disk-quota", "a=4k"], "--disk-quota a must be"),
                     (["--disk", "/x", "--disk-capacity", "1G", "--disk-quota", "a=2G"],
                      "more than --disk-capacity")):
        with pytest.raises(SystemExit, match=msg):
            parse_args(bad)
    cfg = parse_args(["--disk", "/x"])
    assert (cfg.disk_namespace_quota_bytes, cfg.disk_quotas) == (0, {})
    cfg = parse_args(["--disk", "/x", "--disk-namespace-quota", "100G", "--disk-quota", "a=1T",
                      "--disk-quota", "b=2G"])
    assert cfg.disk_namespace_quota_bytes == 100 << 30
    assert cfg.disk_quotas == {"a": 1 << 40, "b": 2 << 30}


def test_bad_disk_quota_is_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "xkv.gateway", "--disk", "/x", "--disk-quota",
                        "nosize"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "invalid disk quota 'nosize': expected NAMESPACE=SIZE" in p.stderr


def start_fails(args) -> str:
    p = subprocess.run([sys.executable, "-m", "xkv.gateway", "--port", "0", "--capacity", "4M",
                        *args], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    return p.stderr


def test_unusable_directory_stops_the_gateway(tmp_path):
    err = start_fails(["--disk", str(tmp_path / "no" / "such")])
    assert "does not exist and cannot be created" in err and str(tmp_path / "no") in err
    err = start_fails(["--disk", "/proc/self"])
    assert "cannot create" in err and "/proc/self" in err
    d = tmp_path / "d"
    (d / ROOT_NAME).mkdir(parents=True)
    os.chmod(d / ROOT_NAME, 0o755)
    err = start_fails(["--disk", str(d)])
    assert "chmod 700" in err


def stats_when(c, pred, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not pred(s := c.stats()):
        assert time.monotonic() < deadline, s
        time.sleep(0.01)
    return s


def test_restart_serves_the_disk_and_damage_is_a_miss(tmp_path):
    d = str(tmp_path / "disk")
    args = ["--disk", d, "--disk-wait-ms", "5000"]
    proc, port = spawn_gateway("16M", extra_args=args)
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
            lid = c.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
            card = c.map_card()
            keys = [os.urandom(32) for _ in range(6)]
            data = {}
            res = c.reserve(lid, keys)
            for k, r in zip(keys, res, strict=True):
                for s, off in enumerate(r.offsets):
                    data[(k, s)] = os.urandom(SHARD_BYTES)
                    card[off:off + SHARD_BYTES] = data[(k, s)]
            for s in range(SHARDS):
                assert c.commit(lid, s, res) == len(keys)
            stats_when(c, lambda s: s["disk_written"] == 6 and not s["disk_write_backlog_bytes"])
    finally:
        stop_gateway(proc)
    files = object_files(d)
    assert len(files) == 6
    victim = [f for f in files if os.path.basename(f) == keys[4].hex()][0]
    with open(victim, "r+b") as f:  # damaged while the gateway was down
        f.seek(BLOCK + 100)
        f.write(b"\xff" * 8)
    proc, port = spawn_gateway("16M", extra_args=args)
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
            lid = c.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
            card = c.map_card()
            s = stats_when(c, lambda s: s["disk_scanned"])
            assert s["disk_scan_found"] == 6 and s["ready_objects"] == 0
            r = c.lookup([(lid, keys)])
            assert r.num_chunks == 4  # chunk 4 fails its checksum: the prefix stops there
            for i, k in enumerate(keys[:4]):
                for s_, off in enumerate(r.slots[0][i].offsets):
                    assert bytes(card[off:off + SHARD_BYTES]) == data[(k, s_)]
            s = c.stats()
            assert s["disk_corrupt"] == 1 and s["disk_hits"] == 5 and s["disk_served_chunks"] == 4
            assert not os.path.exists(victim)
            assert s["disk_written"] == 0  # restored objects are not written again
    finally:
        stop_gateway(proc)


def test_disk_quota_in_a_real_gateway(tmp_path):
    """--disk-quota a=1M: namespace a keeps 9 files of 108 KiB (its oldest go), namespace b
    (no quota) keeps all it wrote; the stats and the directory agree."""
    from xkv.gateway.disk_format import file_bytes

    fb = file_bytes(SHARDS, SHARD_BYTES)
    d = str(tmp_path / "disk")
    proc, port = spawn_gateway("16M", extra_args=["--disk", d, "--disk-quota", "a=1M"])
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
            for ns, n in (("a", 12), ("b", 12)):
                lid = c.register_layout(ns, "fp", SHARDS, SHARD_BYTES).layout_id
                for _ in range(n):  # one at a time: the LRU order is the order of writing
                    before = c.stats()["disk_written"]
                    res = c.reserve(lid, [os.urandom(32)])
                    for s in range(SHARDS):
                        c.commit(lid, s, res)
                    stats_when(c, lambda s, b=before: s["disk_written"] == b + 1)
            s = stats_when(c, lambda s: s["disk_written"] == 24)
            assert s["disk_quota_evicted"] == 12 - (1 << 20) // fb and s["disk_quota_refused"] == 0
            assert s["disk_objects"] == (1 << 20) // fb + 12
    finally:
        stop_gateway(proc)
    files = object_files(d)
    assert len(files) == (1 << 20) // fb + 12
