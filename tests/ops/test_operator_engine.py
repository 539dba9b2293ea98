"""A real CPU engine with the connector, as an operator watches it: the gateway's KV events
carry exactly the block hashes vLLM's own events carry for the same prompt, then their eviction
when a second prompt fills the card; every series the Grafana dashboard queries is in a scrape
of the gateway and of vLLM's /metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
from promtext import dashboard_selectors, missing, value

from xkv.gateway import GatewayClient
from xkv.gateway.testing import spawn_gateway, stop_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))
BLOCK, CHUNK, TOKENS = 32, 128, 1000


def _collect(sock, decoder, out: list, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sock.poll(50):
            _topic, _seq, payload = sock.recv_multipart()
            out.extend(decoder.decode(payload).events)


def test_events_hashes_match_vllm_and_dashboard_series_are_scraped():
    from tiny_models import ensure_model
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    model = str(ensure_model("llama"))
    metrics_port = _free_port()
    # 1 MiB = 8 objects of this model's 128 KiB chunks: the second prompt evicts the first
    proc, port = spawn_gateway("1M", extra_args=["--kv-events-port", "0",
                                                   "--metrics-port", str(metrics_port)])
    ctx = zmq.Context()
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
            ev_port = c.stats()["kv_events_port"]
        ours = ctx.socket(zmq.SUB)
        ours.setsockopt(zmq.SUBSCRIBE, b"")
        ours.connect(f"tcp://127.0.0.1:{ev_port}")
        theirs = ctx.socket(zmq.SUB)  # vLLM's publisher connects to this one
        theirs.setsockopt(zmq.SUBSCRIBE, b"")
        vllm_port = theirs.bind_to_random_port("tcp://127.0.0.1")
        tokens = [(11 + 17 * i) % 900 + 5 for i in range(TOKENS)]
        sc = {"model": model, "block_size": BLOCK, "chunk_size": CHUNK, "port": port,
              "vllm_events_port": vllm_port, "tokens": tokens,
              "second_tokens": [(7 + 29 * i) % 900 + 3 for i in range(TOKENS)]}
        with tempfile.TemporaryDirectory() as d:
            scp, rp = Path(d, "sc.json"), Path(d, "res.json")
            scp.write_text(json.dumps(sc))
            env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1",
                       TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                       VLLM_ENABLE_V1_MULTIPROCESSING="0",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                os.environ.get("PYTHONPATH")])))
            env.pop("XKV_GATEWAY_HOSTNAME", None)
            child = subprocess.Popen([sys.executable, str(Path(__file__).with_name(
                "ops_driver.py")), str(scp), str(rp)], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
            decoder = msgspec.msgpack.Decoder(KVEventBatch)
            got_ours, got_theirs = [], []
            while child.poll() is None:  # drain both while the engine runs
                _collect(ours, decoder, got_ours, 0.2)
                _collect(theirs, decoder, got_theirs, 0.05)
            log = child.stdout.read()
            assert child.returncode == 0 and rp.exists(), log[-6000:]
            _collect(ours, decoder, got_ours, 0.5)
            _collect(theirs, decoder, got_theirs, 0.5)
            res = json.loads(rp.read_text())
        restore = res["runs"][1]
        n_chunks = TOKENS // CHUNK
        assert restore["cached"] == n_chunks * CHUNK and restore["tokens"] == res["runs"][0][
            "tokens"]
        # vLLM's GPU-tier events: the prompt's full blocks, in order
        gpu = []
        for e in got_theirs:
            if isinstance(e, BlockStored):
                gpu.extend(h for h in e.block_hashes if h not in gpu)
        k = CHUNK // BLOCK
        assert len(gpu) >= n_chunks * k, (len(gpu), got_theirs[:3])
        stored = [e for e in got_ours if isinstance(e, BlockStored)]
        assert len(stored) == 2 * n_chunks  # both prompts
        first = stored[:n_chunks]
        assert [h for e in first for h in e.block_hashes] == gpu[:n_chunks * k]
        for i, e in enumerate(first):
            assert e.parent_block_hash == (gpu[i * k - 1] if i else None)
            assert (e.medium, e.block_size, e.group_idx) == ("CPU", BLOCK, 0)
        # the second prompt needed 7 of the 8 slots: the first prompt's chunks went, oldest first
        removed = [e for e in got_ours if isinstance(e, BlockRemoved)]
        assert len(removed) >= n_chunks - 1
        assert [e.block_hashes for e in removed[:n_chunks - 1]] == [
            e.block_hashes for e in first[:n_chunks - 1]]
        assert all(e.medium == "CPU" and e.group_idx == 0 for e in removed)
        # metrics: every dashboard series, with values that match what happened
        prom = res["prometheus"]
        sel = dashboard_selectors()
        assert missing(prom, sel, "vllm:") == []
        assert value(prom, "vllm:xkv_hit_tokens_total") == restore["cached"]
        assert value(prom, "vllm:xkv_stored_chunks_total") == 2 * n_chunks
        assert value(prom, "vllm:xkv_restored_bytes_total") > 0
        assert value(prom, "vllm:xkv_load_errors_total") == 0
        with GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
            s = c.stats()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            gw_text = r.read().decode()
        assert missing(gw_text, sel, "xkv_gateway_") == []
        assert value(gw_text, 'xkv_gateway_kv_events_total{type="stored"}') == 2 * n_chunks
        assert value(gw_text, 'xkv_gateway_freed_objects_total{reason="lru"}') == len(removed)
        assert s["hit_chunks"] >= n_chunks
    finally:
        ctx.destroy(linger=0)
        stop_gateway(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
