"""The ``verify_restores`` debug check of the transfer handlers (``transfer.py``): poison the
destination pages of every load before the copy, then, once the copies finished, compare each
restored (and each saved) block of every layer with the card bytes it came from (went to), byte
for byte, and log the counts as ``XKV_VERIFY`` lines. Pages are read with plain torch indexing,
not with the kernels under test.

Shapes and units: ``card`` a uint8 1-D tensor; ``offsets`` int64 [n] byte offsets into it;
``pool`` a layer's ``xkv.layout.PagePool``; ``block_ids`` int64 [n].
"""

from __future__ import annotations

import logging

import torch

from xkv.kernels import host
from xkv.layout import contiguous_runs

log = logging.getLogger("xkv.connector")

POISON = 0xA5
_VERIFY_BATCH_BYTES = 256 << 20  # compare at most this many bytes of pages at once (memory cap)


class PageVerifier:
    """Counts block-layers whose page bytes differ from their card bytes (debug, slow)."""

    def __init__(self) -> None:
        self.pending: dict[str, list] = {"restore": [], "save": []}
        self.checked = {"restore": 0, "save": 0}
        self.mismatched = {"restore": 0, "save": 0}

    def poison(self, pool, block_ids: torch.Tensor) -> None:
        """Fill the destination blocks with ``POISON`` (on the current stream) so that a restore
        that never ran cannot pass for one that did (the pages may still hold the same KV)."""
        ids = block_ids.to(pool.device)
        for r in range(len(pool.runs)):
            pool.run_view(r).index_fill_(0, ids, POISON)

    def record(self, kind: str, card, offsets, pool, block_ids, layer: str = "") -> None:
        self.pending[kind].append((card, offsets.clone(), pool, block_ids.clone(), layer))

    def check(self, kind: str, layers: set[str] | None = None) -> None:
        """Compare everything recorded for ``kind`` (only ``layers``' records when given); the
        copies must have finished (on the current stream, for device pages)."""
        todo = self.pending[kind]
        if layers is not None:
            todo = [t for t in todo if t[4] in layers]
            self.pending[kind] = [t for t in self.pending[kind] if t[4] not in layers]
        else:
            self.pending[kind] = []
        if not todo:
            return
        checked = bad = 0
        for card, offs, pool, ids, _layer in todo:
            c, b = _compare(card, offs, pool, ids)
            checked, bad = checked + c, bad + b
        self.checked[kind] += checked
        self.mismatched[kind] += bad
        if bad:
            log.warning("XKV_VERIFY %s MISMATCH: %d of %d block-layers differ from the card",
                        kind, bad, checked)
        log.info("XKV_VERIFY %s checked=%d mismatched=%d total_checked=%d total_mismatched=%d",
                 kind, checked, bad, self.checked[kind], self.mismatched[kind])

    def record_tail(self, names, card, offsets, pools, block_ids) -> None:
        """Poison and record a load of blocks the step's forward also writes
        (``GroupTransfer.tail``; ``offsets`` int64 ``[L, n]``, ``pools[l]`` is layer
        ``names[l]``) under their own tags, which :meth:`check_tail` compares before the forward
        rewrites part of them."""
        for i, pool in enumerate(pools):
            self.poison(pool, block_ids)
            self.record("restore", card, offsets[i], pool, block_ids, tail_tag(names[i]))

    def check_tail(self, names) -> None:
        """Compare what :meth:`record_tail` recorded for layers ``names`` (copies finished)."""
        self.check("restore", {tail_tag(n) for n in names})


def tail_tag(name: str) -> str:
    """The verifier's tag of layer ``name``'s before-forward (tail) restores."""
    return f"{name}#tail"


def _compare(card: torch.Tensor, offs: torch.Tensor, pool, ids: torch.Tensor) -> tuple[int, int]:
    """(blocks compared, blocks differing) between ``pool`` blocks ``ids`` and the ``block_bytes``
    card bytes at ``offs``. Card rows are fetched as contiguous spans (one copy per span)."""
    n, bb = int(ids.numel()), pool.block_bytes
    if n == 0 or bb == 0:
        return 0, 0
    dev = pool.device
    per = max(1, _VERIFY_BATCH_BYTES // bb)
    bad = 0
    for a in range(0, n, per):
        z = min(n, a + per)
        want = torch.empty((z - a, bb), dtype=torch.uint8, device=dev)
        flat = want.view(-1)
        for i, count, o in contiguous_runs(offs[a:z], bb):  # adjacent card blocks: one copy
            host.copy_bytes(flat[i * bb:(i + count) * bb], card[o:o + count * bb])  # pieces
        idx = ids[a:z].to(dev)
        got = torch.cat([pool.run_view(r).index_select(0, idx) for r in range(len(pool.runs))], 1)
        bad += int((got != want).any(dim=1).sum())
    return n, bad
