"""Power loss at any point of the disk tier's writes and deletes never yields a torn or stale
object, and never loses one whose write was acknowledged (issue 26).

A seeded workload drives a :class:`DiskStore` (writes of new objects and new versions of old
ones, deletes) with its ``os`` replaced by tests/disk/power_loss_fs.py's recorder. The recorded
operations are then replayed into a fresh model; after each one, several states a power loss
there may leave (unsynced writes absent, present or torn per 4 KiB; unsynced name operations
each kept or not) are written to a fresh directory and opened the way a restarted gateway opens
its tier (a new DiskStore: directory checks, the scan that lists objects and removes leftover
temporary files), and every key ever stored is read back. The checks:

* opening and scanning never fail; the scan lists every object-named file and removes every
  leftover temporary file;
* a served object is byte-exact one version stored under its key, never older than the last
  version acknowledged before the power loss (contents are a function of key and version);
* an object whose write was acknowledged (``written``/``ok``: file synced, renamed, its
  directory synced) and not deleted since is served.

The seed is printed; ``XKV_POWER_LOSS_SEED`` replays one, ``XKV_POWER_LOSS_STATES`` sets how many
states are drawn per operation (default 4).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import random
import shutil
import tempfile

import pytest
from power_loss_fs import BLOCK, Model, RecordingOs
from store_results import wait

from xkv.gateway import disk_dir, disk_store
from xkv.gateway.disk_format import ROOT_NAME, TMP_MARK, file_name, stride
from xkv.gateway.disk_store import DiskItem, DiskStore

STATES = int(os.environ.get("XKV_POWER_LOSS_STATES", "4"))
JOBS = 30  # write or delete jobs of one workload
DIGESTS = (bytes(range(16)), bytes(range(16, 32)))  # two layouts: two directories
SIZES = (1, 100, 4096, 5000, 9000)  # shard bytes: under, at and over a block
CARD = 4 << 20


def content(key: bytes, gen: int, shard: int, nbytes: int) -> bytes:
    return hashlib.shake_256(key + gen.to_bytes(4, "little") + bytes([shard])).digest(nbytes)


class Workload:
    """The objects of one run: per key its layout digest, geometry and versions written."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.geom: dict[bytes, tuple[bytes, int, int]] = {}  # key -> (digest, shards, bytes)
        self.gens: dict[bytes, int] = {}  # key -> latest version handed to a write
        self.on_disk: set[bytes] = set()

    def new_key(self) -> bytes:
        rng, key = self.rng, b""
        while not key or key in self.geom:  # a key has one geometry
            if rng.random() < 0.1:  # over 64 bytes: a hashed file name
                key = rng.randbytes(70)
            else:  # few prefixes: several files share a directory
                key = bytes([rng.choice((0, 1, 0xAB))]) + rng.randbytes(rng.randint(0, 3))
        self.geom[key] = (rng.choice(DIGESTS), rng.randint(1, 3), rng.choice(SIZES))
        return key

    def item(self, key: bytes, base: int, ref=None) -> tuple[DiskItem, int]:
        """The DiskItem of ``key`` with slots from ``base`` in the card; and the next base."""
        digest, shards, nbytes = self.geom[key]
        s = stride(nbytes)
        offs = tuple(base + r * s for r in range(shards))
        return DiskItem(digest, key, file_name(key), shards, nbytes, offs, ref), base + shards * s


