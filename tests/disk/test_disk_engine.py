"""End to end on the CPU engine: a prompt stored through a gateway with a disk tier, the card
forced to evict it, the gateway SIGKILLed and restarted on the same directory, and a fresh vLLM
engine restores the prompt from disk with the tokens of a run without the connector.

One driver process, three engines (reference, store, restore); between the store and the
restore the driver waits on a file the test creates after it restarted the gateway."""

from __future__ import annotations

import os
import threading
import time

import pytest
from e2e_harness import run_engine

from xkv.gateway.client import GatewayClient
from xkv.gateway.testing import spawn_gateway, stop_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base):
    return [(base + 29 * i) % 1000 + 4 for i in range(n)]


P1, P2, P3 = prompt(220, 10), prompt(220, 300), prompt(220, 600)  # 3 whole chunks of 64 each
# one chunk of the tiny llama: 64 tokens x 2 layers x K,V x 2 heads x 32 x fp32 = 64 KiB; the
# card holds 4, so storing P2 and P3 evicts P1
CARD = "256K"


def stats(port):
    with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
        return c.stats()


def test_restore_from_disk_after_eviction_and_restart(models, tmp_path):
    disk = str(tmp_path / "disk")
    # below the harness's lookup_timeout_ms (2000 on a loaded CI box)
    args = ["--disk", disk, "--disk-wait-ms", "1500", "--log-level", "INFO"]
    logs = [open(tmp_path / f"gateway{i}.log", "wb") for i in (1, 2)]  # noqa: SIM115
    proc, port = spawn_gateway(CARD, extra_args=args, stderr=logs[0])
    procs = [proc]
    go, stored = str(tmp_path / "go"), str(tmp_path / "stored")
    steps = [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": P1}]},
        {"op": "engine", "extra": {"xkv_gateway_port": port}},
        {"op": "generate", "name": "store", "prompts": [{"tokens": P1}]},
        # P1 committed and on disk before the fill: an object stays pinned until written, and a
        # fill that races a slow disk (seen on a CI box) is refused instead of evicting P1
        {"op": "wait_file", "path": stored},
        {"op": "generate", "name": "fill", "prompts": [{"tokens": P2}, {"tokens": P3}]},
        {"op": "wait_file", "path": go},
        {"op": "engine", "extra": {"xkv_gateway_port": port}},  # a fresh engine: nothing local
        {"op": "generate", "name": "restore", "prompts": [{"tokens": P1}]},
    ]
    out: dict = {}

    def drive():
        try:
            out["res"], out["log"] = run_engine(models, "llama", (proc, port), steps,
                                                extra={"chunk_size": 64}, timeout=900)
        except BaseException as e:  # reported by the main thread
            out["error"] = e

    th = threading.Thread(target=drive, daemon=True)
    th.start()
    def reached(path):
        while not os.path.exists(path + ".waiting"):
            assert th.is_alive(), out.get("error")
            time.sleep(0.1)

    try:
        reached(stored)
        deadline = time.monotonic() + 30
        while not ((s0 := stats(port))["disk_written"] >= 3
                   and s0["disk_write_backlog_bytes"] == 0):
            assert time.monotonic() < deadline, s0
            time.sleep(0.05)
        open(stored, "w").close()
        reached(go)
        deadline = time.monotonic() + 30
        while (s1 := stats(port))["disk_write_backlog_bytes"]:  # every write done
            assert time.monotonic() < deadline, s1
            time.sleep(0.05)
        proc.kill()  # SIGKILL: no clean shutdown
        proc.wait()
        proc, port2 = spawn_gateway(CARD, port=port, extra_args=args, stderr=logs[1])
        procs.append(proc)
        assert port2 == port
        deadline = time.monotonic() + 30
        while not (s2 := stats(port))["disk_scanned"]:
            assert time.monotonic() < deadline, s2
            time.sleep(0.05)
        open(go, "w").close()
        th.join(900)
        if "error" in out:
            raise out["error"]
        s3 = stats(port)
    finally:
        for p in procs:
            stop_gateway(p)
        for f in logs:
            f.close()
    r = {x["name"]: x for x in out["res"]["runs"]}
    ref = r["ref"]["tokens"]
    assert r["store"]["cached"] == [0] and r["store"]["tokens"] == ref
    assert s0["committed"] == s0["disk_written"] == 3 and s0["evicted"] == 0
    # the card evicted P1's chunks; what it stored was written behind it (P2 and P3 together
    # need 6 slots of a card of 4 whose objects stay pinned until written: some were refused)
    assert s1["evicted"] >= 3 and s1["disk_written"] >= 3 and s1["disk_write_dropped"] == 0
    assert s1["disk_written"] == s1["committed"]
    # the restarted gateway found them, and the fresh engine restored P1's 3 chunks from disk
    assert s2["disk_scan_found"] == s1["disk_written"] and s2["ready_objects"] == 0
    assert r["restore"]["cached"] == [192] and r["restore"]["tokens"] == ref
    assert s3["disk_hits"] == 3 and s3["disk_served_chunks"] == 3
    assert s3["disk_corrupt"] == s3["disk_truncated"] == 0
