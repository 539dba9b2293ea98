"""KV events under CURVE (issue 27 item 6): the events and replay sockets join the gateway's
authentication domain, so a subscriber whose public key is on the allow-list receives events
and replays, a stranger gets nothing; refused handshakes are logged at a bounded rate."""

from __future__ import annotations

import hashlib
import time

import msgspec
import zmq
import zmq.auth

from xkv.gateway import GatewayClient
from xkv.gateway.events import END_SEQ, KVEventBatch
from xkv.gateway.testing import curve_certificates, spawn_gateway, stop_gateway

PAGE = 4096


def _sub(ctx, port: int, server_public: bytes, keys) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey = server_public
    s.curve_publickey, s.curve_secretkey = keys
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _received(sock: zmq.Socket, timeout_s: float) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    while time.monotonic() < deadline:
        if sock.poll(50):
            _topic, _seq, payload = sock.recv_multipart()
            out.extend(dec.decode(payload).events)
    return out


def test_events_reach_allowed_keys_only_and_refusals_are_rate_limited(tmp_path):
    secret, allowed, keys = curve_certificates(tmp_path, ["router", "stranger"],
                                               admitted=["router"])
    server_public = zmq.auth.load_certificate(str(tmp_path / "gateway.key"))[0]
    log = tmp_path / "gw.log"
    with open(log, "w") as err:
        proc, port = spawn_gateway("1M", stderr=err, extra_args=[
            "--curve-secret-key", secret, "--curve-allowed-clients", allowed,
            "--kv-events-port", "0", "--kv-events-replay-port", "0", "--log-level", "INFO"])
    ctx = zmq.Context()
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=2.0, curve_server_key=server_public,
                           curve_client_keys=keys["router"]) as c:
            st = c.stats()
            ev_port, replay_port = st["kv_events_port"], st["kv_events_replay_port"]
            good = _sub(ctx, ev_port, server_public, keys["router"])
            bad = [_sub(ctx, ev_port, server_public, keys["stranger"]) for _ in range(30)]
            time.sleep(1.0)  # handshakes (and refusals) done; SUB subscriptions arrived
            lid = c.register_layout("ns", "fp", 1, PAGE).layout_id
            for i in range(5):
                c.commit(lid, 0, c.reserve(lid, [hashlib.sha256(b"%d" % i).digest()]))
            got = _received(good, 2.0)
            assert len(got) == 5 and all(type(e).__name__ == "BlockStored" for e in got)
            assert all(_received(s, 0.05) == [] for s in bad)
            # replay with an allowed key works; a stranger's request gets no answer
            for who, answered in ((keys["router"], True), (keys["stranger"], False)):
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.curve_serverkey = server_public
                d.curve_publickey, d.curve_secretkey = who
                d.connect(f"tcp://127.0.0.1:{replay_port}")
                d.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
                frames = []
                while d.poll(1500 if answered else 500):
                    frames.append(d.recv_multipart())
                    if frames[-1][2] == END_SEQ:
                        break
                assert bool(frames) == answered
                if answered:
                    assert len(frames) >= 2 and frames[-1][2] == END_SEQ
            refused = c.stats()["refused_connections"]
        assert refused >= 30
    finally:
        ctx.destroy(linger=0)
        stop_gateway(proc)
    warnings = [ln for ln in log.read_text().splitlines() if "refused a connection" in ln]
    assert 1 <= len(warnings) <= 10, f"{len(warnings)} refusal lines for {refused} refusals"
