"""Issue 27 item 7 (KV events): subscribers that never read cost bounded memory each, and there
are at most ``max_subscribers`` of them. Past the cap a new connection is shut down (its ZMQ
reconnects and is refused again), counted in ``kv_events_subscribers_refused`` and logged at
most once per 10 s; the admitted subscribers keep receiving, and a freed place is taken again.
Batches stay under ``MAX_BATCH_BYTES`` (plus one event), so one subscriber's queue is at most
``SUBSCRIBER_HWM`` such batches."""

from __future__ import annotations

import hashlib
import logging
import struct
import time

import msgspec
import pytest
import zmq

from xkv.gateway import events as E
from xkv.gateway.events import EventPublisher, KVEventBatch
from xkv.gateway.subscribers import SubscriberCap


class _Obj:
    def __init__(self, key: bytes):
        self.key, self.ready = key, True


def _sub(ctx, port):
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, 50)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _pump(pub, seconds, tag=b"x"):
    """The gateway loop for ``seconds``: one event and one pass every 10 ms."""
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        pub.stored(_Obj(hashlib.sha256(tag + b"%d" % i).digest()))
        pub.flush()
        pub.serve_replay()
        i += 1
        time.sleep(0.01)


def _receivers(subs, pub):
    """The subscribers that receive every batch published in the next 0.3 s (a refused one
    may get a few: it lives until the loop's next pass, then reconnects and is refused again)."""
    for s in subs:
        while s.poll(0):
            s.recv_multipart()
    first = pub._seq
    _pump(pub, 0.3, b"probe")
    want = set(range(first, pub._seq))
    got = []
    for i, s in enumerate(subs):
        seen = set()
        while s.poll(100):
            seen.add(struct.unpack(">Q", s.recv_multipart()[1])[0])
        if want <= seen:
            got.append(i)
    return got


def test_subscribers_past_the_cap_are_refused_counted_and_logged_once(caplog):
    ctx = zmq.Context()
    pub = EventPublisher(ctx, "127.0.0.1", 0, max_subscribers=3)
    subs = []
    try:
        with caplog.at_level(logging.WARNING, logger="xkv.gateway"):
            subs = [_sub(ctx, pub.port) for _ in range(3)]
            _pump(pub, 0.5)
            assert pub.counters["kv_events_subscribers"] == 3
            assert pub.counters["kv_events_subscribers_refused"] == 0
            subs += [_sub(ctx, pub.port) for _ in range(4)]  # four more: refused, reconnecting
            _pump(pub, 1.0)
        assert pub.counters["kv_events_subscribers"] == 3
        assert pub.counters["kv_events_subscribers_refused"] >= 4
        lines = [r.getMessage() for r in caplog.records if "refused a subscriber" in r.getMessage()]
        assert len(lines) == 1 and "the cap is 3" in lines[0], lines
        assert _receivers(subs, pub) == [0, 1, 2]
        # one admitted subscriber leaves: a refused one (reconnecting) takes its place
        subs[0].close(linger=0)
        _pump(pub, 0.8)
        assert pub.counters["kv_events_subscribers"] == 3
        for _ in range(10):  # its subscription reaches the PUB socket a little later
            got = _receivers(subs[1:], pub)
            if len(got) == 3:
                break
        assert len(got) == 3 and {0, 1} <= set(got), got
        assert pub.counters["kv_events_subscribers"] == 3
    finally:
        pub.close()
        for s in subs:
            s.close(linger=0)
        ctx.term()


def test_the_cap_never_touches_another_socket_of_the_process():
    """A monitor event naming an fd that is not the publisher's (closed and reused by another
    socket) shuts nothing down."""
    import socket

    ctx = zmq.Context()
    pub = EventPublisher(ctx, "127.0.0.1", 0, max_subscribers=1)
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    c = socket.create_connection(other.getsockname())
    a, _ = other.accept()
    try:
        cap = pub._cap
        assert not cap._shut(a.fileno()) and not cap._shut(10**6)
        c.sendall(b"still open")
        assert a.recv(16) == b"still open"
    finally:
        for s in (a, c, other):
            s.close()
        pub.close()
        ctx.term()


def test_the_cap_refuses_a_nonsense_limit():
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUB)
    try:
        with pytest.raises(ValueError, match="max_subscribers=0"):
            SubscriberCap(s, 1, 0)
    finally:
        s.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("int_hashes", [True, False])
def test_batches_stay_under_the_byte_cap(int_hashes):
    """5,000 objects of 64 hash blocks each in one pass: every batch's payload is under
    MAX_BATCH_BYTES plus its largest event, and every event arrives once, in order."""
    ctx = zmq.Context()
    pub = EventPublisher(ctx, "127.0.0.1", 0, int_hashes=int_hashes)
    sub = _sub(ctx, pub.port)
    sub.setsockopt(zmq.RCVHWM, 0)
    try:
        time.sleep(0.3)
        objs = []
        for i in range(5000):
            o = _Obj(hashlib.sha256(b"%d" % i).digest())
            hashes = [hashlib.sha256(b"%d-%d" % (i, j)).digest() for j in range(63)] + [o.key]
            pub.staged(o, hashes, None, 16, 0)
            objs.append(o)
        for o in objs:
            pub.stored(o)
        pub.flush()
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        seqs, lasts = [], []
        while sub.poll(500):
            _, seq, payload = sub.recv_multipart()
            b = dec.decode(payload)
            one = max(len(msgspec.msgpack.encode(KVEventBatch(b.ts, [e]))) for e in b.events)
            assert len(payload) <= E.MAX_BATCH_BYTES + one, (len(payload), one)
            seqs.append(struct.unpack(">Q", seq)[0])
            lasts.extend(e.block_hashes[-1] for e in b.events)
        assert seqs == list(range(len(seqs))) and len(seqs) > 10
        assert lasts == [int.from_bytes(o.key, "big") & (2**64 - 1) if int_hashes else o.key
                         for o in objs]
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()
