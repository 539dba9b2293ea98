"""FusIOnXConnector on the installed vLLM: a real ``Scheduler`` and the worker side on the
tensors this version's own allocation code produces (CPU), against a real xkv-gateway.

Engine A stores a 300-token prompt (chunks of 64 tokens), engine B (fresh scheduler, fresh
poisoned tensors) restores it: 256 tokens promised by the scheduler, and every restored page
equals the bytes A computed for the same token prefix, read back through the raw buffer (not
through the page mover being tested). Runs unchanged on 0.26, 0.28, 0.29 and 0.33.
"""

from __future__ import annotations

import itertools

import pytest
import vllm_harness as V

from xkv.connector import compat, vllm_specs
from xkv.connector.config import ConfigError

pytestmark = pytest.mark.vllm

P = [(10 + 7 * i) % 1000 + 4 for i in range(300)]  # 4 full chunks of 64 + a partial one
CASES = [("attention", "NHD", 32), ("attention", "HND", 32), ("mla", None, 16)]
_ns = itertools.count()


def engine(kind, layout, bs, llama_dir, port, namespace):
    kvc = V.make_kv_cache_config(kind, block_size=bs, num_blocks=64)
    # Allocate first: on 26/28 it sets the layout the way a backend does in a real worker.
    caches = V.allocate(kvc, kind, layout=V.layout_name(layout) if layout else None)
    vc = V.make_vllm_config(llama_dir, block_size=bs, extra={
        "xkv_gateway_port": port, "chunk_size": 64, "key_namespace": namespace})
    sched = V.make_scheduler(vc, kvc)
    worker = V.make_worker(vc, kvc, caches)
    return sched, worker, caches


def run_to_end(sched, worker, caches, bs, max_steps=8):
    outs = []
    for _ in range(max_steps):
        if not sched.requests:
            break
        so, _, out = V.step_with_worker(sched, worker, caches, bs)
        outs.append((so, out))
    assert not sched.requests, "request did not finish"
    return outs