def run_workload(store: DiskStore, rec: RecordingOs, card: mmap.mmap, w: Workload) -> None:
    """Write and delete through ``store``, one job at a time. ``rec``'s log gets a mark
    ``("mark", "start", key, gen)`` before the store's first operation of a write and
    ``("mark", "ack", key, gen)`` after its last (the write acknowledged)."""
    rng = w.rng
    for _ in range(JOBS):
        if w.on_disk and rng.random() < 0.25:
            keys = rng.sample(sorted(w.on_disk), min(len(w.on_disk), rng.randint(1, 2)))
            store.delete([(w.geom[k][0], file_name(k)) for k in keys])
            wait(store, "deleted")
            w.on_disk.difference_update(keys)
            continue
        items, base = [], 0
        for _ in range(rng.randint(1, 3)):
            old = sorted(set(w.gens) - {it.key for it in items})
            key = rng.choice(old) if old and rng.random() < 0.4 else w.new_key()
            w.gens[key] = gen = w.gens.get(key, 0) + 1
            it, nxt = w.item(key, base, (key, gen))
            for r, off in enumerate(it.offsets):
                card[off:off + it.shard_bytes] = content(key, gen, r, it.shard_bytes)
            items.append(it)
            base = nxt
            rec.mark("start", key, gen)
        store.write(items)
        _, done, status, _, _ = wait(store, "written")
        assert status == ["ok"] * len(done), status
        for it in done:  # the loop learns of it here: acknowledged
            rec.mark("ack", *it.ref)
            w.on_disk.add(it.key)


def expected_scan(disk: str) -> tuple[set[str], int]:
    """What the scan of the tier's directory ``disk`` must report: object-named files, and the
    number of temporary files (every file is 0600 and ours; sizes not a block multiple are
    skipped by design)."""
    names, tmps = set(), 0
    for top, _, files in os.walk(os.path.join(disk, ROOT_NAME)):
        if os.path.relpath(top, disk).count(os.sep) != 2:
            continue
        for f in files:
            if os.path.getsize(os.path.join(top, f)) % BLOCK:
                continue
            if TMP_MARK in f:
                tmps += 1
            else:
                names.add(f)
    return names, tmps


def damage(disk: str, rng: random.Random) -> str | None:
    """Beyond the power loss, the disk itself loses bytes of one object file (zeroed, garbage
    or cut at a block) in a fifth of the states, so a restart meets a torn file under its final
    name too; returns the file's name (None: no damage)."""
    files = sorted(os.path.join(top, f) for top, _, fs in os.walk(os.path.join(disk, ROOT_NAME))
                   for f in fs if TMP_MARK not in f and "probe" not in f)
    if not files or rng.random() >= 0.2:
        return None
    path = rng.choice(files)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        how = rng.randrange(3)
        if how == 2 or size < BLOCK:
            f.truncate(rng.randrange(0, size + 1, BLOCK) if size >= BLOCK else 0)
        else:
            f.seek(rng.randrange(0, size - BLOCK + 1, BLOCK))
            f.write(bytes(BLOCK) if how == 0 else rng.randbytes(BLOCK))
    return os.path.basename(path)


def check_state(disk: str, w: Workload, acked: dict, started: dict, must: set, card: mmap.mmap,
                where: str) -> dict:
    """Open the tier in ``disk`` as a restart does and read every key; returns status counts."""
    hurt = damage(disk, w.rng)
    names, tmps = expected_scan(disk)
    store = DiskStore(disk, card, BLOCK, threads=1, direct=False, nice=0)
    try:
        store.start()
        _, found, _, removed = wait(store, "scanned")
        assert {f[1] for f in found} == names, f"{where}: scan listed {found}, files {names}"
        assert removed == tmps, f"{where}: {removed} temporary files removed of {tmps}"
        items, base = [], 0
        for key in started:
            it, base = w.item(key, base)
            items.append(it)
        for it in items:  # poisoned slots: a read that claims success must fill them
            for off in it.offsets:
                card[off:off + it.shard_bytes] = b"\xa5" * it.shard_bytes
        status = []
        if items:  # none before the first write
            store.read("check", items)
            status = wait(store, "read")[2]
    finally:
        store.close()
    assert expected_scan(disk)[1] == 0, f"{where}: temporary files left after the scan"
    counts = {"tmp_removed": removed, "damaged": hurt is not None}
    for it, st in zip(items, status, strict=True):
        counts[st] = counts.get(st, 0) + 1
        k = it.key
        assert st in ("ok", "lost", "truncated", "corrupt"), f"{where}: {k.hex()}: {st}"
        if k in must and it.name != hurt:
            assert st == "ok", f"{where}: {k.hex()} v{acked[k]} acknowledged, read {st}"
        if st != "ok":
            continue
        got = [bytes(card[o:o + it.shard_bytes]) for o in it.offsets]
        gens = [g for g in range(acked.get(k, 1), started[k] + 1)
                if got == [content(k, g, r, it.shard_bytes) for r in range(it.num_shards)]]
        assert gens, (f"{where}: {k.hex()} served bytes of no version in "
                      f"[{acked.get(k, 1)}, {started[k]}] (torn or stale)")
    return counts


