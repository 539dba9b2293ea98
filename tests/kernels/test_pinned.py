"""The page-locked staging pool (xkv/kernels/pinned.py): reuse, best fit, events, refusals; on
the GPU, a restore of a size never seen before allocates nothing after ``reserve_for``."""

import gc

import numpy as np
import pytest
import torch

from xkv.kernels import pinned
from xkv.kernels.pinned import MIN_BYTES, PinnedPool


class Ev:
    """A fake CUDA event: ``done`` says whether the work before it completed."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_take_is_exact_and_reused_after_give():
    p = PinnedPool(pin=False)
    a = p.take(1000)
    assert a.dtype == torch.uint8 and a.numel() == 1000 and p.allocations == 1
    ptr = a.data_ptr()
    p.give(a)
    b = p.take(MIN_BYTES)  # fits the same buffer: no allocation
    assert b.data_ptr() == ptr and p.allocations == 1
    c = p.take(10)  # the only buffer is out: a second one
    assert c.data_ptr() != ptr and p.allocations == 2


def test_best_fit_and_power_of_two_capacity():
    p = PinnedPool(pin=False)
    p.reserve(MIN_BYTES, 1)
    p.reserve(3 * MIN_BYTES, 1)  # capacity rounds up to 4 * MIN_BYTES
    assert p.allocations == 2 and p.free_count() == 2
    small = p.take(17)
    big = p.take(3 * MIN_BYTES + 1)
    assert p.allocations == 2
    assert small.untyped_storage().nbytes() == MIN_BYTES
    assert big.untyped_storage().nbytes() == 4 * MIN_BYTES


def test_pending_event_keeps_a_buffer_out_until_it_completed():
    p = PinnedPool(pin=False)
    a = p.take(100)
    ev = Ev(False)
    p.give(a, ev)
    b = p.take(100)  # the only free buffer is still in use by the device: allocate
    assert b.data_ptr() != a.data_ptr() and p.allocations == 2
    ev.done = True
    c = p.take(100)
    assert c.data_ptr() == a.data_ptr() and p.allocations == 2


def test_give_refuses_twice_and_foreign():
    p = PinnedPool(pin=False)
    a = p.take(8)
    p.give(a)
    with pytest.raises(ValueError, match="not taken from this pool"):
        p.give(a)
    with pytest.raises(ValueError, match="not taken from this pool"):
        p.give(torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"take\(-1\)"):
        p.take(-1)
    with pytest.raises(ValueError, match=r"reserve\(-5, 1\)"):
        p.reserve(-5, 1)


def test_give_when_collected_returns_once_the_tensor_is_dropped():
    p = PinnedPool(pin=False)
    raw = p.take(64)
    ptr = raw.data_ptr()
    out = raw.view(torch.int32).view(4, 4)
    out.fill_(7)
    p.give_when_collected(out, Ev(True))
    del raw
    gc.collect()
    assert p.free_count() == 0  # the holder still has it
    assert int(out.sum()) == 7 * 16
    del out
    gc.collect()
    assert p.free_count() == 1
    assert p.take(64).data_ptr() == ptr and p.allocations == 1


def test_zero_bytes():
    p = PinnedPool(pin=False)
    z = p.take(0)
    assert z.numel() == 0
    p.give(z)
    assert p.free_count() == 1


def test_reserve_for_sizes_and_cap(monkeypatch):
    p = PinnedPool(pin=False)
    monkeypatch.setattr(pinned, "_POOL", p)
    large = pinned.reserve_for(1000, 32, count=2)
    assert large == 8 * 1000 * 40
    # 8 small buffers plus 2 large ones (each rounded up to a power of two)
    assert p.allocations == 10
    sizes = sorted(b.numel() for b, _ in p._free)
    assert sizes[:8] == [MIN_BYTES] * 8 and all(s >= large for s in sizes[8:])
    pinned.reserve_for(1000, 32, count=2)  # already there: nothing more
    assert p.allocations == 10
    capped = pinned.reserve_for(10**9, 80, count=4, cap_bytes=1 << 20)
    assert capped == (1 << 20) // 4
    with pytest.raises(ValueError, match="count=0"):
        pinned.reserve_for(10, 10, count=0)


@pytest.mark.gpu
@pytest.mark.parametrize("defer", [False, True], ids=["planned", "deferred"])
def test_restore_of_a_new_size_allocates_no_pinned_memory(defer):
    """After ``reserve_for``, a checked restore with more blocks and objects than any before
    takes its tables, expected words and flags from the pool: no page-locked allocation (an
    implicit device synchronisation) inside the step; the flags still read back right. Also
    with the connector's deferred planning (its tables in two uploads)."""
    from xkv import kernels
    from xkv.kernels.verify import Checks
    from xkv.layout import PagePool

    dev = torch.device("cuda")
    L, NB, bb = 4, 600, 512
    cache = [torch.zeros(NB * bb, dtype=torch.uint8, device=dev) for _ in range(L)]
    pools = [PagePool(c, NB, bb, bb, ((0, bb),)) for c in cache]
    pinned.reserve_for(NB, L)
    before = pinned.pool().allocations
    for n in (3, 37, 512):  # sizes never seen by this process's pool
        objs = -(-n // 4)
        card = torch.randint(0, 256, (objs * L * 4 * bb,), dtype=torch.uint8).pin_memory()
        blk = torch.arange(n, dtype=torch.int64)
        base = (blk // 4) * (L * 4 * bb) + (blk % 4) * bb
        offs = base.reshape(1, -1) + (torch.arange(L) * 4 * bb).reshape(-1, 1)
        chk = Checks(np.asarray(blk // 4), np.asarray(blk % 4), objs,
                     expected=np.zeros((L, objs), np.uint32))
        prep = kernels.prepare_restore(card, offs, pools, blk, checks=chk, engine="triton",
                                       defer_rest=defer)
        for k in range(L):
            prep.launch(k)
        words = prep.checks.readback()
        torch.cuda.synchronize()
        flags = kernels.mismatch_flags(words.numpy())
        assert flags.shape == (objs,) and bool(flags.all())  # zero words expected: all differ
    assert pinned.pool().allocations == before


def test_upload_fills_a_pool_buffer_and_gives_it_back_with_its_event(monkeypatch):
    """``pinned.upload`` (the tables' and words' staged upload): the fill writes a pool buffer,
    the copy carries its values, and the buffer is free again under the copy's event (here CPU
    stand-ins for the CUDA device and event)."""
    p = PinnedPool(pin=False)
    monkeypatch.setattr(pinned, "_POOL", p)
    ev = Ev(False)
    monkeypatch.setattr(pinned, "record_event", lambda: ev)
    out = pinned.upload(5, torch.int32, torch.device("cpu"),
                        lambda b: b[:5].copy_(torch.arange(5, dtype=torch.int32)))
    assert out[:5].tolist() == [0, 1, 2, 3, 4] and p.allocations == 1
    assert p.free_count() == 1 and p._free[0][1] is ev  # back, behind the copy's event
    p.take(8)  # the event is pending: a second buffer
    assert p.allocations == 2
