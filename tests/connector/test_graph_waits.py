"""Per-layer restore waits captured into vLLM's full CUDA graphs (``xkv.connector.graph_waits``).

CPU: when the captured graphs cover a step's loaded layers (:func:`graph_waits.covers`), what
the façade does while vLLM captures (the hook runs, puts a wait in, saves nothing) and in a
full-graph step (the worker fences only where the graphs do not wait). ``gpu``: a captured graph
replayed after a restore that starts late reads every layer's restored bytes (and a graph
captured without the waits reads the poison: the test can fail), two steps issued back to back
do not deadlock, and a graph that lacks a layer's wait is refused.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_tail_fence import NAMES, _expected, _flat, _setup, _transfer

from xkv.connector import cuda_transfer, graph_waits, loads, worker


def test_covers_needs_every_layer_captured_equally_often():
    assert graph_waits.covers({}, [])
    assert graph_waits.covers({"a": 3, "b": 3}, ["a", "b"])
    assert graph_waits.covers({"a": 3, "b": 3}, ["b"])
    assert not graph_waits.covers({}, ["a"])
    assert not graph_waits.covers({"a": 3, "b": 0}, ["a", "b"])
    assert not graph_waits.covers({"a": 3}, ["a", "b"])
    # a capture run that hooked "a" but not "b": some graph lacks b's wait, even for a alone
    assert not graph_waits.covers({"a": 4, "b": 3}, ["a"])


def test_switch(monkeypatch):
    monkeypatch.delenv("XKV_GRAPH_WAITS", raising=False)
    assert graph_waits.enabled()
    monkeypatch.setenv("XKV_GRAPH_WAITS", "0")
    assert not graph_waits.enabled()
    monkeypatch.setenv("XKV_GRAPH_WAITS", "yes")
    with pytest.raises(ValueError, match="XKV_GRAPH_WAITS='yes'"):
        graph_waits.enabled()


class _Handler:
    def __init__(self, covered: bool):
        self.covered, self.waited, self.captured = covered, [], []

    def graph_waited(self):
        return self.covered

    def wait_layer(self, name):
        self.waited.append(name)

    def capture_wait(self, name):
        self.captured.append(name)


class _Worker(worker.WorkerSide):
    """The worker's full-graph fence without a gateway: groups and handler only."""

    def __init__(self, handler, names, graph_waits_on=True):
        self._h = handler
        self.registry = type("R", (), {"groups": [type("P", (), {"group": type(
            "G", (), {"layer_names": names})})]})()
        self.parts = None
        self.graph_waits = graph_waits_on
        self._full_graphs = graph_waits_on
        self._graph_logged = False
        self._meta = None  # no step bound (vLLM captures between steps)

    handler = property(lambda self: self._h)
    fanout = property(lambda self: None)


@pytest.mark.parametrize("covered", [True, False])
def test_full_graph_step_fences_only_what_the_graphs_do_not_wait_for(covered, caplog):
    h = _Handler(covered)
    w = _Worker(h, ("l0", "l1", "l2"))
    with caplog.at_level("INFO", logger="xkv.connector"):
        w.fence_full_graph_step()
        w.fence_full_graph_step()
    assert h.waited == ([] if covered else ["l0", "l1", "l2"] * 2)
    lines = [r.getMessage() for r in caplog.records if "full-CUDA-graph" in r.getMessage()]
    assert len(lines) == 1  # once
    assert ("graph waits for each layer" in lines[0]) == covered
    if not covered:
        assert "lack a layer's wait" in lines[0]


def test_full_graph_step_without_graph_waits_is_fenced_and_says_why(caplog):
    h = _Handler(False)
    w = _Worker(h, ("l0", "l1"), graph_waits_on=False)
    with caplog.at_level("INFO", logger="xkv.connector"):
        w.fence_full_graph_step()
    assert h.waited == ["l0", "l1"]
    assert "graph waits off: full_cuda_graphs false or XKV_GRAPH_WAITS=0" in caplog.text


def test_capture_runs_the_hook_into_the_handler_and_skips_saves(monkeypatch):
    """While a stream captures: ``capturing()`` is true only with graph waits on; the façade's
    hooks then put the wait into the capture and save nothing; a bound step's metadata is not
    needed (vLLM's decorator asks ``has_connector_metadata`` first)."""
    pytest.importorskip("vllm")
    from xkv.connector.facade import FusIOnXConnector

    h = _Handler(True)
    w = _Worker(h, ("l0",))
    saved = []
    monkeypatch.setattr(w, "save_kv_layer", saved.append, raising=False)
    monkeypatch.setattr(w, "wait_for_layer_load", lambda n: h.waited.append(n), raising=False)
    c = object.__new__(FusIOnXConnector)
    c._worker = w
    c._connector_metadata = None
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert c.has_connector_metadata()
    c.wait_for_layer_load("l0")
    c.save_kv_layer("l0", None, None)
    assert h.captured == ["l0"] and h.waited == [] and saved == []
    capturing[0] = False
    assert not c.has_connector_metadata()
    c.wait_for_layer_load("l0")
    c.save_kv_layer("l0", None, None)
    assert h.captured == ["l0"] and h.waited == ["l0"] and saved == ["l0"]
    capturing[0] = True  # a bound step's hooks are the step's own, whatever the stream says
    w._meta = object()
    c.wait_for_layer_load("l0")
    c.save_kv_layer("l0", None, None)
    assert h.captured == ["l0"] and h.waited == ["l0", "l0"] and saved == ["l0", "l0"]
    w._meta = None
    w.graph_waits = False  # off: a capture is not a hook call
    assert not c.has_connector_metadata()


