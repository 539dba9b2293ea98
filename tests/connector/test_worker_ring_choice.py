"""The worker's start-up choice of the restore path (``WorkerSide._choose_restore_path``).

``auto`` and ``staged`` reserve the copy engine's ring; only ``auto`` probes, on the first cache
whose pages fit a ring slot, reading the card, and logs the verdict; another engine touches
neither. The kernels' calls are recorded stand-ins (no GPU here).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from xkv import kernels
from xkv.connector.worker import WorkerSide
from xkv.kernels.ring_choice import Probe


@pytest.fixture
def calls(monkeypatch):
    got = []
    result = {"probe": Probe(30.0, 53.0, 64 << 20)}
    monkeypatch.setattr(kernels, "reserve_staging", lambda dev: got.append(("reserve", dev)))

    def probe(pool, card, programs):
        got.append(("probe", pool.name, card, programs))
        return result["probe"]

    monkeypatch.setattr(kernels, "probe_ring", probe)
    monkeypatch.setattr(kernels, "light_restore_programs", lambda: 64)
    return got, result


def worker(engine, card="CARD"):
    big = NS(name="mamba", device="cuda:0", block_bytes=kernels.RING_PAGE_BYTES + 16)
    small = NS(name="attn", device="cuda:0", block_bytes=65536)
    return NS(handler=NS(load_engine=engine), pools={"m": big, "a": small},
              session=NS(card=card))


@pytest.mark.parametrize("engine", ["triton", "copy_engine", "reference"])
def test_other_engines_neither_reserve_nor_probe(calls, engine):
    got, _ = calls
    w = worker(engine)
    WorkerSide._choose_restore_path(w)
    assert got == [] and w._ring_line is None


def test_staged_reserves_without_probing(calls):
    got, _ = calls
    w = worker("staged")
    WorkerSide._choose_restore_path(w)
    assert got == [("reserve", "cuda:0")] and w._ring_line is None


def test_auto_probes_the_first_cache_that_fits_a_slot_and_logs_the_verdict(calls):
    got, result = calls
    w = worker("auto")
    WorkerSide._choose_restore_path(w)
    assert got == [("reserve", "cuda:0"), ("probe", "attn", "CARD", 64)]
    assert "through the copy engine and the ring: yes" in w._ring_line
    assert "ring 53.0 GB/s, Triton kernel 30.0 GB/s" in w._ring_line
    result["probe"] = Probe(50.8, 54.0, 64 << 20)
    WorkerSide._choose_restore_path(w)
    assert "ring: no, the Triton kernel" in w._ring_line
    result["probe"] = Probe(0.0, 0.0, 64 << 20, error="RuntimeError: boom")
    WorkerSide._choose_restore_path(w)
    assert w._ring_line == "XKV: restores stay on the Triton kernel (ring probe: RuntimeError: boom)"
    result["probe"] = None  # nothing the ring could restore: no line
    WorkerSide._choose_restore_path(w)
    assert w._ring_line is None


def test_auto_without_a_card_does_not_probe(calls):
    got, _ = calls
    w = worker("auto", card=None)
    WorkerSide._choose_restore_path(w)
    assert got == [("reserve", "cuda:0")] and w._ring_line is None
