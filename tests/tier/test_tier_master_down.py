"""Issue 27 item 3: a Mooncake master that is down when the gateway starts never freezes it.

Mooncake's ``setup`` retries for ~90 s holding the interpreter lock while its master is down;
run on the tier's thread it froze the whole gateway (first PING answered after 90 s, then
frozen ~88 s of every 89, SIGTERM ignored). The gateway must answer at once, whatever the
master does, exit on SIGTERM within 5 s, and attach the tier once the master appears.
"""

from __future__ import annotations

import os
import signal
import time

from mooncake_master import Master
from tier_hosts import store

from xkv.gateway.client import GatewayClient
from xkv.gateway.testing import spawn_gateway, stop_gateway
from xkv.gateway.tier_store import MooncakeSettings, _endpoints, unreachable


def _pings(client, seconds: float) -> float:
    """PING for ``seconds``; the slowest answer (a missed one raises)."""
    worst, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        client.ping()
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    return worst


def test_master_down_at_start_then_up_later(tmp_path):
    master = Master(str(tmp_path / "master.log"))  # ports chosen, nothing listens yet
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc, port = spawn_gateway("64M", extra_args=[*master.gateway_args(), "--log-level",
                                                      "INFO"], stderr=log, timeout_s=30)
        try:
            started = time.monotonic() - t0
            c = GatewayClient("127.0.0.1", port, timeout_s=1.0)
            assert _pings(c, 5.0) < 0.5, started
            assert c.stats()["tier_up"] == 0
            master.start()  # it appears: the tier attaches within about a second
            deadline = time.monotonic() + 30
            while c.stats()["tier_up"] != 1:
                assert time.monotonic() < deadline, "the tier never attached"
                time.sleep(0.1)
            lid = c.register_layout("prod", "fp", 1, 8192).layout_id
            store(type("H", (), {"client": c})(), lid, [os.urandom(32)], 1, 8192)
            deadline = time.monotonic() + 30
            while c.stats()["tier_written"] != 1:  # written through to the master
                assert time.monotonic() < deadline, c.stats()
                time.sleep(0.1)
            c.close()
        finally:
            stop_gateway(proc)
            master.stop()
    text = log_path.read_text(errors="replace")
    assert "setup not attempted" in text and "mooncake tier up" in text, text[-3000:]


def test_sigterm_exits_within_5_s_while_the_master_is_down(tmp_path):
    master = Master(str(tmp_path / "master.log"))
    proc, port = spawn_gateway("64M", extra_args=master.gateway_args(), timeout_s=30)
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=1.0) as c:
            assert _pings(c, 2.0) < 0.5
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 5
    finally:
        stop_gateway(proc)


def test_endpoints_checked_before_setup():
    s = MooncakeSettings("10.0.0.5:50051", "http://10.0.0.5:8080/metadata")
    assert _endpoints(s) == [("master", "10.0.0.5", 50051), ("metadata server", "10.0.0.5", 8080)]
    assert _endpoints(MooncakeSettings("[::1]:7", "P2PHANDSHAKE")) == [("master", "::1", 7)]
    assert _endpoints(MooncakeSettings("h:1", "etcd://e:2379"))[1] == ("metadata server", "e", 2379)
    m = Master("/dev/null")  # free ports: nothing listens
    why = unreachable(MooncakeSettings(m.address, m.metadata))
    assert why is not None and m.address in why
