"""The façade as vLLM loads it: plugin registration, both roles, refusals at start."""

import pytest
import torch

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
import vllm_harness as H  # noqa: E402


def test_register_is_idempotent_and_resolves_by_name():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import xkv_vllm_connector

    xkv_vllm_connector.register()
    xkv_vllm_connector.register()
    from xkv_vllm_connector.fusionx_connector import FusIOnXConnector

    assert KVConnectorFactory._registry["FusIOnXConnector"]() is FusIOnXConnector


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "xkv"]
    # The suite always runs after `pip install -e .`: a missing entry point is a packaging defect.
    assert eps, "no vllm.general_plugins entry point named 'xkv': is the package installed?"
    assert eps[0].value == "xkv_vllm_connector:register"


def test_scheduler_role_by_name_without_module_path(fake_gateway, llama_dir):
    import xkv_vllm_connector

    xkv_vllm_connector.register()
    vc = H.make_vllm_config(llama_dir, policy="recompute", extra={"chunk_size": 64})
    vc.kv_transfer_config.kv_connector_module_path = None
    s = H.make_scheduler(vc, H.attention_cache_config())
    assert type(s.connector).__name__ == "FusIOnXConnector"
    assert s.connector._scheduler is not None and s.connector._worker is None


def test_cache_nobody_writes_refused(fake_gateway, llama_dir):
    # (Mamba state groups are stored since issue 5: tests/hybrid; sliding-window groups since
    # issue 18 (their window's tail, test_dsv4_windows.py); a chunked-local group is not)
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    vc = H.make_vllm_config(llama_dir, policy="recompute")
    kcfg = H.attention_cache_config()
    kcfg.kv_cache_groups.append(KVCacheGroupSpec(
        ["model.layers.2.self_attn"],
        ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=32,
                                  dtype=torch.float32, attention_chunk_size=64)))
    with pytest.raises(ValueError, match="has no writer"):
        H.make_scheduler(vc, kcfg)
    kcfg.kv_cache_groups[-1] = KVCacheGroupSpec(
        ["model.layers.2.self_attn"],
        SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32,
                          sliding_window=64))
    reg = H.make_scheduler(vc, kcfg).connector._scheduler.registry
    (w,) = [p for p in reg.groups if p.is_window]
    assert (w.num_shards, w.blocks_per_object) == (1, 2)  # heads (TP 1); 63 tokens: 2 blocks


def test_stats_round_trip():
    from xkv_vllm_connector.fusionx_connector import FusIOnXConnector, FusIOnXConnectorStats

    a = FusIOnXConnectorStats({"bytes_restored": 2_000_000, "seconds_restored": 0.001})
    b = FusIOnXConnector.build_kv_connector_stats(dict(a.data))
    b.aggregate(a)
    red = b.reduce()
    assert red["bytes_restored"] == 4_000_000 and red["restored_GBps"] == 2.0
    assert not b.is_empty()
    b.reset()
    assert b.is_empty()


def test_full_cuda_graphs_by_default_piecewise_when_turned_off_or_with_fanout():
    """vLLM keeps full CUDA graphs (FULL_AND_PIECEWISE) by default (``full_cuda_graphs: true``);
    piecewise graphs with ``full_cuda_graphs: false`` or the NVLink fan-out (its all-gathers run
    in the per-layer hooks)."""
    from xkv.connector.config import ConnectorConfig
    from xkv_vllm_connector.fusionx_connector import FusIOnXConnector

    ask = FusIOnXConnector.requires_piecewise_for_cudagraph
    assert ask({}) is False and ask(None) is False  # the default: full graphs kept
    assert ConnectorConfig.from_extra({}, {"PYTHONHASHSEED": "0"}).full_cuda_graphs is True
    assert ask({"full_cuda_graphs": True}) is False
    assert ask({"full_cuda_graphs": True, "nvlink_fanout": True}) is True
    assert ask({"nvlink_fanout": True}) is True
    assert ask({"full_cuda_graphs": False}) is True
    assert ask({"full_cuda_graphs": "yes"}) is True  # not a bool: refused at start, piecewise here


