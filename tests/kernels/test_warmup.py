"""warmup: launches every Triton variant one-layer copies can use, and touches no caller byte.

On CPU it runs under the interpreter (``engine="triton"``); completeness is checked against the
variants real launches pick for any number of blocks and any card offsets of the slot model
(slot starts multiples of the slot alignment, fragments ``block_bytes`` apart inside a slot).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import POISON, Geometry, geometries, pool_over, random_bytes

import xkv.kernels as K
from xkv.kernels import _budgets, _launch
from xkv.kernels.jobs import build_job, offsets_arg
from xkv.kernels.page_copy import check_engine

CACHES = [
    Geometry(6, 4096, ((0, 4096),)),  # NHD page
    Geometry(5, 1003, ((3, 997),)),  # odd: byte words
    Geometry(4, 2048, ((0, 2048), (4 * 2048, 2048))),  # K/V-first: two runs per block
    Geometry(3, 64 * 656 + 8, ((8, 64 * 656),)),  # fp8_ds_mla rows, 8-byte aligned
]


def _caches(seed: int):
    raws = [random_bytes(g.extent + 19, seed + k) for k, g in enumerate(CACHES)]
    return raws, [pool_over(r, 3 * (k % 2), g) for k, (r, g) in enumerate(zip(raws, CACHES,
                                                                            strict=True))]


def test_warmup_touches_nothing_and_covers_both_directions():
    raws, pools = _caches(1)
    card = random_bytes(1 << 16, 9)
    before = [r.clone() for r in raws], card.clone()
    keys = K.warmup(pools, card, engine="triton")
    assert all(torch.equal(a, b) for a, b in zip(raws, before[0], strict=True))
    assert torch.equal(card, before[1])
    saves = {dict(k)["SAVE"] for k in keys}
    assert saves == {"True", "False"} and len(keys) >= 2 * len(CACHES)
    assert K.warmup(pools + pools, card, engine="triton") == keys  # same geometries: same set
    assert K.warmup(pools, None, engine="triton")  # a stand-in card


def test_checked_warmup_reads_flags_back_once_per_direction(monkeypatch):
    """checks=True also runs the torch ops that read a checked copy's words back (their CUDA
    kernels load on first use); without checks nothing of the kind runs."""
    from xkv.kernels import verify

    seen = []
    real = verify.CheckWords.readback
    monkeypatch.setattr(verify.CheckWords, "readback",
                        lambda self: seen.append((self.save, self.shape)) or real(self))
    raws, pools = _caches(2)
    card = random_bytes(1 << 16, 8)
    K.warmup(pools[:1], card, engine="triton")
    assert seen == []
    K.warmup(pools[:1], card, engine="triton", checks=True)
    assert sorted(save for save, _ in seen) == [False, True]


def test_warmup_auto_on_cpu_compiles_nothing_and_refusals():
    raws, pools = _caches(2)
    assert K.warmup(pools, random_bytes(64, 0)) == set()  # CPU copies use the torch engine
    assert K.warmup([], None, engine="triton") == set()
    with pytest.raises(ValueError, match="engine"):
        K.warmup(pools, None, engine="copy_engine")
    with pytest.raises(ValueError, match="power of two"):
        K.warmup(pools, None, engine="triton", offset_alignment=48)
    with pytest.raises(ValueError):
        K.warmup(pools[0], None, engine="triton")  # not a sequence of pools
    with pytest.raises(ValueError, match="max_programs"):
        K.warmup(pools, None, engine="triton", max_programs=0)
    with pytest.raises(ValueError, match="uint8"):
        K.warmup(pools, torch.zeros(8), engine="triton")  # not a byte buffer
    with pytest.raises(ValueError, match="CPU caches"):
        K.warmup(pools, torch.zeros(8, dtype=torch.uint8, device="meta"), engine="triton")


def test_warmup_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, pools = _caches(3)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        K.warmup(pools, None, engine="triton")


@settings(max_examples=40, deadline=None)
@given(
    g=geometries(),
    base=st.sampled_from([0, 3, 8, 16]),
    align=st.sampled_from([1, 2, 4, 8, 16, 4096]),
    budget=st.sampled_from([1, 3, 4, 132]),
    data=st.data(),
)
def test_warmup_covers_every_block_count(g, base, align, budget, data):
    """The variant of a one-layer copy of any n blocks at card offsets of the slot model is one
    warmup launched (the plan is what ``launches`` builds for that layer)."""
    raw = torch.zeros(base + g.extent + 16, dtype=torch.uint8)
    pool = pool_over(raw, base, g)
    card = torch.zeros(4096 * 3, dtype=torch.uint8)
    card = card[-card.data_ptr() % 4096 :]
    keys = K.warmup([pool], card, offset_alignment=align, max_programs=budget, engine="triton")
    bb = g.block_bytes
    for _ in range(6):
        n = data.draw(st.integers(1, 5000))
        slots = np.array(data.draw(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4)))
        where = data.draw(st.lists(st.integers(0, slots.size - 1), min_size=n, max_size=n))
        offs = slots[where] * align + np.arange(n) * bb  # fragment j at its slot + j blocks
        gcd = int(np.gcd.reduce(offs))
        for save in (False, True):
            p = _launch.plan([pool], card, n=n, has_flat_off=True, flat_off_gcd=gcd, flat_base=0,
                             save=save, sliced=False, lo=0, hi=n * bb, max_programs=budget)
            assert p.key in keys, (n, gcd, save)


@pytest.mark.parametrize("save", [False, True])
def test_real_launches_use_warmed_variants(save):
    g = Geometry(40, 4096 + 64, ((0, 4096),))
    raw = random_bytes(g.extent + 5, 4)
    pool = pool_over(raw, 0, g)
    card = torch.zeros(4096 * 64, dtype=torch.uint8)
    card = card[-card.data_ptr() % 4096 :][: 4096 * 60]
    keys = K.warmup([pool], card, engine="triton")
    for n in (1, 2, 5, 17, 40):
        offs = np.arange(n, dtype=np.int64)[::-1] * 4096
        job = build_job([pool], np.arange(n)[::-1], card, offsets_arg(offs, 1, "o"), save=save)
        (launch,) = _launch.launches(job, K.default_programs())
        assert launch.key in keys, n


@pytest.mark.gpu
@pytest.mark.parametrize("runs", [1, 2])
@pytest.mark.parametrize("checked", [False, True])
def test_no_compile_after_warmup(runs, checked, monkeypatch):
    """After warmup, restores and saves of any size on the registered caches compile nothing:
    pages of one run, and K/V-first pages of two (Triton specialises n_runs == 1), checked or
    not."""
    from xkv.kernels import _triton
    from xkv.kernels.verify import Checks

    kernel = _triton.page_copy_kernel
    nb = 300
    g = (Geometry(nb, 4096, ((0, 4096),)) if runs == 1
         else Geometry(nb, 2048, ((0, 2048), (nb * 2048, 2048))))
    raw = torch.full((g.extent,), POISON, dtype=torch.uint8, device="cuda")
    pool = pool_over(raw, 0, g)
    card = torch.empty(nb * 4096 + 4096, dtype=torch.uint8).pin_memory()
    card = card[-card.data_ptr() % 4096:][: nb * 4096]
    K.warmup([pool], card, checks=checked)
    # Triton sets the per-kernel compile hook when the kernel first runs on a device (warmup)
    assert hasattr(kernel, "compile"), "no per-kernel compile hook to count compiles with"
    compiled = []
    real = kernel.compile
    monkeypatch.setattr(kernel, "compile", lambda *a, **k: compiled.append(1) or real(*a, **k))
    for n in (1, 3, 8, 33, 100, 299):
        offs = np.arange(n, dtype=np.int64) * 4096
        rchk = (Checks(np.zeros(n, np.int64), np.arange(n), 1,
                       expected=np.zeros((1, 1), np.uint32)) if checked else None)
        schk = Checks(np.zeros(n, np.int64), np.arange(n), 1) if checked else None
        K.prepare_restore(card, offs[None], [pool], np.arange(n), checks=rchk).launch(0)
        K.prepare_save([pool], np.arange(n), card, offs[None], checks=schk).launch(0)
        K.restore(card, offs, pool, np.arange(n))
    torch.cuda.synchronize()
    assert compiled == []


@settings(max_examples=25, deadline=None)
@given(L=st.integers(2, 6), n=st.integers(1, 3000), align=st.sampled_from([16, 4096]),
       budget=st.sampled_from([4, 132]), data=st.data())
def test_restore_groups_are_warmed(L, n, align, budget, data):
    """A grouped (multi-layer) restore launch of any block count, for a layer group named in
    ``restore_groups``, uses a warmed variant."""
    g = Geometry(8, 4096, ((0, 4096),))
    raw = torch.zeros(L * (g.extent + 512) + 64, dtype=torch.uint8)
    pools = [pool_over(raw, k * (g.extent + 512), g) for k in range(L)]
    card = torch.zeros(4096 * 3, dtype=torch.uint8)
    card = card[-card.data_ptr() % 4096 :]
    a = data.draw(st.integers(0, L - 2))
    b = data.draw(st.integers(a + 2, L))
    keys = K.warmup(pools, card, offset_alignment=align, max_programs=budget, engine="triton",
                    restore_groups=[list(range(a, b))])
    slots = np.array(data.draw(st.lists(st.integers(0, 1 << 16), min_size=1, max_size=3)))
    where = np.array(data.draw(st.lists(st.integers(0, slots.size - 1), min_size=n, max_size=n)))
    offs = np.stack([slots[where] * align + (k * 8 + np.arange(n)) * 4096 for k in range(b - a)])
    p = _launch.plan(pools[a:b], card, n=n, has_flat_off=True,
                     flat_off_gcd=int(np.gcd.reduce(offs.ravel())), flat_base=0, save=False,
                     sliced=False, lo=0, hi=n * 4096, max_programs=budget)
    assert p.key in keys


def _layers(L: int):
    """L layer pools of one 4 KiB-page geometry (40 blocks) and a 4096-aligned card for them."""
    g = Geometry(40, 4096, ((0, 4096),))
    raw = torch.zeros(L * g.extent + 64, dtype=torch.uint8)
    pools = [pool_over(raw, k * g.extent, g) for k in range(L)]
    card = torch.zeros(4096 * (40 * L + 2), dtype=torch.uint8)
    return pools, card[-card.data_ptr() % 4096 :][: 4096 * 40 * L]


def _steps(L: int):
    """(n, block ids, [L, n] card offsets) of chunk objects of n blocks (layer-major), for block
    counts that reach different tile shapes."""
    for n in (1, 3, 16, 40):
        slot = np.arange(n, dtype=np.int64) * 4096
        yield n, np.arange(n)[::-1].copy(), np.stack([k * n * 4096 + slot for k in range(L)])


def _checked_steps(L: int):
    """:func:`_steps` with each step's ``Checks`` (one object, expected words zero)."""
    for n, ids, offs in _steps(L):
        yield n, ids, offs, K.Checks(np.zeros(n, np.int64), np.arange(n), 1,
                                     expected=np.zeros((L, 1), np.uint32))


