"""The start-up probe that decides whether ``engine="auto"`` restores through the ring (xkv.kernels.ring_choice).

CPU: the verdict's threshold, that it is kept per GPU, that ``staged_restore.preferred`` follows
it, and that the probe declines what the ring cannot restore. ``gpu``: a real probe moves the
card's bytes into the pages exactly, records its rates, and ``auto`` then follows the verdict.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from gpu_buffers import gpu_and_cpu
from pools import POISON, Geometry, pool_over, random_bytes

import xkv.kernels as K
from xkv.kernels import ring_choice, staged, staged_restore
from xkv.kernels.ring_choice import MIN_GAIN, Probe


def test_the_ring_wins_from_min_gain_times_the_triton_rate():
    assert Probe(triton_gbps=40.0, ring_gbps=40.0 * MIN_GAIN, nbytes=1).ring_wins
    assert not Probe(triton_gbps=40.0, ring_gbps=40.0 * MIN_GAIN - 0.01, nbytes=1).ring_wins
    # the two hosts measured: stop 41's H200 (page mover) loses, stop 40's H100 wins
    assert not Probe(triton_gbps=50.8, ring_gbps=54.3, nbytes=1).ring_wins
    assert Probe(triton_gbps=31.0, ring_gbps=53.0, nbytes=1).ring_wins
    assert 1.07 < MIN_GAIN < 1.6
    assert not Probe(triton_gbps=1.0, ring_gbps=99.0, nbytes=1, error="RuntimeError: x").ring_wins


def test_the_gain_can_be_lowered_and_the_size_rule_still_decides(monkeypatch):
    """``XKV_RING_MIN_GAIN`` replaces ``MIN_GAIN`` (a number >= 1, anything else refuses,
    naming the variable); a probe keeps the gain it was made with (``gain``: the environment is
    read once, not at every restore); at 1 a ring a few percent faster wins, from the size
    where its copy saves ``RING_EXTRA_S``; equal rates never take the ring (no division by
    zero)."""
    monkeypatch.delenv(ring_choice.GAIN_ENV, raising=False)
    assert ring_choice.min_gain() == MIN_GAIN
    p = Probe(triton_gbps=49.9, ring_gbps=52.6, nbytes=1)  # stop 56's H100
    assert p.gain == MIN_GAIN and not p.ring_wins and p.ring_from_bytes is None
    monkeypatch.setenv(ring_choice.GAIN_ENV, "1")
    assert ring_choice.min_gain() == 1.0
    assert not p.ring_wins  # made before: its gain stays
    p = Probe(triton_gbps=49.9, ring_gbps=52.6, nbytes=1, gain=ring_choice.min_gain())
    assert p.ring_wins
    saved = (1 / 49.9 - 1 / 52.6) / 1e9  # seconds per byte
    assert p.ring_from_bytes == int(np.ceil(ring_choice.RING_EXTRA_S / saved))
    assert 1.9e9 < p.ring_from_bytes < 2.0e9
    even = Probe(50.0, 50.0, 1, gain=1.0)
    assert even.ring_wins and even.ring_from_bytes is None
    assert not Probe(50.0, 49.9, 1, gain=1.0).ring_wins
    assert not Probe(30.0, 44.0, 1, gain=1.5).ring_wins and Probe(30.0, 45.0, 1, gain=1.5).ring_wins
    for bad in ("0.9", "x", "", "nan", "inf", "-1"):
        monkeypatch.setenv(ring_choice.GAIN_ENV, bad)
        with pytest.raises(ValueError, match=f"XKV_RING_MIN_GAIN='{bad}': expected a number >= 1"):
            ring_choice.min_gain()


def test_ring_from_names_the_smallest_restore_takes_ring_gives_the_ring(monkeypatch):
    monkeypatch.delenv(ring_choice.GAIN_ENV, raising=False)
    monkeypatch.setattr(ring_choice, "_CHOICE", {})
    assert ring_choice.ring_from("cpu") == staged.STAGED_MIN_BYTES  # unprobed: the ring
    ring_choice.set_choice(Probe(30.0, 53.0, 1), "cpu")
    start = ring_choice.ring_from("cpu")
    assert start == Probe(30.0, 53.0, 1).ring_from_bytes
    assert ring_choice.takes_ring("cpu", start) and not ring_choice.takes_ring("cpu", start - 1)
    ring_choice.set_choice(Probe(50.8, 54.0, 1), "cpu")
    assert ring_choice.ring_from("cpu") is None and not ring_choice.takes_ring("cpu", 1 << 62)


class _Host:
    """A virtual clock and copies whose duration triples while a load beside them runs (until
    ``busy_until``): what one engine's probe saw while another engine started (stop 42)."""

    def __init__(self, busy_until: float):
        self.t, self.busy_until, self.calls = 0.0, busy_until, []

    def copy(self, name: str, seconds: float):
        def go():
            self.calls.append(name)
            self.t += seconds * (3.0 if self.t < self.busy_until else 1.0)
        return go


