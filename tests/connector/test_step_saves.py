"""``save_mode`` step (issue 24, point 4): ``save_kv_layer`` does nothing, ``wait_for_save`` saves
every layer of the step in one call per group, and the compute stream waits for those copies only
at the next step's bind.

A CUDA-like fake handler (:class:`StreamHandler`) models the two streams on the CPU: a save is
queued (on the "save stream") and applied only when its fence completes or when the "compute
stream" is ordered after it (``order_after_saves``, ``fence_saves``): what the GPU would run
before anything queued later on the compute stream. The fake gateway's COMMIT compares every
committed chunk's card bytes with the bytes the forward computed for it (``H.pattern`` of the
block's token prefix), not with the pages as they are at commit time, so a block reused and
rewritten before its copy ran shows up as torn.
"""

import threading
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from xkv import kernels
from xkv.connector import setup, transfer
from xkv.connector.config import ConfigError, ConnectorConfig
from xkv.connector.saves import Saver
from xkv.connector.transfer import SyncTransferHandler

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
import vllm_harness as H  # noqa: E402

CHUNK, BS = 64, 32


class Fence:
    """Completes when the test (or the handler's ordering) says so, then applies its copies."""

    def __init__(self, copies):
        self.copies = copies
        self._done = threading.Event()

    def complete(self):
        if self._done.is_set():
            return
        for kind, pools, ids, card, offs in self.copies:
            if kind == "group":
                transfer.save_all(pools, ids, card, offs, "auto")
            else:
                kernels.save(pools, ids, card, offs)
        self._done.set()

    def query(self):
        return self._done.is_set()

    def synchronize(self):
        assert self._done.wait(10), "fence never completed"


class StreamHandler(SyncTransferHandler):
    """Loads inline; saves queued until their fence completes or the compute stream is ordered
    after them (see the module docstring). ``calls``: every save-side call, in order.
    ``ordering=False``: a broken handler whose compute stream never waits (the negative
    control: the reuse test must catch it)."""

    def __init__(self, ordering=True):
        super().__init__()
        self.ordering = ordering
        self.queued, self.fences, self.calls = [], [], []
        self._unordered = []

    def prepare_saves(self, pools, block_ids, card, offsets, checks=None):
        self.calls.append("prepare_saves")
        return None

    def save_prepared(self, prep, layer, name, pool, block_ids, card, offsets):
        self.calls.append("save_prepared")
        self.queued.append(("layer", pool, block_ids.clone(), card, offsets.clone()))

    def save_group(self, names, pools, block_ids, card, offsets, checks=None):
        assert checks is None, "these tests' sessions have no checksum words"
        self.calls.append("save_group")
        self.queued.append(("group", list(pools), block_ids.clone(), card, offsets.clone()))

    def flush_saves(self):
        raise AssertionError("wait_for_save must not block on the save copies")

    def _fence(self):
        f = Fence(self.queued)
        self.queued = []
        self.fences.append(f)
        return f

    def fence_saves(self):
        self.calls.append("fence_saves")
        f = self._fence()
        f.complete()  # the compute stream waits for it: nothing later can overtake the copies
        return f

    def fence_saves_deferred(self):
        self.calls.append("fence_saves_deferred")
        f = self._fence()
        self._unordered.append(f)
        return f

    def order_after_saves(self):
        self.calls.append("order_after_saves")
        if self.ordering:
            for f in self._unordered:
                f.complete()
        self._unordered = []


def _prompt(n, base=10):
    return [(base + i) % 1000 + 4 for i in range(n)]


def _engine(llama_dir, mode, *, num_blocks=256, handler=StreamHandler, mla=False):
    bs = 16 if mla else BS
    vc = H.make_vllm_config(llama_dir, policy="recompute", block_size=bs,
                            extra={"chunk_size": CHUNK, "save_mode": mode,
                                   # the one-launch path (save_group); step saves with checksum
                                   # words: tests/connector/test_checksums.py
                                   "verify_checksums": False})
    layout = "LBNHC" if mla else "LBHNC"
    kcfg = H.attention_cache_config(block_size=bs, num_blocks=num_blocks, mla=mla)
    kcfg.kv_cache_layout = layout
    sched = H.make_scheduler(vc, kcfg)
    with mock.patch.object(setup, "make_handler", lambda device, verify=False: handler()):
        conn, caches = H.make_worker_caches(
            vc, H.attention_cache_config(block_size=bs, num_blocks=num_blocks, mla=mla),
            layout=layout)
    w = conn._worker
    assert w.saver.mode == mode
    return sched, conn, w, caches, bs


