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
    result["probe"] = Probe(50.8, 54.0, 64 << 20, gain=1.0)  # XKV_RING_MIN_GAIN=1's probe
    line = choose("auto")
    assert "restores of >= 1" in line and "the ring from 1x" in line and ": yes" in line
    result["probe"] = Probe(0.0, 0.0, 64 << 20, error="RuntimeError: boom")
    assert choose("auto") == ("XKV: restores stay on the Triton kernel (ring probe: "
                              "RuntimeError: boom)")
    result["probe"] = None  # nothing the ring could restore: no line
    assert choose("auto") is None


def test_auto_without_a_card_does_not_probe(calls):
    got, _ = calls
    assert choose("auto", card=None) is None and got == [("reserve", "cuda:0")]


def test_which_restores_may_take_the_copy_engine(monkeypatch):
    """``XKV_EARLY_ISSUE``'s auto asks this after the probe: only the Triton kernel's restores
    count as not taking the copy engine (``triton``, or ``auto`` whose probe kept the kernel
    at every size and no calibration installed)."""
    from xkv.connector.warmup import restores_may_take_copy_engine as may
    from xkv.kernels import ring_choice

    dev = "cpu"  # the records are per device index; no GPU needed
    monkeypatch.setattr(ring_choice, "_CHOICE", {})
    monkeypatch.setattr(kernels, "calibration", lambda d: None)
    assert not may(NS(), dev)  # the CPU handler: no engines
    assert not may(NS(load_engine="triton"), dev)
    for engine in ("staged", "copy_engine", "reference"):
        assert may(NS(load_engine=engine), dev)
    assert may(NS(load_engine="auto"), dev)  # no probe ran: auto takes the ring
    ring_choice.set_choice(Probe(50.8, 54.0, 64 << 20), dev)  # kept the kernel
    assert not may(NS(load_engine="auto"), dev)
    monkeypatch.setattr(kernels, "calibration", lambda d: object())
    assert may(NS(load_engine="auto"), dev)  # a calibration decides per fragment size
    monkeypatch.setattr(kernels, "calibration", lambda d: None)
    ring_choice.set_choice(Probe(30.0, 53.0, 64 << 20), dev)  # chose the ring
    assert may(NS(load_engine="auto"), dev)


def test_a_lower_ring_gain_gives_the_ring_only_large_restores(monkeypatch):
    """``XKV_RING_MIN_GAIN=1`` on a host whose SMs read host memory nearly as fast as the copy
    engine (stop 56's probe: ring 52.6, kernel 49.9 GB/s): the ring takes restores of about 2
    GB and more (``copy_engine_from_bytes``), while ``restores_may_take_copy_engine`` (early
    issue's engine-wide condition) still says no: only those large steps skip early issue."""
    from xkv.connector.warmup import copy_engine_from_bytes as start
    from xkv.connector.warmup import restores_may_take_copy_engine as may
    from xkv.kernels import ring_choice

    dev = "cpu"
    monkeypatch.setattr(ring_choice, "_CHOICE", {})
    monkeypatch.setattr(kernels, "calibration", lambda d: None)
    assert start(NS(), dev) is None and start(NS(load_engine="triton"), dev) is None
    for engine in ("staged", "copy_engine", "reference"):
        assert start(NS(load_engine=engine), dev) == 0
    assert start(NS(load_engine="auto"), dev) == kernels.staged.STAGED_MIN_BYTES  # unprobed
    ring_choice.set_choice(Probe(49.9, 52.6, 63 << 20), dev)  # stop 56's probe, the default
    assert start(NS(load_engine="auto"), dev) is None and not may(NS(load_engine="auto"), dev)
    stop56 = Probe(49.9, 52.6, 63 << 20, gain=1.0)  # the same probe under XKV_RING_MIN_GAIN=1
    ring_choice.set_choice(stop56, dev)
    big = start(NS(load_engine="auto"), dev)
    assert big == stop56.ring_from_bytes and 1.9e9 < big < 2.0e9
    assert not may(NS(load_engine="auto"), dev)  # not a ring host by the default's margin
    assert ring_choice.takes_ring(dev, big) and not ring_choice.takes_ring(dev, big - 1)
    ring_choice.set_choice(Probe(30.0, 53.0, 64 << 20), dev)  # a ring host either way
    assert may(NS(load_engine="auto"), dev) and start(NS(load_engine="auto"), dev) < 140 << 20
    monkeypatch.setattr(kernels, "calibration", lambda d: object())
    assert start(NS(load_engine="auto"), dev) == 0


def test_a_bad_ring_gain_refuses_to_start_before_the_probe(calls, monkeypatch):
    got, _ = calls
    monkeypatch.setenv("XKV_RING_MIN_GAIN", "0.5")
    with pytest.raises(ValueError, match="XKV_RING_MIN_GAIN='0.5': expected a number >= 1"):
        choose("auto")
    assert got == []  # nothing reserved or probed
    assert choose("triton") is None  # an engine that never takes the ring does not read it
