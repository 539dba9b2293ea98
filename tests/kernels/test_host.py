"""register_host / unregister_host / is_host_accessible."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import xkv.kernels as K
from xkv.kernels import host


def test_register_host_without_cuda_is_a_noop():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    t = torch.zeros(10, dtype=torch.uint8)
    assert K.register_host(t) is t
    K.unregister_host(t)
    with pytest.raises(ValueError):
        K.register_host(t[::2])


@pytest.mark.gpu
def test_register_host_round_trip():
    t = torch.zeros(1 << 20, dtype=torch.uint8)
    assert not K.is_host_accessible(t)
    K.register_host(t)
    assert K.is_host_accessible(t) and K.is_host_accessible(t[4096:8192])
    K.register_host(t)  # idempotent
    K.unregister_host(t)
    assert not K.is_host_accessible(t)


# ------------------------------------------------------------------ copies cut at piece boundaries


def _byte_map(d, s, z):
    """{destination address: source address} of every byte a batch copies."""
    out = {}
    for dk, sk, zk in zip(d.tolist(), s.tolist(), z.tolist(), strict=True):
        for i in range(zk):
            assert dk + i not in out  # no byte written twice
            out[dk + i] = sk + i
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(0, 7), nb=st.integers(0, 6),
       dtype=st.sampled_from([np.uint64, np.int64]))
def test_split_at_moves_the_same_bytes_and_no_copy_crosses_a_boundary(data, n, nb, dtype):
    span = 4096
    bounds = np.array(sorted(set(data.draw(st.lists(st.integers(1, span), min_size=nb,
                                                    max_size=nb)))), dtype=np.uint64)
    z = np.array(data.draw(st.lists(st.integers(1, 300), min_size=n, max_size=n)), dtype=dtype)
    s = np.array(data.draw(st.lists(st.integers(0, span - 300), min_size=n, max_size=n)),
                 dtype=dtype)
    d = (np.cumsum(np.concatenate([[0], z[:-1]]))[:n].astype(dtype)
         + dtype(data.draw(st.integers(0, 200))))  # destinations: disjoint, may cross too
    d2, s2, z2 = host.split_at(d, s, z, bounds)
    assert d2.dtype == s2.dtype == z2.dtype == np.dtype(dtype)
    assert (z2 > 0).all()
    assert _byte_map(d2, s2, z2) == _byte_map(d, s, z)
    for a, m in ((s2, z2), (d2, z2)):
        for b in bounds.tolist():
            assert not ((a < b) & (b < a + m)).any(), (b, a, m)
    if nb == 0:
        assert d2 is d and s2 is s and z2 is z
    # crossing() names exactly the copies split_at cut: the others come back first, unchanged
    cut = host.crossing(d, s, z, bounds)
    assert cut.shape == z.shape and cut.dtype == bool
    keep = ~cut
    assert (d2[:keep.sum()] == d[keep]).all() and (z2[:keep.sum()] == z[keep]).all()
    assert z2.size - keep.sum() > cut.sum() or not cut.any()  # each cut copy became >= 2


def test_split_at_edges():
    b = np.array([100], dtype=np.uint64)
    u = lambda *x: np.array(x, dtype=np.uint64)  # noqa: E731
    # ending on, starting on, and crossing a boundary in source and destination at once
    d, s, z = host.split_at(u(0, 200, 1000), u(50, 100, 90), u(50, 10, 40), b)
    assert (d.tolist(), s.tolist(), z.tolist()) == ([0, 200, 1000, 1010], [50, 100, 90, 100],
                                                    [50, 10, 10, 30])
    assert host.crossing(u(0, 200, 1000), u(50, 100, 90), u(50, 10, 40), b).tolist() == [
        False, False, True]
    d, s, z = host.split_at(u(95), u(0), u(10), b)  # the destination crosses
    assert (d.tolist(), s.tolist(), z.tolist()) == ([95, 100], [0, 5], [5, 5])
    e = np.zeros(0, dtype=np.uint64)
    assert [x.size for x in host.split_at(e, e, e, b)] == [0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 300), nb=st.integers(0, 5))
def test_copy_bytes_cuts_at_boundaries_and_moves_the_same_bytes(data, n, nb):
    """``copy_bytes`` (torch copies of card bytes): fresh random bytes into a poisoned
    destination, boundaries inside the source, the destination, both or neither; every torch copy
    it makes stays inside one piece of each side, and the bytes equal ``src``."""
    src_all = torch.randint(0, 256, (n + 64,), dtype=torch.uint8)
    dst_all = torch.full((n + 64,), 0xA5, dtype=torch.uint8)
    i, j = data.draw(st.integers(0, 64)), data.draw(st.integers(0, 64))
    src, dst = src_all[i:i + n], dst_all[j:j + n]
    addrs = [t.data_ptr() + data.draw(st.integers(1, max(1, n - 1))) for t in (src, dst)
             for _ in range(nb)]
    bounds = np.array(sorted(set(addrs)), dtype=np.uint64)
    made = []
    real = torch.Tensor.copy_

    def spy(self, other, non_blocking=False):
        made.append((self.data_ptr(), other.data_ptr(), self.numel()))
        return real(self, other, non_blocking=non_blocking)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "_bounds", bounds)
        mp.setattr(torch.Tensor, "copy_", spy)
        host.copy_bytes(dst, src)
    assert torch.equal(dst, src)
    assert torch.equal(dst_all[:j], torch.full((j,), 0xA5, dtype=torch.uint8))  # nothing outside
    assert torch.equal(dst_all[j + n:], torch.full((64 - j,), 0xA5, dtype=torch.uint8))
    assert sum(z for _, _, z in made) == n and (len(made) == 1 or nb > 0)  # cut only at bounds
    for d, s_, z in made:
        for b in bounds.tolist():
            assert not (s_ < b < s_ + z) and not (d < b < d + z), (b, d, s_, z)


def test_copy_bytes_refuses_what_it_cannot_cut():
    a = torch.zeros(8, dtype=torch.uint8)
    for dst, src in ((a[:4], a[:5]), (a.view(2, 4), a.view(2, 4)), (a[::2], a[:4]),
                     (torch.zeros(2, dtype=torch.int32), a[:2])):
        with pytest.raises(ValueError, match="contiguous 1-D uint8"):
            host.copy_bytes(dst, src)


def test_piece_boundaries_follow_the_registrations(monkeypatch):
    """Adjacent registrations (a card in segments) meet at a boundary; separate ones do not."""
    import types

    class Rt:
        def cudaHostRegister(self, ptr, n, flags):  # noqa: N802
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            return 0

    cuda = types.SimpleNamespace(is_available=lambda: True, cudart=lambda: Rt())
    monkeypatch.setattr(host, "torch", types.SimpleNamespace(Tensor=torch.Tensor, cuda=cuda))
    monkeypatch.setattr(host, "_registered", {})
    monkeypatch.setattr(host, "_spans", [])
    monkeypatch.setattr(host, "_bounds", np.zeros(0, dtype=np.uint64))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: False)
    card = torch.zeros(40960, dtype=torch.uint8)
    other = torch.zeros(4096, dtype=torch.uint8)
    p = card.data_ptr()
    for o in range(0, 40960, 8192):
        host.register_host(card[o:o + 8192])
    host.register_host(other)
    assert host.piece_boundaries().tolist() == [p + o for o in range(8192, 40960, 8192)]
    host.unregister_host(card[32768:])
    assert host.piece_boundaries().tolist() == [p + o for o in range(8192, 32768, 8192)]
    for o in range(0, 32768, 8192):
        host.unregister_host(card[o:])
    host.unregister_host(other)
    assert host.piece_boundaries().size == 0
