"""FusIOnXConnector driven through the V2 model runner's own connector wrapper of the installed
vLLM (``vllm.v1.worker.gpu.kv_connector``: ``get_kv_connector`` -> ``ActiveKVConnector``), in the
order V2's ``execute_model`` uses it, against a real xkv-gateway. Runs on every version of the
matrix (the V2 runner itself needs a GPU with Triton; its connector wrapper does not).

A real ``Scheduler`` that feeds the V2 runner (``use_v2_model_runner``: V2-shaped outputs)
schedules; each step is then run as V2 runs it:

* eager / PIECEWISE step: ``set_forward_context(attn_metadata)`` around ``pre_forward`` and the
  layers, each an attention op under vLLM's own ``maybe_transfer_kv_layer`` (and
  ``eager_break_during_capture``, outermost, as vLLM stacks them); ``finish_forward`` (0.32+);
  ``post_forward`` (with ``defer_finalize`` + ``finalize_step`` where V2 has them);
* full-CUDA-graph step: ``pre_forward`` outside any forward context, no per-layer hooks;
* ``no_forward`` (zero tokens) and ``set_disabled`` (warm-up).

A spy records every call V2 makes on the connector: the order must be the one xkv relies on
(``expected``), so a vLLM that reorders them fails here. Pages are checked byte-exact through
the raw buffer (poisoned destinations, ``vllm_harness.raw_page``).
"""

from __future__ import annotations

import inspect
import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
import vllm_harness as V
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import has_kv_transfer_group, kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.forward_context import set_forward_context

from xkv.connector import compat
from xkv.connector.config import ConfigError
from xkv_vllm_connector.fusionx_connector import FusIOnXConnector

v2 = pytest.importorskip("vllm.v1.worker.gpu.kv_connector")
pytestmark = pytest.mark.vllm

BS, CHUNK = 32, 64
P = [(10 + 7 * i) % 1000 + 4 for i in range(300)]  # 4 whole chunks + a partial one
LAYERS = V.ATTN_LAYERS
# The connector methods xkv implements, in the order it relies on within one step.
XKV = ("register_kv_caches", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
       "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
       "get_kv_connector_stats", "build_connector_worker_meta", "clear_connector_metadata")
OTHERS = ("set_host_xfer_buffer_ops", "handle_preemptions", "get_kv_connector_kv_cache_events",
          "finish_forward")
END = ("get_finished", "get_block_ids_with_load_errors", "get_kv_connector_stats",
       "build_connector_worker_meta")
# V2's wrapper, by signature (never by version): 0.33 hands start_load_kv the input batch's
# fields; 26-29 skip wait_for_save on no-forward steps; 0.33 can defer the end of a step.
PRE_TAKES_BATCH = "input_batch" in inspect.signature(v2.ActiveKVConnector.pre_forward).parameters
POST = inspect.signature(v2.ActiveKVConnector.post_forward).parameters
NO_FORWARD_SAVES = "wait_for_save" not in POST
CAN_DEFER = "defer_finalize" in POST
_ns = itertools.count()
_V2: set[int] = set()  # ids of the VllmConfigs whose engine runs the V2 model runner


@pytest.fixture(autouse=True)
def v2_configs(monkeypatch):
    """Configs in ``_V2`` select the V2 runner (set after construction: VllmConfig's own V2
    check needs Triton, which this CPU machine lacks)."""
    orig = VllmConfig.use_v2_model_runner
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner",
                        property(lambda self: id(self) in _V2 or orig.fget(self)))
    yield
    _V2.clear()


