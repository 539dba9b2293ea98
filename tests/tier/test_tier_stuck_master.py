"""A Mooncake call that blocks on a dead master flips the tier down within its time limit, and the
lookups waiting for the tier are answered from the card then, not at ``--mooncake-wait-ms``.

Mooncake's client blocks a call for seconds once its master is gone; the tier used to say "down"
only when that call returned, so meanwhile every lookup that missed the card still waited the
whole wait for the tier, and write-through kept pinning objects. Here a fake store (the
backend's ``store_factory``) blocks chosen calls until released: the state must flip within
``call_limit_s`` plus one loop pass, a waiting lookup must be answered then, new lookups must not
ask, and once the call returns and the master answers again the tier is up again (one line each).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from types import SimpleNamespace

import pytest

from xkv.gateway.tier import DEFERRED, Tier
from xkv.gateway.tier_store import RPC_FAIL, MooncakeBackend, MooncakeSettings

LIMIT_S = 0.3


class HangingStore:
    """``MooncakeDistributedStore`` stand-in: while ``hang`` is set, calls block until
    ``release`` is set, then fail as a dead master's do (RPC_FAIL)."""

    def __init__(self):
        self.hang = threading.Event()
        self.release = threading.Event()
        self.blocked = threading.Event()

    def _wait(self) -> bool:
        if not self.hang.is_set():
            return False
        self.blocked.set()
        self.release.wait(20)
        return True

    def setup(self, *a):
        return 0

    def health_check(self):
        return -1 if self._wait() else 0

    def batch_is_exist(self, names):
        return [RPC_FAIL] * len(names) if self._wait() else [0] * len(names)

    def batch_put_from_multi_buffers(self, names, ptrs, sizes):
        return [RPC_FAIL] * len(names) if self._wait() else [0] * len(names)

    def close(self):
        pass


class FakeIndex:
    """What Tier touches of the gateway's Index for a lookup that found nothing in the card."""

    def __init__(self):
        self.on_ready = None
        self.layouts = {1: SimpleNamespace(layout_id=1, namespace="ns", fingerprint="fp",
                                           num_shards=1, shard_bytes=4096, check_words=0)}
        self.counters = {"lookups": 1, "lookup_keys": 2, "hit_chunks": 0, "released": 0}

    def release(self, lease_id):
        return False


def _backend(store):
    s = MooncakeSettings("127.0.0.1:1", "P2PHANDSHAKE", probe_interval_s=0.05,
                         call_limit_s=LIMIT_S)
    return MooncakeBackend(s, mmap.mmap(-1, 1 << 20), store_factory=lambda: store)


def _until(pred, timeout_s=5.0, every=None):
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        if every is not None:
            every()
        time.sleep(0.01)


def test_a_blocked_call_flips_the_tier_down_within_its_limit(caplog):
    store = HangingStore()
    b = _backend(store)
    b.start()
    try:
        _until(lambda: b.state == "up")
        with caplog.at_level(logging.INFO, logger="xkv.gateway"):
            store.hang.set()
            t0 = time.monotonic()
            b.submit(("exists", 1, ["xkv1/a"]))
            store.blocked.wait(5)
            _until(lambda: b.state == "down", every=lambda: b.watch(time.monotonic()))
            took = time.monotonic() - t0
            assert LIMIT_S * 0.9 < took < LIMIT_S + 0.3, took  # not when the call returns
            assert b.done.empty()  # the call still blocks
            store.hang.clear()
            store.release.set()
            _until(lambda: not b.done.empty())
            assert b.done.get() == ("exists", 1, [0])
            _until(lambda: b.state == "up")  # the master answers again: probed, up
        text = caplog.text
        assert text.count("mooncake tier down") == 1 and "batch_is_exist has not returned" in text
        assert text.count("(reconnected)") == 1
    finally:
        store.release.set()
        b.close()


def test_a_pull_or_push_gets_time_for_its_bytes():
    b = _backend(HangingStore())
    with b._call("batch_get_into", nbytes=int(200e6)):
        start, limit, what = next(iter(b._calls.values()))
        assert limit == pytest.approx(LIMIT_S + 2.0) and what == "batch_get_into"
        b.state = "up"
        b.watch(start + LIMIT_S + 1.0)
        assert b.state == "up"  # 200 MB may take 2 s more
        b.watch(start + LIMIT_S + 2.1)
        assert b.state == "down"
    assert b._calls == {}


def test_lookups_waiting_for_the_tier_are_answered_when_it_goes_down():
    store = HangingStore()
    b = _backend(store)
    replies = []
    tier = Tier(FakeIndex(), b, answer=lambda req: replies.append(req) or b"from the card",
                wait_s=5.0)
    try:
        _until(lambda: tier.up)
        req = SimpleNamespace(groups=[SimpleNamespace(layout_id=1, keys=[b"k1", b"k2"])])
        assert tier.wants(req, 0)
        store.hang.set()
        t0 = time.monotonic()
        assert tier.defer((b"peer", b"rid"), req, 0, 0, t0) is DEFERRED
        out = []
        _until(lambda: bool(out), every=lambda: out.extend(tier.poll(time.monotonic())))
        took = time.monotonic() - t0
        assert out == [[b"peer", b"rid", b"from the card"]] and replies == [req]
        assert took < LIMIT_S + 0.3, took  # not the 5 s wait
        assert not tier.up and not tier.wants(req, 0)  # new lookups do not ask
        assert tier.counters["tier_skipped"] == 1
        store.hang.clear()
        store.release.set()  # the blocked call fails late: nothing is answered twice
        _until(lambda: tier.up, every=lambda: out.extend(tier.poll(time.monotonic())))
        assert len(out) == 1 and tier.snapshot()["tier_deferred"] == 0
    finally:
        store.release.set()
        tier.close()


def test_a_frozen_master_flips_a_real_gateway_down_within_its_limit(master, tmp_path):
    """A real mooncake_master frozen (SIGSTOP: its port accepts, nothing answers) while B's
    lookup waits for it with a 3 s wait: the lookup is answered from the card about 1 s later
    (the call limit), B's tier is down by then and the next lookup is answered at once; thawed,
    the tier comes back up."""
    import os
    import signal

    from tier_hosts import hosts, store

    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "3000"]) as (a, b):
        la = a.client.register_layout("prod", "fp-1", 1, 8192).layout_id
        lb = b.client.register_layout("prod", "fp-1", 1, 8192).layout_id
        ks = [os.urandom(32) for _ in range(4)]
        store(a, la, ks, 1, 8192)
        a.wait(lambda t: t["tier_written"] == 4, what="written")
        master.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = b.client.lookup([(lb, ks)])
            took = time.monotonic() - t0
            assert r.num_chunks == 0 and took < 2.0, took  # not the 3 s wait
            assert b.tier()["tier_up"] == 0
            t0 = time.monotonic()
            assert b.client.lookup([(lb, ks)]).num_chunks == 0
            assert time.monotonic() - t0 < 0.5  # down: not asked
        finally:
            master.proc.send_signal(signal.SIGCONT)
        b.wait(lambda t: t["tier_up"] == 1, timeout_s=60, what="tier back up")
        assert "has not returned for" in b.log()
