"""A restore that ends inside a block (issue 24: a full hit restores every token but the last, so
the step computes one token): the blocks the step's forward also writes (``GroupTransfer.tail``)
are copied for every layer before the forward (``loads.load_transfers(fence_tail=True)``),
the others keep their per-layer fences; every byte is the card's, and the forward's own writes
into a tail block are never overwritten by the copy.

CPU tests run the SyncTransferHandler (vLLM's CPU engine); the ``gpu`` test the CUDA handler,
whose tail copy the compute stream must wait for on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from connector_fakes import written_part
from hypothesis import given, settings
from hypothesis import strategies as st

from xkv.connector import cuda_transfer, handler_settings, light_steps, loads, transfer
from xkv.connector.metadata import ChunkRef, load_transfer
from xkv.connector.registry import CacheGroup, build_registry
from xkv.layout import describe_cache

B, H, N, D2 = 12, 2, 16, 64  # blocks, kv heads, tokens per block, 2 * head dim (bf16)
K = 2  # blocks per chunk
NAMES = ("l0", "l1", "l2")


def _caches(device):
    return [torch.zeros(B, N, H, D2, dtype=torch.bfloat16, device=device).permute(0, 2, 1, 3)
            for _ in NAMES]  # logical (B, H, N, 2D), NHD strides


def _setup(device, seed):
    kvs = _caches(device)
    pools = [describe_cache(kv, num_blocks=B, layout="NHD") for kv in kvs]
    bb = pools[0].block_bytes
    reg = build_registry([CacheGroup(0, "attention", NAMES, N, bb)], tp_size=1, pp_size=1,
                         chunk_size=K * N)
    plan = reg.groups[0]
    obj = len(NAMES) * K * bb
    g = torch.Generator().manual_seed(seed)
    card = torch.randint(0, 256, (6 * obj,), dtype=torch.uint8, generator=g)
    if device == "cuda":
        card = card.pin_memory()
    return kvs, pools, plan, card, obj


def _transfer(ids, first, last, objs, obj, tail):
    return load_transfer(0, ids, first, last, K,
                         lambda c: ChunkRef(b"k%d" % c, (objs[c] * obj,), (0,)), tail=tail)


def _flat(kv):
    """A cache's blocks as rows of bytes on the host (logical NHD order): uint8 [B, page bytes]."""
    return kv.permute(0, 2, 1, 3).contiguous().view(torch.uint8).reshape(kv.shape[0], -1).cpu()


def _expected(plan, card, gt, layer, i):
    """The card bytes block ``gt.block_ids[i]`` of ``layer`` must hold."""
    off = gt.chunks[gt.chunk_of[i]].offsets[0] + plan.object_offset(layer, gt.block_in_chunk[i])
    return card[off:off + plan.group.block_bytes]