def _watch_commits(sched, w, caches, bs):
    """COMMIT checks each chunk's card bytes against the bytes the forward computed for it (the
    block's token prefix -> ``H.pattern``, as ``H.compute_layer`` writes them), noted at bind
    while the blocks still belong to the request. Returns (committed keys, torn blocks)."""
    expect = {}  # key -> [(block in chunk, token prefix of the block)]
    committed, torn = [], []
    client = w.session.client
    bind, commit = w.bind, client.commit

    def bind_rec(meta):
        for job in meta.saves:
            req = sched.requests[job.req_id]
            table = sched.kv_cache_manager.get_block_ids(job.req_id)[0]
            toks = list(req.all_token_ids)
            for gt in job.groups:
                for b, c, j in zip(gt.block_ids, gt.chunk_of, gt.block_in_chunk, strict=True):
                    pos = table.index(b)
                    expect.setdefault(gt.chunks[c].key, []).append((j, toks[:(pos + 1) * bs]))
        bind(meta)

    def commit_check(layout_id, shard, refs):
        card = torch.frombuffer(client.gw.card, dtype=torch.uint8)
        for ref in refs:
            for j, prefix in expect[ref.key]:
                for li, (name, kv) in enumerate(caches.items()):
                    nbytes = H.page(kv, 0).numel()
                    off = ref.offsets[shard] + (li * (CHUNK // bs) + j) * nbytes
                    if not torch.equal(card[off:off + nbytes], H.pattern(prefix, name, nbytes)):
                        torn.append((ref.key.hex()[:12], j, name))
        committed.extend(r.key for r in refs)
        return commit(layout_id, shard, refs)

    w.bind = bind_rec
    client.commit = commit_check
    return committed, torn


def _step(sched, conn, caches, bs, *, probe=None):
    """``H.step_with_worker``; with ``probe``, every save_kv_layer must leave ``probe()``
    unchanged (no handler call, no kernel launch)."""
    if probe is None:
        return H.step_with_worker(sched, conn, caches, bs)
    orig = conn.save_kv_layer

    def hooked(name, kv, attn, **kw):
        before = probe()
        orig(name, kv, attn, **kw)
        assert probe() == before, f"save_kv_layer({name}) did work in step mode"

    conn.save_kv_layer = hooked
    try:
        return H.step_with_worker(sched, conn, caches, bs)
    finally:
        conn.save_kv_layer = orig


class _Counts:
    """Counts every kernel entry point a save can take (patched on ``xkv.kernels``)."""

    NAMES = ("save", "save_layers", "prepare_save", "restore", "restore_layers",
             "prepare_restore")

    def __init__(self):
        self.n = dict.fromkeys(self.NAMES, 0)
        self._patches = []
        for name in self.NAMES:
            real = getattr(kernels, name)

            def counted(*a, _real=real, _name=name, **kw):
                self.n[_name] += 1
                return _real(*a, **kw)

            self._patches.append(mock.patch.object(kernels, name, counted))

    def __enter__(self):
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self._patches:
            p.stop()


@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
def test_step_mode_does_nothing_per_layer_and_saves_once_per_step(fake_gateway, llama_dir, mla):
    sched, conn, w, caches, bs = _engine(llama_dir, "step", mla=mla)
    committed, torn = _watch_commits(sched, w, caches, bs)
    h = w.handler
    sched.add_request(H.make_request("a", _prompt(300), block_size=bs, max_tokens=1))
    sched.add_request(H.make_request("b", _prompt(200, base=500), block_size=bs, max_tokens=1))
    with _Counts() as counts:
        _, _, out = _step(sched, conn, caches, bs, probe=lambda: (len(h.calls), dict(counts.n)))
        # one group: one save_group for every layer of both requests, one deferred fence; no
        # per-layer call at all
        assert h.calls == ["save_group", "fence_saves_deferred"]
        assert sum(counts.n.values()) == 0  # queued on the fake save stream, nothing ran yet
        (fence,) = h.fences
        assert not fence.query() and not committed and not any(fake_gateway.card)
        fence.complete()  # the "save stream" runs the step's copies: one save_layers call
        assert counts.n["save_layers"] == 1 and counts.n["save"] == 0
    assert w.drain_saves(10)
    assert len(committed) == 300 // CHUNK + 200 // CHUNK and not torn
    assert not any(m[0] == "abort" for m in fake_gateway.messages)
    st = out.kv_connector_stats.data  # counted when the step issued its copies
    page = H.page(next(iter(caches.values())), 0).numel()
    assert st["bytes_saved"] == len(committed) * (CHUNK // bs) * len(caches) * page


def test_layer_mode_still_saves_per_layer(fake_gateway, llama_dir):
    """The control of the test above: 'layer' copies as each save_kv_layer comes."""
    sched, conn, w, caches, bs = _engine(llama_dir, "layer")
    committed, torn = _watch_commits(sched, w, caches, bs)
    sched.add_request(H.make_request("a", _prompt(300), block_size=bs, max_tokens=1))
    _step(sched, conn, caches, bs)
    calls = w.handler.calls
    assert calls == ["prepare_saves"] + ["save_prepared"] * len(caches) + ["fence_saves"]
    assert w.drain_saves(10)
    assert len(committed) == 4 and not torn


def test_step_mode_saves_layers_whose_hook_never_came(fake_gateway, llama_dir):
    """CUDA-graph replays and hook-less attention classes call no save_kv_layer: step mode
    saves every layer anyway, and commits (layer mode saves them in bulk, warning)."""
    sched, conn, w, caches, bs = _engine(llama_dir, "step")
    committed, torn = _watch_commits(sched, w, caches, bs)
    sched.add_request(H.make_request("a", _prompt(300), block_size=bs, max_tokens=1))
    H.step_with_worker(sched, conn, caches, bs, layers_saved=0)
    w.handler.fences[0].complete()
    assert w.drain_saves(10)
    assert len(committed) == 4 and not torn


def _preempt(sched, req_id):
    """What vLLM's schedule() does to a request it preempts (blocks freed at once, the request
    back in the waiting queue), then the request put behind every other waiting one."""
    import time

    req = sched.requests[req_id]
    sched.running.remove(req)
    sched._preempt_request(req, time.monotonic())
    sched.waiting.remove_request(req)
    return req


@pytest.mark.parametrize("how", ["finished", "aborted", "preempted"])
@pytest.mark.parametrize("mode,ordering,torn_expected", [
    ("step", True, False), ("layer", True, False),
    ("step", False, True),  # negative control: a compute stream that never waits tears chunks
], ids=["step", "layer", "step-unordered"])
def test_blocks_reused_next_step_are_saved_before_overwritten(fake_gateway, llama_dir, how,
                                                              mode, ordering, torn_expected):
    """A request's saves are still on the save stream when its blocks are freed (it finished,
    was aborted or preempted) and the next step gives them to another request, whose forward
    writes them: the committed chunks must hold the first request's bytes."""
    from vllm.v1.request import RequestStatus

    # 16 blocks of 32 tokens (block 0 is vLLM's null block): B's 13 blocks must take A's
    sched, conn, w, caches, bs = _engine(
        llama_dir, mode, num_blocks=16, handler=lambda: StreamHandler(ordering=ordering))
    committed, torn = _watch_commits(sched, w, caches, bs)
    a = H.make_request("a", _prompt(300), block_size=bs, max_tokens=1 if how == "finished" else 8)
    sched.add_request(a)
    H.step_with_worker(sched, conn, caches, bs)
    a_blocks = set(sched.kv_cache_manager.get_block_ids("a")[0]) if how != "finished" else None
    if how == "aborted":
        sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    elif how == "preempted":
        _preempt(sched, "a")
    b = H.make_request("b", _prompt(400, base=600), block_size=bs, max_tokens=1)
    sched.add_request(b)
    if how == "preempted":
        sched.waiting.add_request(a)  # behind B: B's allocation evicts A's cached blocks
    so, _, _ = H.step_with_worker(sched, conn, caches, bs)
    assert "b" in so.num_scheduled_tokens
    (new_b,) = [r for r in so.scheduled_new_reqs if r.req_id == "b"]
    reused = set(new_b.block_ids[0])
    if a_blocks is not None:
        assert reused & a_blocks, "the test must make B reuse A's blocks"
    for f in w.handler.fences:  # whatever was not ordered yet runs now, after B's forward
        f.complete()
    assert w.drain_saves(10)
    a_keys = 300 // CHUNK
    assert len(committed) >= a_keys
    assert bool(torn) == torn_expected, torn


def test_step_mode_turned_off_mid_step_aborts_and_copies_nothing(fake_gateway, llama_dir):
    sched, conn, w, caches, bs = _engine(llama_dir, "step")
    sched.add_request(H.make_request("a", _prompt(300), block_size=bs, max_tokens=1))
    so = sched.schedule()
    conn.bind_connector_metadata(so.kv_connector_metadata)
    conn.start_load_kv(None)
    work = H.step_work(sched, so, bs)
    for name, kv in caches.items():
        H.compute_layer(caches, name, work)
        conn.save_kv_layer(name, kv, None)
    w.turn_off("test: the gateway went away mid-step")
    conn.wait_for_save()
    assert "save_group" not in w.handler.calls
    for f in w.handler.fences:  # the (empty) save stream reaches the step's fence
        f.complete()
    assert w.drain_saves(10)
    assert not fake_gateway.committed(1)
    assert conn.get_kv_connector_stats().data["save_errors"] == 4


def test_step_mode_saves_owed_without_wait_for_save_at_the_next_bind(fake_gateway, llama_dir):
    """A step whose wait_for_save never came: its forward is over when the next step binds, so
    step mode saves it there (all layers) and commits it."""
    sched, conn, w, caches, bs = _engine(llama_dir, "step")
    committed, torn = _watch_commits(sched, w, caches, bs)
    orig = conn.wait_for_save
    conn.wait_for_save = lambda: None
    sched.add_request(H.make_request("a", _prompt(300), block_size=bs, max_tokens=3))
    H.step_with_worker(sched, conn, caches, bs)
    assert "save_group" not in w.handler.calls and w.saver.has_unflushed
    conn.wait_for_save = orig
    H.step_with_worker(sched, conn, caches, bs)
    # the owed save and its fence at the bind, before the forward (a decode step writing none
    # of its blocks: the compute stream need not wait)
    assert w.handler.calls[:2] == ["save_group", "fence_saves_deferred"]
    for f in w.handler.fences:
        f.complete()
    assert w.drain_saves(10)
    assert len(committed) == 4 and not torn


@pytest.mark.parametrize("mode", ["layer", "step"])
def test_inline_handler_saves_byte_exact_in_both_modes(fake_gateway, llama_dir, mode):
    """The real CPU handler (inline copies, ``transfer.save_all`` in step mode): the card holds
    the computed bytes of every committed chunk; both modes write the same card bytes."""
    sched, conn, w, caches, bs = _engine(llama_dir, mode, handler=SyncTransferHandler)
    committed, torn = _watch_commits(sched, w, caches, bs)
    fake_gateway.card[:] = b"\xa5" * len(fake_gateway.card)  # poisoned slots
    for i, n in enumerate((300, 200, 129)):
        sched.add_request(H.make_request(f"r{i}", _prompt(n, base=100 * i), block_size=bs,
                                         max_tokens=2))
    while sched.has_unfinished_requests():
        H.step_with_worker(sched, conn, caches, bs)
    assert w.drain_saves(10)
    assert len(committed) == 300 // CHUNK + 200 // CHUNK + 129 // CHUNK and not torn


# ------------------------------------------------------------------ which mode runs


def _registry(*groups):
    return SimpleNamespace(groups=[SimpleNamespace(is_state=s, group=SimpleNamespace(block_size=b))
                                   for s, b in groups])


def test_save_mode_falls_back_to_layer_where_step_is_unsafe():
    reg = _registry((False, 16))
    assert setup.save_mode("step", reg, zeroing=False, hash_block_size=16)[0] == "step"
    assert setup.save_mode("layer", reg, zeroing=False, hash_block_size=16)[0] == "layer"
    mode, line = setup.save_mode("step", _registry((False, 64), (True, 64)), zeroing=True,
                                 hash_block_size=64)
    assert mode == "layer" and "recurrent-state" in line and "zeroes new blocks" in line
    mode, line = setup.save_mode("step", reg, zeroing=True, hash_block_size=16)
    assert mode == "layer" and "zeroes new blocks" in line
    mode, line = setup.save_mode("step", _registry((False, 16), (False, 64)), zeroing=False,
                                 hash_block_size=16)
    assert mode == "layer" and "copy-on-write" in line and "[16, 64]" in line


def test_save_mode_config_and_saver_refusals():
    assert ConnectorConfig.from_extra({}, env={"PYTHONHASHSEED": "0"}).save_mode == "step"
    cfg = ConnectorConfig.from_extra({"save_mode": "layer"}, env={"PYTHONHASHSEED": "0"})
    assert cfg.save_mode == "layer"
    with pytest.raises(ConfigError, match=r"save_mode='steps': expected one of 'step', 'layer'"):
        ConnectorConfig.from_extra({"save_mode": "steps"}, env={"PYTHONHASHSEED": "0"})
    with pytest.raises(ConfigError, match="save_mode"):
        ConnectorConfig.from_extra({"save_mode": 1}, env={"PYTHONHASHSEED": "0"})
    kw = dict(pools={}, layer_pos={}, on_bulk_saves=lambda names: None)
    with pytest.raises(ValueError, match="recurrent-state"):
        Saver(_registry((True, 16)), 0, None, None, None, mode="step", **kw)
    with pytest.raises(ValueError, match="'bulk'"):
        Saver(_registry((False, 16)), 0, None, None, None, mode="bulk", **kw)


def test_engine_start_line_names_the_mode(fake_gateway, llama_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        _engine(llama_dir, "step")
    assert "XKV: stores: save_mode 'step' (one launch per group after the forward)" in caplog.text


def test_hybrid_model_asking_for_step_runs_layer(fake_gateway, llama_dir, caplog):
    """A Mamba hybrid (attention + state group over one buffer, as this vLLM allocates it):
    'step' would let the next step's zeroing and state writes overtake the copies; 'layer' runs,
    and the start-up line says why."""
    import logging

    nb, bs = 8, 16
    kvc, caches, _, page, state = H.make_hybrid(bs, nb)
    vc = H.make_vllm_config(llama_dir, block_size=bs,
                            extra={"chunk_size": bs, "save_mode": "step"})
    with caplog.at_level(logging.INFO):
        conn = H.make_worker(vc, kvc, H.Caches(caches, {}, {}, page, state))
    assert conn._worker.saver.mode == "layer"
    assert "save_mode 'step' requested, 'layer' used: recurrent-state groups" in caplog.text
    conn.shutdown()


def test_compute_stream_waits_only_for_steps_that_write_a_block_being_copied(fake_gateway,
                                                                              llama_dir):
    """Decode steps of the request whose chunks are still being copied write none of those
    blocks: no wait, the copies overlap them. A step that hands one of those blocks to another
    request (its loads or its forward write it) waits first. Unknown written blocks: waits."""
    from vllm.v1.request import RequestStatus

    from xkv.connector.metadata import StepMetadata

    sched, conn, w, caches, bs = _engine(llama_dir, "step", num_blocks=16)
    committed, torn = _watch_commits(sched, w, caches, bs)
    h = w.handler
    sched.add_request(H.make_request("a", _prompt(300), block_size=bs, max_tokens=8))
    H.step_with_worker(sched, conn, caches, bs)  # prefill: 4 chunks saved, fence pending
    (fence,) = h.fences
    for _ in range(3):  # decode steps: no wait, the copy still "runs"
        so, meta, _ = H.step_with_worker(sched, conn, caches, bs)
        assert meta.written_blocks is not None
        assert "order_after_saves" not in h.calls and not fence.query()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    sched.add_request(H.make_request("b", _prompt(400, base=600), block_size=bs, max_tokens=1))
    H.step_with_worker(sched, conn, caches, bs)  # B gets A's blocks: ordered before its forward
    assert h.calls.count("order_after_saves") == 1 and fence.query()
    for f in h.fences:  # the GPU finishes B's own (deferred) copies too
        f.complete()
    assert w.drain_saves(10)
    assert len(committed) >= 4 and not torn
    # a step whose written blocks are not known (older metadata): always waits
    sched.add_request(H.make_request("c", _prompt(300, base=77), block_size=bs, max_tokens=1))
    H.step_with_worker(sched, conn, caches, bs)
    n = h.calls.count("order_after_saves")
    conn.bind_connector_metadata(type(sched.schedule().kv_connector_metadata)(StepMetadata()))
    assert h.calls.count("order_after_saves") == n + 1
    for f in h.fences:
        f.complete()
    assert w.drain_saves(10) and not torn
