"""The xkv-gateway process: flags, binding rules, shutdown, metrics, CURVE, the card's protection,
and the client's deadlines and errors."""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import zmq
import zmq.auth

from xkv.gateway import ErrorCode, GatewayClient, GatewayError, GatewayUnavailable, Reservation
from xkv.gateway import protocol as P
from xkv.gateway.config import parse_size
from xkv.gateway.testing import curve_certificates, running_gateway, spawn_gateway, stop_gateway

GATEWAY = [sys.executable, "-m", "xkv.gateway"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parse_size():
    assert parse_size("1G") == 1 << 30 and parse_size("512M") == 512 << 20
    assert parse_size("4096") == 4096 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("64k") == 64 << 10
    with pytest.raises(Exception, match="invalid size"):
        parse_size("12 parsecs")


def test_help_documents_every_flag():
    out = subprocess.run([*GATEWAY, "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--capacity", "--port", "--host", "--slot-alignment", "--metrics-port",
                 "--log-level", "--lease-ttl", "--write-ttl", "--namespace-quota", "--quota",
                 "--curve-secret-key", "--curve-allowed-clients", "--card", "--prefault",
                 "--stats-interval", "--port-file"):
        assert flag in out, flag
    assert "5557" in out and "XKV_GATEWAY_HOSTNAME" in out


def test_port_in_use_names_the_kv_events_clash(tmp_path):
    # Only a TCP gateway (CURVE on) can clash with vLLM's KV-events publisher.
    secret, allowed, _ = curve_certificates(tmp_path, ["client"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([*GATEWAY, "--capacity", "1M", "--port", str(port),
                            "--curve-secret-key", secret, "--curve-allowed-clients", allowed],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "already in use" in r.stderr and "KV-events" in r.stderr and "5557" in r.stderr


def test_non_loopback_bind_needs_curve():
    r = subprocess.run([*GATEWAY, "--capacity", "1M", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not a loopback address" in r.stderr
    assert "--curve-secret-key" in r.stderr


def test_sigterm_removes_the_card_and_logs_stats(tmp_path):
    log = tmp_path / "gw.log"
    with open(log, "w") as err:
        proc, port = spawn_gateway("2M", extra_args=["--card", "shm", "--stats-interval", "0.2",
                                                     "--log-level", "INFO"], stderr=err)
    with GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
        c.register_layout("ns", "fp", 1, 4096)
        card = c.map_card()
        card[:5] = b"hello"
        info = c._call(P.Card(), P.CardInfo, 2.0)
        assert info.kind == "shm" and os.path.exists(info.path)
        assert os.stat(info.path).st_mode & 0o777 == 0o600
        time.sleep(0.5)
        assert stop_gateway(proc) == 0
        assert not os.path.exists(info.path) and not os.path.exists(info.gen_path)
        assert bytes(card[:5]) == b"hello"  # our mapping outlives the name
        del card
    text = log.read_text()
    assert re.search(r"stats: used [\d.]+% of 2097152 B", text), text
    assert "stopped" in text


def test_metrics_endpoint():
    mport = _free_port()
    with running_gateway("4M", extra_args=["--metrics-port", str(mport)]) as port:
        with GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
            lid = c.register_layout("ns", "fp", 2, 1000).layout_id
            c.reserve(lid, [b"a"])
            c.lookup([(lid, [b"a"])])
        body = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read()
    text = body.decode()
    assert "xkv_gateway_capacity_bytes 4194304" in text
    assert 'xkv_gateway_object_bytes{state="staged"} 8192' in text
    assert 'xkv_gateway_requests_total{type="lookup"} 1' in text
    assert 'xkv_gateway_request_duration_seconds_count{type="reserve"} 1' in text
    assert 'xkv_gateway_reserve_results_total{result="ok"} 1' in text


def test_ttls_run_in_the_serving_loop():
    with running_gateway("1M", extra_args=["--lease-ttl", "0.3", "--write-ttl", "0.3"]) as port, \
            GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
        lid = c.register_layout("ns", "fp", 2, 100).layout_id
        done, _ = c.reserve(lid, [b"done", b"abandoned"])
        c.commit(lid, 0, [done])
        c.commit(lid, 1, [done])
        assert c.lookup([(lid, [b"done"])]).lease_id
        s = c.stats()
        assert (s["leases"], s["staged_objects"], s["ready_objects"]) == (1, 1, 1)
        time.sleep(0.8)  # idle: the loop's receive timeout still runs the expiry
        s = c.stats()
        assert (s["leases"], s["staged_objects"], s["ready_objects"]) == (0, 0, 1), s
        assert s["lease_expired"] == 1 and s["write_expired"] == 1


def test_card_is_shared_sealed_and_generations_read_only():
    with running_gateway("1M") as port, GatewayClient("127.0.0.1", port, timeout_s=2.0) as a, \
            GatewayClient("127.0.0.1", port, timeout_s=2.0) as b:
        lid = a.register_layout("ns", "fp", 1, 100).layout_id
        b.register_layout("ns", "fp", 1, 100)
        [r] = a.reserve(lid, [b"k"])
        a.map_card()[r.offsets[0]:r.offsets[0] + 3] = b"xyz"
        assert bytes(b.map_card()[r.offsets[0]:r.offsets[0] + 3]) == b"xyz"
        assert b.slot_generation(r.offsets[0]) == r.generations[0] == 0
        a.abort(lid, 0, [r])
        assert b.slot_generation(r.offsets[0]) == 1  # freed: generation moved, seen without RPC
        with pytest.raises(ValueError):
            b.slot_generation(r.offsets[0] + 1)
        with pytest.raises(TypeError):
            b._gens[0] = 1  # mapped read-only
        info = a._call(P.Card(), P.CardInfo, 2.0)
        assert info.kind == "memfd" and os.stat(os.path.dirname(info.path)).st_mode & 0o777 == 0o700
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(info.path)
            _, fds, _, _ = socket.recv_fds(s, 64, 2)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], 4096)  # sealed: nobody can shrink the card under others
            with pytest.raises(PermissionError):
                mmap.mmap(fds[1], 4096)  # F_SEAL_FUTURE_WRITE: no writable mapping
            assert fcntl.fcntl(fds[1], fcntl.F_GET_SEALS) & 0x10
        finally:
            for fd in fds:
                os.close(fd)


def test_client_errors_and_deadlines():
    port = _free_port()
    c = GatewayClient("127.0.0.1", port, timeout_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(GatewayUnavailable, match="is xkv-gateway running"):
        c.ping()
    assert time.monotonic() - t0 < 0.3
    with pytest.raises(GatewayError, match="register_layout"):
        c.lookup([(1, [b"k"])])
    c.close()
    with running_gateway("1M") as port, GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
        with pytest.raises(GatewayError) as e:
            c._call(P.Hello(P.PROTOCOL_VERSION + 1, "ns", "fp", 1, 1), P.LayoutInfo, 2.0)
        assert e.value.code == ErrorCode.BAD_VERSION and not isinstance(e.value, GatewayUnavailable)
        lid = c.register_layout("ns", "fp", 1, 4096).layout_id
        with pytest.raises(GatewayError) as e:
            c.register_layout("ns", "fp", 2, 4096)
        assert e.value.code == ErrorCode.LAYOUT_MISMATCH
        with pytest.raises(GatewayError) as e:
            c.register_layout("ns", "huge", 1, 2 << 20)
        assert e.value.code == ErrorCode.NO_SPACE
        with pytest.raises(GatewayError) as e:
            c.commit(lid, 3, [Reservation(b"k", (0,) * 4, (0,) * 4)])
        assert e.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(TypeError, match="reservations"):
            c.commit(lid, 0, [b"k"])  # a bare key has no token
        with pytest.raises(ValueError, match="at most"):
            c.reserve(lid, [b"k"] * (P.MAX_KEYS + 1))
        # the client stays usable after refusals
        res = c.reserve(lid, [b"k%d" % i for i in range(300)])
        assert res.status.count(P.ReserveStatus.NO_SPACE) == 300 - 256
        assert c.release(0) == 0 and c.ping().used_bytes == 1 << 20


def test_curve_encrypted_gateway(tmp_path):
    secret, allowed, keys = curve_certificates(tmp_path, ["client"])
    server_public, _ = zmq.auth.load_certificate(str(tmp_path / "gateway.key"))
    with running_gateway("1M", extra_args=[
            "--curve-secret-key", secret, "--curve-allowed-clients", allowed]) as port:
        with GatewayClient("127.0.0.1", port, timeout_s=2.0, curve_server_key=server_public,
                           curve_client_keys=keys["client"]) as c:
            assert c.endpoint.startswith("tcp://")
            assert c.ping().protocol_version == P.PROTOCOL_VERSION
        ctx = zmq.Context()
        try:  # a plaintext TCP client gets no service
            plain = ctx.socket(zmq.DEALER)
            plain.setsockopt(zmq.LINGER, 0)
            plain.connect(f"tcp://127.0.0.1:{port}")
            plain.send_multipart([P.pack_id(1), P.encoder.encode(P.Ping())])
            assert not plain.poll(300)
        finally:
            ctx.destroy(linger=0)


def test_card_in_process_prefault_and_names():
    from xkv.gateway.card import Card, open_card

    stale = "/dev/shm/xkv-card-0123456789abcdef"  # nobody holds its lock: a dead gateway's
    with open(stale, "wb"):
        pass
    c = Card(1 << 20, 4096, kind="shm", prefault=True, epoch=3)
    assert not os.path.exists(stale)  # left by a gateway that is gone: removed
    try:
        assert os.stat(c.path).st_mode & 0o777 == 0o600 and os.path.exists(c.gen_path)
        arena, gens = open_card("shm", c.path, c.gen_path, c.capacity_bytes, 3)
        c.arena[4096:4100] = b"abcd"
        c.generations[1] = 42
        assert arena[4096:4100] == b"abcd" and int.from_bytes(gens[8:16], "little") == 42
        with pytest.raises(OSError, match="announced"):
            open_card("shm", c.path, c.gen_path, c.capacity_bytes * 2, 3)
    finally:
        c.close()
    assert not os.path.exists(c.path) and not os.path.exists(c.gen_path)
    with pytest.raises(ValueError):
        Card(100, 4096)


def test_client_keeps_working_in_a_forked_child():
    with running_gateway("1M") as port, GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
        lid = c.register_layout("ns", "fp", 1, 100).layout_id
        card = c.map_card()
        pid = os.fork()
        if pid == 0:  # child: same client object, inherited mapping
            code = 1
            try:
                [r] = c.reserve(lid, [b"from-child"])
                card[r.offsets[0]:r.offsets[0] + 5] = b"child"
                code = 0 if c.commit(lid, 0, [r]) == 1 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        got = c.lookup([(lid, [b"from-child"])])
        off = got.offsets[0][0]
        assert got.num_chunks == 1 and bytes(card[off:off + 5]) == b"child"
