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

A replay reader slower than the ROUTER's high-water mark loses batches silently, as with vLLM's
publisher (ZMQ drops at the HWM; the sequence numbers show the gap).
"""

from __future__ import annotations

import contextlib

import zmq

#: Kept batches sent per loop pass, over all replays in progress.
BATCHES_PER_PASS = 32
#: Replay requests read per loop pass (each O(1)).
REQUESTS_PER_PASS = 64
#: Replays in progress at most; a request past that is answered END_SEQ at once.
MAX_REPLAYS = 64
#: vLLM's end-of-replay marker (``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ReplayBuffer:
    """The kept batches (``max_bytes`` of payloads, oldest dropped first) and the replays in
    progress on ``sock`` (a bound ROUTER). Single-threaded: the gateway loop calls everything."""

    def __init__(self, sock: zmq.Socket, topic: bytes, max_bytes: int):
        self.sock, self.topic, self.max_bytes = sock, topic, max_bytes
        self._kept: dict[int, bytes] = {}  # seq -> payload, oldest first (contiguous seqs)
        self._first = 0  # oldest kept seq
        self._bytes = 0
        self._cursors: dict[bytes, list[int]] = {}  # identity -> [next seq, end seq (excl.)]
        self.refused = 0

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
        """Replays in progress (the loop should not sleep)."""
        return bool(self._cursors)

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
            self._cursors[ident] = [int.from_bytes(frames[2], "big"), end]
        if not self._cursors:
            return
        share = max(1, BATCHES_PER_PASS // len(self._cursors))
        kept, topic = self._kept, self.topic
        for ident, cur in list(self._cursors.items()):
            seq = max(cur[0], self._first)
            stop = min(seq + share, cur[1])
            try:
                for s in range(seq, stop):
                    sock.send_multipart((ident, b"", topic, s.to_bytes(8, "big"), kept[s]),
                                        noblock)
            except zmq.Again:
                pass
            if stop >= cur[1]:
                del self._cursors[ident]
                self._send_end(ident)
            else:
                cur[0] = stop
                del self._cursors[ident]  # round robin: to the back
                self._cursors[ident] = cur

    def _send_end(self, ident: bytes) -> None:
        with contextlib.suppress(zmq.Again):
            self.sock.send_multipart((ident, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
