"""Per-layer vs bulk restore fences, bulk saves and the safety net (``xkv.connector.fences``).

The transfer seam is a CPU fake with the CUDA handler's ordering (``StreamLikeHandler``): a
layer's copies land only when something waits for them (``wait_layer``, ``fence_loads``,
``sync_loads``), as a load stream's copies become visible to the compute stream only after it
waited on their event. A simulated forward reads each layer's pages when that layer runs: a
layer whose pages are still poisoned there would have produced a wrong token on a GPU, unless
the step's blocks are reported as load errors.
"""


import pytest
import torch
from connector_fakes import SO, FakeGateway, New, Req, Warnings, written_part
from hypothesis import given, settings
from hypothesis import strategies as st

from xkv import kernels
from xkv.connector.config import ConnectorConfig
from xkv.connector.fences import HookPlan
from xkv.connector.registry import CacheGroup, build_registry
from xkv.connector.scheduler import SchedulerSide
from xkv.connector.transfer import SyncTransferHandler
from xkv.connector.worker import WorkerSide

BS, K, NB = 16, 2, 24  # block size, blocks per chunk, blocks per cache
LAYERS = ("l0", "l1", "l2")
POISON = 0xA5





class StreamLikeHandler(SyncTransferHandler):
    """Loads are queued per layer and applied only when waited for (CUDA ordering on CPU)."""

    def __init__(self):
        super().__init__()
        self.queued: dict[str, list] = {}
        self.fenced_all = 0  # fence_loads calls
        self.waits: list[str] = []  # wait_layer calls, in order

    def load_group(self, names, card, offsets, pools, block_ids, checks=None):
        # copies applied at wait_layer by plain restores: unverified (returns no flags)
        block_ids, offsets = written_part(block_ids, offsets, checks)
        for name, offs, pool in zip(names, offsets, pools, strict=True):
            self.queued.setdefault(name, []).append((card, offs.clone(), pool, block_ids.clone()))

    def _land(self, name):
        for card, offs, pool, ids in self.queued.pop(name, ()):
            kernels.restore(card, offs, pool, ids)

    def wait_layer(self, name):
        self.waits.append(name)
        self._land(name)

    def pending_layers(self):
        return sorted(self.queued)

    def fence_loads(self):
        self.fenced_all += 1
        for name in list(self.queued):
            self._land(name)

    def sync_loads(self):
        for name in list(self.queued):
            self._land(name)


def _caches(seed=0, poison=None):
    out = {}
    for li, name in enumerate(LAYERS):
        g = torch.Generator().manual_seed(100 * li + seed)
        t = torch.randint(0, 256, (NB, 2, BS, 8), dtype=torch.uint8, generator=g)
        out[name] = t.fill_(poison) if poison is not None else t
    return out


def _registry(groups=1):
    bb = 2 * 8 * BS
    if groups == 1:
        cg = [CacheGroup(0, "attention", LAYERS, BS, bb)]
    else:  # a second group makes the model multi-group (no block errors on vLLM <= 0.29)
        cg = [CacheGroup(0, "attention", LAYERS, BS, bb), CacheGroup(1, "attention", ("m0",), BS, bb)]
    return build_registry(cg, tp_size=1, pp_size=1, chunk_size=BS * K)


def _worker(reg, gw, kv, hooks):
    w = WorkerSide(reg, [f"fp{i}" for i in range(len(reg.groups))], namespace="default",
                   tp_rank=0, gateway_factory=gw.client,
                   handler_factory=lambda device: StreamLikeHandler())
    w.register_kv_caches(kv, num_blocks=NB, hooks=hooks)
    return w


def _sched(reg, gw):
    cfg = ConnectorConfig.from_extra({"chunk_size": BS * K})
    return SchedulerSide(cfg, reg, [f"fp{i}" for i in range(len(reg.groups))],
                         hash_block_size=BS, world_size=1, gateway_factory=gw.client)