def _launched(monkeypatch) -> list:
    """The variant keys of every launch from now on (nothing runs)."""
    seen: list = []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self: seen.append(self.key))
    return seen


@pytest.mark.parametrize("mode", ["auto", "eighths"])
@pytest.mark.parametrize("L", [5, 16, 32])
def test_grouped_and_all_layer_restores_after_warmup_compile_nothing_new(L, mode, monkeypatch):
    """What the connector launches for a light step (``XKV_LOAD_GROUPS`` ``mode``'s layer groups)
    and for a partly restored last block (every layer in one launch) uses variants the worker's
    warmup ran."""
    from xkv.connector.light_steps import load_layer_groups

    pools, card = _layers(L)
    groups = load_layer_groups(L, mode)
    keys = K.warmup(pools, card, engine="triton", restore_groups=groups + [list(range(L))])
    seen = []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self: seen.append(self.key))
    for n in (1, 3, 16, 40):
        ids = np.arange(n)[::-1].copy()
        slot = np.arange(n, dtype=np.int64) * 4096  # a chunk object: layer-major, n blocks each
        offs = np.stack([k * n * 4096 + slot for k in range(L)])
        prep = K.prepare_restore(card, offs, pools, ids, engine="triton", layer_groups=groups,
                                 defer_rest=True)  # as the connector prepares them
        for i in range(len(prep)):
            prep.launch(i)
        K.restore_layers(card, offs[:, :1], pools, ids[:1], engine="triton")
    assert seen and set(seen) <= keys


