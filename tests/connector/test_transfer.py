"""transfer.py: the handlers' byte-exact check (``verify_restores``) and the CUDA handler's
streams (moved from tests/gpu: CPU tests beside the ``gpu`` one); ``xkv.layout.contiguous_runs``.

CPU tests run the SyncTransferHandler on an NHD-strided FLASH_ATTN-shaped cache (vLLM 0.26's
``(B, H, N, 2D)`` view of ``[B, N, H, 2D]`` memory); the ``gpu`` test runs CudaTransferHandler on
the same shape with a pinned card: a correct restore and save are counted as matches, a skipped or
corrupted copy as mismatches (so the check can fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xkv.connector import cuda_transfer, transfer
from xkv.layout import describe_cache

B, H, N, D2 = 12, 2, 16, 64  # blocks, kv heads, tokens per block, 2 * head dim (bf16)


def _cache(device):
    mem = torch.zeros(B, N, H, D2, dtype=torch.bfloat16, device=device)
    return mem.permute(0, 2, 1, 3)  # logical (B, H, N, 2D), NHD strides


def _card(nbytes, device="cpu"):
    g = torch.Generator().manual_seed(7)
    c = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return c.pin_memory() if device == "cuda" else c


def _setup(device):
    kv = _cache(device)
    pool = describe_cache(kv, num_blocks=B, layout="NHD")
    bb = pool.block_bytes
    card = _card(8 * bb + 3 * bb, "cuda" if device == "cuda" else "cpu")
    # odd card order: two spans of adjacent fragments and one lone fragment
    offs = torch.tensor([0, bb, 2 * bb, 5 * bb, 6 * bb, 9 * bb], dtype=torch.int64)
    ids = torch.tensor([7, 2, 11, 0, 5, 3], dtype=torch.int64)
    return kv, pool, card, offs, ids, bb



def _load(h, card, offs, pool, ids, name="l0"):
    """One layer through the handlers' group seam (what the worker calls)."""
    h.load_group((name,), card, offs.reshape(1, -1), [pool], ids)


def _save(h, pool, ids, card, offs, name="l0"):
    prep = h.prepare_saves([pool], ids, card, offs.reshape(1, -1))
    h.save_prepared(prep, 0, name, pool, ids, card, offs)


def test_sync_restore_and_save_verified():
    kv, pool, card, offs, ids, bb = _setup("cpu")
    h = transfer.SyncTransferHandler(verify=True)
    _load(h, card, offs, pool, ids)
    h.sync_loads()
    assert h.verifier.checked["restore"] == 6 and h.verifier.mismatched["restore"] == 0
    for i, b in enumerate(ids.tolist()):
        assert torch.equal(pool.block(b), card[offs[i]: offs[i] + bb])
    out = torch.zeros_like(card)
    _save(h, pool, ids, out, offs)
    h.flush_saves()
    assert h.verifier.checked["save"] == 6 and h.verifier.mismatched["save"] == 0


def test_sync_skipped_restore_is_caught(monkeypatch):
    kv, pool, card, offs, ids, bb = _setup("cpu")
    # the pages already hold the card bytes (as after a reset of the GPU prefix cache) ...
    transfer.kernels.restore(card, offs, pool, ids)
    h = transfer.SyncTransferHandler(verify=True)
    # ... and the restore does nothing: only the poison can tell
    monkeypatch.setattr(transfer.kernels, "prepare_restore",
                        lambda *a, **k: type("Noop", (), {"launch": lambda self, i: None})())
    _load(h, card, offs, pool, ids)
    h.sync_loads()
    assert h.verifier.mismatched["restore"] == 6


def test_sync_one_corrupt_byte_is_caught():
    kv, pool, card, offs, ids, bb = _setup("cpu")
    h = transfer.SyncTransferHandler(verify=True)
    _load(h, card, offs, pool, ids)
    pool.run_view(0)[int(ids[4]), bb - 1] ^= 1  # after the copy, before the check
    h.sync_loads()
    assert (h.verifier.checked["restore"], h.verifier.mismatched["restore"]) == (6, 1)