def _store(gw, reg, n=5 * BS, ids=(3, 4, 5, 6, 7), salt=7):
    """Engine 1: save a prompt's two full chunks (every layer saves through its hook)."""
    s, src = _sched(reg, gw), _caches()
    w = _worker(reg, gw, src, {n: (True, "Attention") for n in LAYERS})
    req = Req("a", n, salt)
    assert s.get_num_new_matched_tokens(req, 0) == 0
    s.update_state_after_alloc(req, [list(ids)], 0)
    w.bind(s.build_connector_meta(SO([New("a", list(ids), 0)], {"a": n})))
    for name in LAYERS:
        w.save_kv_layer(name)
    w.wait_for_save()
    w.clear()
    return src


def _restore_step(w, s, rid, ids, salt=7, fire=LAYERS):
    """One engine-2 step restoring 4 blocks of a stored prompt; the forward calls
    wait_for_layer_load only for the layers in ``fire``. Returns (pages each layer read when it
    ran, load errors, metadata)."""
    req = Req(rid, 5 * BS, salt)
    assert s.get_num_new_matched_tokens(req, 0) == 4 * BS
    s.update_state_after_alloc(req, [list(ids)], 4 * BS)
    meta = s.build_connector_meta(SO([New(rid, list(ids), 4 * BS)], {rid: BS}))
    w.bind(meta)
    w.start_load_kv()
    seen = {}
    for name in LAYERS:  # the forward, layer by layer
        if name in fire:
            w.wait_for_layer_load(name)
        seen[name] = w.pools[name].block(ids[0]).clone()
    w.wait_for_save()
    w.get_finished()
    errs = w.take_load_errors()
    w.clear()
    return seen, errs, meta


def test_bulk_layer_lands_before_the_forward_and_per_layer_fences_stay():
    gw = FakeGateway(capacity=1 << 22)
    reg = _registry()
    src = _store(gw, reg)
    dst = _caches(poison=POISON)
    hooks = {"l0": (True, "Attention"), "l1": (False, "DeepseekV32Attention"),
             "l2": (True, "Attention")}
    w = _worker(reg, gw, dst, hooks)
    assert w.hooks.bulk_layers(0) == ("l1",)
    s = _sched(reg, gw)
    ids = [9, 4, 17, 11, 2]
    req = Req("b", 5 * BS)
    assert s.get_num_new_matched_tokens(req, 0) == 4 * BS
    s.update_state_after_alloc(req, [ids], 4 * BS)
    w.bind(s.build_connector_meta(SO([New("b", ids, 4 * BS)], {"b": BS})))
    w.start_load_kv()
    # before the forward: the bulk layer landed, the per-layer ones are still in flight (their
    # fence is the hook: no extra wait for layers known to fire)
    assert w.handler.waits == ["l1"] and w.handler.pending_layers() == ["l0", "l2"]
    assert torch.equal(dst["l1"][ids[0]], src["l1"][3])
    assert (dst["l0"][ids[0]] == POISON).all()
    for name in ("l0", "l2"):
        w.wait_for_layer_load(name)
    w.wait_for_save()
    w.get_finished()
    assert not w.take_load_errors() and w.handler.fenced_all == 0
    for name in LAYERS:
        for i in range(4):
            assert torch.equal(dst[name][ids[i]], src[name][3 + i]), (name, i)


def test_start_line_names_the_class():
    reg = _registry()
    plan = HookPlan([p.group.layer_names for p in reg.groups], [],
                    {"l0": (True, "Attention"), "l1": (False, "KimiMLA"), "l2": (False, "KimiMLA")})
    (line,) = plan.start_lines()
    assert "2 layer(s) of class KimiMLA" in line and "l1" in line


