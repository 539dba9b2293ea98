"""Crash safety of the disk tier: real xkv-gateway processes killed with SIGKILL at random points
while clients store objects (the card evicting, the disk writing) and restore them (the disk
reading), ``XKV_DISK_CRASH_RUNS`` times (default 100). Each restarted gateway must serve every
object whose file was on disk at the kill, byte-exact, and never serve a byte that is not the
object's own (contents are a function of the key, so every hit is checked).

The runs form chains of ``CHAIN`` gateways on one directory (the next gateway of a chain is the
restart of the previous one), so one gateway start serves as both the check of one crash and
the victim of the next."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import time

import pytest

from xkv.gateway.client import GatewayClient, GatewayError
from xkv.gateway.disk_format import ROOT_NAME, TMP_MARK
from xkv.gateway.testing import spawn_gateway

pytestmark = pytest.mark.slow

RUNS = int(os.environ.get("XKV_DISK_CRASH_RUNS", "100"))
CHAIN = 10
SHARDS, SHARD_BYTES = 2, 30001
CARD = "600K"  # about 12 objects: stores evict, restores evict
BATCH = 6  # keys per checking lookup


def content(key: bytes, shard: int) -> bytes:
    return hashlib.shake_256(key + bytes([shard])).digest(SHARD_BYTES)


def on_disk(d: str) -> set[bytes]:
    """Keys whose file (final name) is in the tier's directory."""
    out = set()
    for top, _, files in os.walk(os.path.join(d, ROOT_NAME)):
        if top.count(os.sep) - d.count(os.sep) == 3:
            out.update(bytes.fromhex(f) for f in files if TMP_MARK not in f)
    return out


def served(c: GatewayClient, card, lid: int, keys: list[bytes]) -> int:
    """Look ``keys`` up (restoring from disk); every hit must be byte-exact. Returns the hits."""
    r = c.lookup([(lid, keys)])
    try:
        for key, slots in zip(keys, r.slots[0][:r.num_chunks], strict=False):
            for s, off in enumerate(slots.offsets):
                assert bytes(card[off:off + SHARD_BYTES]) == content(key, s), \
                    f"wrong bytes {key.hex()}"
    finally:
        if r.lease_id:
            c.release(r.lease_id)
    return r.num_chunks


def work(c, card, lid: int, rng: random.Random, old: list[bytes], stop, errors: list) -> None:
    """Store fresh objects and restore old ones until the gateway is gone; a wrong byte goes
    to ``errors`` (the gateway's death ends it with GatewayError, which is expected)."""
    try:
        _work(c, card, lid, rng, old, stop)
    except GatewayError:
        pass
    except BaseException as e:  # noqa: BLE001 (the test raises it)
        errors.append(e)


def _work(c, card, lid: int, rng: random.Random, old: list[bytes], stop) -> None:
    while not stop.is_set():
        if old and rng.random() < 0.3:
            served(c, card, lid, rng.sample(old, min(len(old), 3)))
            continue
        keys = [rng.randbytes(32) for _ in range(rng.randint(1, 4))]
        res = c.reserve(lid, keys)
        for k, slot in zip(keys, res, strict=True):
            if slot is not None:
                for s, off in enumerate(slot.offsets):
                    card[off:off + SHARD_BYTES] = content(k, s)
        for s in range(SHARDS):
            c.commit(lid, s, res)
        old.extend(k for k, slot in zip(keys, res, strict=True) if slot is not None)


def test_sigkill_at_random_points(tmp_path):
    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    seed_note = f"(seed state {rng.getstate()[1][:2]})"
    totals = {"checked": 0, "restored": 0, "tmp_removed": 0, "kills_in_scan": 0}
    expected: set[bytes] = set()
    errors: list = []
    d = ""
    for run in range(RUNS):
        if run % CHAIN == 0:  # a fresh chain on a fresh directory
            d = str(tmp_path / f"chain{run // CHAIN}")
            expected, seen = set(), set()
        proc, port = spawn_gateway(CARD, extra_args=["--disk", d, "--disk-capacity", "1G",
                                                     "--disk-wait-ms", "3000",
                                                     "--write-ttl", "5"])
        c = GatewayClient("127.0.0.1", port, timeout_s=10)
        try:
            card = c.map_card()
            lid = c.register_layout("crash", "fp", SHARDS, SHARD_BYTES).layout_id
            if rng.random() < 0.1:  # now and then: kill during the start-up scan
                totals["kills_in_scan"] += 1
            else:
                deadline = time.monotonic() + 30
                while not c.stats()["disk_scanned"]:  # lookups before the scan are misses
                    assert time.monotonic() < deadline, "the start-up scan did not finish"
                    time.sleep(0.005)
                # every object on disk at the last kill that no earlier run of the chain checked
                # (the ones a kill could have torn), and a sample of the older ones
                fresh = sorted(expected - seen)
                seen |= expected
                old = sorted(expected.difference(fresh))
                check = fresh + rng.sample(old, min(len(old), 12))
                for i in range(0, len(check), BATCH):
                    keys = check[i:i + BATCH]
                    got = served(c, card, lid, keys)
                    assert got == len(keys), \
                        f"run {run}: {keys[got].hex()} on disk, not served {seed_note}"
                    totals["checked"] += got
                s = c.stats()
                totals["restored"] += s["disk_hits"]
                totals["tmp_removed"] += s["disk_scan_removed"]
                assert s["disk_corrupt"] == s["disk_truncated"] == 0, s
                stop = threading.Event()
                old = list(expected)
                # a short deadline: after the kill, the worker's call in flight fails quickly
                w = GatewayClient("127.0.0.1", port, timeout_s=0.3)
                t = threading.Thread(target=work, args=(w, w.map_card(), lid, rng, old, stop, errors),
                                     daemon=True)
                t.start()
                time.sleep(rng.uniform(0.0, 0.25))
        finally:
            proc.kill()
            proc.wait()
            if "stop" in locals():
                stop.set()
                t.join(20)
                w.close()
                del stop
            with contextlib.suppress(GatewayError):
                c.close()
        if errors:
            raise errors[0]
        expected = on_disk(d)
    assert totals["checked"] > 0, totals
    if RUNS >= 50:  # kills landed inside writes (a restart removed their temporary files)
        assert totals["tmp_removed"] > 0, totals
    print(f"crash runs {RUNS}: {totals}")