@pytest.mark.parametrize("L,light,whole", [(5, 64, False), (16, 64, False), (32, 7, False),
                                           (32, 64, True)])
def test_checked_light_step_restores_after_warmup_compile_nothing_new(L, light, whole,
                                                                       monkeypatch):
    """A light step's verified restore (halving layer groups at the light step's own SM budget,
    which changes the tile's ``ROWS``) uses variants the worker's warmup ran with that budget.
    ``whole``: one group of 32 layers, whose 1-block launch at 64 programs takes ``ROWS`` 1,
    which no default-budget sample of that group reaches (32 rows / 16 programs)."""
    from xkv.connector.light_steps import load_layer_groups

    pools, card = _layers(L)
    groups = [list(range(L))] if whole else load_layer_groups(L)
    keys = K.warmup(pools, card, engine="triton", restore_groups=groups, checks=True,
                    light_programs=light)
    default = K.warmup(pools, card, engine="triton", restore_groups=groups, checks=True)
    seen = _launched(monkeypatch)
    for _, ids, offs, checks in _checked_steps(L):
        prep = K.prepare_restore(card, offs, pools, ids, engine="triton", layer_groups=groups,
                                 checks=checks, max_programs=light, defer_rest=True)
        for i in range(len(prep)):
            prep.launch(i)
    assert seen and set(seen) <= keys
    assert {dict(k)["CHECK"] for k in seen} == {"True"}
    assert default <= keys  # the light budget adds variants, never takes any away
    if whole:
        assert not set(seen) <= default


