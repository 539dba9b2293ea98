"""Reads in flight (xkv/gateway/disk_depth.py and its use by DiskStore): objects cut into pieces
read back bit-exact, the gate bounds concurrent reads, the measurement at start picks a depth and
leaves no file behind, and bad depths are refused by name before anything is opened."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_results import wait  # noqa: E402

from xkv.gateway import disk_depth as dd
from xkv.gateway import disk_store as ds
from xkv.gateway.config import parse_args
from xkv.gateway.disk_format import BLOCK, file_name
from xkv.gateway.disk_store import DiskItem, DiskStore

DIGEST = bytes(range(16))


@pytest.fixture
def direct_dir(tmp_path):
    """A directory for O_DIRECT files: the test suite's tmp_path, as the store's own tests use
    (tests/disk/test_disk_store.py writes O_DIRECT there too; a file system without O_DIRECT
    fails these tests rather than skipping them)."""
    return tmp_path


# ---------------------------------------------------------------------------- pieces


@given(sizes=st.lists(st.integers(0, 5 * BLOCK + 7), max_size=7),
       unit_blocks=st.integers(1, 4))
def test_pieces_cover_the_buffers_in_file_order(sizes, unit_blocks):
    unit = unit_blocks * BLOCK
    src = [bytearray(os.urandom(n)) for n in sizes]
    out = dd.pieces(src, unit)
    flat = b"".join(bytes(v) for bufs, _ in out for v in bufs)
    assert flat == b"".join(src)
    at, total = 0, sum(sizes)
    for i, (bufs, offset) in enumerate(out):
        n = sum(len(v) for v in bufs)
        assert offset == at and n > 0
        assert all(len(v) for v in bufs)  # no empty buffer is handed to preadv
        if i < len(out) - 1:
            assert n == unit  # every read but the last is one unit
        else:  # the rest; a rest under a quarter unit rides with the read before it
            assert n < unit + unit // 4
        at += n
    q, r = divmod(total, unit)
    assert len(out) == (q + (r >= unit // 4) if total > unit else int(total > 0))
    # the pieces are views: a read into them lands in the caller's buffers
    for bufs, _ in out:
        for v in bufs:
            v[:] = b"\x5a" * len(v)
    assert all(b == bytearray(b"\x5a" * len(b)) for b in src)


def test_pieces_edges():
    # an object of 4 MiB behind its 4 KiB header: one read; with 1 MiB more: two
    hdr, body = bytearray(BLOCK), bytearray(4 << 20)
    assert [sum(map(len, b)) for b, _ in dd.pieces([hdr, body])] == [(4 << 20) + BLOCK]
    assert [(sum(map(len, b)), at) for b, at in dd.pieces([hdr, body, bytearray(1 << 20)])] == [
        (4 << 20, 0), ((1 << 20) + BLOCK, 4 << 20)]
    assert dd.pieces([]) == []
    assert dd.pieces([b""]) == []
    with pytest.raises(ValueError, match="multiple of 4096, got 1000"):
        dd.pieces([b"x"], 1000)
    with pytest.raises(ValueError, match="got 0"):
        dd.pieces([b"x"], 0)


# ---------------------------------------------------------------------------- choice


def test_candidates():
    assert dd.candidates(1) == [1]
    assert dd.candidates(4) == [1, 2, 4]
    assert dd.candidates(6) == [1, 2, 4, 6]
    assert dd.candidates(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="got 0"):
        dd.candidates(0)


def test_choose_depth_smallest_within_tolerance_of_the_best_median():
    assert dd.choose_depth({1: [2.0e9, 2.1e9, 1.9e9], 2: [1.7e9] * 3, 4: [1.5e9] * 3}) == 1
    assert dd.choose_depth({1: [1.0e9] * 3, 2: [1.8e9] * 3, 4: [1.86e9] * 3}) == 2  # 0.97 x best
    assert dd.choose_depth({1: [1.0e9] * 3, 2: [1.5e9] * 3, 4: [1.86e9] * 3}) == 4
    # one fast sample does not decide: medians
    assert dd.choose_depth({1: [9e9, 1.0e9, 1.0e9], 4: [1.6e9] * 3}) == 4
    assert dd.choose_depth({1: [1.0e9], 4: [1.2e9]}, tolerance=0.2) == 1
    with pytest.raises(ValueError, match="no read rates"):
        dd.choose_depth({})
    with pytest.raises(ValueError, match="no read rates"):
        dd.choose_depth({1: []})


def test_plan():
    assert dd.plan(None, 4) == (4, [])
    assert dd.plan("auto", 4) == (4, [1, 2, 4])
    assert dd.plan("auto", 1) == (1, [])  # nothing to choose from
    assert dd.plan(1, 4) == (1, [])
    assert dd.plan(4, 4) == (4, [])
    for bad in (0, 5, -1, True, "3", 2.0, "Auto"):
        with pytest.raises(ValueError, match=rf"1\.\.4 .*got {bad!r}"):
            dd.plan(bad, 4)


# ---------------------------------------------------------------------------- the gate


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_gate_bounds_holders(limit):
    gate = dd.ReadGate(limit)
    busy, most, lock = [0], [0], threading.Lock()

    def work():
        for _ in range(20):
            with gate.hold():
                with lock:
                    busy[0] += 1
                    most[0] = max(most[0], busy[0])
                time.sleep(0.0005)
                with lock:
                    busy[0] -= 1

    ts = [threading.Thread(target=work) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts)
    assert most[0] == limit  # reached, never passed


def test_gate_raising_the_limit_lets_waiters_in():
    gate = dd.ReadGate(1)
    entered = threading.Event()
    with gate.hold():
        t = threading.Thread(target=lambda: gate.hold().__enter__() or entered.set(), daemon=True)
        t.start()
        assert not entered.wait(0.05)  # held back at 1
        gate.set_limit(2)
        assert entered.wait(5)
    assert gate.limit == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            gate.set_limit(bad)
    assert gate.limit == 2


# ---------------------------------------------------------------------------- measurement


def test_calibrate_measures_every_depth_and_leaves_nothing(direct_dir):
    rates = dd.calibrate(str(direct_dir), [1, 2, 3], unit=16 * BLOCK, count=6, rounds=2)
    assert sorted(rates) == [1, 2, 3]
    assert all(len(r) == 2 and all(x > 0 for x in r) for r in rates.values())
    assert os.listdir(direct_dir) == []
    assert dd.choose_depth(rates) in (1, 2, 3)
    assert "1: " in dd.describe(rates) and "3: " in dd.describe(rates)


def test_calibrate_errors_remove_the_file(direct_dir, monkeypatch):
    with pytest.raises(ValueError, match="depths"):
        dd.calibrate(str(direct_dir), [])
    with pytest.raises(ValueError, match="rounds 0"):
        dd.calibrate(str(direct_dir), [1], rounds=0)
    real = os.preadv

    def short(fd, bufs, offset):
        return real(fd, bufs, offset) - BLOCK  # the disk gave less than asked

    monkeypatch.setattr(dd.os, "preadv", short)
    with pytest.raises(OSError, match="short read"):
        dd.calibrate(str(direct_dir), [1, 2], unit=4 * BLOCK, count=3, rounds=1)
    assert os.listdir(direct_dir) == []


# ---------------------------------------------------------------------------- in the store


def _store(path, card, **kw):
    s = DiskStore(str(path / "disk"), card, 4096, **kw)
    s.start()
    assert wait(s, "scanned")[1] == []
    return s


def _item(key, shards, shard_bytes, base, slot, checks=None):
    return DiskItem(DIGEST, key, file_name(key), shards, shard_bytes,
                    tuple(base + r * slot for r in range(shards)), checks=checks)


@pytest.mark.parametrize("unit_blocks", [1, 2, 3, 64])
def test_objects_read_in_pieces_bit_exact(direct_dir, unit_blocks):
    card = mmap.mmap(-1, 8 << 20)
    s = _store(direct_dir, card, threads=3, read_depth=2, direct=True)
    try:
        s.read_unit = unit_blocks * BLOCK
        shard_bytes, slot = 3 * BLOCK + 123, 4 * BLOCK
        items = [_item(bytes([k + 1]), 3, shard_bytes, k * 3 * slot, slot,
                       checks=bytearray(os.urandom(40))) for k in range(4)]
        data = {}
        for it in items:
            for off in it.offsets:
                data[off] = os.urandom(shard_bytes)
                card[off:off + shard_bytes] = data[off]
        s.write(items)
        assert wait(s, "written")[2] == ["ok"] * 4
        back = [_item(it.key, 3, shard_bytes, (4 << 20) + k * 3 * slot, slot,
                      checks=bytearray(40)) for k, it in enumerate(items)]
        for it in back:  # poisoned destination
            for off in it.offsets:
                card[off:off + slot] = b"\xa5" * slot
        s.read("t", back)
        assert wait(s, "read")[2] == ["ok"] * 4
        for src, dst in zip(items, back, strict=True):
            for so, do in zip(src.offsets, dst.offsets, strict=True):
                assert card[do:do + shard_bytes] == data[so]
            assert dst.checks == src.checks
    finally:
        s.close()
        card.close()


def test_gate_holds_reads_to_the_depth(direct_dir, monkeypatch):
    card = mmap.mmap(-1, 8 << 20)
    s = _store(direct_dir, card, threads=4, read_depth=1, direct=True)
    try:
        assert (s.read_depth, s.depth_source) == (1, "fixed")
        slot = 16 * BLOCK
        items = [_item(bytes([k + 1]), 2, slot, k * 2 * slot, slot) for k in range(8)]
        for it in items:
            for off in it.offsets:
                card[off:off + slot] = os.urandom(slot)
        s.write(items)
        assert wait(s, "written")[2] == ["ok"] * 8
        real, busy, most, lock = os.preadv, [0], [0], threading.Lock()

        def counted(fd, bufs, offset):
            with lock:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            try:
                time.sleep(0.002)  # long enough for the other threads to try
                return real(fd, bufs, offset)
            finally:
                with lock:
                    busy[0] -= 1

        monkeypatch.setattr(ds.os, "preadv", counted)
        s.read_unit = 4 * BLOCK  # several pieces per object
        s.read("t", [_item(it.key, 2, slot, (4 << 20) + k * 2 * slot, slot)
                     for k, it in enumerate(items)])
        assert wait(s, "read")[2] == ["ok"] * 8
        assert most[0] == 1
    finally:
        s.close()
        card.close()


def test_auto_depth_is_measured_after_the_scan(direct_dir, monkeypatch):
    seen, real = [], dd.calibrate

    def small(root, depths, **kw):
        seen.append(list(depths))
        return real(root, depths, unit=8 * BLOCK, count=4, rounds=1)

    monkeypatch.setattr(dd, "calibrate", small)
    card = mmap.mmap(-1, 1 << 20)
    s = _store(direct_dir, card, threads=4, read_depth="auto", direct=True)
    try:
        deadline = time.monotonic() + 10
        while s.depth_source != "measured" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.depth_source == "measured" and seen == [[1, 2, 4]]
        assert s.read_depth in (1, 2, 4) and sorted(s.depth_rates) == [1, 2, 4]
        assert s.read_depth == dd.choose_depth(s.depth_rates)
        assert not [n for n in os.listdir(s.root) if n.startswith("probe")]
    finally:
        s.close()
        card.close()


@pytest.mark.parametrize("error, why", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (RuntimeError("a bug"), "a bug")])
def test_auto_depth_when_measuring_fails(direct_dir, monkeypatch, error, why):
    def full(root, depths, **kw):
        raise error

    monkeypatch.setattr(dd, "calibrate", full)
    card = mmap.mmap(-1, 1 << 20)
    s = _store(direct_dir, card, threads=3, read_depth="auto", direct=True)
    try:
        deadline = time.monotonic() + 10
        while s.depth_source.startswith("auto: measuring") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.depth_source == f"auto, not measured: {why}"
        assert s.read_depth == 3  # one read per thread, as before the option
    finally:
        s.close()
        card.close()


def test_buffered_io_is_not_measured(tmp_path):
    card = mmap.mmap(-1, 1 << 20)
    s = _store(tmp_path, card, threads=2, read_depth="auto", direct=False)
    try:
        assert s.read_depth == 2 and s.depth_source.startswith("auto, not measured: buffered")
    finally:
        s.close()
        card.close()


def test_bad_depth_refused_before_the_directory_is_made(tmp_path):
    card = mmap.mmap(-1, 1 << 20)
    with pytest.raises(ValueError, match=r"1\.\.2 .*got 3"):
        DiskStore(str(tmp_path / "disk"), card, 4096, threads=2, read_depth=3)
    assert not (tmp_path / "disk").exists()


def test_flag():
    assert parse_args(["--disk", "/x"]).disk_read_depth == "auto"
    assert parse_args(["--disk", "/x", "--disk-read-depth", "2"]).disk_read_depth == 2
    assert parse_args(["--disk", "/x", "--disk-threads", "8", "--disk-read-depth",
                       "8"]).disk_read_depth == 8
    for bad, msg in ((["--disk-read-depth", "0"], r"must be 1\.\.--disk-threads \(4\) or auto, "
                      "got 0"),
                     (["--disk-read-depth", "5"], "got 5"),
                     (["--disk-threads", "2", "--disk-read-depth", "3"], r"\(2\) or auto, got 3")):
        with pytest.raises(SystemExit, match=msg):
            parse_args(["--disk", "/x", *bad])
    with pytest.raises(SystemExit):  # argparse: not a number nor auto
        parse_args(["--disk", "/x", "--disk-read-depth", "many"])