@pytest.mark.parametrize("kind,layout,bs", CASES, ids=["attn-NHD", "attn-HND", "mla"])
def test_store_then_restore_in_fresh_engine(kind, layout, bs, llama_dir, gateway_port):
    ns = f"compat-{kind}-{layout}-{next(_ns)}"
    sched, worker, caches = engine(kind, layout, bs, llama_dir, gateway_port, ns)
    t = caches.tensors[V.ATTN_LAYERS[0]]
    # The form this vLLM registers: MLA is 3-D before the generic views, 4-D [B, 1, N, C] after.
    if kind == "mla":
        assert t.dim() == (4 if compat.features()["generic_kv_views"] else 3)
    else:
        assert t.dim() == 4 and t.shape[1:] == (2, bs, 64)
    sched.add_request(V.make_request("a", P, block_size=bs, max_tokens=2))
    outs = run_to_end(sched, worker, caches, bs)
    so0, _ = outs[0]
    assert so0.num_scheduled_tokens == {"a": 300}  # nothing stored yet: no hit
    assert hasattr(so0, "has_sync_kv_loads") == compat.features()["sync_load_flag"]
    assert all(not out.invalid_block_ids for _, out in outs)
    worker.shutdown()
    sched.shutdown()

    # Engine B: empty local cache, poisoned tensors; the connector is the only source of hits.
    sched, worker, caches = engine(kind, layout, bs, llama_dir, gateway_port, ns)
    sched.add_request(V.make_request("b", P, block_size=bs, max_tokens=2))
    so, _, out = V.step_with_worker(sched, worker, caches, bs)
    assert so.num_scheduled_tokens == {"b": 300 - 256}
    if compat.features()["sync_load_flag"]:
        assert so.has_sync_kv_loads  # 29+: start_load_kv runs before this step's forward
    assert not out.invalid_block_ids
    ids = sched.kv_cache_manager.get_block_ids("b")[0]
    for name in V.ATTN_LAYERS:
        for i in range(256 // bs):
            want = V.pattern(P[: (i + 1) * bs], name, caches.page_bytes)
            got = V.raw_page(caches, name, ids[i])
            assert got.equal(want), f"{name} block {i} (id {ids[i]}) differs after restore"
    run_to_end(sched, worker, caches, bs)
    worker.shutdown()
    sched.shutdown()


def test_salted_block_hash_scheme_matches_probe():
    """``tagged_extra_keys`` agrees with what vLLM's hasher really computes for a salted block."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as ku

    bs = 16
    r = V.make_request("h", P[:32], block_size=bs, salt="tenant-a", max_tokens=2)
    toks = tuple(P[:bs])
    untagged = sha256((ku.NONE_HASH, toks, ("tenant-a",)))
    tagged = sha256((ku.NONE_HASH, toks, (("cache_salt", "tenant-a"),)))
    got = bytes(r.block_hashes[0])
    assert {got == untagged, got == tagged} == {True, False}
    assert compat.features()["tagged_extra_keys"] == (got == tagged)
    assert compat.block_hash_scheme() == ("tagged" if got == tagged else "untagged")


def test_none_hash_seed_rule(monkeypatch):
    """Without PYTHONHASHSEED, 26/28 seed NONE_HASH randomly per call, 29+ with a fixed seed;
    ``none_hash_seed`` and the refusal follow what vLLM really does."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as ku

    monkeypatch.delenv("PYTHONHASHSEED")
    try:
        ku.init_none_hash(sha256)
        a = ku.NONE_HASH
        ku.init_none_hash(sha256)
        deterministic = a == ku.NONE_HASH
        assert compat.features()["deterministic_none_hash"] == deterministic
        assert (compat.none_hash_seed() == "random") == (not deterministic)
        if deterministic:
            compat.require_supported()
        else:
            with pytest.raises(ConfigError, match="PYTHONHASHSEED=0"):
                compat.require_supported()
    finally:
        monkeypatch.setenv("PYTHONHASHSEED", "0")
        ku.init_none_hash(sha256)
    assert compat.none_hash_seed() == "env:0"


def test_layout_mismatch_refused_before_any_byte(llama_dir, gateway_port):
    """A worker whose tensors do not follow the layout in its fingerprint refuses at start."""
    kvc = V.make_kv_cache_config("attention", block_size=32, num_blocks=8)
    caches = V.allocate(kvc, "attention", layout=V.layout_name("HND"))
    other = V.layout_name("NHD")
    if compat.features()["generic_kv_views"]:
        kvc.kv_cache_layout = other
    else:
        from vllm.v1.attention.backends.utils import set_kv_cache_layout

        set_kv_cache_layout(other)
    vc = V.make_vllm_config(llama_dir, block_size=32, extra={"xkv_gateway_port": gateway_port})
    with pytest.raises(ValueError, match="layout"):
        V.make_worker(vc, kvc, caches)


def test_fingerprint_record(llama_dir):
    """The fingerprint of one fixed cache on this vLLM. With ``XKV_MATRIX_DIR`` set
    (scripts/matrix.sh) it is written there; the matrix then checks that no two vLLM versions
    share one (so they never read each other's objects on one gateway)."""
    import json
    import os

    import vllm

    from xkv.connector.keys import fingerprint
    from xkv.connector.registry import build_registry

    kvc = V.make_kv_cache_config("attention", block_size=32, num_blocks=8)
    V.allocate(kvc, "attention", layout=V.layout_name("NHD"))
    vc = V.make_vllm_config(llama_dir, block_size=32)
    reg = build_registry(vllm_specs.cache_groups(kvc), tp_size=1, pp_size=1, chunk_size=64,
                         slot_alignment=4096)
    fields = compat.fingerprint_fields(vc, kvc, reg.groups[0])
    assert fields["hash_scheme"] == compat.block_hash_scheme()
    assert fields["none_hash"] == "env:0"
    assert fields["vllm_features"] == sorted(k for k, v in compat.features().items() if v)
    fp = fingerprint(fields)
    out = os.environ.get("XKV_MATRIX_DIR")
    if out:
        # the keys of one salted prompt: versions that share a fingerprint must agree on them
        r = V.make_request("fp", P[:64], block_size=32, salt="tenant-a")
        rec = {"vllm": vllm.__version__, "fingerprint": fp, "fields": fields,
               "features": compat.features(),
               "block_hashes": [bytes(h).hex() for h in r.block_hashes]}
        with open(os.path.join(out, f"fingerprint-{vllm.__version__}.json"), "w") as f:
            json.dump(rec, f, indent=1, sort_keys=True, default=str)


def test_runtime_fp8_scales_refused(llama_dir):
    """fp8 pages stored under one engine's run-time k/v scales must never be read by another:
    refused at start, naming the setting; static scales and bf16 caches start as before."""
    vc = V.make_vllm_config(llama_dir, block_size=32)
    assert not compat.runtime_kv_scales(vc)
    vc.cache_config.cache_dtype = "fp8"
    assert not compat.runtime_kv_scales(vc)  # checkpoint (or default 1.0) scales
    object.__setattr__(vc.cache_config, "calculate_kv_scales", True)
    assert compat.runtime_kv_scales(vc)
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        compat.require_supported(vc)
    vc.cache_config.cache_dtype = "auto"
    assert not compat.runtime_kv_scales(vc)  # bf16 pages carry no scales