@pytest.mark.parametrize("busy_until", [0.0, 4.0, 12.0, 15.0])
def test_the_paths_are_timed_in_alternating_rounds_so_a_load_beside_slows_both(busy_until):
    """The probe compares two rates: a load that lasts the first rounds must not fall on one
    path's repetitions only (timed one path after the other, a load over the first 12 s gives
    the Triton kernel 1/3 of its rate here and flips the verdict)."""
    from xkv.kernels.calibrate import copy_rates

    host = _Host(busy_until)
    tri, ring = host.copy("triton", 1.0), host.copy("ring", 1.0 / 1.1)
    rates = copy_rates([tri, ring], 10**9, None, reps=5, sync=lambda: None,
                       clock=lambda: host.t)
    assert rates == pytest.approx([1.0, 1.1])  # each path's unloaded rate, GB/s
    assert not Probe(triton_gbps=rates[0], ring_gbps=rates[1], nbytes=1).ring_wins
    # one warm-up each, then 5 rounds of both, the first of a round alternating
    assert host.calls == ["triton", "ring"] + ["triton", "ring", "ring", "triton"] * 2 + [
        "triton", "ring"]
    if busy_until == 12.0:  # what the probe did before: one path's 3 repetitions, then the other's
        host = _Host(busy_until)
        one_by_one = [copy_rates([host.copy(n, s)], 10**9, None, reps=3, sync=lambda: None,
                                 clock=lambda: host.t)[0] for n, s in (("t", 1.0), ("r", 1 / 1.1))]
        assert one_by_one == pytest.approx([1 / 3, 1.1])
        assert Probe(triton_gbps=one_by_one[0], ring_gbps=one_by_one[1], nbytes=1).ring_wins


def test_copy_rates_of_one_path_is_copy_gbps_and_refuses_nothing_odd():
    from xkv.kernels.calibrate import copy_rates

    host = _Host(0.0)
    assert copy_rates([host.copy("a", 0.5)], 2 * 10**9, None, reps=0, sync=lambda: None,
                      clock=lambda: host.t) == pytest.approx([4.0])
    assert host.calls == ["a", "a"]  # warm-up, then at least one timed round
    assert copy_rates([], 1, None, sync=lambda: None) == []


def test_the_verdict_is_kept_per_gpu_and_unprobed_takes_the_ring():
    big = 4 << 30
    try:
        assert ring_choice.choice(7) is None and ring_choice.takes_ring(7, big)
        assert ring_choice.takes_ring(7, 1)  # unprobed: every size (STAGED_MIN_BYTES is preferred's)
        lose = Probe(triton_gbps=50.0, ring_gbps=52.0, nbytes=64 << 20)
        ring_choice.set_choice(lose, 7)
        assert ring_choice.choice(7) is lose and not ring_choice.takes_ring(7, big)
        assert ring_choice.takes_ring(6, big)  # another GPU: unprobed
        ring_choice.set_choice(Probe(30.0, 53.0, 64 << 20), 7)
        assert ring_choice.takes_ring(7, big)
        ring_choice.set_choice(None, 7)
        assert ring_choice.choice(7) is None and ring_choice.takes_ring(7, big)
    finally:
        ring_choice.set_choice(None, 7)


