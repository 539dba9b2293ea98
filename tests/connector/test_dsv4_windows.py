"""The whole DeepSeek-V4 cache (compressed MLA + SWA + compressor-state groups, four block sizes)
against this vLLM's own ``Scheduler`` (its ``SlidingWindowManager`` and hybrid coordinator; no
forward) and FusIOnXConnector loaded by vLLM, with a fake gateway.

Specs as vLLM builds them (``vllm/models/deepseek_v4``, ``sparse_swa.py``): per layer a 64-token
SWA cache (``SlidingWindowMLASpec``, window 128), on C4/C128 layers the compressed latent (block
256) and a compressor-state cache (block 4, window 8 / block 8, window 128, fp32), on C4 layers
the indexer cache and its compressor's state cache; grouped by ``get_kv_cache_groups``,
allocated by ``allocate_kv_cache`` (``BLNHC``).

A simulated forward writes, for every block a step computes, ``pattern(prefix, layer)`` into
the block id vLLM's own block table has for it at that step. The oracle of a restore is that
pattern (what vLLM's prefix cache would hold for the block), never xkv's formulas: every block
vLLM gives a real id in the hit is byte-exact; the null block and every other byte stay poison.
The last test runs the same path for a head-sharded ``SlidingWindowSpec`` model (full attention
+ SWA layers, Gemma-3 / gpt-oss-like, under the hybrid allocator).
"""

from __future__ import annotations

import pytest
import torch
from connector_fakes import dsv4_specs_or_skip

pytestmark = pytest.mark.vllm
kvi = dsv4_specs_or_skip()

import vllm_harness as H  # noqa: E402

from xkv.connector.registry import build_registry  # noqa: E402
from xkv.layout import kinds  # noqa: E402

POISON = 0xA5
RATIOS = (1, 4, 128, 4, 128)  # layer 0 is SWA only (compress ratio 0 in the config)


def dsv4_specs() -> dict:
    M, W = kvi.MLAAttentionSpec, kvi.SlidingWindowMLASpec
    out = {}
    for i, r in enumerate(RATIOS):
        out[f"l{i}.swa"] = W(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.bfloat16,
                             sliding_window=128, alignment=512, model_version="deepseek_v4")
        if r == 1:
            continue
        out[f"l{i}.attn"] = M(block_size=256, num_kv_heads=1, head_size=512,
                              dtype=torch.bfloat16, tokens_per_state=r, alignment=512,
                              model_version="deepseek_v4")
        coff = 1 + (r == 4)
        out[f"l{i}.comp"] = W(block_size=4 if r == 4 else 8, num_kv_heads=1,
                              head_size=2 * coff * 512, dtype=torch.float32,
                              sliding_window=coff * r, alignment=512)
        if r == 4:
            out[f"l{i}.indexer"] = M(block_size=256, num_kv_heads=1, head_size=132,
                                     dtype=torch.uint8, tokens_per_state=4, alignment=512)
            out[f"l{i}.icomp"] = W(block_size=4, num_kv_heads=1, head_size=512,
                                   dtype=torch.float32, sliding_window=8, alignment=512)
    return out


