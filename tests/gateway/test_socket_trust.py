"""Issue 27 item 4: a socket directory or a gateway planted by another local user is never
trusted. The second user is ``nobody``: a directory made with ``setpriv`` as that user, a fake
gateway (a ZMQ ROUTER answering HELLO/CARD/PING, and its own memfd card) in a forked child that
switched to that uid. Root only (the CI machine runs as root); the base-choice tests run anywhere.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import zmq

from xkv.gateway import GatewayClient, GatewayError, GatewayUnavailable, sockdir
from xkv.gateway import protocol as P
from xkv.gateway.card import Card, open_card
from xkv.gateway.testing import spawn_gateway, stop_gateway

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second uid")
EPOCH = 4242


def _nobody() -> tuple[int, int]:
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


@pytest.fixture
def base(monkeypatch):
    """A /tmp-like base (root's, mode 1777: anyone may create entries) as the socket base."""
    d = tempfile.mkdtemp(prefix="xkv-base-", dir="/tmp")
    os.chmod(d, 0o1777)
    monkeypatch.setenv(sockdir.SOCKET_DIR_ENV, d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_nobody(*cmd: str) -> None:
    uid, gid = _nobody()
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *cmd],
                   check=True)


def _fake_gateway(idir: str, ready_w: int) -> None:
    """Child body: become nobody, serve a gateway look-alike in ``idir`` (made here, ours)."""
    uid, gid = _nobody()
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        os.makedirs(idir, 0o700, exist_ok=True)
        card = Card(1 << 20, 4096, kind="memfd", epoch=EPOCH,
                    handover_path=os.path.join(idir, "card.sock"))
        ctx = zmq.Context()
        r = ctx.socket(zmq.ROUTER)
        r.bind(f"ipc://{os.path.join(idir, 'control.sock')}")
        os.write(ready_w, b"1")
        while True:
            ident, rid, body = r.recv_multipart()
            req = P.request_decoder.decode(body)
            if isinstance(req, P.Hello):
                rep = P.LayoutInfo(EPOCH, 1, 4096, req.num_shards, req.shard_bytes, 1 << 20,
                                   30.0, 60.0)
            elif isinstance(req, P.Card):
                rep = P.CardInfo(EPOCH, "memfd", card.path, "", card.capacity_bytes, 4096)
            else:
                rep = P.PingReply(EPOCH, P.PROTOCOL_VERSION, 1 << 20, 0, 1.0)
            r.send_multipart([ident, rid, P.encoder.encode(rep)])
    finally:
        os._exit(0)


@contextlib.contextmanager
def _fake(idir: str):
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        _fake_gateway(idir, wr)
    os.close(wr)
    try:
        with os.fdopen(rd, "rb") as f:
            assert f.read(1) == b"1", "the fake gateway did not start"
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


# ------------------------------------------------------------------ where the sockets live


def test_runtime_dir_first_if_ours_and_closed_then_tmp(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(run)}
    assert sockdir.candidate_bases(env=env)[0] == str(run)
    assert sockdir.candidate_bases(env=env)[-1] == "/tmp"
    run.chmod(0o755)  # open to others: not a runtime directory we may use
    assert str(run) not in sockdir.candidate_bases(env=env)
    assert sockdir.candidate_bases(env={**env, sockdir.SOCKET_DIR_ENV: "/x"}) == ["/x"]
    assert sockdir.control_path(5557, base="/b") == f"/b/xkv-{os.geteuid()}/gateway-5557/control.sock"