@pytest.mark.parametrize("L", [2, 16, 32])
def test_all_layer_saves_after_warmup_compile_nothing_new(L, monkeypatch):
    """``save_mode`` step saves every layer of a group in one launch (``save_layers``): its
    variants are warmed by ``save_groups``, and only by it (restore groups do not cover them)."""
    pools, card = _layers(L)
    every = [list(range(L))]
    keys = K.warmup(pools, card, engine="triton", save_groups=every)
    without = K.warmup(pools, card, engine="triton", restore_groups=every)
    seen = []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self: seen.append(self.key))
    for _, ids, offs in _steps(L):
        K.save_layers(pools, ids, card, offs, engine="triton")
    assert seen and set(seen) <= keys
    assert not set(seen) <= without


@pytest.mark.parametrize("save", [False, True])
def test_checked_launches_use_warmed_variants(save):
    """``checks=True`` warms the checksum variants too; an unaligned cache has none (its
    verified copies are refused) and warms without error."""
    g = Geometry(40, 4096 + 64, ((0, 4096),))
    raw = random_bytes(g.extent + 5, 4)
    pool = pool_over(raw, 0, g)
    card = torch.zeros(4096 * 64, dtype=torch.uint8)
    card = card[-card.data_ptr() % 4096 :][: 4096 * 60]
    plain = K.warmup([pool], card, engine="triton")
    keys = K.warmup([pool], card, engine="triton", checks=True)
    assert plain < keys and {dict(k)["CHECK"] for k in keys} == {"True", "False"}
    for n in (1, 2, 5, 17, 40):
        offs = np.arange(n, dtype=np.int64)[::-1] * 4096
        exp = None if save else np.zeros((1, 1), np.uint32)
        checks = K.Checks(np.zeros(n, np.int64), np.arange(n), 1, expected=exp)
        job = build_job([pool], np.arange(n)[::-1], card, offsets_arg(offs, 1, "o"), save=save,
                        checks=checks)
        _, budget = check_engine(job, "triton", None)  # a checked restore's own default budget
        (launch,) = _launch.launches(job, budget)
        assert launch.key in keys, n
    _, pools = _caches(5)
    K.warmup(pools, card, engine="triton", checks=True)  # the odd (byte-word) cache: skipped


def test_hash_launches_use_warmed_variants():
    """``hashes=True`` warms the store-free checked variants ``hash_pages`` and the two-pass
    verified restore launch, layer by layer, for any block count."""
    from xkv.kernels.hashing import build_hash_job

    g = Geometry(40, 4096 + 64, ((0, 4096),))
    pools = [pool_over(random_bytes(g.extent + 5, 4 + k), 0, g) for k in range(2)]
    card = torch.zeros(4096 * 64, dtype=torch.uint8)
    card = card[-card.data_ptr() % 4096 :][: 4096 * 60]
    checked = K.warmup(pools, card, engine="triton", checks=True)
    keys = K.warmup(pools, card, engine="triton", checks=True, hashes=True)
    assert checked < keys and {dict(k).get("STORE") for k in keys - checked} == {"False"}
    for n in (1, 2, 5, 17, 40):
        exp = np.zeros((2, 1), np.uint32)
        job = build_hash_job(pools, np.arange(n)[::-1],
                             K.Checks(np.zeros(n, np.int64), np.arange(n), 1, expected=exp))
        _, budget = check_engine(job, "triton", None)
        for launch in _launch.launches(job, budget, groups=[[0], [1]]):
            assert launch.key in keys, n