# ------------------------------------------------------------------------------------ GPU

_SLEEP_CYCLES = 60_000_000  # ~35 ms at H100/H200 clocks: the copies start well after the replay


def _capture(h, kvs, outs, names):
    """A graph that reads every layer's cache into ``outs`` (the forward's attention reads),
    each read after ``capture_wait`` of the layers in ``names``."""
    g = torch.cuda.CUDAGraph()
    for o, kv in zip(outs, kvs, strict=True):  # warm the copy kernels outside the capture
        o.copy_(kv)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for name, o, kv in zip(NAMES, outs, kvs, strict=True):
            if name in names:
                h.capture_wait(name)
            o.copy_(kv)
    return g


def _restore(h, plan, card, gt, pools, kvs):
    """Poison the caches (compute stream), then a restore whose copies start ~35 ms late."""
    for kv in kvs:
        kv.fill_(-7.0)
    h.begin_loads()
    with torch.cuda.stream(h.load_stream):
        torch.cuda._sleep(_SLEEP_CYCLES)
    loads.load_transfers(h, plan, 0, card, [gt], pools, fence_tail=False)


def _graph_setup(seed, captured):
    """A CUDA handler with graph waits, caches, card, and a graph reading every layer into the
    returned outputs, captured with waits for the layers in ``captured`` (the ``gpu`` marker
    skips the tests without a CUDA device)."""
    kvs, pools, plan, card, obj = _setup("cuda", seed)
    h = cuda_transfer.CudaTransferHandler(torch.device("cuda"))
    assert h.enable_graph_waits(NAMES)
    outs = [torch.empty_like(kv) for kv in kvs]
    return h, kvs, pools, plan, card, obj, outs, _capture(h, kvs, outs, captured)


def _assert_restored(outs, plan, card, gt, n):
    for layer, o in enumerate(outs):
        flat = _flat(o)
        for i in range(n):
            assert torch.equal(flat[i], _expected(plan, card.cpu(), gt, layer, i))


def _synced(deadline_s=30.0):
    """Wait for the GPU with a deadline (a deadlocked replay fails instead of hanging)."""
    t = time.monotonic()
    while not torch.cuda.current_stream().query():
        assert time.monotonic() - t < deadline_s, "GPU work did not finish: deadlock?"
        time.sleep(0.005)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_graph_replay_reads_each_layer_after_its_copy():
    """Three steps, the host issuing the next step's restore before the GPU finished the last
    replay: every replay reads its own step's restored bytes (a wait node waits for the record
    made before its graph's launch); a graph captured without the waits reads the poison."""
    h, kvs, pools, plan, card, obj, outs, g = _graph_setup(6, set(NAMES))
    assert h.graph_waited()  # nothing loaded yet: nothing to fence
    n = 2 * 2 * 3
    steps = [[5, 2, 0, 4, 1, 3], [0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2]]
    results = []
    for objs in steps:  # issued back to back: no host wait between the steps
        gt = _transfer(list(range(n)), 0, n, objs, obj, 0)
        _restore(h, plan, card, gt, pools, kvs)
        assert h.graph_waited() and h.pending_layers() == []
        g.replay()
        results.append((gt, [o.clone() for o in outs]))
    _synced()
    h.sync_loads()
    for gt, got in results:
        _assert_restored(got, plan, card, gt, n)
    # the negative control: the same restore, a graph without the waits, reads the poison
    bare = [torch.empty_like(kv) for kv in kvs]
    g2 = _capture(h, kvs, bare, set())
    gt = _transfer(list(range(n)), 0, n, steps[0], obj, 0)
    _restore(h, plan, card, gt, pools, kvs)
    g2.replay()
    _synced()
    h.sync_loads()
    assert bool((bare[0] == -7.0).all())


@pytest.mark.gpu
def test_cuda_graph_lacking_a_layer_is_fenced_by_the_caller():
    """Captured waits for two of three layers: ``graph_waited`` is False and leaves every
    pending layer to the caller's fence (the worker then waits for each before the replay)."""
    h, kvs, pools, plan, card, obj, outs, g = _graph_setup(7, set(NAMES[:2]))
    n = 2 * 2 * 3
    gt = _transfer(list(range(n)), 0, n, [5, 2, 0, 4, 1, 3], obj, 0)
    _restore(h, plan, card, gt, pools, kvs)
    assert not h.graph_waited()
    assert sorted(h.pending_layers()) == sorted(NAMES)
    for name in NAMES:  # what fence_full_graph_step does
        h.wait_layer(name)
    g.replay()
    _synced()
    h.sync_loads()
    _assert_restored(outs, plan, card, gt, n)
