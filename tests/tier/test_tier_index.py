"""The index hooks the tier relies on (pure logic, no Mooncake needed to run them): a STAGED
object held by the tier is left alone by clients' COMMIT/ABORT and by the write TTL; every
object that becomes READY is announced once through ``on_ready``; the flags parse and refuse
nonsense with a message naming the value."""

from __future__ import annotations

import pytest

from xkv.gateway.config import parse_args
from xkv.gateway.index import Index
from xkv.gateway.protocol import ReserveStatus


def test_held_staged_object_ignores_client_commit_abort_and_write_ttl():
    ix = Index(1 << 20, slot_alignment=4096, write_ttl_s=1.0)
    lay = ix.register_layout("ns", "fp", 2, 5000)
    (st, slots), = ix.reserve(lay.layout_id, [b"k"], now=0.0)
    assert st == ReserveStatus.OK
    obj = lay.objects[b"k"]
    obj.leases = 1  # what Tier._reserve does while a pull writes into the slots
    gens = [ix.generations[o // 4096] for o in slots.offsets]
    assert ix.commit(lay.layout_id, 0, [b"k"]) == 0
    assert ix.commit(lay.layout_id, 1, [b"k"]) == 0
    assert ix.abort(lay.layout_id, 0, [b"k"]) == 0
    ix.expire(10.0)
    assert obj.alive and not obj.ready and lay.objects[b"k"] is obj
    assert [ix.generations[o // 4096] for o in slots.offsets] == gens  # slots never reused
    assert ix.lookup([(lay.layout_id, [b"k"])], 10.0)[0] == 0  # invisible while held
    ready = []
    ix.on_ready = ready.append
    obj.leases = 0  # the pull landed: the tier commits every shard
    assert ix.commit(lay.layout_id, 0, [b"k"]) == 1
    assert ready == []
    assert ix.commit(lay.layout_id, 1, [b"k"]) == 1
    assert ready == [obj] and obj.ready
    assert ix.commit(lay.layout_id, 1, [b"k"]) == 0 and ready == [obj]  # announced once
    assert ix.lookup([(lay.layout_id, [b"k"])], 10.0)[0] == 1


def test_unheld_staged_object_still_expires_and_aborts():
    ix = Index(1 << 20, slot_alignment=4096, write_ttl_s=1.0)
    lay = ix.register_layout("ns", "fp", 1, 4096)
    ix.reserve(lay.layout_id, [b"a", b"b"], now=0.0)
    assert ix.abort(lay.layout_id, 0, [b"a"]) == 1
    ix.expire(2.0)
    assert lay.objects == {} and ix.counters["write_expired"] == 1


def test_tier_flags():
    cfg = parse_args(["--mooncake-master", "127.0.0.1:50051"])
    assert cfg.mooncake_master == "127.0.0.1:50051"
    assert cfg.mooncake_metadata == "http://127.0.0.1:8080/metadata"
    assert cfg.mooncake_local_hostname == "127.0.0.1" and cfg.mooncake_protocol == "tcp"
    assert cfg.mooncake_write_through and cfg.mooncake_wait_ms == 20.0
    assert cfg.mooncake_segment_bytes == 1 << 30 and cfg.mooncake_backlog == 4096
    cfg = parse_args(["--mooncake-master", "localhost:1", "--mooncake-protocol", "rdma",
                      "--mooncake-device", "mlx5_0", "--no-mooncake-write-through",
                      "--mooncake-segment-size", "2G", "--mooncake-wait-ms", "5",
                      "--mooncake-metadata", "http://10.0.0.5:8080/metadata"])
    assert (cfg.mooncake_protocol, cfg.mooncake_device) == ("rdma", "mlx5_0")
    assert not cfg.mooncake_write_through and cfg.mooncake_segment_bytes == 2 << 30
    assert cfg.mooncake_metadata == "http://10.0.0.5:8080/metadata"
    assert parse_args([]).mooncake_master is None  # off by default
    import os
    import tempfile

    with tempfile.NamedTemporaryFile("wb", delete=False) as f:
        f.write(b"  s3cret-s3cret-s3cret\n")
    try:
        os.chmod(f.name, 0o600)
        cfg = parse_args(["--mooncake-master", "127.0.0.1:1", "--mooncake-secret-file", f.name])
        assert cfg.mooncake_secret == b"s3cret-s3cret-s3cret"
        os.chmod(f.name, 0o644)
        with pytest.raises(SystemExit, match="readable by others .mode 644.; chmod 600"):
            parse_args(["--mooncake-master", "127.0.0.1:1", "--mooncake-secret-file", f.name])
        os.chmod(f.name, 0o600)
        with open(f.name, "wb") as g:
            g.write(b"short")
        with pytest.raises(SystemExit, match="holds 5 bytes, expected at least 16"):
            parse_args(["--mooncake-master", "127.0.0.1:1", "--mooncake-secret-file", f.name])
    finally:
        os.unlink(f.name)
    assert parse_args(["--mooncake-master", "127.0.0.1:1"]).mooncake_secret is None
    for bad, msg in ((["--mooncake-master", "nohost"], "HOST:PORT, got 'nohost'"),
                     (["--mooncake-master", "h:99999"], "HOST:PORT, got 'h:99999'"),
                     (["--mooncake-master", "127.0.0.1:5", "--mooncake-wait-ms", "-1"], ">= 0"),
                     (["--mooncake-master", "127.0.0.1:5", "--mooncake-segment-size", "4k"],
                      "at least 1M, got 4096")):
        with pytest.raises(SystemExit, match=msg):
            parse_args(bad)


def test_remote_master_needs_a_reachable_local_hostname(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    with pytest.raises(SystemExit, match="resolves to 127.0.0.1, which other hosts cannot reach"):
        parse_args(["--mooncake-master", "10.1.2.3:50051"])
    cfg = parse_args(["--mooncake-master", "10.1.2.3:50051", "--mooncake-local-hostname",
                      "10.1.2.4"])
    assert cfg.mooncake_local_hostname == "10.1.2.4"
    assert cfg.mooncake_metadata == "http://10.1.2.3:8080/metadata"
