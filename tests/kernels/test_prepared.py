"""Prepared steps: validated and uploaded once, then ``launch(l)`` moves layer l's bytes only.

Bit-exact against the byte-loop oracle with poisoned destinations, layers launched in any order
or only some of them, odd sizes and empty block lists (hypothesis); bad input refused before any
byte moves; after ``prepare_*`` a launch validates, plans and uploads nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_buffers import GPU_ENGINES, SOURCES, flat_of
from hypothesis import given
from hypothesis import strategies as st
from pools import (
    POISON,
    Geometry,
    layer_jobs,
    layers_buffer_size,
    oracle,
    pool_over,
    pools_over,
    random_bytes,
    refused_and_untouched,
)

import xkv.kernels as K
from xkv.kernels import _launch, jobs, prepared

ENGINES = ["reference", "triton"]


def _launch_some(prep, data) -> list[int]:
    """Launch a drawn subset of the layers, in a drawn order; returns the layers launched."""
    order = data.draw(st.permutations(range(len(prep))))
    some = order[: data.draw(st.integers(0, len(order)))] if data.draw(st.booleans()) else order
    for k in some:
        prep.launch(k)
    return sorted(some)


@pytest.mark.parametrize("defer", [False, True], ids=["planned", "deferred"])
@pytest.mark.parametrize("engine", ENGINES)
@given(job=layer_jobs(save=False), seed=st.integers(0, 2**16), data=st.data())
def test_prepared_restore(engine, defer, job, seed, data):
    geoms, offsets, ids, offs, flat_size = job
    raw = torch.full((layers_buffer_size(geoms, offsets),), POISON, dtype=torch.uint8)
    flat = random_bytes(flat_size, seed)
    flat0 = flat.clone()
    prep = K.prepare_restore(flat, torch.from_numpy(offs), pools_over(raw, geoms, offsets),
                             torch.from_numpy(ids), engine=engine, max_programs=3,
                             defer_rest=defer)
    assert len(prep) == len(geoms) and prep.nbytes == ids.size * geoms[0].block_bytes
    assert torch.equal(raw, torch.full_like(raw, POISON))  # preparing moves nothing
    done = _launch_some(prep, data)
    expect = torch.full_like(raw, POISON)
    epools = pools_over(expect, geoms, offsets)
    oracle(expect, [epools[k] for k in done], flat, offs[done], ids, save=False)
    assert torch.equal(raw, expect)
    assert torch.equal(flat, flat0)


@pytest.mark.parametrize("engine", ENGINES)
@given(job=layer_jobs(save=True), seed=st.integers(0, 2**16), data=st.data())
def test_prepared_save(engine, job, seed, data):
    geoms, offsets, ids, offs, flat_size = job
    raw = random_bytes(layers_buffer_size(geoms, offsets), seed)
    raw0 = raw.clone()
    flat = torch.full((flat_size,), POISON, dtype=torch.uint8)
    pools = pools_over(raw, geoms, offsets)
    prep = K.prepare_save(pools, ids, flat, offs, engine=engine, max_programs=2)
    done = _launch_some(prep, data)
    expect = torch.full_like(flat, POISON)
    oracle(raw, [pools[k] for k in done], expect, offs[done], ids, save=True)
    assert torch.equal(flat, expect)
    assert torch.equal(raw, raw0)


@pytest.mark.parametrize("engine", ENGINES)
def test_prepared_is_the_one_layer_call(engine):
    """A layer may be launched again, and two layers may be the same pool (KV sharing): launches
    are ordered, each is exactly ``restore(src, offs[l], pools[l], ids)``."""
    g = Geometry(5, 24, ((0, 7), (9, 5)))
    raw = torch.full((200,), POISON, dtype=torch.uint8)
    pool = pool_over(raw, 3, g)
    flat = random_bytes(100, 4)
    offs = np.array([[0, 12, 24], [50, 62, 74]])
    prep = K.prepare_restore(flat, offs, [pool, pool], [4, 0, 2], engine=engine)
    prep.launch(0)
    prep.launch(1)
    expect = torch.full_like(raw, POISON)
    oracle(expect, [pool_over(expect, 3, g)], flat, offs[1:], np.array([4, 0, 2]), save=False)
    assert torch.equal(raw, expect)
    prep.launch(0)
    oracle(expect, [pool_over(expect, 3, g)], flat, offs[:1], np.array([4, 0, 2]), save=False)
    assert torch.equal(raw, expect)


@pytest.mark.parametrize("engine", ENGINES)
def test_prepared_empty(engine):
    g = Geometry(3, 40, ((0, 17), (20, 3)))
    raw = torch.full((200,), POISON, dtype=torch.uint8)
    pools = [pool_over(raw, 1, g), pool_over(raw, 120, Geometry(2, 20, ((0, 20),)))]
    flat = random_bytes(64, 0)
    prep = K.prepare_restore(flat, np.zeros((2, 0), np.int64), pools[:1] * 2, [], engine=engine)
    prep.launch(0)
    prep.launch(1)
    save = K.prepare_save(pools[:1], [], flat, np.zeros((1, 0), np.int64), engine=engine)
    save.launch(0)
    assert len(K.prepare_restore(flat, np.zeros((0, 0), np.int64), [], [], engine=engine)) == 0
    assert (raw == POISON).all() and torch.equal(flat, random_bytes(64, 0))


def test_launch_does_no_host_work(monkeypatch):
    """After prepare, launches neither validate, plan nor upload (the Triton engine)."""
    g = Geometry(6, 40, ((0, 16), (24, 8)))
    raw = torch.full((400,), POISON, dtype=torch.uint8)
    pools = [pool_over(raw, 0, g), pool_over(raw, 240, Geometry(6, 24, ((0, 24),)))]
    flat = random_bytes(300, 5)
    offs = np.array([[0, 24, 48], [120, 144, 168]])
    uploads = []
    real = _launch.Tables.upload
    monkeypatch.setattr(_launch.Tables, "upload", lambda s, d: uploads.append(1) or real(s, d))
    prep = K.prepare_restore(flat, offs, pools, [5, 0, 3], engine="triton")
    assert uploads == [1]  # one upload for every layer's tables

    def refuse(*a, **k):
        raise AssertionError("host work in a launch")

    for name in ("build_job", "as_index"):
        monkeypatch.setattr(jobs, name, refuse)
    for name in ("build_job", "check_engine"):
        monkeypatch.setattr(prepared, name, refuse)
    monkeypatch.setattr(_launch, "plan", refuse)
    monkeypatch.setattr(_launch.Tables, "upload", refuse)
    prep.launch(1)
    prep.launch(0)
    expect = torch.full_like(raw, POISON)
    oracle(expect, pools_over(expect, [g, Geometry(6, 24, ((0, 24),))], [0, 240]), flat, offs,
           np.array([5, 0, 3]), save=False)
    assert torch.equal(raw, expect)


def _bad_cases():
    g = Geometry(4, 24, ((0, 10), (12, 6)))  # 16 bytes a block

    def setup():
        raw = torch.full((300,), POISON, dtype=torch.uint8)
        return raw, random_bytes(100, 1), pool_over(raw, 0, g)

    PR, PS = K.prepare_restore, K.prepare_save
    return {
        "id too large": lambda raw, flat, p, e: PR(flat, [[0]], [p], [4], engine=e),
        "id negative": lambda raw, flat, p, e: PR(flat, [[0]], [p], [-1], engine=e),
        "duplicate destination": lambda raw, flat, p, e: PR(flat, [[0, 16]], [p], [1, 1], engine=e),
        "offsets not [L, n]": lambda raw, flat, p, e: PR(flat, [0, 16], [p, p], [1], engine=e),
        "offset past the end": lambda raw, flat, p, e: PR(flat, [[0], [85]], [p, p], [1], engine=e),
        "flat is the cache": lambda raw, flat, p, e: PR(raw, [[10]], [p], [0], engine=e),
        "save overlap": lambda raw, flat, p, e: PS([p, p], [0, 1], flat, [[0, 16], [40, 48]],
                                                   engine=e),
        "save into the cache": lambda raw, flat, p, e: PS([p], [0], raw, [[0]], engine=e),
        "layers block bytes": lambda raw, flat, p, e: PR(
            flat, [[0], [20]], [p, pool_over(raw, 200, Geometry(2, 20, ((0, 20),)))], [1], engine=e
        ),
        "not a pool": lambda raw, flat, p, e: PR(flat, [[0]], [raw], [1], engine=e),
        "pool not a sequence": lambda raw, flat, p, e: PS(p, [1], flat, [[0]], engine=e),
        "float ids": lambda raw, flat, p, e: PR(flat, [[0]], [p], torch.tensor([1.0]), engine=e),
        "bad engine": lambda raw, flat, p, e: PR(flat, [[0]], [p], [1], engine="dma"),
        "bad engine, no layers": lambda raw, flat, p, e: PR(
            flat, np.zeros((0, 0), np.int64), [], [], engine="dma"
        ),
        "bad max_programs": lambda raw, flat, p, e: PR(flat, [[0]], [p], [1], engine=e,
                                                       max_programs=0),
        "copy engine on CPU": lambda raw, flat, p, e: PR(flat, [[0]], [p], [1],
                                                         engine="copy_engine"),
    }, setup


BAD, _SETUP = _bad_cases()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_rejected_nothing_written(case, engine):
    assert refused_and_untouched(BAD[case], _SETUP, engine)


@pytest.mark.parametrize("layer", [2, -1])
def test_launch_out_of_range(layer):
    raw, flat, pool = _SETUP()
    prep = K.prepare_restore(flat, [[0], [16]], [pool, pool], [1], engine="reference")
    with pytest.raises(IndexError):
        prep.launch(layer)
    assert (raw == POISON).all()


@pytest.mark.gpu
@pytest.mark.parametrize("engine", GPU_ENGINES)
@pytest.mark.parametrize("source", SOURCES)
def test_prepared_gpu_on_a_side_stream(engine, source):
    """Prepared on a side stream, launched from the default one: the copies run on the side
    stream (where the tables were uploaded), so waiting on it is enough; a Triton or copy-engine
    launch never synchronises the host."""
    L, page, nb = 4, 4096 + 512, 30
    geoms = [Geometry(nb, page, ((0, 4096), (4096 + 256, 128)))] * L
    offsets = [k * (nb * page + 64) for k in [2, 0, 3, 1]]
    size = layers_buffer_size(geoms, offsets)
    raw_cpu = torch.full((size,), POISON, dtype=torch.uint8)
    raw_gpu = raw_cpu.cuda()
    ids = np.array([29, 0, 7, 8, 13], dtype=np.int64)
    bb = geoms[0].block_bytes
    offs = (np.arange(L * ids.size, dtype=np.int64)[::-1] * bb).reshape(L, ids.size) + 4096
    data = random_bytes(int(offs.max()) + bb + 5, 3)
    flat = flat_of(source, data)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        prep = K.prepare_restore(flat, offs, pools_over(raw_gpu, geoms, offsets), ids,
                                 engine=engine)
    assert prep.stream == side and prep.engines == (engine,) * L
    # a synchronising CUDA call in a launch raises (staged keeps its per-launch ring, see prepared)
    torch.cuda.set_sync_debug_mode("error" if engine != "staged" else "default")
    try:
        for k in range(L):
            prep.launch(k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    oracle(raw_cpu, pools_over(raw_cpu, geoms, offsets), data, offs, ids, save=False)
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    out = flat_of(source, torch.full_like(data, POISON))
    with torch.cuda.stream(side):
        save = K.prepare_save(pools_over(raw_gpu, geoms, offsets), ids, out, offs, engine=engine)
    for k in reversed(range(L)):
        save.launch(k)
    side.synchronize()
    expect = torch.full_like(data, POISON)
    oracle(raw_cpu, pools_over(raw_cpu, geoms, offsets), expect, offs, ids, save=True)
    assert torch.equal(out.cpu(), expect)


def _groups(L: int, data) -> list[list[int]]:
    """A drawn split of range(L) into runs of consecutive layers."""
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, L - 1)), max_size=L - 1)) if L > 1
                  else [])
    bounds = [0, *cuts, L]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@pytest.mark.parametrize("defer", [False, True], ids=["planned", "deferred"])
@pytest.mark.parametrize("engine", ENGINES)
@given(job=layer_jobs(save=False), seed=st.integers(0, 2**16), data=st.data())
def test_prepared_restore_in_layer_groups(engine, defer, job, seed, data):
    """``layer_groups``: ``launch(g)`` writes exactly group g's layers (one launch for a group of
    one geometry on Triton, per layer otherwise), bit-exact, poisoned elsewhere; with
    ``defer_rest`` too, whichever group is launched first."""
    geoms, offsets, ids, offs, flat_size = job
    groups = _groups(len(geoms), data)
    raw = torch.full((layers_buffer_size(geoms, offsets),), POISON, dtype=torch.uint8)
    flat = random_bytes(flat_size, seed)
    prep = K.prepare_restore(flat, torch.from_numpy(offs), pools_over(raw, geoms, offsets),
                             torch.from_numpy(ids), engine=engine, max_programs=3,
                             layer_groups=groups, defer_rest=defer)
    assert len(prep) == len(groups)
    some = _launch_some(prep, data)
    done = sorted(k for g in some for k in groups[g])
    expect = torch.full_like(raw, POISON)
    epools = pools_over(expect, geoms, offsets)
    oracle(expect, [epools[k] for k in done], flat, offs[done], ids, save=False)
    assert torch.equal(raw, expect)


def test_grouped_triton_is_one_launch_per_group(monkeypatch):
    """Layers of one geometry in a group: a single kernel launch for the group."""
    g = Geometry(6, 64, ((0, 32),))
    raw = torch.full((4 * g.extent + 64,), POISON, dtype=torch.uint8)
    pools = pools_over(raw, [g] * 4, [k * (g.extent + 16) for k in range(4)])
    flat = random_bytes(4 * 3 * 32, 5)
    offs = np.arange(12, dtype=np.int64).reshape(4, 3) * 32
    calls = []
    real = _launch.Launch.__call__
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self: (calls.append(1), real(self)))
    prep = K.prepare_restore(flat, offs, pools, [5, 0, 2], engine="triton",
                             layer_groups=[[0, 1, 2], [3]])
    prep.launch(0)
    prep.launch(1)
    assert len(calls) == 2
    for k, p in enumerate(pools):
        for i, b in enumerate([5, 0, 2]):
            assert torch.equal(p.run_view(0)[b], flat[offs[k, i]:offs[k, i] + 32])


@pytest.mark.parametrize("groups", [None, [[0, 1], [2], [3]]], ids=["per_layer", "grouped"])
def test_deferred_restore_plans_the_first_launch_then_the_rest_once(groups, monkeypatch):
    """``defer_rest``: preparing plans and uploads the first launch only; launching it plans
    nothing; the first later launch plans every other launch with one more upload, the ones
    after it plan nothing; the launches run the variants planning them together gives."""
    g = Geometry(6, 64, ((0, 32),))
    raw = torch.full((4 * g.extent + 64,), POISON, dtype=torch.uint8)
    pools = pools_over(raw, [g] * 4, [k * (g.extent + 16) for k in range(4)])
    flat = random_bytes(4 * 3 * 32, 9)
    offs = np.arange(12, dtype=np.int64).reshape(4, 3)[::-1].copy() * 32
    ids = [5, 0, 2]
    together = K.prepare_restore(flat, offs, pools, ids, engine="triton", layer_groups=groups)
    want = [together._calls[i].key for i in range(len(together))]
    uploads, plans, keys = [], [], []
    real_up, real_plan, real_call = _launch.Tables.upload, _launch.plan, _launch.Launch.__call__
    monkeypatch.setattr(_launch.Tables, "upload", lambda s, d: uploads.append(1) or real_up(s, d))
    monkeypatch.setattr(_launch, "plan", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(_launch.Launch, "__call__",
                        lambda self: (keys.append(self.key), real_call(self)))
    prep = K.prepare_restore(flat, offs, pools, ids, engine="triton", layer_groups=groups,
                             defer_rest=True)
    assert (len(uploads), len(plans)) == (1, 1)
    prep.launch(0)
    assert (len(uploads), len(plans)) == (1, 1)
    prep.launch(len(prep) - 1)  # a later launch first: every other one is planned now
    assert len(uploads) == 2 and len(plans) >= 2
    before = len(plans)
    for i in range(1, len(prep) - 1):
        prep.launch(i)
    assert len(uploads) == 2 and len(plans) == before
    assert sorted(keys) == sorted(want)
    expect = torch.full_like(raw, POISON)
    oracle(expect, pools_over(expect, [g] * 4, [k * (g.extent + 16) for k in range(4)]), flat,
           offs, np.array(ids), save=False)
    assert torch.equal(raw, expect)


@pytest.mark.parametrize("groups", [[[0], [2], [1]], [[0, 1]], [[0], []], [[0, 1, 2, 3]]])
def test_layer_groups_must_split_the_layers_in_order(groups):
    g = Geometry(4, 64, ((0, 32),))
    raw = torch.full((3 * g.extent,), POISON, dtype=torch.uint8)
    pools = pools_over(raw, [g] * 3, [k * g.extent for k in range(3)])
    with pytest.raises(ValueError, match="layer_groups must split range"):
        K.prepare_restore(random_bytes(96, 1), np.zeros((3, 1), np.int64), pools, [0],
                          engine="reference", layer_groups=groups)
    assert torch.equal(raw, torch.full_like(raw, POISON))


def test_engine_checked_once_per_pool_geometry(monkeypatch):
    """prepare asks check_engine once per distinct pool geometry (not once per layer), and
    every layer gets the answer of its own geometry."""
    ga, gb = Geometry(6, 40, ((0, 16), (24, 8))), Geometry(6, 24, ((0, 24),))
    raw = torch.full((1200,), POISON, dtype=torch.uint8)
    pa = [pool_over(raw, 0, ga), pool_over(raw, 240, ga), pool_over(raw, 480, ga)]
    pb = [pool_over(raw, 720, gb), pool_over(raw, 900, gb)]
    pools = [pa[0], pb[0], pa[1], pb[1], pa[2]]
    flat = random_bytes(600, 7)
    offs = np.array([[i * 100, i * 100 + 40] for i in range(5)])
    asked, real = [], prepared.check_engine

    def answer(job, engine, max_programs):
        asked.append(job.pools[0].runs)
        eng, budget = real(job, engine, max_programs)
        return eng, budget + 1000 * len(job.pools[0].runs)  # tells the geometries apart

    monkeypatch.setattr(prepared, "check_engine", answer)
    prep = K.prepare_restore(flat, offs, pools, [5, 1], engine="reference")
    assert sorted(asked) == sorted([ga.runs, gb.runs])  # once per geometry, not per layer
    job = prep._job
    assert prepared._engines(job, "reference", None) == [
        answer(job.layer(k), "reference", None) for k in range(5)]
    for k in range(5):
        prep.launch(k)
    expect = torch.full_like(raw, POISON)
    oracle(expect, pools_over(expect, [ga, gb, ga, gb, ga], [0, 720, 240, 900, 480]), flat,
           offs, np.array([5, 1]), save=False)
    assert torch.equal(raw, expect)