def test_waited_layers_are_verified_before_the_forward_rewrites_them():
    """verify_layers (the worker calls it for layers fenced in start_load_kv: Mamba states, hook-
    less classes) compares those layers at once; a later rewrite (the forward updating an
    'align' running block) is then not a false mismatch, and the other layers wait for
    sync_loads, where a corrupt byte is still caught."""
    kv, pool, card, offs, ids, bb = _setup("cpu")
    kv2, pool2, _card, _offs, _ids, _bb = _setup("cpu")
    h = transfer.SyncTransferHandler(verify=True)
    h.load_group(("state", "attn"), card, torch.stack([offs, offs]), [pool, pool2], ids)
    h.wait_layer("state")
    h.verify_layers(["state"])
    assert (h.verifier.checked["restore"], h.verifier.mismatched["restore"]) == (6, 0)
    pool.run_view(0)[int(ids[0]), 0] ^= 1  # the forward writes the running state
    pool2.run_view(0)[int(ids[1]), 3] ^= 1  # a real corruption of a per-layer-fenced layer
    h.sync_loads()
    assert (h.verifier.checked["restore"], h.verifier.mismatched["restore"]) == (12, 1)


def test_empty_load_checks_nothing():
    kv, pool, card, offs, ids, bb = _setup("cpu")
    h = transfer.SyncTransferHandler(verify=True)
    _load(h, card, offs[:0], pool, ids[:0])
    h.sync_loads()
    assert h.verifier.checked["restore"] == 0


@pytest.mark.gpu
def test_cuda_handler_restore_save_verified():
    kv, pool, card, offs, ids, bb = _setup("cuda")
    h = cuda_transfer.CudaTransferHandler(torch.device("cuda"), verify=True)
    h.begin_loads()
    _load(h, card, offs, pool, ids)
    h.wait_layer("l0")
    h.sync_loads()
    assert h.verifier.checked["restore"] == 6 and h.verifier.mismatched["restore"] == 0
    out = torch.zeros_like(card).pin_memory()
    _save(h, pool, ids, out, offs)
    h.flush_saves()
    assert h.verifier.mismatched["save"] == 0
    for i in range(6):
        assert torch.equal(out[offs[i]: offs[i] + bb], card[offs[i]: offs[i] + bb])
    pool.run_view(0)[int(ids[0]), 0] ^= 1
    _save(h, pool, ids[:1], card, offs[:1])  # save writes the flipped byte: matches
    h.flush_saves()
    assert h.verifier.mismatched["save"] == 0


# ---------------------------------------------------------------- contiguous runs (xkv.layout)
def _runs_oracle(offs, step):
    out = []
    for i, o in enumerate(offs):
        if out and o == out[-1][2] + out[-1][1] * step:
            out[-1][1] += 1
        else:
            out.append([i, 1, o])
    return [tuple(r) for r in out]


@given(st.lists(st.integers(0, 40), max_size=30), st.integers(1, 5))
def test_contiguous_runs_match_a_plain_scan(steps, step):
    from xkv.layout import contiguous_runs

    offs, o = [], 0
    for s in steps:  # 0 repeats an offset, step continues a run, anything else breaks it
        o += s
        offs.append(o)
    want = _runs_oracle(offs, step)
    assert contiguous_runs(offs, step) == want
    assert contiguous_runs(torch.tensor(offs, dtype=torch.int64), step) == want
    assert sum(n for _, n, _ in want) == len(offs)


# ---------------------------------------------------------------- group loads, prepared saves
class _Plan:
    """What layer_offsets reads of a GroupPlan: its layer names and page sizes (one for all
    layers here), object_offset."""

    def __init__(self, layers: int, blocks_per_object: int, block_bytes: int):
        self.group = type("G", (), {"layer_names": tuple(f"l{i}" for i in range(layers)),
                                    "layer_bytes": ()})()
        self.k, self.bb = blocks_per_object, block_bytes

    def object_offset(self, layer, block):
        return (layer * self.k + block) * self.bb


def _handler(device):
    if device == "cuda":
        return cuda_transfer.CudaTransferHandler(torch.device("cuda"))
    return transfer.SyncTransferHandler()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@given(data=st.data())