class Spy:
    """Records the calls made on a connector instance (layer hooks with their layer)."""

    def __init__(self, conn):
        self.calls: list[str] = []
        self.load_kwargs: list[dict] = []
        for name in XKV + OTHERS:
            if hasattr(conn, name):
                setattr(conn, name, self._wrap(name, getattr(conn, name)))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            layer = name in ("wait_for_layer_load", "save_kv_layer")
            self.calls.append(f"{name}:{args[0]}" if layer else name)
            if name == "start_load_kv":
                self.load_kwargs.append(kwargs)
            return fn(*args, **kwargs)
        return call

    def take(self) -> list[str]:
        """The calls since the last take, restricted to those xkv implements."""
        calls, self.calls = self.calls, []
        return [c for c in calls if c.split(":")[0] in XKV]


def expected(so, *, hooks=True, forward=True, defer=False) -> list[str]:
    """What xkv relies on: bind, then start_load_kv before any layer whenever the step loads
    (29+ starts it after the forward only for steps without sync loads), each layer's wait
    before its save, wait_for_save after the last save, then end-of-step reads, clear last."""
    late = compat.features()["sync_load_flag"] and not so.has_sync_kv_loads
    assert not (late and so.kv_connector_metadata.step.loads), "a load step without sync loads"
    seq = ["bind_connector_metadata"] + ([] if late else ["start_load_kv"])
    if hooks:
        seq += [f"{h}:{n}" for n in LAYERS for h in ("wait_for_layer_load", "save_kv_layer")]
    seq += ["start_load_kv"] if late else []
    save = [] if defer or (not forward and not NO_FORWARD_SAVES) else ["wait_for_save"]
    return seq + save + list(END) + ([] if defer else ["clear_connector_metadata"])