def test_gateway_and_client_agree_without_configuration(tmp_path, monkeypatch):
    """The gateway picked /tmp (no runtime directory in its environment); vLLM's environment
    has one: the client still finds the gateway (every candidate, in order)."""
    monkeypatch.delenv(sockdir.SOCKET_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    if os.path.isdir(f"/run/user/{os.geteuid()}"):
        pytest.skip("/run/user/<uid> exists here: the gateway would not pick /tmp")
    gw, port = spawn_gateway("1M", 0)
    try:
        run = tmp_path / "run"
        run.mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        with GatewayClient("localhost", port, timeout_s=2.0) as c:
            assert c.ping().epoch
            assert c.endpoint.startswith("ipc:///tmp/")
    finally:
        stop_gateway(gw)


def test_a_dead_gateways_socket_fails_the_call_at_once(base):
    gw, port = spawn_gateway("1M", 0)
    c = GatewayClient("localhost", port, timeout_s=1.0)
    try:
        c.ping()
        gw.kill()
        gw.wait()
        time.sleep(0.2)  # died a moment ago (a call in flight at the death waits its deadline)
        t0 = time.monotonic()
        for _ in range(3):
            with pytest.raises(GatewayUnavailable):
                c.ping()
        assert time.monotonic() - t0 < 0.5  # not three 1 s deadlines
    finally:
        c.close()
        stop_gateway(gw)


# ------------------------------------------------------------------ another uid


@ROOT
def test_a_planted_user_directory_stops_the_gateway_with_a_clear_error(base):
    planted = os.path.join(base, "xkv-0")
    _as_nobody("mkdir", "-m", "700", planted)
    p = subprocess.run([sys.executable, "-m", "xkv.gateway", "--capacity", "1M", "--port", "5999"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert p.returncode != 0
    err = p.stderr
    assert planted in err and "uid 65534" in err and "expected uid 0 with mode 700" in err, err


@ROOT
def test_the_client_refuses_a_fake_gateway_planted_while_it_waits(base):
    """vLLM started before its gateway: the client waits for the socket; another user plants
    ``xkv-<uid>/gateway-<port>/control.sock`` meanwhile and serves HELLO and a card. The client
    refuses it at once and never maps its card."""
    port = 5998
    out: dict = {}

    def client():
        c = GatewayClient("localhost", port, timeout_s=0.2, setup_timeout_s=8.0)
        t0 = time.monotonic()
        try:
            out["hello"] = c.register_layout("ns", "fp", 1, 4096)
            out["card"] = c.map_card()
        except GatewayError as e:
            out["error"] = e
        out["s"] = time.monotonic() - t0
        c.close()

    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.5)  # the client is waiting for the socket
    with _fake(os.path.join(base, "xkv-0", "gateway-5998")):
        t.join(20)
    assert "hello" not in out and "card" not in out, out
    assert isinstance(out["error"], GatewayUnavailable) and "refused" in str(out["error"])
    assert "uid 65534" in str(out["error"]) and out["s"] < 7.0, out


@ROOT
def test_a_socket_of_another_uid_is_refused_by_its_peer_credentials(base, tmp_path):
    """Even inside our own 0700 directories (a socket moved there, a directory opened by
    mistake), a control or card socket whose listener is another uid is never trusted."""
    port = 5997
    theirs = os.path.join(base, "theirs")
    _as_nobody("mkdir", "-m", "700", theirs)
    ours = sockdir.instance_dir(port)
    sockdir.check_private_dir(os.path.dirname(ours), create=True)
    sockdir.check_private_dir(ours, create=True)
    with _fake(os.path.join(theirs, "gw")):
        # their card socket, named by a CARD reply: no file descriptor is taken from it
        with pytest.raises(PermissionError, match="uid 65534"):
            open_card("memfd", os.path.join(theirs, "gw", "card.sock"), "", 1 << 20, EPOCH)
        os.rename(os.path.join(theirs, "gw", "control.sock"), os.path.join(ours, "control.sock"))
        with pytest.raises(PermissionError, match="uid 65534"):
            sockdir.probe(os.path.join(ours, "control.sock"), 1.0)
        with GatewayClient("localhost", port, timeout_s=1.0) as c, \
                pytest.raises(GatewayUnavailable, match="refused.*uid 65534"):
            c.ping()


@ROOT
def test_an_own_gateway_still_serves_under_the_checks(base):
    gw, port = spawn_gateway("1M", 0)
    try:
        with GatewayClient("localhost", port, timeout_s=2.0) as c:
            lid = c.register_layout("ns", "fp", 1, 4096).layout_id
            card = c.map_card()
            [r] = c.reserve(lid, [b"k"])
            card[r.offsets[0]:r.offsets[0] + 3] = b"abc"
            assert c.commit(lid, 0, [r]) == 1
            assert c.lookup([(lid, [b"k"])]).num_chunks == 1
            assert c.endpoint == f"ipc://{sockdir.control_path(port)}"
    finally:
        stop_gateway(gw)


def test_an_open_base_without_sticky_bit_is_refused(base):
    gw, port = spawn_gateway("1M", 0)  # its directories exist, then the base is opened up
    try:
        os.chmod(base, 0o777)
        with pytest.raises(PermissionError, match="sticky"):
            sockdir.check_base(base)
        with GatewayClient("localhost", port, timeout_s=1.0) as c, \
                pytest.raises(GatewayUnavailable, match="refused.*sticky"):
            c.ping()
    finally:
        os.chmod(base, 0o1777)
        stop_gateway(gw)