# stop 50's H100: probe rates (GB/s) and two full-hit restores' bytes measured against each other
STOP50 = Probe(triton_gbps=31.3, ring_gbps=51.8, nbytes=64 << 20)
MLA_4K = 16 * 257 * 18432  # 16 layers x 257 blocks of 18 KiB (the tail's block included)
LLAMA_2K = 32 * 129 * 65536


def test_the_ring_takes_only_restores_whose_faster_copy_pays_for_its_host_work():
    """Where the ring won the probe, a restore takes it from the size at which copying at the
    ring's rate instead of the kernel's saves ``RING_EXTRA_S``: stop 50's MLA 4k restore (ring 1.5
    ms slower in the engine) stays on the kernel, its Llama 2k restore (1.6 ms faster) takes the
    ring."""
    start = STOP50.ring_from_bytes
    saved = start / (STOP50.triton_gbps * 1e9) - start / (STOP50.ring_gbps * 1e9)
    assert saved == pytest.approx(ring_choice.RING_EXTRA_S, rel=1e-6)
    assert (start - 1) / (STOP50.triton_gbps * 1e9) - (start - 1) / (STOP50.ring_gbps * 1e9) \
        < ring_choice.RING_EXTRA_S
    assert MLA_4K < start < LLAMA_2K
    assert 100 << 20 < start < 200 << 20  # ~158 MB
    # the closer the rates, the larger the restore must be; no gain, never
    assert Probe(31.3, 31.3 * MIN_GAIN, 1).ring_from_bytes > 3 * start
    assert Probe(31.3, 31.3 * MIN_GAIN - 0.01, 1).ring_from_bytes is None
    assert Probe(1.0, 99.0, 1, error="RuntimeError: x").ring_from_bytes is None
    # never below what a staged restore needs to fill its pipeline
    assert Probe(1.0, 99.0, 1).ring_from_bytes == staged.STAGED_MIN_BYTES
    try:
        ring_choice.set_choice(STOP50, 7)
        assert not ring_choice.takes_ring(7, MLA_4K)
        assert ring_choice.takes_ring(7, LLAMA_2K)
        assert not ring_choice.takes_ring(7, start - 1) and ring_choice.takes_ring(7, start)
    finally:
        ring_choice.set_choice(None, 7)


@pytest.mark.parametrize("layers,n,bb,ring", [(16, 257, 18432, False), (32, 129, 65536, True),
                                              (16, 4097, 18432, True), (1, 128, 65536, False)])
def test_preferred_asks_the_probe_with_the_whole_restores_bytes(monkeypatch, layers, n, bb, ring):
    """``staged_restore.preferred`` passes the restore's bytes (every layer's pages) to the
    probe's rule: with stop 50's probe recorded, MLA 4k stays on the kernel, Llama 2k and MLA 64k
    take the ring, 8 MiB (below ``STAGED_MIN_BYTES``) never does."""
    from xkv.kernels import copy_engine

    monkeypatch.setattr(copy_engine, "available", lambda: True)
    monkeypatch.setattr(staged_restore, "calibration", lambda dev: None)
    dev = torch.device("cuda", 7)  # a device index no test GPU has: this GPU's probe only
    job = NS(save=False, sliced=False, pools=[NS(device=dev)] * layers, n=n, block_bytes=bb,
             flat=NS(device=NS(type="cpu")))
    try:
        ring_choice.set_choice(STOP50, dev)
        assert staged_restore.preferred(job) is ring
    finally:
        ring_choice.set_choice(None, dev)


def test_auto_follows_the_probe(monkeypatch):
    """A restore ``preferred`` takes through the ring stays on the Triton kernel once the GPU's
    probe found the ring not enough faster (the job is a stand-in: no GPU here)."""
    from xkv.kernels import copy_engine

    monkeypatch.setattr(copy_engine, "available", lambda: True)
    monkeypatch.setattr(staged_restore, "calibration", lambda dev: None)
    job = NS(save=False, sliced=False, pools=[NS(device=NS(type="cuda"))] * 32, n=128,
             block_bytes=65536, flat=NS(device=NS(type="cpu")))
    verdict = {"wins": True}
    asked = []
    monkeypatch.setattr(staged_restore, "takes_ring",
                        lambda dev, nbytes: asked.append(nbytes) or verdict["wins"])
    assert staged_restore.preferred(job)
    verdict["wins"] = False
    assert not staged_restore.preferred(job)
    assert asked == [32 * 128 * 65536] * 2


