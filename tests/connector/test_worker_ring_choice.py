"""The worker's start-up choice of the restore path (``warmup.choose_restore_path``).

``auto`` and ``staged`` reserve the copy engine's ring; only ``auto`` probes, on the first cache
whose pages fit a ring slot, reading the card, and logs the verdict; another engine touches
neither. The kernels' calls are recorded stand-ins (no GPU here).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from xkv import kernels
from xkv.connector.warmup import choose_restore_path
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


def choose(engine, card="CARD"):
    """The verdict line for a handler of ``engine`` over a Mamba cache too large for a ring
    slot, then an attention cache that fits one."""
    big = NS(name="mamba", device="cuda:0", block_bytes=kernels.RING_PAGE_BYTES + 16)
    small = NS(name="attn", device="cuda:0", block_bytes=65536)
    return choose_restore_path(NS(load_engine=engine), {"m": big, "a": small}, card)


@pytest.mark.parametrize("engine", ["triton", "copy_engine", "reference"])
def test_other_engines_neither_reserve_nor_probe(calls, engine):
    got, _ = calls
    assert choose(engine) is None and got == []


def test_staged_reserves_without_probing(calls):
    got, _ = calls
    assert choose("staged") is None and got == [("reserve", "cuda:0")]


def test_auto_probes_the_first_cache_that_fits_a_slot_and_logs_the_verdict(calls):
    got, result = calls
    line = choose("auto")
    assert got == [("reserve", "cuda:0"), ("probe", "attn", "CARD", 64)]
    # from the size where the ring's faster copy pays for its host work (ring_from_bytes)
    start = Probe(30.0, 53.0, 64 << 20).ring_from_bytes
    assert 131 << 20 < start <= 132 << 20
    assert "restores of >= 132 MiB through the copy engine and the ring: yes" in line
    assert "ring 53.0 GB/s, Triton kernel 30.0 GB/s" in line
    assert "where its copy saves 2 ms" in line
    result["probe"] = Probe(50.8, 54.0, 64 << 20)
    assert "ring: no, the Triton kernel" in choose("auto")
    result["probe"] = Probe(0.0, 0.0, 64 << 20, error="RuntimeError: boom")
    assert choose("auto") == ("XKV: restores stay on the Triton kernel (ring probe: "
                              "RuntimeError: boom)")
    result["probe"] = None  # nothing the ring could restore: no line
    assert choose("auto") is None


def test_auto_without_a_card_does_not_probe(calls):
    got, _ = calls
    assert choose("auto", card=None) is None and got == [("reserve", "cuda:0")]
