"""Imported in the engine process (scenario key ``imports``): records every object the engines
commit, so that the driver's ``fault`` step can damage chosen objects on the gateway's card the
way issue 25's fault classes do (tests/e2e/test_fault_classes_engine.py).

Recording goes through public seams only: ``GatewayClient.commit`` (key, card offset of the
committed shard, layout id, in commit order) and ``WorkerSide.bind`` (the group plan of each
layout id: where each layer of an object lives, ``GroupPlan.object_offset``).

Fault classes (``{"op": "fault", "kind": K, "object": i, "other": j}``; ``i``/``j`` index the
recorded commits, negative from the end):

* ``flip``: one bit of one byte in the middle of the object (a bit flip in host memory);
* ``torn``: the object's second half zeroed (a partial write);
* ``swap_layers``: the object's first two layers exchanged (layers written to the wrong place);
* ``wrong_slot``: object ``j``'s bytes in object ``i``'s slot (an index entry pointing at the
  wrong slot, or a slot reused under a stale generation: another object's bytes);
* ``rewrite``: the object's own bytes written again (harmless: the bytes are equal).
"""

from __future__ import annotations

from xkv.connector.worker import WorkerSide
from xkv.gateway.client import GatewayClient

#: every committed shard, in commit order: (layout id, shard, key, card offset)
COMMITS: list[tuple[int, int, bytes, int]] = []
#: layout id -> (shard bytes, [(start, end) of each layer inside the object])
LAYOUTS: dict[int, tuple[int, list[tuple[int, int]]]] = {}

_commit, _bind = GatewayClient.commit, WorkerSide.bind


def _recording_commit(self, layout_id, shard, keys, **kw):
    n = _commit(self, layout_id, shard, keys, **kw)
    COMMITS.extend((layout_id, shard, k.key, k.offsets[shard]) for k in keys)
    return n


def _recording_bind(self, meta):
    reg = self.registry
    for g, lid in enumerate(self.layout_ids):
        plan = reg.groups[g]
        n = len(plan.group.layer_names)
        bounds = [plan.object_offset(li, 0) for li in range(n)] + [plan.shard_bytes]
        LAYOUTS[lid] = (plan.shard_bytes, list(zip(bounds[:-1], bounds[1:], strict=True)))
    _bind(self, meta)


GatewayClient.commit = _recording_commit
WorkerSide.bind = _recording_bind


def apply(step: dict, card) -> dict:
    """Damage the card (a writable uint8 numpy view) as ``step`` says; returns what was done
    (the key as hex, the offset, the bytes changed)."""
    kind = step["kind"]
    lid, _, key, off = COMMITS[step["object"]]
    size, layers = LAYOUTS[lid]
    obj = card[off:off + size]
    before = obj.copy()
    if kind == "flip":
        obj[size // 2 + 1] ^= 0x10
    elif kind == "torn":
        obj[size // 2:] = 0
    elif kind == "swap_layers":
        if len(layers) < 2:
            raise ValueError(f"swap_layers needs an object of >= 2 layers, got {len(layers)}")
        (a0, a1), (b0, b1) = layers[0], layers[1]
        if a1 - a0 != b1 - b0:
            raise ValueError(f"swap_layers needs layers of one size, got {a1 - a0} and {b1 - b0}")
        first = obj[a0:a1].copy()
        obj[a0:a1] = obj[b0:b1]
        obj[b0:b1] = first
    elif kind == "wrong_slot":
        olid, _, okey, ooff = COMMITS[step["other"]]
        if olid != lid or okey == key:
            raise ValueError(f"wrong_slot needs another object of layout {lid}")
        obj[:] = card[ooff:ooff + size]
    elif kind == "rewrite":
        obj[:] = before
    else:
        raise ValueError(f"unknown fault kind {kind!r}: expected flip, torn, swap_layers, "
                         "wrong_slot or rewrite")
    return {"kind": kind, "key": key.hex(), "offset": off,
            "changed": int((obj != before).sum())}
