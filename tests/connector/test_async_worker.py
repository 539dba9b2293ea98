"""The worker half of asynchronous restores (``AsyncLoadWorker``) without vLLM: batches on
handlers of their own, completion polled per batch (never a blocking wait), the slot-generation
check after the copy, failures reported with the request, a reattach drain."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace as NS

import pytest
import torch
from connector_fakes import written_part

from xkv.connector import async_loads
from xkv.connector.async_loads import AsyncLoadWorker
from xkv.connector.loads import LoadOutcomes
from xkv.connector.metadata import ChunkRef, GroupTransfer, TransferJob
from xkv.connector.registry import CacheGroup, build_registry
from xkv.connector.stats import ConnectorStats
from xkv.connector.transfer import SyncTransferHandler

BB = 256  # bytes per block and layer
LAYERS = ("l0", "l1")


class _Handler(SyncTransferHandler):
    """Records what it was asked to copy; ``sync_loads`` must only come once copies landed."""

    def __init__(self, fences):
        super().__init__()
        self.fences, self.loads, self.synced = fences, [], 0

    def begin_loads(self):
        self.fence = self.fences.new()

    def load_group(self, names, card, offsets, pools, block_ids, checks=None):
        assert offsets.shape == (len(names), len(block_ids)) and offsets.dtype == torch.int64
        block_ids, offsets = written_part(block_ids, offsets, checks)  # copies nothing: no check
        self.loads.append((tuple(names), offsets.clone(), block_ids.tolist()))

    def sync_loads(self):
        assert self.fence["landed"], "synced a batch whose copies had not finished"
        self.synced += 1


class _Fences:
    def __init__(self, monkeypatch):
        self.all = []
        monkeypatch.setattr(async_loads, "load_fence", lambda h: NS(
            query=lambda: h.fence["landed"], synchronize=lambda: h.fence.update(landed=True)))

    def new(self):
        self.all.append({"landed": False})
        return self.all[-1]


def _job(job_id, req, blocks, offsets, gens=(1,)):
    refs = tuple(ChunkRef(bytes([job_id]) * 32, (o,), gens) for o in offsets)
    k = len(blocks) // len(offsets)
    gt = GroupTransfer(0, tuple(blocks), tuple(i // k for i in range(len(blocks))),
                       tuple(i % k for i in range(len(blocks))), refs)
    return TransferJob(job_id, req, (gt,), len(blocks) * 32)


class _Outcomes(LoadOutcomes):
    """The restore bookkeeping the sync path shares, recording what it was told."""

    def __init__(self, *args):
        super().__init__(*args)
        self.errors: set[int] = set()
        self.done: Counter = Counter()

    def fail(self, block_ids):
        block_ids = list(block_ids)
        self.errors.update(block_ids)
        super().fail(block_ids)

    def finished(self, job):
        self.done[job.job_id] += 1
        super().finished(job)


CARD = torch.zeros(1 << 16, dtype=torch.uint8)


@pytest.fixture
def side(monkeypatch):
    fences = _Fences(monkeypatch)
    reg = build_registry([CacheGroup(0, "attention", LAYERS, 32, BB)], tp_size=1, pp_size=1,
                         chunk_size=64)
    gens: dict[int, int] = {}
    session = NS(slot_generation=lambda off: gens.get(off, 1), card=CARD, epoch=7)
    stats = ConnectorStats()
    outcomes = _Outcomes(reg, 0, session, stats)
    handlers: list[_Handler] = []

    def new_handler():
        handlers.append(_Handler(fences))
        return handlers[-1]

    w = AsyncLoadWorker(reg, 0, outcomes, stats, pools=dict.fromkeys(LAYERS, object()),
                        new_handler=new_handler)
    return NS(w=w, fences=fences, gens=gens, done=outcomes.done, errors=outcomes.errors,
              handlers=handlers, outcomes=outcomes)



def test_batches_complete_independently_and_handlers_are_reused(side):
    w = side.w
    w.start([_job(1, "a", [5, 6, 7, 8], [0, 4096])], CARD)
    w.start([_job(2, "b", [9, 10], [8192])], CARD)
    assert len(side.handlers) == 2 and w.in_flight
    (names, offs, ids), = side.handlers[0].loads
    # one call for both layers of the group: layer l at slot + (l * k + j) * block bytes
    assert names == LAYERS and ids == [5, 6, 7, 8]
    assert offs.tolist() == [[0, BB, 4096, 4096 + BB], [2 * BB, 3 * BB, 4096 + 2 * BB, 4096 + 3 * BB]]
    w.poll()
    assert w.take_finished() == set() and not side.done  # nothing landed: nothing reported
    side.fences.all[1]["landed"] = True  # the later batch lands first
    w.poll()
    assert w.take_finished() == {"b"} and side.done == Counter({2: 1})
    assert w.take_finished() == set()  # reported once
    assert side.handlers[1].synced == 1 and side.handlers[0].synced == 0 and w.in_flight
    w.start([_job(3, "c", [11, 12], [12288])], CARD)
    assert len(side.handlers) == 2  # the idle handler of batch 2 is reused
    w.poll(wait=True)  # drain (before the card is let go)
    assert w.take_finished() == {"a", "c"} and not w.in_flight and not side.errors
    st = w.stats.data
    assert st["blocks_restored"] == 8 and st["bytes_restored"] == 8 * BB * len(LAYERS)


def test_reused_slot_fails_only_its_blocks(side):
    w = side.w
    w.start([_job(1, "a", [5, 6, 7, 8], [0, 4096])], CARD)
    side.gens[4096] = 2  # chunk 1's slot was reused while the copy ran
    w.poll(wait=True)
    assert side.errors == {7, 8} and w.take_finished() == {"a"} and side.done == Counter({1: 1})


def test_no_card_fails_every_block_and_reports_at_once(side):
    w = side.w
    w.start([_job(1, "a", [5, 6], [0]), _job(2, "b", [9, 10], [4096])], None)
    assert side.errors == {5, 6, 9, 10} and w.take_finished() == {"a", "b"}
    assert not side.handlers and not w.in_flight
    card = side.outcomes.usable_card(8)  # offsets of another gateway epoch than the card's (7)
    assert card is None and side.outcomes.usable_card(7) is CARD
    w.start([_job(3, "c", [11, 12], [8192])], card)
    assert side.errors >= {11, 12} and w.take_finished() == {"c"}
    w.start([], CARD)  # an empty step: nothing issued
    assert not side.handlers and not w.in_flight


def test_inline_handler_needs_no_fence():
    from xkv.connector.transfer import SyncTransferHandler

    # the CPU handler copies inline: its batches are complete when issued
    assert async_loads.load_fence(SyncTransferHandler()) is None


@pytest.mark.gpu
def test_async_batches_on_the_gpu_land_byte_exact_and_report_once():
    """The worker half on CUDA handlers (a load stream each, a CUDA event per batch): two
    steps' batches of layer-major chunk objects from a page-locked card land byte for byte in
    their blocks, the other blocks keep their poison, each request is reported once, and a
    finished batch's handler serves the next step."""
    from xkv.connector.cuda_transfer import CudaTransferHandler
    from xkv.layout import PagePool

    dev, bb, nblocks = torch.device("cuda"), 4096, 16
    reg = build_registry([CacheGroup(0, "attention", LAYERS, 32, bb)], tp_size=1, pp_size=1,
                         chunk_size=64)
    card = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(5)).pin_memory()
    raw = torch.full((len(LAYERS) * nblocks * bb,), 0xA5, dtype=torch.uint8, device=dev)
    pools = {name: PagePool(base=raw[k * nblocks * bb:(k + 1) * nblocks * bb],
                            num_blocks=nblocks, block_bytes=bb, block_stride=bb,
                            runs=((0, bb),))
             for k, name in enumerate(LAYERS)}
    session = NS(slot_generation=lambda off: 1, card=card, epoch=7)
    stats = ConnectorStats()
    handlers: list = []

    def new_handler():
        handlers.append(CudaTransferHandler(dev))
        return handlers[-1]

    w = AsyncLoadWorker(reg, 0, _Outcomes(reg, 0, session, stats), stats, pools=pools,
                        new_handler=new_handler)
    w.start([_job(1, "a", [5, 6, 7, 8], [0, 4 * bb])], card)
    w.start([_job(2, "b", [9, 10], [8 * bb])], card)
    assert len(handlers) == 2
    done: set = set()
    for _ in range(10_000):  # polls never block: spin until both batches landed
        w.poll()
        done |= w.take_finished()
        if done == {"a", "b"}:
            break
        time.sleep(0.001)
    assert done == {"a", "b"} and not w.in_flight
    w.start([_job(3, "c", [11, 12], [12 * bb])], card)
    assert len(handlers) == 2  # an idle handler is reused
    w.poll(wait=True)
    assert w.take_finished() == {"c"}
    pages = raw.view(len(LAYERS), nblocks, bb).cpu()
    # block -> (its chunk's slot, position j in the chunk): layer l at slot + (l * 2 + j) * bb
    where = {5: (0, 0), 6: (0, 1), 7: (4, 0), 8: (4, 1), 9: (8, 0), 10: (8, 1), 11: (12, 0),
             12: (12, 1)}
    for layer in range(len(LAYERS)):
        for b in range(nblocks):
            if b in where:
                slot, j = where[b]
                at = (slot + layer * 2 + j) * bb
                assert torch.equal(pages[layer, b], card[at:at + bb]), (layer, b)
            else:
                assert bool((pages[layer, b] == 0xA5).all()), (layer, b)