@pytest.mark.parametrize("L", [2, 16, 32])
def test_whole_hash_after_warmup_compiles_nothing_new(L, monkeypatch):
    """``checksum_pass`` "end" hashes every layer of a group in one launch at its own budget
    (``WHOLE_HASH_PROGRAMS``): ``hash_groups`` warms those variants, per-layer hashes do not."""
    pools, card = _layers(L)
    every, budget = [list(range(L))], _budgets.WHOLE_HASH_PROGRAMS
    keys = K.warmup(pools, card, engine="triton", checks=True, hashes=True, hash_groups=every,
                    hash_programs=budget)
    per_layer = K.warmup(pools, card, engine="triton", checks=True, hashes=True)
    seen = _launched(monkeypatch)
    for _, ids, offs, checks in _checked_steps(L):
        prep = K.prepare_hashed_restore(card, offs, pools, ids, checks, engine="triton",
                                        hash_programs=budget, hash_groups=every)
        prep.launch_checks()
    assert seen and set(seen) <= keys
    assert not set(seen) <= per_layer


@pytest.mark.parametrize("checked", [False, True])
def test_warmup_runs_the_specialisation_of_two_run_pages(checked, monkeypatch):
    """K/V-first caches (FLASH_ATTN's ``[2, blocks, ...]`` per layer) have two runs per page:
    the launches warmup actually runs must specialise ``n_runs`` as real copies do (Triton
    compiles an int equal to 1 as a constant: a warmup run with 1 left the real variant to
    compile mid-serving, ~1 s, on the H200's first per-layer checked restore). Keys include the
    scalars' specialisation classes (``_launch.variant_key``)."""
    from xkv.connector.light_steps import load_layer_groups
    from xkv.kernels.verify import Checks

    L, nb, run = 4, 40, 2048
    g = Geometry(nb, run, ((0, run), (nb * run, run)))  # K of every block, then V
    raw = torch.zeros(L * g.extent + 64, dtype=torch.uint8)
    pools = [pool_over(raw, k * g.extent, g) for k in range(L)]
    bb = g.block_bytes
    card = torch.zeros(bb * (nb * L + 2), dtype=torch.uint8)
    card = card[-card.data_ptr() % 4096:][: bb * nb * L]
    groups = load_layer_groups(L)
    ran = []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self: ran.append(self.key))
    K.warmup(pools, card, engine="triton", checks=checked, restore_groups=groups)
    warmed, ran[:] = set(ran), []
    assert all(dict(k)["int:n_runs"] == "" for k in warmed)  # 2 runs: not the constant 1
    for n in (1, 3, 17, 40):
        ids = np.arange(n)[::-1].copy()
        offs = np.stack([k * n * bb + np.arange(n, dtype=np.int64) * bb for k in range(L)])
        chk = (Checks(np.zeros(n, np.int64), np.arange(n), 1, expected=np.zeros((L, 1), np.uint32))
               if checked else None)
        for lg in (None, groups):  # a step's per-layer launches, a light step's groups
            prep = K.prepare_restore(card, offs, pools, ids, engine="triton", layer_groups=lg,
                                     checks=chk, defer_rest=True)
            for i in range(len(prep)):
                prep.launch(i)
        save_chk = Checks(np.zeros(n, np.int64), np.arange(n), 1) if checked else None
        prep = K.prepare_save(pools, ids, card, offs, engine="triton", checks=save_chk)
        for i in range(len(prep)):
            prep.launch(i)
    assert ran and set(ran) <= warmed, set(ran) - warmed


