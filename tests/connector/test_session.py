"""GatewaySession: HELLO per group and the card at open, the failure policy (answered calls reset
the count, MAX_FAILURES unanswered calls in a row turn it off with one line, refusals do not
count), no message once off, and one turn-off under concurrent callers."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from connector_fakes import FakeGateway

from xkv.connector.session import MAX_FAILURES, GatewaySession, LayoutSpec, SessionOff
from xkv.gateway.client import GatewayError, GatewayUnavailable

LAYOUTS = [LayoutSpec("fp-a", 2, 8192), LayoutSpec("fp-b", 1, 4096)]


def _session(gw, **kw):
    lines: list[str] = []
    s = GatewaySession(gw.client, LAYOUTS, namespace="ns", on_off=lines.append, **kw)
    return s, lines


def test_open_registers_every_group_and_maps_the_card():
    gw = FakeGateway(epoch=11)
    s, lines = _session(gw, map_card=True)
    seen = []
    assert s.open(register_card=lambda t: seen.append(t) or t)
    assert s.layout_ids == (1, 2) and s.epoch == 11 and not s.turned_off and not lines
    assert [m[:3] for m in gw.messages[:2]] == [("hello", "ns", "fp-a"), ("hello", "ns", "fp-b")]
    assert s.card.dtype == torch.uint8 and s.card.numel() == len(gw.card) and len(seen) == 1
    s.card[5] = 9  # a view of the mapped card, not a copy
    assert gw.card[5] == 9


def test_close_unregisters_and_drops_the_card():
    gw = FakeGateway(epoch=11)
    s, _ = _session(gw, map_card=True)
    gone = []
    assert s.open(register_card=lambda t: t, unregister_card=gone.append)
    card = s.card
    s.close()
    assert s.card is None and len(gone) == 1 and gone[0].data_ptr() == card.data_ptr()
    s.close()  # twice: nothing left to let go
    assert len(gone) == 1


def test_open_against_a_dead_gateway_turns_off_once():
    gw = FakeGateway()
    gw.dead = True
    s, lines = _session(gw, map_card=True)
    assert not s.open()
    assert s.turned_off and s.card is None and s.layout_ids == ()
    assert len(lines) == 1 and "unusable at start" in lines[0]
    with pytest.raises(SessionOff):
        s.call("LOOKUP", lambda c: c.release(1))
    assert not s.turn_off("again") and len(lines) == 1


def _flaky(fail: list[bool]):
    def fn(client):
        if fail.pop(0):
            raise GatewayUnavailable("deadline missed")
        return "ok"
    return fn


def test_failures_in_a_row_turn_off_answers_reset():
    gw = FakeGateway()
    s, lines = _session(gw)
    assert s.open()
    pattern = [True] * (MAX_FAILURES - 1) + [False] + [True] * (MAX_FAILURES - 1)
    fn = _flaky(list(pattern))
    for failed in pattern:
        if failed:
            with pytest.raises(GatewayUnavailable):
                s.call("X", fn)
        else:
            assert s.call("X", fn) == "ok"
    assert not s.turned_off and not lines  # never MAX_FAILURES in a row
    with pytest.raises(GatewayUnavailable):
        s.call("RESERVE", _flaky([True]))
    assert s.turned_off and len(lines) == 1 and "RESERVE" in lines[0]
    n = len(gw.messages)
    with pytest.raises(SessionOff):
        s.call("COMMIT", lambda c: c.commit(1, 0, [b"k"]))
    assert len(gw.messages) == n  # nothing sent once off


def test_refusals_do_not_count():
    gw = FakeGateway()
    s, lines = _session(gw)
    assert s.open()

    def refused(client):
        raise GatewayError("NO_SPACE")

    for _ in range(3 * MAX_FAILURES):
        with pytest.raises(GatewayError) as e:
            s.call("RESERVE", refused)
        assert not isinstance(e.value, SessionOff)
    assert not s.turned_off and not lines


def test_one_turn_off_under_concurrent_callers():
    gw = FakeGateway()
    s, lines = _session(gw)
    assert s.open()
    start = threading.Barrier(8)

    def dead(client):
        raise GatewayUnavailable("gone")

    def worker():
        start.wait()
        for _ in range(20):
            with contextlib.suppress(GatewayError):
                s.call("COMMIT", dead)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert s.turned_off and len(lines) == 1


def test_slot_generation_and_close():
    gw = FakeGateway()
    s, _ = _session(gw)
    assert s.slot_generation(0) is None  # not open yet
    assert s.open()
    gw.gens[4096] = 3
    assert s.slot_generation(4096) == 3
    s.close()
    assert s.client is None and s.slot_generation(4096) is None
    with pytest.raises(SessionOff):
        s.call("LOOKUP", lambda c: c.release(1))


def test_backoff_then_reprobe_same_gateway(monkeypatch):
    """Off after MAX_FAILURES; the first probe waits BACKOFF_S[0], each failed one longer; the
    same gateway process answering turns it on again (one on_reattach)."""
    import xkv.connector.session as S

    now = [100.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: now[0])
    gw = FakeGateway()
    back: list[int] = []
    s = GatewaySession(gw.client, LAYOUTS, namespace="ns", on_off=lambda r: None,
                       on_reattach=back.append)
    assert s.open()
    gw.dead = True
    for _ in range(MAX_FAILURES):
        with pytest.raises(GatewayUnavailable):
            s.call("LOOKUP", lambda c: c.lookup([(1, [b"k"])]))
    assert s.turned_off and not s.reattach_due()  # backing off
    waited = []
    for wait in S.BACKOFF_S[:3]:
        now[0] += wait - 0.01
        assert not s.reattach_due()
        now[0] += 0.01
        assert s.reattach_due() and not s.reattach()  # still dead: a longer back-off
        waited.append(wait)
    assert waited == [1.0, 2.0, 4.0] and s.turned_off and not back
    gw.dead = False
    now[0] += S.BACKOFF_S[3]
    assert s.reattach_due() and s.reattach()
    assert not s.turned_off and back == [gw.epoch] and s.layout_ids == (1, 2)


def test_restarted_gateway_only_with_reattach():
    for enabled in (False, True):
        gw = FakeGateway(epoch=3)
        s, _ = _session(gw, reattach=enabled, reattach_interval_s=0.0)
        assert s.open()
        s.turn_off("test")
        gw.restart()
        assert s.reattach_due()
        assert s.reattach() is enabled
        assert s.turned_off is not enabled
        if enabled:
            assert s.epoch == 4 and s.layout_ids == (1, 2)
        else:  # off for good: no more probes
            assert s.epoch == 3 and not s.reattach_due()


def test_after_a_miss_calls_wait_the_probe_deadline_until_one_is_answered():
    """A dead gateway must not stall the scheduler loop for a RESERVE's 1 s deadline per request
    (H200 run, 2026-12-01): after an unanswered call every call is capped at the probe deadline,
    and an answered call lifts the cap."""
    gw = FakeGateway()
    s, _ = _session(gw, probe_timeout_s=0.03)
    assert s.open()
    client = s.client
    assert client.deadline_cap_s is None
    with pytest.raises(GatewayUnavailable):
        s.call("LOOKUP", _flaky([True]))
    assert client.deadline_cap_s == 0.03
    assert s.call("RESERVE", _flaky([False])) == "ok"
    assert client.deadline_cap_s is None


def test_the_real_client_honours_the_deadline_cap(tmp_path, monkeypatch):
    """GatewayClient: with ``deadline_cap_s`` set, a call whose own deadline is 5 s gives up
    after the cap (the error names the deadline it waited); no gateway listens on this port."""
    from xkv.gateway.client import GatewayClient

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    c = GatewayClient("127.0.0.1", 5987, timeout_s=5.0)
    c.deadline_cap_s = 0.02
    with pytest.raises(GatewayUnavailable, match="within 20 ms"):
        c.ping()
    c.close()