def replay(log: list, base: str, w: Workload, rng: random.Random, scratch: str, card,
           seed: int) -> dict:
    """After each logged operation, draw ``STATES`` power-loss states and check each."""
    model, acked, started, must, names = Model(base), {}, {}, set(), {}
    totals = {"states": 0}
    for n, entry in enumerate(log):
        if entry[0] == "mark" and entry[1] == "start":
            started[entry[2]] = entry[3]
        elif entry[0] == "mark":  # ("mark", "ack", key, gen)
            _, _, key, gen = entry
            acked[key] = gen
            must.add(key)
            digest = w.geom[key][0]
            names[os.path.join(base, "disk", ROOT_NAME, digest.hex(), file_name(key)[:2],
                               file_name(key))] = key
        else:
            getattr(model, entry[0])(*entry[1:])
            if entry[0] == "unlink" and entry[1] in names:  # deleted: may or may not survive
                must.discard(names[entry[1]])
        for j in range(STATES):
            out = tempfile.mkdtemp(dir=scratch)
            try:
                model.lost_power(rng, out, keep=rng.choice((0.1, 0.5, 0.9)))
                where = f"seed {seed}, power lost after operation {n} {entry[:2]}, state {j}"
                for st, c in check_state(os.path.join(out, "disk"), w, acked, started, must,
                                         card, where).items():
                    totals[st] = totals.get(st, 0) + c
                totals["states"] += 1
            finally:
                shutil.rmtree(out)
    return totals


@pytest.fixture
def scratch(tmp_path):
    """Where the power-loss states go: a tmpfs when there is one (no disk writes), else tmp."""
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(prefix="xkv-power-loss-", dir=root)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("direct", [False, None])  # buffered; O_DIRECT where the probe allows
def test_power_loss_at_every_operation(request, scratch, direct, monkeypatch, caplog):
    seed = int(os.environ.get("XKV_POWER_LOSS_SEED", "0")) or random.randrange(1, 2**32)
    print(f"power-loss seed {seed} (XKV_POWER_LOSS_SEED={seed} replays it)")
    rng = random.Random(seed)
    # a path fixed by the seed: the store syncs a batch's directories in the order of a set of
    # their paths, so the same seed gives the same operations only on the same path
    base = os.path.join(tempfile.gettempdir(), f"xkv-power-loss-{seed}-{direct}")
    shutil.rmtree(base, ignore_errors=True)
    os.mkdir(base)
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    rec = RecordingOs(Model(base))
    card = mmap.mmap(-1, CARD)
    w = Workload(rng)
    with monkeypatch.context() as m:
        m.setattr(disk_store, "os", rec)
        m.setattr(disk_dir, "os", rec)
        store = DiskStore(os.path.join(base, "disk"), card, BLOCK, threads=1, direct=direct,
                          nice=0)
        try:
            store.start()
            assert wait(store, "scanned")[1] == []
            run_workload(store, rec, card, w)
        finally:
            store.close()
    caplog.set_level(logging.ERROR, logger="xkv.gateway")
    totals = replay(rec.log, base, w, rng, scratch, card, seed)
    print(f"power loss (direct={store.direct}): {len(rec.log)} operations, {totals}")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert totals.get("ok", 0) and totals.get("corrupt", 0) + totals.get("truncated", 0), totals
    card.close()
