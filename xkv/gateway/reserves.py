"""RESERVE beyond the plain index call: big RESERVEs served in slices (fairness) and RESERVEs that
carry KV-event block information.

Fairness (see server.py): a RESERVE of more than RESERVE_SLICE keys becomes a :class:`SlicedReserve`
job; the loop serves one slice of RESERVE_SLICE keys of each job in progress between two turns
of the sockets, so another client's LOOKUP waits behind at most one slice of every RESERVE.
"""

from __future__ import annotations

import logging
import time

from xkv.gateway import protocol as P
from xkv.gateway.index import Index, RequestError

log = logging.getLogger("xkv.gateway")

#: Keys of a RESERVE handled before other clients get a turn (see server.py's docstring).
RESERVE_SLICE = 256


def reply(epoch: int, out: list) -> P.ReserveReply:
    """The ReserveReply of ``out`` (one (status, slots) per key, from Index.reserve)."""
    return P.ReserveReply(epoch, [int(s) for s, _ in out], [c for _, c in out])


class SlicedReserve:
    """A RESERVE being served in slices: where to answer, and the answers so far. ``present``
    holds the keys stored when the request arrived (answers reflect the index as it was then)."""

    __slots__ = ("sock", "ident", "rid", "req", "present", "out", "pos", "t0")

    def __init__(self, index: Index, sock, ident: bytes, rid: bytes, req: P.Reserve, t0: float):
        """Validates the layout now (RequestError before anything is reserved)."""
        objects = index.layout(req.layout_id).objects
        self.sock, self.ident, self.rid, self.req = sock, ident, rid, req
        self.present = {k for k in req.keys if k in objects}
        self.out: list = []
        self.pos, self.t0 = 0, t0

    @staticmethod
    def wanted(req, events_on: bool) -> bool:
        """Whether ``req`` is served in slices: a RESERVE longer than one slice (one with block
        information for KV events, ``events_on``, is served whole: its blocks are checked first)."""
        return (type(req) is P.Reserve and len(req.keys) > RESERVE_SLICE
                and not (req.blocks and events_on))

    def step(self, index: Index) -> bool:
        """Serve the next RESERVE_SLICE keys; True when the job is complete."""
        keys = self.req.keys[self.pos:self.pos + RESERVE_SLICE]
        try:
            self.out += index.reserve(self.req.layout_id, keys, time.monotonic(), self.present)
        except Exception:  # noqa: BLE001 (validated at start; never let the loop die)
            log.exception("internal error in a sliced RESERVE")
            self.out += [(P.ReserveStatus.NO_SPACE, None)] * len(keys)
        self.pos += RESERVE_SLICE
        return self.pos >= len(self.req.keys)


def reserve_announced(index: Index, events, req: P.Reserve) -> list:
    """RESERVE with block information for KV events (``events``: the EventPublisher): the
    blocks are checked before anything is reserved; returns Index.reserve's answers."""
    if len(req.blocks) != len(req.keys):
        raise RequestError(P.ErrorCode.BAD_REQUEST,
                           f"{len(req.blocks)} blocks for {len(req.keys)} keys: expected one "
                           f"BlockInfo per key")
    for key, info in zip(req.keys, req.blocks, strict=True):
        if info.hashes[-1] != key:
            raise RequestError(P.ErrorCode.BAD_REQUEST,
                               f"the last block hash of key {key.hex()[:16]}... is "
                               f"{info.hashes[-1].hex()[:16]}...: a chunk's key must be "
                               f"its last block hash")
    if req.block_size < 1:
        raise RequestError(P.ErrorCode.BAD_REQUEST,
                           f"block_size {req.block_size}: expected the tokens per hash block "
                           f"(>= 1) with blocks")
    out = index.reserve(req.layout_id, req.keys, time.monotonic())
    objects = index.layout(req.layout_id).objects
    for key, info, (status, _) in zip(req.keys, req.blocks, out, strict=True):
        if status == P.ReserveStatus.OK:
            events.staged(objects[key], info.hashes, info.parent, req.block_size, req.group_idx)
    return out