def swa_specs() -> dict:
    """A head-sharded sliding-window model under the hybrid allocator (Gemma-3 / gpt-oss-like):
    full-attention and SWA layers alternating, fp32 K/V, block 16, window 40."""
    F, W = kvi.FullAttentionSpec, kvi.SlidingWindowSpec
    kw = dict(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return {f"l{i}.attn": (W(sliding_window=40, **kw) if i % 2 else F(**kw)) for i in range(4)}


MODELS = {"dsv4": (dsv4_specs, "BLNHC", 256), "swa": (swa_specs, "LBHNC", 16)}


def dsv4_kv_cache_config(vc, mem=96 << 20, model="dsv4"):
    try:
        from vllm.v1.core import kv_cache_planning as P
    except ImportError:
        from vllm.v1.core import kv_cache_utils as P
    specs, layout, _ = MODELS[model]
    vc.cache_config.kv_cache_layout = layout
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False  # DeepSeek-V4 runs with HMA
    groups = P.get_kv_cache_groups(vc, specs())
    kvc = P.get_kv_cache_config_from_groups(vc, groups, mem)
    kvc.kv_cache_layout = layout
    return kvc


def allocate(kvc):
    """vLLM's own allocation, every byte poisoned; (tensors, [uint8 views of the buffers])."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
    t = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[kvc.kv_cache_layout], sizes)
    bufs = {}
    for x in t.values():
        s = x.untyped_storage()
        bufs[s.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(s)
    for b in bufs.values():
        b.fill_(POISON)
    return t, list(bufs.values())


def page(t, b):
    """Block ``b``'s page of one layer as bytes (a view: writes go to the cache)."""
    return t[b].view(torch.uint8).reshape(-1)


class Engine:
    """A vLLM scheduler with FusIOnXConnector and a worker-role connector over a poisoned
    allocation; ``step`` runs one engine step with a simulated forward."""

    def __init__(self, llama_dir, *, chunk=256, budget=2048, model="dsv4"):
        self.vc = H.make_vllm_config(llama_dir, block_size=MODELS[model][2], policy="recompute",
                                     max_num_batched_tokens=budget,
                                     extra={"chunk_size": chunk, "lookup_timeout_ms": 1000})
        self.kvc = dsv4_kv_cache_config(self.vc, model=model)
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.structured_output import StructuredOutputManager

        register_all_kvcache_specs(self.vc)  # what the engine core does at start
        sched_bs, self.hash_bs = resolve_kv_cache_block_sizes(self.kvc, self.vc)
        self.vc.cache_config.num_gpu_blocks = self.kvc.num_blocks
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

        # the scheduler (and its connector) get what the engine core gives them: one spec per
        # group (the first layer's), the worker the full config
        self.skvc = generate_scheduler_kv_cache_config([self.kvc])
        self.s = H.Scheduler(vllm_config=self.vc, kv_cache_config=self.skvc,
                             structured_output_manager=StructuredOutputManager(self.vc),
                             block_size=sched_bs, hash_block_size=self.hash_bs, log_stats=True)
        self.tensors, self.bufs = allocate(self.kvc)
        self.w = H.make_worker(self.vc, self.kvc, H.Caches(self.tensors, {}, {}, 0, 0))
        self.layer_group = {n: (gi, g.kv_cache_spec.block_size)
                            for gi, g in enumerate(self.kvc.kv_cache_groups) for n in g.layer_names}
        self.written: dict[int, set[str]] = {}  # block id -> requests the forward wrote it for

    @property
    def registry(self):
        return self.s.connector._scheduler.registry

    def request(self, rid, tokens):
        return H.make_request(rid, tokens, block_size=self.hash_bs, max_tokens=2)

    def step(self, check_restore=None):
        so = self.s.schedule()
        meta = so.kv_connector_metadata
        self.w.bind_connector_metadata(meta)
        self.w.start_load_kv(None)
        if check_restore is not None:
            check_restore(so, meta.step)
        self._forward(so)
        self.w.wait_for_save()
        _, recv = self.w.get_finished(so.finished_req_ids)
        out = H.KVConnectorOutput(finished_recving=recv,
                                  invalid_block_ids=self.w.get_block_ids_with_load_errors(),
                                  kv_connector_worker_meta=self.w.build_connector_worker_meta())
        self.w.clear_connector_metadata()
        H.finish_step(self.s, so, out)
        return so, meta.step, out

    def _forward(self, so):
        for rid, n in so.num_scheduled_tokens.items():
            req = self.s.requests[rid]
            end = req.num_computed_tokens  # schedule() counted this step's tokens already
            toks = list(req.all_token_ids)
            ids = self.s.kv_cache_manager.get_block_ids(rid)
            for name, t in self.tensors.items():
                g, bs = self.layer_group[name]
                for b in range((end - n) // bs, -(-end // bs)):
                    assert ids[g][b] != 0, (rid, name, b)  # vLLM never computes into null
                    self.written.setdefault(ids[g][b], set()).add(rid)
                    pg = page(t, ids[g][b])
                    pg.copy_(H.pattern(toks[: min(end, (b + 1) * bs)], name, pg.numel()))

    def run(self, *reqs, max_steps=60):
        for r in reqs:
            self.s.add_request(r)
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def expect(self, name, tokens, b):
        """The oracle: the bytes of block index ``b`` of layer ``name`` for prefix ``tokens``."""
        _, bs = self.layer_group[name]
        return H.pattern(list(tokens[: (b + 1) * bs]), name, page(self.tensors[name], 0).numel())


def _prompt(n, base=10):
    return [(base + 7 * i) % 5000 + 4 for i in range(n)]


@pytest.fixture
def fake_gateway(monkeypatch):
    """A FakeGateway (256 MiB: a C128 compressor-state object alone is 1 MiB) that every
    FusIOnXConnector built in this test talks to."""
    from connector_fakes import FakeGateway

    import xkv.connector.setup as setup

    gw = FakeGateway(capacity=1 << 28)
    monkeypatch.setattr(setup, "gateway_factory", lambda cfg, timeout_s: gw.client)
    return gw


@pytest.fixture
def engines(llama_dir, fake_gateway):
    def make(**kw):
        return Engine(llama_dir, **kw)

    return make


def _check_restore(e: Engine, rid: str, tokens, hit: int):
    """A check for ``Engine.step``: right after ``start_load_kv``, before the forward."""
    seen = {}

    def check(so, meta):
        assert so.num_scheduled_tokens[rid] == len(tokens) - hit
        ids = e.s.kv_cache_manager.get_block_ids(rid)
        restored = {b for job in meta.loads for gt in job.groups for b in gt.block_ids}
        marks = [torch.zeros_like(b, dtype=torch.bool) for b in e.bufs]
        want = set()
        for name, t in e.tensors.items():
            g, bs = e.layer_group[name]
            for b in range(hit // bs):
                if ids[g][b] == 0:
                    continue  # outside the window: vLLM asked for nothing there
                want.add(ids[g][b])
                pg = page(t, ids[g][b])
                assert torch.equal(pg, e.expect(name, tokens, b)), (name, b)
                for m, buf in zip(marks, e.bufs, strict=True):
                    if pg.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                        m[pg.storage_offset():pg.storage_offset() + pg.numel()] = True
        assert restored == want  # every real block of the hit, and nothing else
        assert 0 not in restored
        for m, buf in zip(marks, e.bufs, strict=True):
            assert (buf[~m] == POISON).all()  # null block, padding, other blocks untouched
        seen["ok"] = True

    return check, seen


def test_dsv4_registers_every_group():
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    from xkv.connector import vllm_specs

    vc = VllmConfig(cache_config=CacheConfig(block_size=256), device_config=DeviceConfig("cpu"))
    groups = vllm_specs.cache_groups(dsv4_kv_cache_config(vc))
    got = sorted((g.kind, g.block_size, g.sliding_window, g.window_blocks, g.replicated)
                 for g in groups)
    assert (kinds.MLA_COMPRESSED, 256, 0, 0, False) in got
    assert (kinds.SLIDING_WINDOW, 64, 128, 2, True) in got  # SWA: 2 blocks of 64 end a window
    assert (kinds.SLIDING_WINDOW, 4, 8, 2, True) in got  # C4 compressor states
    assert (kinds.SLIDING_WINDOW, 8, 128, 16, True) in got  # C128 compressor states
    reg = build_registry(groups, tp_size=2, pp_size=1, chunk_size=512)
    for p in reg.groups:
        assert p.num_shards == 1 and p.writer_ranks == (0,) and p.reader_ranks == (0, 1)
        assert p.blocks_per_object == (p.group.window_blocks or 512 // p.group.block_size)
    assert reg.hit_granularity == 256


@pytest.mark.parametrize("model", ["dsv4", "glm5"])
def test_both_roles_agree_on_what_the_gateway_sees(model):
    """The scheduler role's config keeps one spec per group (its first layer's), the worker's
    every layer's: both must register the same layouts (fingerprint fields and slot sizes),
    or the scheduler would reserve slots the worker writes past. The content of every layer
    fits in the slot. Also GLM-5.x / DeepSeek-V3.2's latent + indexer group (layer-outermost)."""
    from test_dsv4_layout import _glm5_specs, _kv_cache_config, _vllm_config
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from xkv.connector import vllm_specs

    if model == "glm5":
        kvc = _kv_cache_config(_vllm_config("LBNHC", 64), _glm5_specs(), "LBNHC")
    else:
        vc = VllmConfig(cache_config=CacheConfig(block_size=256),
                        device_config=DeviceConfig("cpu"))
        kvc = dsv4_kv_cache_config(vc)
    worker = vllm_specs.cache_groups(kvc)
    sched = vllm_specs.cache_groups(generate_scheduler_kv_cache_config([kvc]))
    assert any(g.layer_bytes for g in worker) and not any(g.layer_bytes for g in sched)
    fields = ("index", "kind", "layer_names", "block_size", "block_bytes", "spec",
              "layer_pages", "sliding_window", "extra_retained", "replicated")
    for w, s in zip(worker, sched, strict=True):
        assert [getattr(w, f) for f in fields] == [getattr(s, f) for f in fields]
    rw = build_registry(worker, tp_size=1, pp_size=1, chunk_size=512, slot_alignment=4096)
    rs = build_registry(sched, tp_size=1, pp_size=1, chunk_size=512, slot_alignment=4096)
    for pw, ps in zip(rw.groups, rs.groups, strict=True):
        assert pw.registered_bytes == ps.registered_bytes >= pw.shard_bytes
        last = len(pw.group.layer_names) - 1
        end = pw.object_offset(last, pw.blocks_per_object - 1) + pw.group.bytes_of(last)
        assert end == pw.shard_bytes <= pw.registered_bytes


@pytest.mark.parametrize("chunk,budget", [(256, 2048), (512, 2048), (256, 300), (512, 700)])
def test_store_then_full_and_partial_hits_are_byte_exact(engines, fake_gateway, chunk, budget):
    """Store a 1500-token prompt (in one step, or chunked prefill whose steps split chunks),
    then on a fresh engine: the same prompt hits every chunk before its last token; a prompt
    sharing 3 chunks hits 3 chunks (its own continuation differs)."""
    n = 1500
    a = engines(chunk=chunk, budget=budget)
    a.run(a.request("a", _prompt(n)))
    assert a.s.connector._scheduler.registry.hit_granularity == 256

    b = engines(chunk=chunk, budget=2048)
    toks = _prompt(n)
    hit = (n - 1) // chunk * chunk
    check, seen = _check_restore(b, "b", toks, hit)
    b.s.add_request(b.request("b", toks))
    b.step(check)
    assert seen

    c = engines(chunk=chunk, budget=2048)
    shared = 3 * 256 // chunk * chunk
    toks2 = _prompt(shared) + _prompt(600, base=999)
    check, seen = _check_restore(c, "c", toks2, shared)
    c.s.add_request(c.request("c", toks2))
    c.step(check)
    assert seen


def test_two_requests_reusing_freed_window_blocks_store_exact_bytes(engines, fake_gateway):
    """Chunked prefill of two prompts at once: the SWA and compressor-state blocks each frees
    go to the other (and are overwritten by its forward); every stored window tail still
    restores byte-exact, for both prompts."""
    a = engines(chunk=256, budget=384)
    a.run(a.request("x", _prompt(1300, 11)), a.request("y", _prompt(1100, 23)))
    assert any(len(r) == 2 for r in a.written.values())  # a freed block was reused
    for rid, toks in (("x", _prompt(1300, 11)), ("y", _prompt(1100, 23))):
        b = engines(chunk=256, budget=2048)
        hit = (len(toks) - 1) // 256 * 256
        check, seen = _check_restore(b, rid, toks, hit)
        b.s.add_request(b.request(rid, toks))
        b.step(check)
        assert seen


def test_window_tails_freed_before_the_save_are_not_stored_and_end_the_hit(engines,
                                                                            fake_gateway):
    """A prompt served from vLLM's own prefix cache: its early chunks' window blocks are null
    (outside the window), so only the prefix groups' objects of those chunks are saved, never
    a window tail; a later prompt ending inside them gets no hit (the window object its last
    chunk needs is absent), the full prompt still gets its hit."""
    toks = _prompt(1500)
    a = engines(chunk=256, budget=2048)
    a.run(a.request("a", toks))
    fake_gateway.objects.clear()  # the card forgot everything; vLLM's prefix cache did not
    a.run(a.request("a2", toks))
    reg = a.registry
    windows = [g for g, p in enumerate(reg.groups) if p.is_window]
    prefix = [g for g, p in enumerate(reg.groups) if not p.at_boundary]
    lids = a.s.connector._scheduler.layout_ids
    keys = [bytes(h) for h in a.request("k", toks).block_hashes[63::64]]  # 256 / 4 hashes per chunk
    local = 1280  # vLLM's own hit: 1499 tokens rounded down to its 256-token hit alignment
    for g in prefix:
        assert fake_gateway.committed(lids[g]) >= set(keys[: local // 256])
    for g in windows:
        got = fake_gateway.committed(lids[g])
        assert not got & set(keys[: local // 256 - 1]), g  # tails that were null: not stored
        assert keys[local // 256 - 1] in got  # the hit's own tail was real: stored

    b = engines(chunk=256, budget=2048)
    short = toks[: 3 * 256 + 40]
    b.s.add_request(b.request("s", short))
    so, meta, _ = b.step()
    assert so.num_scheduled_tokens["s"] == len(short) and not meta.loads

    c = engines(chunk=256, budget=2048)
    check, seen = _check_restore(c, "f", toks, local)
    c.s.add_request(c.request("f", toks))
    c.step(check)
    assert seen


@pytest.mark.parametrize("budget", [2048, 50])
def test_head_sharded_sliding_window_model_stores_and_restores(engines, fake_gateway, budget):
    """The same path for ``SlidingWindowSpec`` (K/V heads, one shard per TP rank): full and
    partial hits byte-exact, also after chunked prefill splitting every chunk."""
    a = engines(chunk=64, budget=budget, model="swa")
    assert {p.group.kind for p in a.registry.groups} == {kinds.ATTENTION, kinds.SLIDING_WINDOW}
    (w,) = [p for p in a.registry.groups if p.is_window]
    assert (w.blocks_per_object, w.group.replicated) == (3, False)  # 39 tokens: 3 blocks of 16
    a.run(a.request("a", _prompt(300)))
    for rid, toks, hit in (("b", _prompt(300), 256), ("c", _prompt(128) + _prompt(90, 77), 128)):
        e = engines(chunk=64, budget=2048, model="swa")
        check, seen = _check_restore(e, rid, toks, hit)
        e.s.add_request(e.request(rid, toks))
        e.step(check)
        assert seen