class _Recorder:
    """The handler seam, recorded: which blocks go before the forward, which per layer."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load_before_forward(self, names, card, offsets, pools, block_ids):
        self.calls.append(("before", block_ids.tolist()))
        self.inner.load_before_forward(names, card, offsets, pools, block_ids)

    def load_group(self, names, card, offsets, pools, block_ids, checks=None):
        self.calls.append(("layers", written_part(block_ids, offsets, checks)[0].tolist()))
        return self.inner.load_group(names, card, offsets, pools, block_ids, checks=checks)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2 * K * 3), tail=st.sampled_from([0, 1]), two=st.booleans(),
       fence=st.booleans(), last=st.booleans(), seed=st.integers(0, 2**16))
def test_tail_goes_first_and_every_byte_is_the_cards(n, tail, two, fence, last, seed):
    """The tail's copy is issued before the group's per-layer copy, or after it for a handler
    with ``tail_last`` (the CUDA one with ``XKV_TAIL_ORDER=last``); every byte is the card's
    either way, and the forward's own write into a tail block survives."""
    kvs, pools, plan, card, obj = _setup("cpu", seed)
    ids = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).tolist()
    # one request's blocks [0, n) of chunks stored at shuffled card objects; maybe a second
    # request (other blocks, no tail) in the same step
    objs = [5, 2, 0, 4, 1, 3]
    gts = [_transfer(ids[:n], 0, n, objs, obj, tail)]
    if two and n < B:
        gts.insert(0, _transfer(ids[n:], 0, min(B - n, 2), objs[::-1], obj, 0))
    h = _Recorder(transfer.SyncTransferHandler(verify=True))
    h.inner.tail_last = last
    got = loads.load_transfers(h, plan, 0, card, gts, pools, fence_tail=fence)
    assert got == sum(len(gt.block_ids) for gt in gts)
    tails = [gt.block_ids[-1] for gt in gts if gt.tail] if fence else []
    body = [b for gt in gts for b in gt.block_ids if b not in tails]
    calls = [[("before", tails)] if tails else [], [("layers", body)] if body else []]
    assert h.calls == (calls[1] + calls[0] if last else calls[0] + calls[1])
    for layer, kv in enumerate(kvs):
        flat = _flat(kv)
        for gt in gts:
            for i, b in enumerate(gt.block_ids):
                assert torch.equal(flat[b], _expected(plan, card, gt, layer, i)), (layer, b)
    # the forward now writes the tail block's last token (the step's own KV): after the step the
    # byte-exact check (which ran on the tail before the forward) still finds every block right
    for kv in kvs:
        for b in tails:
            kv[b, :, N - 1, :] = 1.5
    h.sync_loads()
    v = h.inner.verifier
    assert v.mismatched["restore"] == 0
    assert v.checked["restore"] == len(NAMES) * got


@pytest.mark.parametrize("last", [False, True], ids=["tail_first", "tail_last"])
@pytest.mark.parametrize("flip", [None, "tail", "body"])
def test_verified_restore_with_a_tail_in_either_order(last, flip):
    """A verified restore ending inside a block: the tail block is hash-only in the group's
    copy and written by the tail copy, in either order; a clean card flags nothing and every
    byte is the card's; a bit flipped in the tail block's page on the card, or in another
    page, flags exactly its object."""
    from dataclasses import replace

    from xkv.kernels import checksum

    kvs, pools, plan, card, obj = _setup("cpu", 7)
    bb, L = plan.group.block_bytes, len(NAMES)
    objs = [5, 2, 0, 4, 1, 3]
    n = 2 * K + 1  # three chunks, the last one partly restored; its first block is the tail
    gt = _transfer(list(range(n)), 0, n, objs, obj, 1)

    def words(c):  # the object's words as stored (numpy definition)
        o = objs[c] * obj
        return np.array([checksum.words_numpy(card[o + li * K * bb:o + (li + 1) * K * bb]
                                              .numpy().tobytes()) for li in range(L)], "<u4")

    clean = {c: words(c) for c in range(3)}
    bad = {None: None, "tail": 2, "body": 0}[flip]
    if bad is not None:  # then one bit of layer 1 of the tail block (chunk 2) or of block 1
        card[objs[bad] * obj + plan.object_offset(1, 0 if flip == "tail" else 1) + 5] ^= 0x10
    gt = replace(gt, checks=tuple(clean[c].tobytes() for c in range(3)))
    h = _Recorder(transfer.SyncTransferHandler())
    h.inner.tail_last = last
    pending = []
    loads.load_transfers(h, plan, 0, card, [gt], pools, fence_tail=True, check_words=L,
                         on_checks=pending.append)
    assert [c[0] for c in h.calls] == (["layers", "before"] if last else ["before", "layers"])
    assert h.calls[[c[0] for c in h.calls].index("before")][1] == [n - 1]
    (pc,) = pending
    flags = pc.flags.get()
    want = np.zeros(3, bool)
    if bad is not None:
        want[bad] = True
    np.testing.assert_array_equal(flags, want)
    for layer, kv in enumerate(kvs):
        flat = _flat(kv)
        for i, b in enumerate(gt.block_ids):
            assert torch.equal(flat[b], _expected(plan, card, gt, layer, i)), (layer, b)


def test_without_tail_nothing_changes():
    """No tail (a hit that ends on a block boundary): one per-layer group load, as before."""
    kvs, pools, plan, card, obj = _setup("cpu", 1)
    h = _Recorder(transfer.SyncTransferHandler())
    gt = _transfer(list(range(4)), 0, 4, [1, 0], obj, 0)
    loads.load_transfers(h, plan, 0, card, [gt], pools, fence_tail=True)
    assert h.calls == [("layers", [0, 1, 2, 3])]