def test_load_group_and_prepared_saves_bit_exact(device, data):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    L = data.draw(st.integers(1, 4), label="layers")
    n = data.draw(st.integers(0, B), label="blocks")
    ids = torch.tensor(data.draw(st.permutations(range(B)))[:n], dtype=torch.int64)
    caches = [_cache(device) for _ in range(L)]
    for c in caches:
        c.view(torch.uint8).fill_(0xA5)  # poisoned destination
    pools = [describe_cache(c, num_blocks=B, layout="NHD") for c in caches]
    bb = pools[0].block_bytes
    k = B  # one object holds B blocks per layer; slot i of the step in a shuffled order
    plan = _Plan(L, k, bb)
    slots = torch.tensor(data.draw(st.permutations(range(k)))[:n], dtype=torch.int64)
    base = slots * bb + 3 * 4096  # the object starts at an aligned offset inside the card
    offs = transfer.layer_offsets(plan, base)
    assert offs.shape == (L, n)
    for i in range(L):
        assert torch.equal(offs[i], base + plan.object_offset(i, 0))
    card = _card(3 * 4096 + L * k * bb, device)
    h = _handler(device)
    h.begin_loads()
    names = plan.group.layer_names
    h.load_group(names, card, offs, pools, ids)
    for name in reversed(names):
        h.wait_layer(name)
    h.sync_loads()
    for i, pool in enumerate(pools):
        for j, b in enumerate(ids.tolist()):
            assert torch.equal(pool.block(b).cpu(), card[offs[i, j]: offs[i, j] + bb].cpu())
        untouched = sorted(set(range(B)) - set(ids.tolist()))
        for b in untouched:
            assert bool((pool.block(b) == 0xA5).all())
    out = torch.zeros(card.numel(), dtype=torch.uint8)
    out = out.pin_memory() if device == "cuda" else out  # the GPU writes the card directly
    prep = h.prepare_saves(pools, ids, out, offs)
    order = data.draw(st.permutations(range(L)), label="save order")
    for i in order:
        h.save_prepared(prep, i, names[i], pools[i], ids, out, offs[i])
    h.flush_saves()
    for i, pool in enumerate(pools):
        for j, b in enumerate(ids.tolist()):
            assert torch.equal(out[offs[i, j]: offs[i, j] + bb].cpu(), pool.block(b).cpu())
    written = torch.zeros(out.numel(), dtype=torch.bool)
    for i in range(L):
        for j in range(n):
            written[int(offs[i, j]): int(offs[i, j]) + bb] = True
    assert not bool(out.cpu()[~written].any())  # nothing outside the step's fragments


def test_load_group_refuses_bad_offsets_before_any_byte_moves():
    kv, pool, card, offs, ids, bb = _setup("cpu")
    before = kv.clone()
    bad = torch.stack([offs, offs + card.numel()])  # layer 1 reads past the card's end
    with pytest.raises(ValueError):
        transfer.SyncTransferHandler().load_group(("a", "b"), card, bad, [pool, pool], ids)
    assert torch.equal(kv, before)