def test_missed_fence_is_a_load_error_then_bulk():
    gw = FakeGateway(capacity=1 << 22)
    reg = _registry()
    src = _store(gw, reg)
    dst = _caches(poison=POISON)
    w = _worker(reg, gw, dst, {n: (True, "Attention") for n in LAYERS})
    s = _sched(reg, gw)
    with Warnings() as warned:
        ids = [9, 4, 17, 11, 2]
        seen, errs, _ = _restore_step(w, s, "b", ids, fire=("l0", "l2"))
        # l1 ran on unfinished pages: every restored block of the request is a load error
        assert (seen["l1"] == POISON).all()
        assert errs == set(ids[:4])
        assert w.handler.fenced_all == 1 and not w.handler.pending_layers()
        assert w.hooks.bulk_layers(0) == ("l1",)
        # next step: l1 lands before the forward, no error, no second warning
        s.request_finished(Req("b", 5 * BS))
        ids2 = [12, 13, 14, 15, 16]
        seen2, errs2, _ = _restore_step(w, s, "c", ids2, fire=("l0", "l2"))
        assert not errs2
        for name in LAYERS:
            assert torch.equal(seen2[name], src[name][3].reshape(-1)), name
    assert warned.count("did not call wait_for_layer_load") == 1
    assert warned.count("l1 (class Attention)") == 1


def test_missed_fence_aborts_that_requests_saves():
    gw = FakeGateway(capacity=1 << 22)
    reg = _registry()
    _store(gw, reg)
    w = _worker(reg, gw, _caches(poison=POISON), {n: (True, "Attention") for n in LAYERS})
    s = _sched(reg, gw)
    # a 7-block prompt: 4 blocks restored, the next chunk (blocks 4, 5) computed and saved
    n = 7 * BS
    req = Req("b", n)
    req.block_hashes = [bytes([7, i]) * 16 for i in range(4)] + [bytes([8, i]) * 16
                                                                  for i in range(4, 7)]
    assert s.get_num_new_matched_tokens(req, 0) == 4 * BS
    ids = [9, 4, 17, 11, 2, 18, 19]
    s.update_state_after_alloc(req, [ids], 4 * BS)
    meta = s.build_connector_meta(SO([New("b", ids, 4 * BS)], {"b": 3 * BS}))
    assert meta.loads and meta.saves
    w.bind(meta)
    w.start_load_kv()
    for name in LAYERS:
        if name != "l1":
            w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    w.wait_for_save()
    w.get_finished()
    assert w.take_load_errors() == set(ids[:4])
    saved = {c.key for j in meta.saves for gt in j.groups for c in gt.chunks}
    assert saved and not saved & gw.committed(1)
    assert any(m[0] == "abort" and set(m[3]) & saved for m in gw.messages)


def test_missed_fence_on_a_multi_group_model_stops_with_a_clear_error():
    gw = FakeGateway(capacity=1 << 22)
    reg = _registry(groups=2)
    w = WorkerSide(reg, ["fp0", "fp1"], namespace="default", tp_rank=0, gateway_factory=gw.client,
                   handler_factory=lambda device: StreamLikeHandler())
    kv = {**_caches(), "m0": _caches(seed=9)["l0"]}
    w.register_kv_caches(kv, num_blocks=NB, hooks={n: (True, "Attention") for n in kv})
    w.handler.queued["l1"] = []  # as after a load whose l1 fence never came
    w._check_fences = True

    class Job:
        req_id, job_id = "x", 1
        groups = (type("GT", (), {"group": 0, "block_ids": (3,)})(),)

        def block_ids(self):
            return {3}

    w._meta = type("M", (), {"loads": (Job(),), "saves": ()})()
    with pytest.raises(RuntimeError, match="several KV cache groups"):
        w.wait_for_save()
    assert w.handler.fenced_all == 1  # the copies are fenced before the error


@settings(max_examples=25, deadline=None)
@given(fires=st.lists(st.booleans(), min_size=3, max_size=3),
       called=st.lists(st.booleans(), min_size=3, max_size=3))
