"""Issue 14 at the process level: who can reach the gateway, late writers through the real client,
the message-size rule, the metrics server, and the lock that marks a live shm card."""

from __future__ import annotations

import contextlib
import encodings.idna  # noqa: F401 (the child switched to another uid cannot import it)
import http.client
import json
import os
import pwd
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
import zmq
import zmq.auth

from xkv.gateway import GatewayClient, GatewayUnavailable
from xkv.gateway import protocol as P
from xkv.gateway.config import parse_args
from xkv.gateway.testing import curve_certificates, running_gateway, spawn_gateway, stop_gateway
from xkv.gateway.transport import control_path, instance_dir, user_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_as(uid: int, port: int, metrics_port: int, lease: int, epoch: int, key: bytes) -> dict:
    """Fork, become ``uid`` and try every endpoint of the gateway; what answered."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        out = {}
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with GatewayClient("localhost", port, timeout_s=0.3) as c:
                try:
                    c.ping()
                    out["client"] = "answered"
                except GatewayUnavailable:
                    out["client"] = "no reply"
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{control_path(port, uid=0)}")
            for msg in (P.Reserve(epoch, 1, [key]), P.Release(epoch, lease),
                        P.Lookup(epoch, [P.LookupGroup(1, [key])], False), P.Stats()):
                s.send_multipart([P.pack_id(1), P.encoder.encode(msg)])
            out["raw"] = "answered" if s.poll(500) else "no reply"
            ctx.destroy(linger=0)
            try:
                with socket.socket(socket.AF_UNIX) as u:
                    u.settimeout(1)
                    u.connect(os.path.join(instance_dir(port, uid=0), "card.sock"))
                    _, fds, _, _ = socket.recv_fds(u, 64, 2)
                    out["card"] = f"{len(fds)} fds"
            except OSError as e:
                out["card"] = type(e).__name__
            try:
                h = http.client.HTTPConnection("127.0.0.1", metrics_port, timeout=2)
                h.request("GET", "/metrics")
                out["metrics"] = f"HTTP {h.getresponse().status}"
            except (OSError, http.client.HTTPException) as e:
                out["metrics"] = type(e).__name__
        except BaseException as e:  # report, never escape the child
            out["error"] = repr(e)
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to uid nobody")
def test_another_uid_gets_no_reply_from_any_endpoint_and_changes_nothing():
    nobody = pwd.getpwnam("nobody").pw_uid
    mport = _free_port()
    with running_gateway("1M", extra_args=["--metrics-port", str(mport)]) as port, \
            GatewayClient("localhost", port, timeout_s=2.0) as owner:
        lid = owner.register_layout("ns", "fp", 1, 4096).layout_id
        assert lid == 1
        card = owner.map_card()
        [r] = owner.reserve(lid, [b"victim"])
        card[r.offsets[0]:r.offsets[0] + 6] = b"secret"
        owner.commit(lid, 0, [r])
        lease = owner.lookup([(lid, [b"victim"])]).lease_id
        before = owner.stats()
        udir, idir = user_dir(0), instance_dir(port, uid=0)
        sock, card_sock = control_path(port, uid=0), os.path.join(idir, "card.sock")
        modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in (udir, idir, sock, card_sock)}
        assert modes == {udir: 0o700, idir: 0o700, sock: 0o600, card_sock: 0o600}
        # 1. as installed: the 0700 directory keeps the other uid away from every socket
        got = _probe_as(nobody, port, mport, lease, owner.epoch, b"victim")
        assert got == {"client": "no reply", "raw": "no reply", "card": "PermissionError",
                       "metrics": "RemoteDisconnected"}, got
        # 2. directories and socket opened up by mistake: the peer-credential checks still
        # refuse (ZAP on the control socket, SO_PEERCRED on the card socket, /proc on metrics)
        try:
            for p in modes:
                os.chmod(p, 0o777)
            got = _probe_as(nobody, port, mport, lease, owner.epoch, b"victim")
        finally:
            for p, m in modes.items():
                os.chmod(p, m)
        assert got == {"client": "no reply", "raw": "no reply", "card": "0 fds",
                       "metrics": "RemoteDisconnected"}, got
        after = owner.stats()
        for k in ("requests_reserve", "requests_release", "requests_lookup", "requests_stats",
                  "reserved", "released", "refused_releases"):
            assert after.get(k, 0) == before.get(k, 0) + (k == "requests_stats"), k
        assert after["refused_connections"] >= 1
        hit = owner.lookup([(lid, [b"victim"])], lease=False)
        assert hit.num_chunks == 1 and bytes(card[hit.offsets[0][0]:][:6]) == b"secret"
        assert owner.release(lease) == 1  # the lease was still held, by its owner only
        del card


def test_tcp_only_with_curve_and_an_allow_list(tmp_path):
    secret, allowed, keys = curve_certificates(tmp_path, ["admitted", "stranger"],
                                               admitted=["admitted"])
    with pytest.raises(SystemExit, match="--curve-allowed-clients"):
        parse_args(["--curve-secret-key", secret])
    # without CURVE no TCP port is opened at all
    tport = _free_port()
    with running_gateway("1M", port=tport), pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", tport)).close()
    server_public = zmq.auth.load_certificate(str(tmp_path / "gateway.key"))[0]
    with running_gateway("1M", extra_args=["--curve-secret-key", secret,
                                           "--curve-allowed-clients", allowed]) as port:
        with GatewayClient("127.0.0.1", port, timeout_s=2.0, curve_server_key=server_public,
                           curve_client_keys=keys["admitted"]) as ok:
            assert ok.ping().protocol_version == P.PROTOCOL_VERSION
            lid = ok.register_layout("ns", "fp", 1, 100).layout_id
            ok.commit(lid, 0, ok.reserve(lid, [b"k"]))
        for who in (keys["stranger"], None):  # not on the list; a fresh key pair
            with GatewayClient("127.0.0.1", port, timeout_s=0.3, curve_server_key=server_public,
                               curve_client_keys=who) as c, pytest.raises(GatewayUnavailable):
                c.ping()
        with GatewayClient("localhost", port, timeout_s=2.0) as local:  # the owner's socket
            # spawn_gateway's readiness probe and the admitted client; strangers never got in
            assert local.stats()["requests_ping"] == 2


def test_remote_host_without_keys_is_refused_with_a_clear_message():
    c = GatewayClient("192.0.2.1", 5557, timeout_s=0.05)
    with pytest.raises(GatewayUnavailable, match="CURVE"):
        c.ping()
    c.close()


def test_late_writer_cannot_commit_and_its_pages_stay_quarantined():
    args = ["--write-ttl", "0.3", "--quarantine", "30"]
    with running_gateway("64K", extra_args=args) as port, \
            GatewayClient("localhost", port, timeout_s=2.0) as worker, \
            GatewayClient("localhost", port, timeout_s=2.0) as unmapped:
        lid = worker.register_layout("ns", "fp", 1, 4096).layout_id
        unmapped.register_layout("ns", "fp", 1, 4096)
        card = worker.map_card()
        [late] = worker.reserve(lid, [b"k"])
        time.sleep(0.6)  # the writer outlives its write TTL
        card[late.offsets[0]:late.offsets[0] + 4] = b"late"
        sent = worker.stats().get("requests_commit", 0)
        assert worker.commit(lid, 0, [late]) == 0 and worker.stale_reservations == 1
        assert worker.stats().get("requests_commit", 0) == sent  # checked locally, not sent
        [fresh] = unmapped.reserve(lid, [b"k"])  # another writer of the same key
        assert fresh.offsets != late.offsets  # the late writer's pages are quarantined
        assert unmapped.commit(lid, 0, [late]) == 0  # the gateway refuses the stale token
        assert unmapped.lookup([(lid, [b"k"])]).num_chunks == 0
        assert unmapped.commit(lid, 0, [fresh]) == 1
        s = unmapped.stats()
        assert s["refused_commits"] == 1 and s["quarantined_bytes"] == 4096
        del card


def test_largest_valid_message_is_answered_and_a_bigger_one_refused_before_sending():
    keys = [i.to_bytes(4, "little") * (P.MAX_KEY_BYTES // 4) for i in range(P.MAX_KEYS)]
    with running_gateway("64M") as port, GatewayClient("localhost", port, timeout_s=5.0) as c:
        lid = c.register_layout("ns", "fp", 1, 4096).layout_id
        res = c.reserve(lid, keys)
        assert res.status.count(P.ReserveStatus.OK) == P.MAX_KEYS
        assert c.commit(lid, 0, res) == P.MAX_KEYS
        assert c.lookup([(lid, keys)]).num_chunks == P.MAX_KEYS
        too_big = P.Reserve(c.epoch, lid, keys * 3)  # bypasses the schema's key limit
        with pytest.raises(ValueError, match="message limit"):
            c._call(too_big, P.ReserveReply, 1.0)
        assert c.ping().epoch == c.epoch


def test_metrics_survive_lease_churn_and_idle_connections_are_dropped():
    mport = _free_port()
    with running_gateway("16M", extra_args=["--metrics-port", str(mport)]) as port, \
            GatewayClient("localhost", port, timeout_s=2.0) as c:
        lid = c.register_layout("ns", "fp", 1, 4096).layout_id
        keys = [b"k%d" % i for i in range(64)]
        c.commit(lid, 0, c.reserve(lid, keys))
        held = [c.lookup([(lid, keys[: 1 + i % 64])]).lease_id for i in range(800)]
        stop = threading.Event()

        def churn():
            i = 0
            while not stop.is_set():
                c.release(held[i % len(held)])
                held[i % len(held)] = c.lookup([(lid, keys[: 1 + i % 64])]).lease_id
                i += 1

        idle = socket.create_connection(("127.0.0.1", mport))  # says nothing
        t = threading.Thread(target=churn)
        t.start()
        try:
            codes = []
            for _ in range(30):
                h = http.client.HTTPConnection("127.0.0.1", mport, timeout=5)
                h.request("GET", "/metrics")
                resp = h.getresponse()
                codes.append(resp.status)
                assert re.search(rb"\nxkv_gateway_leases (799|800)\n", resp.read())
        finally:
            stop.set()
            t.join()
        assert codes == [200] * 30
        idle.settimeout(10)
        t0 = time.monotonic()
        assert idle.recv(1) == b""  # the server hung up on the idle connection
        assert time.monotonic() - t0 < 8
        idle.close()


def test_a_live_shm_card_in_another_pid_namespace_is_kept(tmp_path):
    from xkv.gateway.card import Card

    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode:
        pytest.skip("cannot create a PID namespace here")
    port_file = tmp_path / "port"
    # burn pids inside the namespace: the gateway's pid there means nothing out here
    script = (f"for i in $(seq 300); do /bin/true; done; exec {sys.executable} -m xkv.gateway "
              f"--capacity 1M --card shm --port 0 --port-file {port_file} --log-level WARNING")
    other = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sh", "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert time.monotonic() < deadline and other.poll() is None
            time.sleep(0.05)
        with GatewayClient("localhost", int(port_file.read_text()), timeout_s=2.0) as c:
            info = c._call(P.Card(), P.CardInfo, 2.0)
            assert info.kind == "shm" and os.path.exists(info.path)
            mine = Card(1 << 20, 4096, kind="shm")  # cleans up stale cards at start
            mine.close()
            assert os.path.exists(info.path) and os.path.exists(info.gen_path)
            assert c.ping().epoch == info.epoch
        other.send_signal(signal.SIGKILL)  # --kill-child: the gateway dies with unshare
        other.wait()
        deadline = time.monotonic() + 10
        while True:  # its lock is gone once the process is: the next start removes the files
            mine = Card(1 << 20, 4096, kind="shm")
            mine.close()
            if not os.path.exists(info.path) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not os.path.exists(info.path) and not os.path.exists(info.gen_path)
    finally:
        with contextlib.suppress(ProcessLookupError):
            other.kill()
        other.wait()


def test_second_gateway_on_the_same_port_is_refused():
    proc, port = spawn_gateway("1M")
    try:
        r = subprocess.run([sys.executable, "-m", "xkv.gateway", "--capacity", "1M", "--port",
                            str(port)], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "another xkv-gateway runs on port" in r.stderr
        with GatewayClient("localhost", port, timeout_s=2.0) as c:
            assert c.ping()
    finally:
        assert stop_gateway(proc) == 0


def test_a_big_reserve_is_served_in_slices_and_a_lookup_overtakes_it():
    keys = [b"big-%d" % i for i in range(P.MAX_KEYS)]
    with running_gateway("64M") as port, GatewayClient("localhost", port, timeout_s=5.0) as c:
        lid = c.register_layout("ns", "fp", 1, 4096).layout_id
        c.commit(lid, 0, c.reserve(lid, keys[:100]))  # present at the start: EXISTS
        ctx = zmq.Context()
        try:
            socks = []
            for _ in range(2):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"ipc://{control_path(port)}")
                socks.append(s)
            heavy, light = socks
            for s in socks:  # connected before the race starts
                s.send_multipart([P.pack_id(1), P.encoder.encode(P.Ping())])
                assert s.poll(2000)
                s.recv_multipart()
            heavy.send_multipart([P.pack_id(2), P.encoder.encode(P.Reserve(c.epoch, lid, keys))])
            for i in range(2):  # more heavy work queued behind it on the same connection
                more = [b"more-%d-%d" % (i, j) for j in range(P.MAX_KEYS)]
                heavy.send_multipart([P.pack_id(10 + i),
                                      P.encoder.encode(P.Reserve(c.epoch, lid, more))])
            time.sleep(0.005)  # the gateway has started on the first one
            light.send_multipart([P.pack_id(3), P.encoder.encode(
                P.Lookup(c.epoch, [P.LookupGroup(lid, keys[:100])], False))])
            poller = zmq.Poller()
            poller.register(heavy, zmq.POLLIN)
            poller.register(light, zmq.POLLIN)
            order, replies = [], {}
            while len(order) < 4:
                ready = dict(poller.poll(5000))
                assert ready, "no reply"
                for s in ready:
                    rid, body = s.recv_multipart()
                    order.append(P.unpack_id(rid))
                    replies[P.unpack_id(rid)] = P.reply_decoder.decode(body)
        finally:
            ctx.destroy(linger=0)
        assert order.index(3) < order.index(2)  # the lookup did not wait for all 4096 keys
        assert replies[3].num_chunks == 100
        status = replies[2].status
        assert status[:100] == [P.ReserveStatus.EXISTS] * 100  # as found at the start
        assert status[100:] == [P.ReserveStatus.OK] * (P.MAX_KEYS - 100)
        offs = [s.offsets[0] for s in replies[2].slots[100:]]
        assert len(set(offs)) == len(offs)  # slices never hand out one slot twice


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_gateway_hostname_is_an_error_everywhere_not_localhost(monkeypatch, blank, capsys):
    """XKV_GATEWAY_HOSTNAME set but blank: the gateway, its stats command, the client and the
    connector all refuse it with the same words (one reading, xkv.gateway.transport)."""
    from xkv.connector.config import ConfigError, ConnectorConfig
    from xkv.gateway import stats_cli

    monkeypatch.setenv("XKV_GATEWAY_HOSTNAME", blank)
    words = "XKV_GATEWAY_HOSTNAME is set but empty"
    with pytest.raises(SystemExit, match=words):
        parse_args([])
    with pytest.raises(SystemExit):
        stats_cli.main([])
    assert words in capsys.readouterr().err
    with pytest.raises(ValueError, match=words):
        GatewayClient(port=1)
    with pytest.raises(ConfigError, match=words):
        ConnectorConfig.from_extra({}, {"PYTHONHASHSEED": "0", "XKV_GATEWAY_HOSTNAME": blank})
    from xkv.gateway.transport import gateway_host

    assert gateway_host({"XKV_GATEWAY_HOSTNAME": " cache-host "}) == "cache-host"
    monkeypatch.delenv("XKV_GATEWAY_HOSTNAME")
    assert parse_args([]).host == "localhost" and parse_args([]).port == 5557