class Engine:
    """A scheduler + a worker connector inside V2's wrapper, over vLLM's own CPU allocation
    (poisoned) of a two-layer attention cache."""

    def __init__(self, llama_dir, port, ns, policy=None, num_blocks=64, load_mode="sync",
                 save_mode="layer"):
        kvc = V.make_kv_cache_config("attention", block_size=BS, num_blocks=num_blocks)
        self.caches = V.allocate(kvc, "attention", layout=V.layout_name("HND"))
        self.vc = V.make_vllm_config(llama_dir, block_size=BS, policy=policy, extra={
            "xkv_gateway_port": port, "chunk_size": CHUNK, "key_namespace": ns,
            "load_mode": load_mode, "save_mode": save_mode})
        _V2.add(id(self.vc))
        self.sched = V.make_scheduler(self.vc, kvc)
        self.conn = FusIOnXConnector(self.vc, KVConnectorRole.WORKER, kvc)
        self.spy = Spy(self.conn)
        self._agent()
        self.akv = v2.get_kv_connector(self.vc, self.caches.tensors)
        assert isinstance(self.akv, v2.ActiveKVConnector)
        self.init_calls = list(self.spy.calls)
        self.spy.take()
        # what get_attention_context reads for each layer: the layer with its kv_cache
        for name, t in self.caches.tensors.items():
            self.vc.compilation_config.static_forward_context[name] = SimpleNamespace(kv_cache=t)

    def _agent(self):
        kv_transfer_state._KV_CONNECTOR_AGENT = self.conn  # vLLM's one per-process agent

    def step(self, *, graph=False, defer=False, check=True):
        """One engine step as V2's execute_model + sample_tokens run it; returns (scheduler
        output, KVConnectorOutput)."""
        self._agent()
        so = self.sched.schedule()
        assert so.total_num_scheduled_tokens > 0
        work = V.step_work(self.sched, so, BS)
        batch = SimpleNamespace(idx_mapping=torch.arange(len(so.num_scheduled_tokens)),
                                req_ids=list(so.num_scheduled_tokens),
                                num_tokens=so.total_num_scheduled_tokens)
        pre = (so, batch) if PRE_TAKES_BATCH else (so,)
        meta = {n: SimpleNamespace(layer=n) for n in LAYERS}  # per-layer attention metadata
        if graph == "v1":  # V1's FULL step: start_load_kv inside a FULL forward context
            from vllm.config import CUDAGraphMode

            with set_forward_context(meta, self.vc, slot_mapping={},
                                     cudagraph_runtime_mode=CUDAGraphMode.FULL):
                self.akv.pre_forward(*pre)
                for name in LAYERS:  # the replay runs no hook
                    V.compute_layer(self.caches, name, work)
        elif graph:  # FULL: pre_forward outside the forward context, the graph replays the layers
            self.akv.pre_forward(*pre, **({"attn_metadata": meta} if PRE_TAKES_BATCH else {}))
            for name in LAYERS:
                V.compute_layer(self.caches, name, work)
        else:
            with set_forward_context(meta, self.vc, slot_mapping={}):
                self.akv.pre_forward(*pre)
                for name in LAYERS:
                    attention_op()(name, self.caches, work)
        if hasattr(self.akv, "finish_forward"):
            self.akv.finish_forward()
        out = self.akv.post_forward(so.finished_req_ids, **({"defer_finalize": True} if defer else {}))
        if check:
            assert self.spy.take() == expected(so, hooks=not graph, defer=defer)
        if defer:
            self.akv.finalize_step()  # after the drafter ran
            assert self.spy.take() == ["wait_for_save", "clear_connector_metadata"]
        V.finish_step(self.sched, so, out)
        return so, out

    def idle(self):
        """A step that schedules no token: V2 runs ``no_forward``; returns (scheduler output,
        KVConnectorOutput or None)."""
        self._agent()
        so = self.sched.schedule()
        assert so.total_num_scheduled_tokens == 0
        out = self.akv.no_forward(so).kv_connector_output
        assert self.spy.take() == expected(so, hooks=False, forward=False)
        V.finish_step(self.sched, so, out)
        return so, out

    def run(self, req_id, prompt, **kw) -> dict:
        """Run a request to its end; returns the summed connector stats."""
        self.sched.add_request(V.make_request(req_id, prompt, block_size=BS, max_tokens=2))
        total: dict = {}
        for _ in range(8):
            if not self.sched.requests:
                break
            _, out = self.step(**kw)
            assert not out.invalid_block_ids
            for k, v in (out.kv_connector_stats.data if out.kv_connector_stats else {}).items():
                total[k] = total.get(k, 0) + v
        assert not self.sched.requests, "request did not finish"
        return total

    def assert_restored(self, req_id, prompt, n_tokens):
        ids = self.sched.kv_cache_manager.get_block_ids(req_id)[0]
        for name in LAYERS:
            for i in range(n_tokens // BS):
                want = V.pattern(prompt[: (i + 1) * BS], name, self.caches.page_bytes)
                assert V.raw_page(self.caches, name, ids[i]).equal(want), (name, i)

    def close(self):
        if self.sched is not None:
            self.conn.shutdown()
            self.sched.shutdown()
            self.sched = None
        kv_transfer_state._KV_CONNECTOR_AGENT = None


_OP = None


def attention_op():
    """An attention layer's op as vLLM declares it: ``eager_break_during_capture`` outermost,
    then ``maybe_transfer_kv_layer`` (wait for the layer's load on entry, save it on exit); the
    body 'computes' the step's blocks (``vllm_harness.compute_layer``)."""
    global _OP
    if _OP is None:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

        @eager_break_during_capture
        @maybe_transfer_kv_layer
        def attention(layer_name, caches, work):
            V.compute_layer(caches, layer_name, work)

        _OP = attention
    return _OP


@pytest.fixture
def engines(llama_dir, gateway_port):
    made = []

    def make(ns, **kw):
        e = Engine(llama_dir, gateway_port, ns, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_v2_wrapper_detected_and_required(llama_dir, monkeypatch):
    vc = V.make_vllm_config(llama_dir, block_size=BS)
    assert not compat.model_runner_v2(vc)
    _V2.add(id(vc))
    assert compat.model_runner_v2(vc)
    assert compat.v2_connector_wrapper() is v2.ActiveKVConnector
    compat.require_supported(vc)  # V2 with its connector wrapper: accepted
    # xkv places nothing in handle_preemptions, whose place differs between V1 and V2
    assert FusIOnXConnector.handle_preemptions is KVConnectorBase_V1.handle_preemptions
    monkeypatch.delattr(v2, "ActiveKVConnector")  # a vLLM whose V2 runner drives no connector
    assert compat.v2_connector_wrapper() is None
    with pytest.raises(ConfigError, match="ActiveKVConnector.*VLLM_USE_V2_MODEL_RUNNER=0"):
        compat.require_supported(vc)


@pytest.mark.parametrize("save_mode", ["layer", "step"], ids=["save-layer", "save-step"])
@pytest.mark.parametrize("defer", [False, True], ids=["step", "deferred-finalize"])
def test_store_then_restore_through_v2_wrapper(engines, defer, save_mode, caplog, monkeypatch):
    if defer and not CAN_DEFER:
        pytest.skip("this vLLM's V2 wrapper has no defer_finalize")
    ns = f"v2-{defer}-{save_mode}-{next(_ns)}"
    caplog.set_level("INFO", logger="xkv")
    monkeypatch.setattr(logging.getLogger("xkv"), "propagate", True)
    a = engines(ns, save_mode=save_mode)
    assert a.conn._worker.saver.mode == save_mode
    assert a.init_calls == ["register_kv_caches", "set_host_xfer_buffer_ops"]  # before any step
    assert "XKV: vLLM model runner V2" in caplog.text
    stats = a.run("a", P, defer=defer)
    assert stats.get("chunks_saved") == 4 and not stats.get("save_errors")
    a.close()

    b = engines(ns)  # empty local cache, poisoned tensors: the connector is the only source
    b.sched.add_request(V.make_request("b", P, block_size=BS, max_tokens=2))
    so, out = b.step(defer=defer)
    assert so.num_scheduled_tokens == {"b": 300 - 256}
    assert not out.invalid_block_ids
    assert out.kv_connector_stats.data["blocks_restored"] == 256 // BS
    if PRE_TAKES_BATCH:  # 0.33: the input batch's fields reach start_load_kv
        assert set(b.spy.load_kwargs[-1]) == {"scheduler_output", "request_state_indices",
                                              "request_ids", "num_tokens"}
    b.assert_restored("b", P, 256)


def _spy_fences(engine, monkeypatch) -> list:
    """The layers the worker fences (``wait_for_layer_load``), in call order."""
    fenced = []
    orig = engine.conn._worker.wait_for_layer_load
    monkeypatch.setattr(engine.conn._worker, "wait_for_layer_load",
                        lambda name: (fenced.append(name), orig(name)))
    return fenced


@pytest.mark.parametrize("graph", [True, "v1"])
@pytest.mark.parametrize("save_mode", ["layer", "step"])
def test_full_graph_step_fences_every_layer_and_saves_after_the_forward(engines, monkeypatch,
                                                                        save_mode, graph):
    """A FULL-CUDA-graph step (``full_cuda_graphs``, or a user's ``cudagraph_mode``): no layer
    hook runs, so start_load_kv fences every layer itself (V2: no forward context at
    pre_forward; ``"v1"``: inside a forward context whose ``cudagraph_runtime_mode`` is FULL),
    and the pages the graph wrote are saved in wait_for_save, after the forward (issue 18: a
    layer whose save_kv_layer did not come is saved in bulk, not aborted); a fresh engine
    restores them."""
    ns = f"v2-full-{save_mode}-{graph}-{next(_ns)}"
    a = engines(ns, save_mode=save_mode)
    a.run("a", P)
    a.close()
    prompt = P + [(3 + 11 * i) % 1000 + 4 for i in range(100)]  # 400 tokens, 6 whole chunks
    c = engines(ns, save_mode=save_mode)
    fenced = _spy_fences(c, monkeypatch)
    c.sched.add_request(V.make_request("c", prompt, block_size=BS, max_tokens=2))
    so, out = c.step(graph=graph)
    assert so.num_scheduled_tokens == {"c": 400 - 256}
    assert fenced == LAYERS  # inside start_load_kv, before the graph read a page
    if PRE_TAKES_BATCH and graph is True:
        assert "attn_metadata" in c.spy.load_kwargs[-1]
    c.assert_restored("c", prompt, 256)
    st = out.kv_connector_stats.data
    assert st["chunks_saved"] == 2 and not st.get("save_errors")  # chunks 4 and 5 committed
    c.close()
    d = engines(ns)
    d.sched.add_request(V.make_request("d", prompt, block_size=BS, max_tokens=2))
    so, out = d.step()
    assert so.num_scheduled_tokens == {"d": 400 - 384} and not out.invalid_block_ids
    d.assert_restored("d", prompt, 384)  # the graph step's chunks, byte-exact


def test_load_error_reported_through_v2_wrapper(engines):
    ns = f"v2-err-{next(_ns)}"
    a = engines(ns)
    a.run("a", P)
    a.close()
    e = engines(ns, policy="recompute")
    e.conn._worker.session.epoch = 12345  # the worker mapped another gateway process's card
    e.sched.add_request(V.make_request("e", P, block_size=BS, max_tokens=2))
    so, out = e.step()
    meta = so.kv_connector_metadata.step
    assert out.invalid_block_ids == set(meta.loads[0].groups[0].block_ids)
    assert e.sched.requests["e"].num_computed_tokens == 0  # rewound: vLLM recomputes


def test_preempted_request_resumes_through_v2(engines):
    """V2's scheduler hands a preempted request back as a new one (its whole new block table,
    not a resumed entry): its restore lands in its new blocks, byte-exact. 19 usable blocks:
    "a" (10) and "b" (9) fill them, "b"'s 10th block (token 288) preempts "b"; once "a" finished
    the local prefix cache is reset, so "b"'s prefix can only come back from the gateway."""
    from vllm.v1.request import RequestStatus

    e = engines(f"v2-preempt-{next(_ns)}", num_blocks=20)
    pb = [(5 + 13 * i) % 1000 + 4 for i in range(280)]
    e.sched.add_request(V.make_request("a", P, block_size=BS, max_tokens=12))
    e.sched.add_request(V.make_request("b", pb, block_size=BS, max_tokens=12))
    preempted = resumed = False
    for _ in range(80):
        if not e.sched.requests:
            break
        if preempted and "a" not in e.sched.requests and not resumed:
            assert e.sched.reset_prefix_cache()  # nothing runs now: every block is free
        so, out = e.step()
        assert not out.invalid_block_ids
        if preempted and not resumed and "b" in so.num_scheduled_tokens:
            resumed = True
            assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]  # V2: resumed as new
            assert "b" not in so.scheduled_cached_reqs.req_ids
            assert so.scheduled_new_reqs[0].num_computed_tokens == 256  # all from the gateway
            assert out.kv_connector_stats.data["blocks_restored"] == 256 // BS
            e.assert_restored("b", pb, 256)
        b = e.sched.requests.get("b")
        preempted |= b is not None and b.status == RequestStatus.PREEMPTED
    assert preempted and resumed and not e.sched.requests


def test_async_restore_through_v2_no_forward(engines):
    """``load_mode: async``: the parked request's step schedules no token, so V2 runs
    ``no_forward`` (29+: its start_load_kv after the empty forward); the restore is reported in
    ``finished_recving`` and the next step computes only the rest, on byte-exact pages."""
    ns = f"v2-async-{next(_ns)}"
    a = engines(ns)
    a.run("a", P)
    a.close()
    b = engines(ns, load_mode="async")
    b.sched.add_request(V.make_request("b", P, block_size=BS, max_tokens=2))
    so, out = b.idle()
    assert len(so.kv_connector_metadata.step.async_loads) == 1
    assert out.finished_recving == {"b"} and not out.invalid_block_ids
    b.assert_restored("b", P, 256)
    so, out = b.step()
    assert so.num_scheduled_tokens == {"b": 300 - 256} and not out.invalid_block_ids
    b.assert_restored("b", P, 256)  # the forward left the restored blocks alone


def test_no_forward_and_disabled_warmup(engines):
    e = engines(f"v2-idle-{next(_ns)}")
    so, _ = e.idle()  # nothing to run: V2 calls no_forward
    # warm-up / dummy runs: V2 disables the connector; no hook may reach it
    e.akv.set_disabled(True)
    assert not has_kv_transfer_group()
    e.akv.pre_forward(*((so, None) if PRE_TAKES_BATCH else (so,)))
    with set_forward_context({n: SimpleNamespace() for n in LAYERS}, e.vc, slot_mapping={}):
        for name in LAYERS:
            attention_op()(name, e.caches, [])
    e.akv.post_forward(set())
    e.akv.no_forward(so)
    assert e.spy.calls == []
    e.akv.set_disabled(False)
    assert kv_transfer_state.get_kv_transfer_group() is e.conn
    e.run("x", P[:100])  # and it serves again



@pytest.mark.parametrize("graph", [True, "v1"])
def test_full_graph_step_whose_graphs_wait_per_layer_is_not_fenced(engines, monkeypatch, graph):
    """``graph_waits``: where the captured full graphs wait for every loaded layer themselves
    (the handler says so; on CPU it is told), start_load_kv fences no layer, the worker's
    missed-fence check raises no load error, and the restored pages are the stored ones (the
    CPU copies ran inline)."""
    ns = f"v2-graph-waits-{graph}-{next(_ns)}"
    a = engines(ns)
    a.run("a", P)
    a.close()
    c = engines(ns)
    h = c.conn._worker.handler
    monkeypatch.setattr(h, "graph_waited", lambda: (h.fence_loads(), True)[1])
    fenced = _spy_fences(c, monkeypatch)
    c.sched.add_request(V.make_request("c", P, block_size=BS, max_tokens=2))
    so, out = c.step(graph=graph)
    assert so.num_scheduled_tokens == {"c": 300 - 256}
    assert fenced == [] and not out.invalid_block_ids
    assert out.kv_connector_stats.data["blocks_restored"] == 256 // BS
    c.assert_restored("c", P, 256)


def test_a_full_graph_capture_runs_vllms_layer_hook_into_the_graph_waits(engines, monkeypatch):
    """vLLM's own decorator chain (``eager_break_during_capture``, ``maybe_transfer_kv_layer``)
    while a full graph is captured (simulated on CPU: the stream 'captures', no step metadata
    is bound, a FULL forward context): with graph waits each layer's hook reaches the handler's
    ``capture_wait`` and nothing is saved; without them vLLM runs no hook (no metadata)."""
    from vllm.config import CUDAGraphMode

    c = engines(f"v2-capture-{next(_ns)}")
    w = c.conn._worker
    captured, saved = [], []
    monkeypatch.setattr(w.handler, "capture_wait", captured.append)
    monkeypatch.setattr(w, "save_kv_layer", saved.append)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    meta = {n: SimpleNamespace(layer=n) for n in LAYERS}

    def capture():
        c._agent()
        with set_forward_context(meta, c.vc, slot_mapping={},
                                 cudagraph_runtime_mode=CUDAGraphMode.FULL):
            for name in LAYERS:
                attention_op()(name, c.caches, [])

    monkeypatch.setattr(w, "graph_waits", True)
    capture()
    assert captured == list(LAYERS) and saved == []
    monkeypatch.setattr(w, "graph_waits", False)
    c.spy.take()
    capture()
    assert captured == list(LAYERS) and saved == []
    assert not [x for x in c.spy.take() if x.startswith(("wait_for_layer_load", "save_kv_layer"))]