def test_per_step_ints_are_typed_int64():
    """The kernel's per-step int arguments are not specialised and are annotated ``tl.int64``:
    Triton types an unannotated int i32 or i64 by its value, so a step whose ``hi`` (the job's
    bytes, in words) passed 2**31 compiled a new variant mid-serving (the H200's 8 x 16k restore:
    17.2 GB / 8-byte words > 2**31). The geometry ints stay specialised (and unannotated)."""
    import inspect

    import triton.language as tl

    from xkv.kernels import _triton

    fn = getattr(_triton.page_copy_kernel, "fn", _triton.page_copy_kernel)
    params = inspect.signature(fn).parameters
    for name in _triton.INT_ARGS:
        assert params[name].annotation is tl.int64, name
    for name in ("n_runs", "block_stride", "block_words", "max_run_words"):
        assert params[name].annotation is inspect.Parameter.empty, name


@pytest.mark.gpu
@pytest.mark.parametrize("checked", [False, True])
def test_no_compile_when_a_step_passes_2_31_words(checked, monkeypatch):
    """A restore of 16 GiB (32 layers x 512 pages of 1 MiB: 2**31 8-byte words, the H200's
    8 x 16k case) after warmup compiles nothing: its ``hi`` would be typed i64 by value, the
    warmed launches' i32, if the kernel did not type it int64 (16 GiB of GPU memory; every
    layer reads the same 512 MiB of the card)."""
    from xkv.kernels import _triton
    from xkv.kernels.verify import Checks

    kernel = _triton.page_copy_kernel
    L, n, bb = 32, 512, 1 << 20
    g = Geometry(n, bb, ((0, bb),))
    raws = [torch.empty(g.extent, dtype=torch.uint8, device="cuda") for _ in range(L)]
    pools = [pool_over(r, 0, g) for r in raws]
    card = torch.empty(n * bb + 4096, dtype=torch.uint8).pin_memory()
    card = card[-card.data_ptr() % 4096:][: n * bb]
    K.warmup(pools, card, checks=checked)
    assert hasattr(kernel, "compile"), "no per-kernel compile hook to count compiles with"
    compiled = []
    real = kernel.compile
    monkeypatch.setattr(kernel, "compile", lambda *a, **k: compiled.append(1) or real(*a, **k))
    offs = np.tile(np.arange(n, dtype=np.int64) * bb, (L, 1))
    chk = (Checks(np.arange(n) // 16, np.arange(n) % 16, n // 16,
                  expected=np.zeros((L, n // 16), np.uint32)) if checked else None)
    prep = K.prepare_restore(card, offs, pools, np.arange(n), checks=chk)
    assert L * n * bb // 8 >= 2**31
    for k in range(L):
        prep.launch(k)
    torch.cuda.synchronize()
    assert compiled == []


@pytest.mark.parametrize("L,checked,grouped", [(5, False, False), (16, True, True),
                                               (32, True, False), (32, False, True)])
def test_staged_restores_after_warmup_compile_nothing_new(L, checked, grouped, monkeypatch):
    """Staged restores (the ring's unpacks, ``engine="auto"``'s choice for large restores from
    host memory) of any length, per layer or in a light step's layer groups, with chunks that
    split a layer or hold several whole layers, run variants the connector's warmup ran: the
    unpack of a chunk is planned as a restore of a full slot (``staged_restore.unpack_plan``), a
    one-layer or layer-group restore whose tiles the warmup enumerates at the same budgets."""
    from xkv.connector.light_steps import load_layer_groups
    from xkv.kernels import ring, staged_restore

    pools, card = _layers(L)
    groups = load_layer_groups(L) if grouped else None
    keys = K.warmup(pools, card, engine="triton", restore_groups=groups or (), checks=checked,
                    light_programs=64)
    r = ring.ring(pools[0].device)
    seen = _launched(monkeypatch)
    for n in (1, 3, 16, 40):
        ids = np.arange(n)[::-1].copy()
        offs = np.stack([k * n * 4096 + np.arange(n, dtype=np.int64) * 4096 for k in range(L)])
        checks = (K.Checks(np.zeros(n, np.int64), np.arange(n), 1,
                           expected=np.zeros((L, 1), np.uint32)) if checked else None)
        budget = (64 if grouped else 16) if checked else 4
        for chunk in (3 * 4096, None, 5 * n * 4096):
            job = build_job(pools, ids, card, offsets_arg(offs, L, "o"), save=False,
                            checks=checks)
            for call in staged_restore.prepare(job, budget, groups, dma=lambda *a: None,
                                               chunk_bytes=chunk, the_ring=r):
                call()
    assert seen and set(seen) <= keys
    if grouped:  # chunks of several whole layers ran
        assert any(dict(k)["HAS_LAYERS"] == "True" for k in seen)