def test_the_probe_declines_what_the_ring_cannot_restore():
    """CPU pages, or too few pages for a staged restore: nothing is timed or recorded."""
    g = Geometry(64, 4096, ((0, 4096),))
    pool = pool_over(torch.full((g.extent,), POISON, dtype=torch.uint8), 0, g)
    card = torch.zeros(64 * 4096, dtype=torch.uint8)
    assert ring_choice.probe(pool, card, 4) is None
    assert ring_choice.choice(-1) is None
    assert staged.STAGED_MIN_BYTES > 64 * 4096
    if torch.cuda.is_available():  # CUDA pages, but 256 KiB: below a staged restore
        _, _, _, pool_gpu = gpu_and_cpu(g, 1, fill=POISON)
        assert ring_choice.probe(pool_gpu, card.pin_memory(), 4) is None
        assert ring_choice.choice(pool_gpu.device) is None


@pytest.mark.gpu
def test_a_probe_restores_the_cards_bytes_and_auto_follows_its_verdict():
    """The probe's restores (Triton, then the ring) leave the card's bytes in the first pages
    exactly; its rates are recorded for the GPU and ``prepare_restore(engine="auto")`` takes the
    ring for a large restore exactly when the verdict says so."""
    dev = torch.device("cuda")
    K.reserve_staging(dev)
    g = Geometry(400, 65536, ((0, 32768), (32768, 32768)))
    card = random_bytes(300 * 65536, 31).pin_memory()
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, 32, fill=POISON)
    try:
        p = K.probe_ring(pool_gpu, card, K.light_restore_programs(), nbytes=256 * 65536)
        assert p is not None and p.nbytes == 256 * 65536
        assert p.triton_gbps > 0 and p.ring_gbps > 0 and p.gain == ring_choice.min_gain()
        assert ring_choice.choice(dev) is p
        torch.cuda.synchronize()
        got = raw_gpu.cpu()[: 256 * g.block_stride]
        assert torch.equal(got, card[: 256 * 65536])
        assert torch.equal(raw_gpu.cpu()[256 * g.block_stride :],
                           raw_cpu[256 * g.block_stride :])  # untouched: still poison
        ids = np.arange(200)
        offs = (np.arange(200, dtype=np.int64) * 65536)[None]
        prep = K.prepare_restore(card, offs, [pool_gpu], ids)  # 12.5 MiB >= STAGED_MIN_BYTES
        assert staged.STAGED_MIN_BYTES <= 200 * 65536
        ring = p.ring_from_bytes is not None and p.ring_from_bytes <= 200 * 65536
        assert ring_choice.takes_ring(dev, 200 * 65536) is ring
        assert prep.engines == (("staged",) if ring else ("triton",))
    finally:
        ring_choice.set_choice(None, dev)


@pytest.mark.gpu
def test_a_probe_that_raises_keeps_the_triton_kernel(monkeypatch):
    """Whatever breaks in the ring's probe, the GPU serves without the ring (recorded with the
    error) rather than failing its first large restore."""
    dev = torch.device("cuda")
    g = Geometry(300, 65536, ((0, 65536),))
    card = random_bytes(256 * 65536, 33).pin_memory()
    _, _, _, pool_gpu = gpu_and_cpu(g, 34, fill=POISON)

    def broken(*a, **k):
        raise RuntimeError("cuMemcpyBatchAsync failed: CUresult 1")

    monkeypatch.setattr(staged_restore, "prepare", broken)
    try:
        p = K.probe_ring(pool_gpu, card, 4, nbytes=256 * 65536)
        assert p is not None and "CUresult 1" in p.error and not p.ring_wins
        assert not ring_choice.takes_ring(dev, 4 << 30)
    finally:
        ring_choice.set_choice(None, dev)