def test_never_an_unfenced_read_without_a_load_error(fires, called):
    """Whatever the class detection says and whatever hooks come: a layer that read poisoned
    pages is always covered by load errors for the request's restored blocks, a layer detected
    as bulk is never waited for per layer, and no layer known to fire is bulk-fenced."""
    gw = FakeGateway(capacity=1 << 22)
    reg = _registry()
    src = _store(gw, reg)
    hooks = {n: (f, "C") for n, f in zip(LAYERS, fires, strict=True)}
    w = _worker(reg, gw, _caches(poison=POISON), hooks)
    s = _sched(reg, gw)
    ids = [9, 4, 17, 11, 2]
    fire = tuple(n for n, c in zip(LAYERS, called, strict=True) if c)
    seen, errs, _ = _restore_step(w, s, "b", ids, fire=fire)
    bulk = {n for n, f in zip(LAYERS, fires, strict=True) if not f}
    stale = {n for n in LAYERS if not torch.equal(seen[n], src[n][3].reshape(-1))}
    assert not stale & bulk
    assert stale == {n for n in LAYERS if n not in bulk and n not in fire}
    assert errs == (set(ids[:4]) if stale else set())
    assert w.hooks.bulk == bulk | stale


class FakeRestorer:
    """A layer-wise fan-out restorer on CPU: a layer's pages land at its ``wait_layer`` (the
    all-gather and scatter), the rest at ``finish``."""

    def __init__(self):
        from xkv.fanout import Mode

        self.mode, self.device = Mode.LAYERWISE, torch.device("cpu")
        self.queued: dict[str, list] = {}

    def begin(self, src, loads):
        for ld in loads:
            self.queued.setdefault(ld.layer, []).append((src, ld))
        return True

    def wait_layer(self, layer):
        for src, ld in self.queued.pop(layer, ()):
            kernels.restore(src, ld.src_offsets, ld.dst, ld.block_ids)

    def finish(self):
        for layer in list(self.queued):
            self.wait_layer(layer)

    def close(self):
        pass


def test_missed_fanout_fence_is_a_load_error():
    """MLA restored by a layer-wise fan-out: a layer whose wait_for_layer_load never comes was
    read before its exchange, so the request's restored blocks are load errors (warned once);
    every page is exchanged before anything later runs."""
    gw = FakeGateway(capacity=1 << 23)
    bb = 576 * 2 * BS
    reg = build_registry([CacheGroup(0, "mla", LAYERS, BS, bb)], tp_size=1, pp_size=1,
                         chunk_size=BS * K)

    def mla_caches(poison=None, seed=0):
        out = {}
        for li, name in enumerate(LAYERS):
            g = torch.Generator().manual_seed(10 * li + seed)
            t = torch.randint(0, 256, (NB, 1, BS, 576 * 2), dtype=torch.uint8, generator=g)
            out[name] = t.fill_(poison) if poison is not None else t
        return out

    src = mla_caches()
    w1 = _worker(reg, gw, src, {n: (True, "MLAAttention") for n in LAYERS})
    s1 = _sched(reg, gw)
    req = Req("a", 5 * BS)
    assert s1.get_num_new_matched_tokens(req, 0) == 0
    s1.update_state_after_alloc(req, [[3, 4, 5, 6, 7]], 0)
    w1.bind(s1.build_connector_meta(SO([New("a", [3, 4, 5, 6, 7], 0)], {"a": 5 * BS})))
    for name in LAYERS:
        w1.save_kv_layer(name)
    w1.wait_for_save()
    w1.clear()

    dst = mla_caches(poison=POISON)
    w = WorkerSide(reg, ["fp0"], namespace="default", tp_rank=0, gateway_factory=gw.client,
                   fanout_factory=lambda kv, dev: FakeRestorer(),
                   handler_factory=lambda device: StreamLikeHandler())
    w.register_kv_caches(dst, num_blocks=NB, hooks={n: (True, "MLAAttention") for n in LAYERS})
    s = _sched(reg, gw)
    with Warnings() as warned:
        ids = [9, 4, 17, 11, 2]
        seen, errs, _ = _restore_step(w, s, "b", ids, fire=("l0", "l2"))
        assert (seen["l1"] == POISON).all() and not (seen["l0"] == POISON).all()
        assert errs == set(ids[:4])
        for name in LAYERS:  # exchanged before get_finished returned
            for i in range(4):
                assert torch.equal(dst[name][ids[i]], src[name][3 + i]), (name, i)
    assert warned.count("l1 (class MLAAttention) did not call wait_for_layer_load") == 1
