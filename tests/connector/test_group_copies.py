"""group_copies: a light step's verified restore takes the light step's SM budget
(``kernels.light_restore_programs``), every other restore the kernels' default; a full hit's
tail under the forced ring takes the Triton kernel's warmed variants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xkv.kernels as K
from xkv.connector import group_copies
from xkv.layout import PagePool


def _captured(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(group_copies.kernels, "prepare_restore",
                        lambda *a, **kw: calls.append(kw) or "prepared")
    return calls


@pytest.mark.parametrize("env,want", [(None, K._budgets.LIGHT_VERIFIED_RESTORE_PROGRAMS),
                                      ("9", 9)])
def test_light_step_verified_restore_takes_the_light_budget(env, want, monkeypatch):
    if env is None:
        monkeypatch.delenv("XKV_LIGHT_PROGRAMS", raising=False)
    else:
        monkeypatch.setenv("XKV_LIGHT_PROGRAMS", env)
    calls = _captured(monkeypatch)
    out = group_copies.prepare_group_restore("card", "offs", ["p0", "p1"], "ids", checks="ck",
                                             layer_groups=[[0], [1]])
    assert out == "prepared"
    assert calls == [dict(engine="auto", layer_groups=[[0], [1]], checks="ck", defer_rest=True,
                          max_programs=want)]


def test_unverified_light_step_keeps_the_default_budget(monkeypatch):
    calls = _captured(monkeypatch)
    group_copies.prepare_group_restore("card", "offs", ["p0"], "ids", layer_groups=[[0]])
    assert calls[0]["max_programs"] is None and calls[0]["checks"] is None


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_light_budget_refuses_a_bad_setting(bad, monkeypatch):
    monkeypatch.setenv("XKV_LIGHT_PROGRAMS", bad)
    with pytest.raises(ValueError, match="XKV_LIGHT_PROGRAMS must be an integer >= 1"):
        K.light_restore_programs()


def _tail_case(L: int, n: int, seed: int, device: torch.device):
    """``L`` layer pools of 4 KiB pages on ``device`` (``n + 2`` blocks each, poisoned), a card
    of random host bytes (page-locked beside a GPU) holding ``n`` blocks of every layer
    (layer-major) and its ``[L, n]`` offsets."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.full((L * (n + 2) * 4096,), 0xA5, dtype=torch.uint8, device=device)
    pools = [PagePool(base=raw[k * (n + 2) * 4096:(k + 1) * (n + 2) * 4096], num_blocks=n + 2,
                      block_bytes=4096, block_stride=4096, runs=((0, 4096),))
             for k in range(L)]
    card = torch.randint(0, 256, (L * n * 4096,), dtype=torch.uint8, generator=g)
    card = card.pin_memory() if device.type == "cuda" else card
    offsets = np.stack([(k * n + np.arange(n, dtype=np.int64)) * 4096 for k in range(L)])
    return raw, pools, card, offsets


@pytest.mark.parametrize("L,n", [(1, 1), (5, 3), (32, 1)])
def test_a_tail_under_the_forced_ring_copies_exactly_with_warmed_variants(L, n, device,
                                                                         monkeypatch):
    """``restore_all`` (a full hit's tail) with the handler's forced ``staged`` engine restores
    the blocks byte for byte, leaves the other blocks poisoned, and launches only variants the
    worker's warmup compiled (``tails``: the all-layer launch). Before: on CPU tensors the
    staged engine refused; on the H100 of stop 46 it compiled its per-launch unpack inside the
    first full hit (252 ms first restore)."""
    from xkv.connector.light_steps import load_layer_groups

    raw, pools, card, offsets = _tail_case(L, n, L * 7 + n, device)
    ids = np.arange(n)[::-1] + 1  # blocks 1..n, reversed: 0 and n + 1 stay poisoned
    group_copies.restore_all(card, offsets, pools, ids, "staged")
    for k, p in enumerate(pools):
        pages = p.base.view(n + 2, 4096).cpu()
        for j, b in enumerate(ids):
            assert torch.equal(pages[b], card[offsets[k, j]:offsets[k, j] + 4096])
        assert bool((pages[0] == 0xA5).all()) and bool((pages[n + 1] == 0xA5).all())
    keys = K.warmup(pools, card, engine="triton",
                    restore_groups=load_layer_groups(L) + [list(range(L))])
    seen: list = []
    monkeypatch.setattr(K._launch.Launch, "__call__", lambda self: seen.append(self.key))
    group_copies.restore_all(card, offsets, pools, ids, "staged")
    assert seen and set(seen) <= keys


def _two_sizes(seed: int, device: torch.device):
    """5 layers of 4 KiB pages and 2 of 1 KiB (an MLA latent and its indexer cache) on
    ``device``, 6 blocks each of random bytes, and a poisoned host card (page-locked beside a
    GPU) with room for 3 blocks of every layer; the layers' card offsets ``[7, 3]``."""
    g = torch.Generator().manual_seed(seed)
    sizes = [4096] * 5 + [1024] * 2
    pools = [PagePool(base=torch.randint(0, 256, (6 * bb,), dtype=torch.uint8,
                                         generator=g).to(device),
                      num_blocks=6, block_bytes=bb, block_stride=bb, runs=((0, bb),))
             for bb in sizes]
    at = np.cumsum([0] + [3 * bb for bb in sizes])
    offsets = np.stack([at[k] + np.arange(3, dtype=np.int64) * bb for k, bb in enumerate(sizes)])
    card = torch.full((int(at[-1]),), 0xA5, dtype=torch.uint8)
    return pools, offsets, card.pin_memory() if device.type == "cuda" else card


def test_verified_step_saves_take_one_launch_per_page_size(device, monkeypatch):
    """``save_all`` with checks (``save_mode`` step with checksums): one launch per page size,
    each block's bytes at its card offsets, the words a launch per layer gives, and only
    variants the worker's warmup compiles for its save groups (``saves.save_groups``: every
    layer of a page size)."""
    pools, offsets, card = _two_sizes(3, device)
    ids = np.array([4, 1, 2])
    checks = K.Checks(np.zeros(3, np.int64), np.arange(3), 1)
    spare = card.clone().pin_memory() if device.type == "cuda" else card.clone()
    per_layer = [K.prepare_save(pools[a:b], ids, spare, offsets[a:b], engine="triton",
                                checks=checks) for a, b in ((0, 5), (5, 7))]
    for prep in per_layer:
        for k in range(len(prep)):
            prep.launch(k)
    keys = K.warmup(pools, card, engine="triton", save_groups=[list(range(5)), [5, 6]],
                    checks=True)
    seen: list = []
    real = K._launch.Launch.__call__
    monkeypatch.setattr(K._launch.Launch, "__call__",
                        lambda self: (seen.append(self.key), real(self)))
    prep = group_copies.save_all(pools, ids, card, offsets, "triton", checks)
    words = group_copies.WordsReadback(prep, len(pools))
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert len(seen) == 2 and set(seen) <= keys
    for k, p in enumerate(pools):
        pages = p.base.view(6, p.block_bytes).cpu()
        for j, b in enumerate(ids):
            assert torch.equal(card[offsets[k, j]:offsets[k, j] + p.block_bytes], pages[b])
    got = words.get()
    assert got.shape == (7, 1)
    np.testing.assert_array_equal(got, np.concatenate([p.checks.host_words() for p in per_layer]))
