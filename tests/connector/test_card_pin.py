"""Issue 27 item 1 (the idle release): the card is pinned in segments and let go of one segment per
idle step, so a request that arrives meanwhile waits for one segment's unregister at most.

On the H200 ``cudaHostUnregister`` of a 40 GiB card blocked every CUDA call of the process for
1.5 s (a driver lock; bench/RESULTS.md ``after_kill_idle``). Here a fake CUDA runtime stands in
(``xkv.kernels.host``'s ``torch.cuda`` only): it pins whole pages like the driver and refuses two
registrations sharing a page, and holds one lock for each call, which an "engine" call must take
too. CPU tests: segment boundaries (odd sizes, misaligned starts, tiny cards, a card smaller than
one segment), one segment per idle step, a step the engine binds stops the release until the
next idle gap, shutdown and attach let go of everything; a GPU test checks real registrations
and copies that cross a segment boundary, bit-exact.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest
import torch
from connector_fakes import FakeGateway
from hypothesis import given, settings
from hypothesis import strategies as st

from xkv.connector import card_pin
from xkv.connector.card_pin import PAGE, pin, segments, unpin
from xkv.connector.session import GatewaySession, LayoutSpec
from xkv.connector.turnoff import OffPath
from xkv.kernels import host


class FakeCudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` of a fake driver: whole pages are pinned,
    a page pinned twice is refused (CUDA: cudaErrorHostMemoryAlreadyRegistered), each call holds
    :attr:`lock` (the driver lock) for ``sleep_s``; calls are logged with their thread."""

    def __init__(self, sleep_s: float = 0.0, fail_at: int | None = None):
        self.sleep_s, self.fail_at = sleep_s, fail_at
        self.pinned: dict[int, int] = {}  # ptr -> bytes
        self.calls: list[tuple[str, int, int, str]] = []
        self.lock = threading.Lock()

    def _pages(self, ptr, n):
        return set(range(ptr // PAGE, -(-(ptr + n) // PAGE)))

    def cudaHostRegister(self, ptr, n, flags):  # noqa: N802 (the CUDA name)
        with self.lock:
            time.sleep(self.sleep_s)
            if self.fail_at is not None and len(self.calls) == self.fail_at:
                return 2  # cudaErrorMemoryAllocation
            new = self._pages(ptr, n)
            if any(new & self._pages(p, m) for p, m in self.pinned.items()):
                return 712
            self.pinned[ptr] = n
            self.calls.append(("register", ptr, n, threading.current_thread().name))
            return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        with self.lock:
            time.sleep(self.sleep_s)
            if ptr not in self.pinned:
                return 713
            n = self.pinned.pop(ptr)
            self.calls.append(("unregister", ptr, n, threading.current_thread().name))
            return 0

    def engine_call(self) -> float:
        """An engine CUDA call: seconds it waited for the driver lock."""
        t0 = time.perf_counter()
        with self.lock:
            return time.perf_counter() - t0

    def names(self):
        return [c[0] for c in self.calls]


@pytest.fixture
def cudart(monkeypatch):
    rt = FakeCudart()
    cuda = types.SimpleNamespace(is_available=lambda: True, cudart=lambda: rt)
    monkeypatch.setattr(host, "torch", types.SimpleNamespace(Tensor=torch.Tensor, cuda=cuda))
    monkeypatch.setattr(host, "_registered", {})
    monkeypatch.setattr(host, "_spans", [])
    monkeypatch.setattr(host, "_bounds", np.zeros(0, dtype=np.uint64))
    return rt


def _card(nbytes: int, lead: int = 0) -> torch.Tensor:
    """A CPU card of ``nbytes`` bytes starting ``lead`` bytes into a page."""
    base = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    start = (-base.data_ptr()) % PAGE + lead
    return base[start:start + nbytes]


# ---------------------------------------------------------------------------- segments


@settings(max_examples=300, deadline=None)
@given(pages=st.integers(1, 5), nbytes=st.integers(0, 40 * PAGE), lead=st.integers(0, PAGE - 1))
def test_segments_cover_the_card_with_page_aligned_boundaries(pages, nbytes, lead):
    seg = pages * PAGE
    ptr = 1000 * PAGE + lead
    out = segments(nbytes, ptr, seg)
    assert [o for o, _ in out] == ([0] + [o + n for o, n in out][:-1] if out else [])
    assert sum(n for _, n in out) == nbytes and all(0 < n <= seg for _, n in out)
    for o, _ in out[1:]:  # every inner boundary at page_floor(ptr) + k * seg
        assert (ptr + o - (ptr - lead)) % seg == 0
    if nbytes:
        assert len(out) == -(-(nbytes + lead) // seg)


def test_segments_edges():
    assert segments(0, 0, PAGE) == []
    assert segments(1, 0, PAGE) == [(0, 1)]  # a tiny card
    assert segments(5 * PAGE, 0, 8 * PAGE) == [(0, 5 * PAGE)]  # smaller than one segment
    assert segments(8 * PAGE, 0, 8 * PAGE) == [(0, 8 * PAGE)]  # exactly one
    assert segments(8 * PAGE + 1, 0, 8 * PAGE) == [(0, 8 * PAGE), (8 * PAGE, 1)]
    # a start 100 bytes into a page: the first segment is 100 bytes short
    assert segments(2 * PAGE, 100, PAGE) == [(0, PAGE - 100), (PAGE - 100, PAGE), (2 * PAGE - 100, 100)]
    for bad in (0, -PAGE, PAGE + 1, PAGE // 2):
        with pytest.raises(ValueError, match=f"segment of {bad} bytes"):
            segments(10, 0, bad)
    with pytest.raises(ValueError, match="-1 bytes"):
        segments(-1, 0, PAGE)


def test_segment_size_from_the_environment(monkeypatch):
    monkeypatch.delenv("XKV_CARD_SEGMENT_MIB", raising=False)
    assert card_pin.segment_bytes() == 1 << 30  # segments by default (stop 32, card_pin)
    monkeypatch.setenv("XKV_CARD_SEGMENT_MIB", "64")
    assert card_pin.segment_bytes() == 64 << 20
    monkeypatch.setenv("XKV_CARD_SEGMENT_MIB", "0")
    assert card_pin.segment_bytes() is None  # at once
    for bad in ("-3", "1.5", "lots"):
        monkeypatch.setenv("XKV_CARD_SEGMENT_MIB", bad)
        with pytest.raises(ValueError, match=f"XKV_CARD_SEGMENT_MIB='{bad}'"):
            card_pin.segment_bytes()


# ---------------------------------------------------------------------------- pin / unpin


@pytest.mark.parametrize("nbytes,lead", [(1, 0), (3 * PAGE, 0), (10 * PAGE + 7, 0),
                                         (10 * PAGE + 7, 123), (4 * PAGE, PAGE - 1)])
def test_pin_registers_each_segment_and_unpin_lets_go_of_the_last_first(cudart, nbytes, lead):
    card = _card(nbytes, lead)
    seg = 4 * PAGE
    want = segments(nbytes, card.data_ptr(), seg)
    assert pin(card, seg) is card
    p = card.data_ptr()
    assert [(c[1] - p, c[2]) for c in cudart.calls] == want  # the fake refuses shared pages
    assert host.registered_ranges(card) == want
    assert host.is_host_accessible(card)
    if len(want) > 1:  # a copy that crosses a boundary reads pinned memory
        o = want[1][0]
        assert host.is_host_accessible(card[o - 1:o + 1])
    assert host.registered_ranges(card[1:]) == [(o - 1, n) for o, n in want if o >= 1]
    for left in range(len(want) - 1, -1, -1):
        assert unpin(card, 1) == left
        assert cudart.calls[-1][:3] == ("unregister", p + want[left][0], want[left][1])
        assert host.registered_ranges(card) == want[:left]
        assert host.is_host_accessible(card) == (left == len(want))  # only while whole
        if left:
            assert host.is_host_accessible(card[:want[left - 1][0] + want[left - 1][1]])
    assert unpin(card, 1) == 0 and unpin(card) == 0 and cudart.pinned == {}
    assert not host.is_host_accessible(card)


def test_a_card_whose_storage_starts_pinned_still_gets_every_segment(cudart, monkeypatch):
    """torch's ``Tensor.is_pinned`` answers for the tensor's *storage base*: once the first
    segment of a card mapped with ``torch.frombuffer`` (storage base = card start, as the
    connector maps it) is registered, every later segment reads as pinned. Trusting that left
    segment 1 unregistered and a kernel faulted there on the H200 (2026-12-03). The fake answers
    as torch does."""
    import mmap

    def torch_is_pinned(t):  # the driver asked about the storage base (torch's isPinnedPtr)
        base = t.untyped_storage().data_ptr()
        return any(p <= base < p + n for p, n in cudart.pinned.items())

    monkeypatch.setattr(torch.Tensor, "is_pinned", torch_is_pinned)
    m = mmap.mmap(-1, 9 * PAGE + 5)
    card = torch.frombuffer(m, dtype=torch.uint8)
    assert card.untyped_storage().data_ptr() == card.data_ptr()
    want = segments(card.numel(), card.data_ptr(), 2 * PAGE)
    pin(card, 2 * PAGE)
    assert [(c[1] - card.data_ptr(), c[2]) for c in cudart.calls] == want and len(want) == 5
    assert host.registered_ranges(card) == want
    unpin(card, 4)  # only segment 0 stays
    o = want[1][0]
    # a slice of segment 1 is not reachable, whatever torch says of the storage base
    assert torch_is_pinned(card[o:o + 8]) and not host.is_host_accessible(card[o:o + 8])
    assert host.is_host_accessible(card[:o])
    unpin(card)
    del card
    m.close()


def test_segments_turned_off_the_card_is_one_registration(cudart, monkeypatch):
    monkeypatch.setenv("XKV_CARD_SEGMENT_MIB", "0")
    card = _card(9 * PAGE + 5, 77)
    assert card_pin.pin_beside_engine(card) is card
    assert [c[:3] for c in cudart.calls] == [("register", card.data_ptr(), card.numel())]
    assert host.registered_ranges(card) == [(0, card.numel())] and host.is_host_accessible(card)
    assert unpin(card, 1) == 0 and cudart.pinned == {}


def test_unpin_all_and_limits(cudart):
    card = _card(9 * PAGE)
    pin(card, 2 * PAGE)  # 5 segments
    assert unpin(card, 0) == 5 and unpin(card, 2) == 3 and unpin(card) == 0
    assert cudart.names() == ["register"] * 5 + ["unregister"] * 5 and cudart.pinned == {}


def test_a_failed_registration_leaves_nothing_pinned(cudart):
    card = _card(9 * PAGE)
    cudart.fail_at = 3
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pin(card, 2 * PAGE)
    assert cudart.pinned == {} and host.registered_ranges(card) == []


def test_pin_refuses_what_it_cannot_register(cudart):
    with pytest.raises(ValueError, match="contiguous 1-byte CPU tensor"):
        pin(torch.zeros(8, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous 1-byte CPU tensor"):
        pin(torch.zeros(64, dtype=torch.uint8)[::2])
    assert cudart.calls == []


def test_pin_beside_engine_pauses_between_segments(cudart, monkeypatch):
    monkeypatch.setenv("XKV_CARD_SEGMENT_MIB", "1")
    card = _card(3 << 20)
    waits = []
    t = threading.Thread(target=lambda: card_pin.pin_beside_engine(card))
    cudart.sleep_s = 0.03
    t.start()
    while t.is_alive():  # an engine issuing CUDA calls meanwhile
        waits.append(cudart.engine_call())
        time.sleep(0.001)
    t.join()
    assert cudart.names() == ["register"] * 3
    assert max(waits) < 0.03 * 1.9, waits  # never two segments back to back


# ---------------------------------------------------------------------------- the idle release


def _session(cudart, gw, seg):
    s = GatewaySession(gw.client, [LayoutSpec("fp", 1, 4096)], namespace="ns",
                       on_off=lambda r: None, map_card=True)
    assert s.open(register_card=lambda t: pin(t, seg), unregister_card=unpin)
    return s


def _retire(s):
    s.turn_off("test")
    old = s.detach()
    assert old is not None and s.card is None
    return old


def test_the_release_lets_go_of_one_segment_per_idle_step(cudart):
    gw = FakeGateway(capacity=10 * PAGE + 5)  # 6 segments of 2 pages (a misaligned bytearray)
    s = _session(cudart, gw, 2 * PAGE)
    n = len(cudart.calls)
    assert n >= 6
    card = s.card
    op = OffPath(s, lambda t: True, name="xkv-offpath-test")
    op.idle_s, op.step_gap_s = 0.2, 0.05
    op.release(_retire(s), [])
    op.note_step()
    assert op.wait(10)
    unreg = [c for c in cudart.calls if c[0] == "unregister"]
    assert len(unreg) == n and cudart.pinned == {}
    assert [c[1] for c in unreg] == sorted((c[1] for c in unreg), reverse=True)
    assert {c[3] for c in unreg} == {"xkv-offpath-test"}
    assert op.last_release_steps == n + 1  # the drain, then one segment per step
    assert s.client is None and card.numel() == len(gw.card)
    op.close()


def test_a_step_the_engine_binds_stops_the_release_until_the_next_idle_gap(cudart):
    gw = FakeGateway(capacity=40 * PAGE)
    s = _session(cudart, gw, 2 * PAGE)  # 20 or 21 segments (the bytearray's start)
    n = len(cudart.calls)
    cudart.sleep_s = 0.03  # each unregister holds the driver lock 30 ms
    op = OffPath(s, lambda t: True, name="xkv-offpath-test")
    op.idle_s, op.step_gap_s = 0.3, 0.01
    op.release(_retire(s), [])
    end = time.monotonic() + 5
    while "unregister" not in cudart.names() and time.monotonic() < end:
        time.sleep(0.002)  # the engine idles: the release starts
    # a request arrives: the engine binds steps (every 20 ms) and makes CUDA calls
    waits, t_end = [], time.monotonic() + 1.0
    while time.monotonic() < t_end:
        op.note_step()
        waits.append(cudart.engine_call())
        time.sleep(0.02)
    during = cudart.names().count("unregister")
    assert during <= 3, cudart.calls  # the one running, at most one started before the bind
    assert max(waits) < 2 * 0.03, waits  # a request waits for one segment at most
    assert op.retired == 1
    waits = []
    t = threading.Thread(target=op.wait, args=(10,))
    t.start()
    while t.is_alive():  # idle again: the release goes on; calls meanwhile wait one segment
        waits.append(cudart.engine_call())
        time.sleep(0.005)
    assert op.retired == 0 and cudart.names().count("unregister") == n
    assert max(waits) < 2 * 0.03, waits
    op.close()


def test_shutdown_lets_go_of_every_segment_at_once(cudart):
    gw = FakeGateway(capacity=12 * PAGE)
    s = _session(cudart, gw, 2 * PAGE)
    op = OffPath(s, lambda t: True, name="xkv-offpath-test")
    op.release(_retire(s), [])
    op.note_step()  # the engine is busy: nothing goes before close
    time.sleep(0.1)
    assert "unregister" not in cudart.names() and op.retired == 1
    t0 = time.perf_counter()
    assert op.close(5) is None
    assert time.perf_counter() - t0 < 1.0  # no idle wait, no gaps
    assert cudart.pinned == {} and op.retired == 0 and s.client is None


def test_an_attach_lets_go_of_the_retired_segments_before_registering(cudart):
    gw = FakeGateway(capacity=8 * PAGE)
    s = _session(cudart, gw, 2 * PAGE)
    old_regs = len(cudart.calls)
    op = OffPath(s, lambda t: True, name="xkv-offpath-test")
    op.release(_retire(s), [])
    op.note_step()
    op.attach()
    att = op.take_attached(None)
    assert att is not None
    names = cudart.names()
    assert names == ["register"] * old_regs + ["unregister"] * old_regs + ["register"] * old_regs
    assert len(cudart.pinned) == old_regs  # the new card only
    s.adopt(att)
    s.close()
    assert cudart.pinned == {}
    op.close()


def test_a_release_after_close_runs_every_step_on_the_caller(cudart):
    gw = FakeGateway(capacity=6 * PAGE)
    s = _session(cudart, gw, 2 * PAGE)
    op = OffPath(s, lambda t: True, name="xkv-offpath-test")
    op.close()
    op.release(_retire(s), [])
    assert cudart.pinned == {} and {c[3] for c in cudart.calls if c[0] == "unregister"} == {
        threading.current_thread().name}


# ---------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
def test_segments_on_the_gpu_copy_across_boundaries_bit_exact():
    """Real ``cudaHostRegister`` of 2 MiB segments of one 32 MiB mapping (a misaligned start):
    restores and saves whose objects cross a segment boundary, with every engine, bit-exact;
    then one segment at a time let go."""
    import mmap

    from xkv import kernels

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seg, size, bb = 2 << 20, 32 << 20, 12288 + 64
    m = mmap.mmap(-1, size + PAGE)
    card = torch.frombuffer(m, dtype=torch.uint8)[100:100 + size]
    g = torch.Generator().manual_seed(3)
    card.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    pin(card, seg)
    try:
        _copies_across_boundaries(card, seg, size, bb, g)
    finally:  # a failure must not leave registrations behind for later tests' mallocs
        unpin(card)
    assert not kernels.is_host_accessible(card)
    del card


def _copies_across_boundaries(card, seg, size, bb, g):
    """The GPU test's copies (``card`` pinned in ``seg``-byte pieces); ends by letting go of one
    piece at a time, checking the count left."""
    from xkv import kernels
    from xkv.layout import PagePool

    want_segs = segments(size, card.data_ptr(), seg)
    assert host.registered_ranges(card) == want_segs and kernels.is_host_accessible(card)
    bounds = [o for o, _ in want_segs[1:]]
    # straddle every boundary (clamped: the last piece may be shorter than a page, seen on the
    # H200, where the card's start was not 4 KiB-aligned in the piece grid)
    offs = ([min(b - bb // 2, size - bb) for b in bounds]
            + [min(b - 1, size - bb) for b in bounds[:3]] + [0, size - bb])
    n = len(offs)
    for engine in ("triton", "copy_engine", "staged"):
        base = torch.full((n * bb,), 0xA5, dtype=torch.uint8, device="cuda")  # poisoned
        pool = PagePool(base=base, num_blocks=n, block_bytes=bb, block_stride=bb,
                        runs=((0, bb),), kind="mla")
        ids = torch.arange(n, dtype=torch.int64)
        kernels.restore(card, torch.tensor(offs, dtype=torch.int64), pool, ids, engine=engine)
        torch.cuda.synchronize()
        want = torch.cat([card[o:o + bb] for o in offs])
        assert torch.equal(base.cpu(), want), engine
        # saves into other places that cross a boundary too (no two overlap)
        dst_offs = [b - bb // 3 for b in bounds[1::2] if b - bb // 3 + bb <= size]
        src = torch.randint(0, 256, (len(dst_offs) * bb,), dtype=torch.uint8, generator=g)
        spool = PagePool(base=src.cuda(), num_blocks=len(dst_offs), block_bytes=bb,
                         block_stride=bb, runs=((0, bb),), kind="mla")
        kernels.save(spool, torch.arange(len(dst_offs)), card,
                     torch.tensor(dst_offs, dtype=torch.int64), engine=engine)
        torch.cuda.synchronize()
        for i, o in enumerate(dst_offs):
            assert torch.equal(card[o:o + bb], src[i * bb:(i + 1) * bb]), (engine, o)
    # a torch copy across a boundary, as page_verify and the fan-out make them
    o = bounds[0] - 4096
    dev = torch.empty(3 * 4096, dtype=torch.uint8, device="cuda")
    # torch's own copy of these bytes fails ("invalid argument": one copy over two
    # registrations, H200 2026-12-03); host.copy_bytes cuts it
    host.copy_bytes(dev, card[o:o + 3 * 4096])
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), card[o:o + 3 * 4096])
    for left in range(len(want_segs) - 1, -1, -1):
        assert unpin(card, 1) == left