def test_every_handler_implements_the_whole_interface():
    """The CUDA handler cannot be built on a CPU machine: its class at least leaves no method of
    ``TransferHandler`` abstract (instantiating it would raise), as the CPU one and the bench's
    state-page checker."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import e2e_models

    for cls in (cuda_transfer.CudaTransferHandler, transfer.SyncTransferHandler, e2e_models.StateCheck):
        assert issubclass(cls, transfer.TransferHandler) and not cls.__abstractmethods__, cls
    inner = transfer.SyncTransferHandler(verify=True)
    assert e2e_models.StateCheck(inner).verifier is inner.verifier
    assert inner.load_fence() is None  # inline copies: already landed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@given(data=st.data())
def test_save_group_bit_exact_and_ordered(device, data):
    """``save_mode`` step: ``save_group`` copies every layer of the step (one launch per page size,
    two page sizes here), byte for byte, nothing outside the step's fragments. CUDA: the save
    stream waits for the forward (the compute stream writes the pages after a sleep), and after
    ``fence_saves_deferred`` + ``order_after_saves`` a compute-stream write cannot overtake a
    delayed copy (the save stream sleeps first)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    L = data.draw(st.integers(1, 4), label="layers")
    n = data.draw(st.integers(0, B), label="blocks")
    ids = torch.tensor(data.draw(st.permutations(range(B)))[:n], dtype=torch.int64)
    half = data.draw(st.lists(st.booleans(), min_size=L, max_size=L), label="small page")
    caches, raw = [], []
    for small in half:  # a second page size: half the tokens per block (an indexer-like cache)
        mem = torch.zeros(B, N // 2 if small else N, H, D2, dtype=torch.bfloat16, device=device)
        caches.append(mem.permute(0, 2, 1, 3))
        raw.append(mem.view(B, -1).view(torch.uint8))  # block b's page = raw[b] (block-compact)
    pools = [describe_cache(c, num_blocks=B, layout="NHD") for c in caches]
    big = max(p.block_bytes for p in pools)
    slots = torch.tensor(data.draw(st.permutations(range(B)))[:n], dtype=torch.int64)
    offs = torch.stack([4096 + (i * B + slots) * big for i in range(L)]) if L else None
    out = torch.zeros(4096 + L * B * big, dtype=torch.uint8)
    out = out.pin_memory() if device == "cuda" else out
    h = _handler(device)
    g = torch.Generator().manual_seed(n)
    final = [torch.randint(0, 256, (B, p.block_bytes), dtype=torch.uint8, generator=g)
             for p in pools]
    if device == "cuda":
        torch.cuda._sleep(20_000_000)  # the "forward" is slow: its writes land late
    for r, f in zip(raw, final, strict=True):
        r.copy_(f.to(device), non_blocking=True)
    names = [f"l{i}" for i in range(L)]
    h.save_group(names, pools, ids, out, offs)
    fence = h.fence_saves_deferred()
    if device == "cuda":
        with torch.cuda.stream(h.save_stream):  # a save stream still busy ...
            torch.cuda._sleep(20_000_000)
        h.save_group(names, pools, ids, out, offs)  # ... with a second copy of the same pages
        fence = h.fence_saves_deferred()
    h.order_after_saves()
    for r in raw:  # the next step's forward reuses the blocks
        r.fill_(0x5A)
    if fence is not None:
        fence.synchronize()
    if device == "cuda":
        torch.cuda.synchronize()
    written = torch.zeros(out.numel(), dtype=torch.bool)
    for i, pool in enumerate(pools):
        bb = pool.block_bytes
        for j, b in enumerate(ids.tolist()):
            o = int(offs[i, j])
            assert torch.equal(out[o:o + bb], final[i][b]), (i, j, b)
            assert pools[i].block(b).numel() == bb
            written[o:o + bb] = True
    assert not bool(out[~written].any())  # nothing outside the step's fragments


@pytest.mark.parametrize("light", [False, True])
def test_verified_loads_and_saves_through_the_handler(device, light):
    """``verify_checksums`` through the handler seam: save words read back after the fence
    (save stream on CUDA), then verified loads (per layer, or grouped as a light step): clean
    -> no flag; one flipped bit -> exactly its object, flags read once after ``sync_loads``."""
    import numpy as np

    from xkv.kernels import Checks, checksum

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    L, k = 3, 2
    caches = [_cache(device) for _ in range(L)]
    g = torch.Generator().manual_seed(11)
    for c in caches:
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape,
                                                dtype=torch.uint8, generator=g))
    pools = [describe_cache(c, num_blocks=B, layout="NHD") for c in caches]
    bb = pools[0].block_bytes
    n = (B // k) * k
    C = n // k
    ids = torch.randperm(B, generator=g)[:n]
    objs, pages = np.arange(n) // k, np.arange(n) % k
    base = torch.from_numpy(objs * L * k * bb + pages * bb)
    offs = base.reshape(1, -1) + torch.arange(L).reshape(-1, 1) * k * bb
    card = _card(C * L * k * bb, device)
    h = _handler(device)
    names = tuple(f"l{i}" for i in range(L))
    prep = h.prepare_saves(pools, ids, card, offs, checks=Checks(objs, pages, C))
    for i in range(L):
        h.save_prepared(prep, i, names[i], pools[i], ids, card, offs[i])
    rb = h.save_words(prep, L)
    fence = h.fence_saves()
    if fence is not None:
        fence.synchronize()
    words = rb.get()
    host = card.cpu().numpy().tobytes()
    for o in range(C):
        for li in range(L):
            a = (o * L + li) * k * bb
            assert words[li, o] == checksum.words_numpy(host[a:a + k * bb])
    for flip in (None, 5):
        if flip is not None:
            card[int(offs[1, flip]) + 7] ^= 0x20
        h.set_light_step(light)
        h.begin_loads()
        flags = h.load_group(names, card, offs, pools, ids,
                             checks=Checks(objs, pages, C, expected=words))
        for name in names:
            h.wait_layer(name)
        h.sync_loads()
        want = np.zeros(C, bool)
        if flip is not None:
            want[objs[flip]] = True
        np.testing.assert_array_equal(flags.get(), want)


# ---------------------------------------------------------------- verified group loads
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cpass", ["copy", "hbm", "end"])
@pytest.mark.parametrize("light", [False, True], ids=["step", "light"])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_verified_load_group_every_checksum_pass(device, cpass, light, data):
    """A checked save's words, then a verified restore of the same fragments through the handler
    with each ``checksum_pass`` (a light step too: halving layer groups on CUDA): the written
    blocks equal the card, hash-only fragments stay poisoned, no object flagged on clean bytes,
    and one flipped card bit flags exactly its object."""
    from xkv import kernels

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    L = data.draw(st.integers(1, 5), label="layers")
    n = data.draw(st.integers(1, B), label="blocks")
    ids = torch.tensor(data.draw(st.permutations(range(B)))[:n], dtype=torch.int64)
    src = [_cache(device) for _ in range(L)]
    g = torch.Generator().manual_seed(L * 100 + n)
    for c in src:
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape,
                                                dtype=torch.uint8, generator=g).to(device))
    pools = [describe_cache(c, num_blocks=B, layout="NHD") for c in src]
    bb = pools[0].block_bytes
    slots = torch.tensor(data.draw(st.permutations(range(B)))[:n], dtype=torch.int64)
    offs = torch.stack([4096 + (i * B + slots) * bb for i in range(L)])
    objects, pages = (slots % 2).numpy(), (slots // 2).numpy()
    card = torch.zeros(4096 + L * B * bb, dtype=torch.uint8)
    card = card.pin_memory() if device == "cuda" else card
    h = _handler(device)
    h.set_checksum_pass(cpass)
    prep = h.prepare_saves(pools, ids, card, offs, checks=kernels.Checks(objects, pages, 2))
    names = [f"l{i}" for i in range(L)]
    for i in range(L):
        h.save_prepared(prep, i, names[i], pools[i], ids, card, offs[i])
    words = h.save_words(prep, L)
    h.flush_saves()
    expected = words.get()
    flagged = np.zeros(2, dtype=bool)
    if data.draw(st.booleans(), label="flip"):
        j, i = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, L - 1))
        card[int(offs[i, j]) + data.draw(st.integers(0, bb - 1))] ^= 1 << data.draw(
            st.integers(0, 7))
        flagged[objects[j]] = True
    ho = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    dst = [_cache(device) for _ in range(L)]
    for c in dst:
        c.view(torch.uint8).fill_(0xA5)
    dpools = [describe_cache(c, num_blocks=B, layout="NHD") for c in dst]
    h.set_light_step(light)
    h.begin_loads()
    got = h.load_group(names, card, offs, dpools, ids,
                       checks=kernels.Checks(objects, pages, 2, expected=expected, hash_only=ho))
    for name in names:
        h.wait_layer(name)
    h.sync_loads()
    np.testing.assert_array_equal(got.get(), flagged)
    for i, pool in enumerate(dpools):
        for j, b in enumerate(ids.tolist()):
            page = pool.block(b).cpu()
            if ho[j]:
                assert bool((page == 0xA5).all())  # hashed from the card, never written
            else:
                assert torch.equal(page, card[offs[i, j]: offs[i, j] + bb].cpu())