@pytest.mark.parametrize("mla", [False, True])
def test_early_issue_auto_follows_the_engine(fake_gateway, llama_dir, monkeypatch, caplog, mla):
    """``XKV_EARLY_ISSUE`` unset (``auto``): the CPU engine replays no CUDA graphs, so its
    worker does not offer early issue and says why; a GPU engine's conditions (full graphs with
    per-layer waits, the Triton kernel's restores) turn it on, on an MLA model as on any other
    (stop 56 measured it faster there), each one missing turns it off with its reason."""
    from xkv.connector import compat, early_issue

    monkeypatch.delenv(early_issue.ENV, raising=False)
    bs = 16 if mla else 32
    vc = H.make_vllm_config(llama_dir, policy="recompute", block_size=bs, extra={"chunk_size": 64})
    with caplog.at_level("INFO", logger="xkv.connector"):
        conn, _ = H.make_worker_caches(vc, H.attention_cache_config(block_size=bs, mla=mla),
                                       layout="LBNHC" if mla else "LBHNC")
    assert early_issue.peer(conn._engine_id) is None
    assert early_issue.OFF_LINE.format(
        why="auto: no full CUDA graphs with per-layer restore waits") in caplog.text
    assert not compat.replays_full_graphs(vc)  # what the CPU engine resolved
    # a GPU engine's state after register_kv_caches
    monkeypatch.setattr(compat, "replays_full_graphs", lambda _vc: True)
    conn._worker.graph_waits, conn._worker.copy_engine_restores = True, False
    assert conn._early_auto_why() == ""
    conn._worker.copy_engine_restores = True
    assert conn._early_auto_why() == "restores may take the copy engine"
    conn._worker.graph_waits = False
    assert conn._early_auto_why() == "no full CUDA graphs with per-layer restore waits"


def test_early_issue_leaves_a_restore_the_copy_engine_may_take_to_start_load_kv(
        fake_gateway, llama_dir, monkeypatch):
    """``XKV_EARLY_ISSUE=1``: a step is issued when it is scheduled only while its restore is
    smaller than the worker's ``copy_engine_from`` (early issue was measured with the Triton
    kernel's restores; a ring restore issued early lost 30 %, stop 49); at or above it the step
    is left to ``start_load_kv``, and the next small step is issued early again."""
    from xkv.connector import early_issue
    from xkv.connector.metadata import ChunkRef, GroupTransfer, StepMetadata, TransferJob

    monkeypatch.setenv(early_issue.ENV, "1")
    vc = H.make_vllm_config(llama_dir, policy="recompute", block_size=32, extra={"chunk_size": 64})
    conn, _ = H.make_worker_caches(vc, H.attention_cache_config(block_size=32), layout="LBHNC")
    assert early_issue.peer(conn._engine_id) is conn
    issued = []
    monkeypatch.setattr(conn._worker, "bind", lambda step: issued.append(step))
    monkeypatch.setattr(conn, "_issue", lambda loads: None)

    def step(job_id, n):
        gt = GroupTransfer(0, tuple(range(n)), tuple(i // 2 for i in range(n)),
                           tuple(i % 2 for i in range(n)),
                           tuple(ChunkRef(bytes([c]) * 8, (c * 4096,), (1,))
                                 for c in range((n + 1) // 2)))
        return StepMetadata(loads=(TransferJob(job_id, f"r{job_id}", (gt,), n * 32),))

    w = conn._worker
    per_block = w.registry.groups[0].group.bytes_all_layers
    big, small = step(1, 5), step(2, 3)
    assert w.restore_bytes(big.loads) == 5 * per_block > 0
    assert w.copy_engine_from is None and not w.may_take_copy_engine(big.loads)  # the CPU engine
    w.copy_engine_from = 4 * per_block  # restores of 4 blocks and more may take the copy engine
    conn._issue_at_scheduling(big)
    assert issued == [] and conn._handover.pending is None  # start_load_kv issues it
    conn._issue_at_scheduling(small)
    assert issued == [small] and conn._handover.pending == early_issue.key(small)