def test_tail_out_of_range_refused():
    with pytest.raises(ValueError, match="tail 2 not in"):
        _transfer([0], 0, 1, [0], 1, 2)


def test_tail_order_setting(monkeypatch):
    """``XKV_TAIL_ORDER``: ``first`` by default, ``last`` on request, anything else refused."""
    monkeypatch.delenv("XKV_TAIL_ORDER", raising=False)
    assert handler_settings.tail_order() == "first"
    assert transfer.SyncTransferHandler().tail_last is False
    monkeypatch.setenv("XKV_TAIL_ORDER", "last")
    assert handler_settings.tail_order() == "last"
    monkeypatch.setenv("XKV_TAIL_ORDER", "before")
    with pytest.raises(ValueError, match="XKV_TAIL_ORDER='before'"):
        handler_settings.tail_order()


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["first", "last"])
def test_cuda_forward_write_after_tail_copy_wins(order, monkeypatch):
    """CUDA: the compute stream writes into the tail block right after ``load_transfers``
    (as vLLM writes a layer's new KV before it waits for that layer): the write must land after
    the copy, for every layer, while the other blocks are still copied per layer; the tail
    copied first on the load stream or last on the tail stream (``XKV_TAIL_ORDER``)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("XKV_TAIL_ORDER", order)
    kvs, pools, plan, card, obj = _setup("cuda", 3)
    h = cuda_transfer.CudaTransferHandler(torch.device("cuda"))
    assert h.tail_last == (order == "last")
    n = 2 * K * 3 - 1
    gt = _transfer(list(range(n)), 0, n, [5, 2, 0, 4, 1, 3], obj, 1)
    for _ in range(3):
        h.begin_loads()
        loads.load_transfers(h, plan, 0, card, [gt], pools, fence_tail=True)
        for kv in kvs:  # the forward's own KV of the last token, before any wait_layer
            kv[n - 1, :, N - 1, :] = 1.5
        for name in NAMES:
            h.wait_layer(name)
        h.sync_loads()
        torch.cuda.synchronize()
        for layer, kv in enumerate(kvs):
            assert bool((kv[n - 1, :, N - 1, :] == 1.5).all())
            flat = _flat(kv)
            for i in range(n - 1):
                assert torch.equal(flat[i], _expected(plan, card.cpu(), gt, layer, i))


@pytest.mark.gpu
@pytest.mark.parametrize("light,mode", [(False, "auto"), (True, "auto"), (True, "whole"),
                                        (True, "eighths")])
def test_cuda_light_step_restores_in_layer_groups(light, mode, monkeypatch):
    """A light step (few tokens computed) restores in ``load_layer_groups`` launches
    (``XKV_LOAD_GROUPS`` ``mode``): every layer's bytes are the card's, and each layer's fence is
    its group's."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("XKV_LOAD_GROUPS", mode)
    kvs, pools, plan, card, obj = _setup("cuda", 4)
    h = cuda_transfer.CudaTransferHandler(torch.device("cuda"))
    h.set_light_step(light)
    n = 2 * K * 3
    gt = _transfer(list(range(n)), 0, n, [5, 2, 0, 4, 1, 3], obj, 0)
    h.begin_loads()
    loads.load_transfers(h, plan, 0, card, [gt], pools, fence_tail=True)
    events = [h._events[name] for name in NAMES]
    groups = (light_steps.load_layer_groups(len(NAMES), mode) if light
              else [[i] for i in range(len(NAMES))])
    assert len({id(e) for e in events}) == len(groups)
    for name in NAMES:
        h.wait_layer(name)
    h.sync_loads()
    torch.cuda.synchronize()
    for layer, kv in enumerate(kvs):
        flat = _flat(kv)
        for i in range(n):
            assert torch.equal(flat[i], _expected(plan, card.cpu(), gt, layer, i))


