"""KV-events replay (vLLM's protocol) with bounded work per request and per loop pass.

vLLM's ``ZmqEventPublisher`` answers a replay request (an 8-byte big-endian start sequence number
sent to its ROUTER) with every kept batch from there, ``[topic, seq, payload]`` each, then
``END_SEQ``. Walking the whole buffer inside one request would freeze the gateway loop for
everybody (64 MiB of batches is tens of thousands of sends), so here a request costs O(1): it
only opens a *cursor* (next sequence number, end = the newest batch when the request came).
Each loop pass then sends at most BATCHES_PER_PASS kept batches in total, shared round robin
between the cursors, each resumed where it stopped; a cursor that reached its end sends END_SEQ
and closes. At most MAX_REPLAYS cursors are open; a request past that gets END_SEQ at once (an
empty replay, counted in ``kv_events_replays_refused``) rather than silence. A repeated request
from the same connection replaces its cursor. Kept batches are indexed by sequence number (a dict
in sequence order), so resuming is O(1); a cursor behind the oldest kept batch (dropped while it
waited) resumes at the oldest one, and the subscriber sees the gap in the sequence numbers.

The ROUTER is ``ROUTER_MANDATORY``: a send to a reader whose queue is full (its high-water mark)
fails at once instead of being dropped, so its cursor waits where it is (a slow reader loses
nothing) and costs one failed send per pass; a reader that disconnected, or that read nothing
for ``STALL_S`` seconds, loses its cursor (counted in ``dropped``; it may ask again). While
some cursor moved in the last pass the loop comes back after 1 ms (server.py), not at once, and
batches are sent at most every SEND_INTERVAL_S: a client that keeps re-requesting replays (each
request wakes the loop) cannot keep the gateway spinning at 100 % of a core (issue 27 item 2, a
victim's p99); replay runs at up to BATCHES_PER_PASS batches per interval.
"""

from __future__ import annotations

import contextlib
import time

import zmq

#: Kept batches sent per loop pass, over all replays in progress.
BATCHES_PER_PASS = 32
#: Seconds between two passes that send (the loop also wakes for every incoming message, which
#: a client can send at any rate): replay sends at most BATCHES_PER_PASS batches per interval
#: (16,000 per second), so a client re-requesting replays costs the loop a bounded share of a
#: core (~0.3 ms of sends per 2 ms on the loaded 2-core dev box), never a spin.
SEND_INTERVAL_S = 0.002
#: Replay requests read per loop pass (each O(1)).
REQUESTS_PER_PASS = 64
#: Replays in progress at most; a request past that is answered END_SEQ at once.
MAX_REPLAYS = 64
#: Seconds a replay may wait for its reader to read before it is dropped.
STALL_S = 10.0
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)
#: vLLM's end-of-replay marker (``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ReplayBuffer:
    """The kept batches (``max_bytes`` of payloads, oldest dropped first) and the replays in
    progress on ``sock`` (a bound ROUTER). Single-threaded: the gateway loop calls everything."""

    def __init__(self, sock: zmq.Socket, topic: bytes, max_bytes: int):
        self.sock, self.topic, self.max_bytes = sock, topic, max_bytes
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone reader: an error, not a drop
        self._kept: dict[int, bytes] = {}  # seq -> payload, oldest first (contiguous seqs)
        self._first = 0  # oldest kept seq
        self._bytes = 0
        # identity -> [next seq, end seq (excl.), monotonic time it last moved]
        self._cursors: dict[bytes, list] = {}
        self._moved = False  # some cursor sent a batch in the last pass that sent
        self._next_send = 0.0  # monotonic time of the next pass that may send
        self.refused = 0
        self.dropped = 0  # replays dropped: the reader went away or read nothing for STALL_S

    def keep(self, seq: int, payload: bytes) -> None:
        """Keep batch ``seq`` (the next sequence number) for replays."""
        if not self._kept:
            self._first = seq
        self._kept[seq] = payload
        self._bytes += len(payload)
        while self._bytes > self.max_bytes and len(self._kept) > 1:
            self._bytes -= len(self._kept.pop(self._first))
            self._first += 1

    @property
    def replaying(self) -> bool:
        """Replays that moved in the last pass (the loop should come back without sleeping);
        replays blocked by their readers' full queues are retried at the next pass anyway."""
        return self._moved and bool(self._cursors)

    def serve(self) -> None:
        """Read the waiting requests (at most REQUESTS_PER_PASS) and send at most
        BATCHES_PER_PASS kept batches (plus END_SEQ of replays that finished)."""
        sock, noblock = self.sock, zmq.NOBLOCK
        end = self._first + len(self._kept)
        for _ in range(REQUESTS_PER_PASS):
            try:
                frames = sock.recv_multipart(noblock)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request (vLLM's publisher ignores these too)
            ident = frames[0]
            if ident not in self._cursors and len(self._cursors) >= MAX_REPLAYS:
                self.refused += 1
                self._send_end(ident)
                continue
            self._cursors.pop(ident, None)  # a new request replaces the old one (and goes last)
            self._cursors[ident] = [int.from_bytes(frames[2], "big"), end, time.monotonic()]
        if not self._cursors:
            self._moved = False
            return
        now = time.monotonic()
        if now < self._next_send:
            return  # ``_moved`` stays: the loop comes back for the next interval
        self._next_send = now + SEND_INTERVAL_S
        self._moved = False
        share = max(1, BATCHES_PER_PASS // len(self._cursors))
        kept, topic = self._kept, self.topic
        send, more, last = sock.send, _MORE, _LAST  # plain ints: no enum arithmetic per frame
        for ident, cur in list(self._cursors.items()):
            s = seq = max(cur[0], self._first)
            stop = min(seq + share, cur[1])
            try:
                while s < stop:
                    send(ident, more)  # ROUTER_MANDATORY: Again/EHOSTUNREACH here, not later
                    send(b"", more)
                    send(topic, more)
                    send(s.to_bytes(8, "big"), more)
                    send(kept[s], last)
                    s += 1
            except zmq.Again:  # the reader's queue is full: wait where it is
                pass
            except zmq.ZMQError:  # EHOSTUNREACH: the reader went away
                del self._cursors[ident]
                self.dropped += 1
                continue
            if s > seq:
                cur[2] = now
                self._moved = True
            elif now - cur[2] > STALL_S:
                del self._cursors[ident]
                self.dropped += 1
                continue
            if s >= cur[1]:
                del self._cursors[ident]
                self._send_end(ident)
            else:
                cur[0] = s
                del self._cursors[ident]  # round robin: to the back
                self._cursors[ident] = cur

    def _send_end(self, ident: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # full or gone: it sees no end, may ask again
            self.sock.send_multipart((ident, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
