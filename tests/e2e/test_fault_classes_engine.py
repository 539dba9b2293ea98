"""Issue 25's fault classes end to end on the CPU engine: a real xkv-gateway whose card is
damaged object by object between the engine that stored two prompts and a fresh engine that
restores them, with checksums on (the default). Every damaged object is detected (its key named
once, counted, reported to the gateway), its blocks are recomputed, and greedy tokens equal the
no-connector run; an object rewritten with its own bytes (harmless) restores as if untouched.

The kernel-level suite (tests/kernels/test_fault_injection.py) injects 10^4 faults into copies;
this test shows the same classes through vLLM: load errors, recompute, tokens."""

import re
import time

import pytest
from e2e_harness import run_engine

from xkv.gateway.client import GatewayClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base):
    return [(base + 13 * i) % 1000 + 4 for i in range(n)]


P1, P2 = prompt(300, 20), prompt(300, 500)  # 4 whole chunks of 64 each (+ a partial one)
# commits 0-3: P1's chunks, 4-7: P2's (each prompt stored by its own step, in chunk order)
FAULTS = [
    {"op": "fault", "kind": "swap_layers", "object": 0},
    {"op": "fault", "kind": "flip", "object": 1},
    {"op": "fault", "kind": "wrong_slot", "object": 2, "other": 3},  # P1's chunk 3 in chunk 2's slot
    {"op": "fault", "kind": "torn", "object": 3},
    {"op": "fault", "kind": "rewrite", "object": 4},  # harmless: equal bytes
    {"op": "fault", "kind": "flip", "object": 6},
]


def metrics(log: str) -> dict[str, float]:
    """The connector's counters summed over every ``KV Transfer metrics`` line of the log (each
    line counts what happened since the one before)."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        if "KV Transfer metrics:" in line:
            for k, v in re.findall(r"(\w+)=([\d.]+)", line.split("KV Transfer metrics:", 1)[1]):
                out[k] = out.get(k, 0) + float(v)
    return out


@pytest.mark.parametrize("checksum_pass", ["copy", "end"])  # copy: the default
def test_every_fault_class_is_recomputed_never_decoded(models, gateway, checksum_pass):
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref1", "prompts": [{"tokens": P1}]},
        {"op": "generate", "name": "ref2", "prompts": [{"tokens": P2}]},
        {"op": "engine"},
        {"op": "generate", "name": "store1", "prompts": [{"tokens": P1}]},
        {"op": "generate", "name": "store2", "prompts": [{"tokens": P2}]},
        *FAULTS,
        {"op": "engine"},  # a fresh engine: nothing in its local prefix cache
        {"op": "generate", "name": "restore1", "prompts": [{"tokens": P1}]},
        {"op": "generate", "name": "restore2", "prompts": [{"tokens": P2}]},
        {"op": "log_stats"},
    ], extra={"chunk_size": 64, "checksum_pass": checksum_pass}, imports=["card_faults"])
    runs = {r["name"]: r for r in res["runs"]}
    assert runs["store1"]["tokens"] == runs["ref1"]["tokens"]
    assert runs["store2"]["tokens"] == runs["ref2"]["tokens"]
    faults = res["faults"]
    assert [f["kind"] for f in faults] == [f["kind"] for f in FAULTS]
    assert len({f["key"] for f in faults}) == len(faults)  # six distinct objects
    damaged = [f for f in faults if f["kind"] != "rewrite"]
    assert all(f["changed"] > 0 for f in damaged) and faults[4]["changed"] == 0

    # never a token from damaged bytes
    assert runs["restore1"]["tokens"] == runs["ref1"]["tokens"]
    assert runs["restore2"]["tokens"] == runs["ref2"]["tokens"]
    # 8 chunks hit and copied; load errors: P1's 4 chunks and P2's chunk 2, each the blocks
    # of one chunk at the block size the restoring engine chose; P2's chunks 0 (rewritten with
    # equal bytes), 1 and 3 restored clean
    per_chunk = 64 // res["engines"][-1]["block_size"]
    got = metrics(log)
    assert got["lookup_chunks_hit"] == 8 and got["blocks_restored"] == 8 * per_chunk, got
    assert got["load_errors"] == 5 * per_chunk and got["checksum_mismatches"] == 5, got
    # each damaged object named once, by its key; the harmless one never
    named = re.findall(r"did not match their checksum: key ([0-9a-f]+)", log)
    assert sorted(named) == sorted(f["key"][:32] for f in damaged)
    assert "turned off" not in log
    # the gateway removed the five (CORRUPT reports go out on a background thread)
    _, port = gateway
    deadline = time.monotonic() + 10
    while True:
        with GatewayClient("127.0.0.1", port, timeout_s=5) as c:
            s = c.stats()
        if s["corrupt_removed"] >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert s["corrupt_reports"] == s["corrupt_removed"] == 5, s