def test_layer_groups_cover_every_layer_once_and_end_with_single_layers():
    for L in range(1, 70):
        groups = light_steps.load_layer_groups(L)
        assert [k for g in groups for k in g] == list(range(L))
        assert len(groups[-1]) == 1 and len(groups) <= L.bit_length() + 1
        assert light_steps.load_layer_groups(L, "whole") == [list(range(L))]
        # eighths: groups of L // 8 layers (at least one), the last such group halved
        eighths = light_steps.load_layer_groups(L, "eighths")
        k = max(1, L // 8)
        assert [i for g in eighths for i in g] == list(range(L)) and len(eighths[-1]) == 1
        body = [len(g) for g in eighths if g[0] < L - k]  # the last k layers are the tail
        tail = [len(g) for g in eighths if g[0] >= L - k]
        assert sum(tail) == k and tail == [len(g) for g in light_steps.load_layer_groups(k)]
        assert all(n == k for n in body[:-1]) and all(0 < n <= k for n in body)
        assert len(eighths) <= min(L, -(-L // k) + k.bit_length())
    assert light_steps.load_layer_groups(0) == light_steps.load_layer_groups(0, "whole") == []
    assert light_steps.load_layer_groups(0, "eighths") == []
    assert [len(g) for g in light_steps.load_layer_groups(32, "eighths")] == [4] * 7 + [2, 1, 1]


def test_light_step_threshold_and_group_mode(monkeypatch):
    """A step computing at most ``LIGHT_STEP_TOKENS`` tokens is light (-1: unknown, never);
    ``XKV_LOAD_GROUPS`` is ``auto`` by default (measured on the H200, bench/RESULTS.md 2026-12-03),
    ``layer`` on request, anything else refused."""
    n = light_steps.LIGHT_STEP_TOKENS
    assert [light_steps.is_light(t) for t in (-1, 0, 1, n, n + 1)] == [False, True, True, True,
                                                                        False]
    monkeypatch.delenv("XKV_LOAD_GROUPS", raising=False)
    assert light_steps.group_mode() == "auto"
    monkeypatch.setenv("XKV_LOAD_GROUPS", "layer")
    assert light_steps.group_mode() == "layer"
    monkeypatch.setenv("XKV_LOAD_GROUPS", "whole")
    assert light_steps.group_mode() == "whole"
    monkeypatch.setenv("XKV_LOAD_GROUPS", "eighths")
    assert light_steps.group_mode() == "eighths"
    monkeypatch.setenv("XKV_LOAD_GROUPS", "halves")
    with pytest.raises(ValueError, match="XKV_LOAD_GROUPS='halves'"):
        light_steps.group_mode()


@pytest.mark.parametrize("tails", [True, False])
@pytest.mark.parametrize("mode", ["auto", "layer", "whole", "eighths"])
def test_warm_groups_name_the_light_and_tail_launches(mode, tails):
    """The warmup's restore groups: per cache group its light-step groups (halves with ``auto``,
    one group with ``whole``, none with ``layer``) and all its layers (a tail's launch; with
    ``whole`` the same launch, named once), as indices into the registered caches' order."""
    bb = 4096
    reg = build_registry([CacheGroup(0, "attention", ("a0", "a1", "a2", "a3", "a4"), N, bb),
                          CacheGroup(1, "attention", ("b0", "b1"), N, bb)],
                         tp_size=1, pp_size=1, chunk_size=K * N)
    names = ["b0", "a0", "a1", "b1", "a2", "a3", "a4"]
    a, b = [1, 2, 4, 5, 6], [0, 3]
    assert light_steps.group_layers(reg, names) == [a, b]
    ta, tb = ([a], [b]) if tails else ([], [])
    want = {"auto": [[a[i] for i in g] for g in light_steps.load_layer_groups(5)] + ta
            + [[b[i] for i in g] for g in light_steps.load_layer_groups(2)] + tb,
            "layer": ta + tb, "whole": [a, b],
            "eighths": [[a[i] for i in g] for g in light_steps.load_layer_groups(5, "eighths")]
            + ta + [[b[i] for i in g] for g in light_steps.load_layer_groups(2, "eighths")]
            + tb}[mode]
    assert light_steps.warm_groups(reg, names, mode, tails=tails) == want
