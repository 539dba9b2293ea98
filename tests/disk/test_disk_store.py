"""The disk tier's store (xkv/gateway/disk_store.py, disk_format.py) on its own: an object written
from card slots and read back into other (poisoned) slots is bit-exact, with O_DIRECT and with
buffered I/O, for odd sizes; every damaged, missing or foreign file is a miss with a clear
status, never bytes; the directory's checks refuse what must not be used."""

from __future__ import annotations

import mmap
import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_results import wait  # noqa: E402

from xkv.gateway import disk_store as ds
from xkv.gateway.disk_format import (
    BLOCK,
    ROOT_NAME,
    TMP_MARK,
    check_header,
    file_bytes,
    file_name,
    pack_header,
)
from xkv.gateway.disk_store import DiskError, DiskItem, DiskStore, check_dir

DIGEST = bytes(range(16))
CARD = 8 << 20


@pytest.fixture
def card():
    m = mmap.mmap(-1, CARD)
    yield m
    m.close()


def make_store(tmp_path, card, **kw):
    s = DiskStore(str(tmp_path / "disk"), card, 4096, threads=2, **kw)
    s.start()
    assert wait(s, "scanned")[1] == []
    return s


def item(key, shards, shard_bytes, base, slot_bytes):
    return DiskItem(DIGEST, key, file_name(key), shards, shard_bytes,
                    tuple(base + r * slot_bytes for r in range(shards)))


def fill(card, it, rng):
    data = [rng(it.shard_bytes) for _ in it.offsets]
    for off, d in zip(it.offsets, data, strict=True):
        card[off:off + len(d)] = d
    return data


@pytest.mark.parametrize("direct", [True, False])
@given(shards=st.integers(1, 4), shard_bytes=st.integers(1, 70000),
       key=st.binary(min_size=1, max_size=128))
def test_roundtrip_bit_exact(tmp_path_factory, direct, shards, shard_bytes, key):
    tmp = tmp_path_factory.mktemp("rt")
    card = mmap.mmap(-1, CARD)
    s = make_store(tmp, card, direct=direct)
    try:
        assert s.direct is direct
        slot = -(-shard_bytes // 4096) * 4096
        src = item(key, shards, shard_bytes, 0, slot)
        data = fill(card, src, os.urandom)
        s.write([src])
        _, items, status, nbytes, _ = wait(s, "written")
        assert status == ["ok"] and nbytes == file_bytes(shards, shard_bytes)
        path = os.path.join(s.root, src.rel)
        assert os.path.getsize(path) == src.nbytes
        assert os.stat(path).st_mode & 0o777 == 0o600
        dst = item(key, shards, shard_bytes, 4 << 20, slot)
        for off in dst.offsets:  # poisoned destination
            card[off:off + slot] = b"\xa5" * slot
        s.read("t", [dst])
        assert wait(s, "read")[1:3] == ("t", ["ok"])
        for off, d in zip(dst.offsets, data, strict=True):
            assert card[off:off + shard_bytes] == d
    finally:
        s.close()
        card.close()


def test_header_names_its_object():
    key = os.urandom(32)
    h = pack_header(DIGEST, key, 3, 1000, 1234)
    assert len(h) == BLOCK
    assert check_header(h, DIGEST, key, 3, 1000) == 1234
    with pytest.raises(ValueError, match="another key"):
        check_header(h, DIGEST, key[:-1] + b"x", 3, 1000)
    with pytest.raises(ValueError, match="another layout"):
        check_header(h, DIGEST, key, 2, 1000)
    with pytest.raises(ValueError, match="another layout"):
        check_header(h, bytes(16), key, 3, 1000)
    bad = bytearray(h)
    bad[20] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        check_header(bytes(bad), DIGEST, key, 3, 1000)
    with pytest.raises(ValueError, match="not an xkv"):
        check_header(bytes(BLOCK), DIGEST, key, 3, 1000)
    # long keys get a hashed name; the header still holds (and checks) the whole key
    long_key = os.urandom(100)
    assert file_name(long_key).startswith("h") and len(file_name(long_key)) == 65
    assert check_header(pack_header(DIGEST, long_key, 1, 5, 7), DIGEST, long_key, 1, 5) == 7


def stored(s, card, n=1, shard_bytes=10000, shards=2):
    out = []
    for i in range(n):
        it = item(os.urandom(32), shards, shard_bytes, i * 2 * 16384, 16384)
        data = fill(card, it, os.urandom)
        s.write([it])
        assert wait(s, "written")[2] == ["ok"]
        out.append((it, data))
    return out


def read_back(s, card, it):
    """Read ``it`` into poisoned slots elsewhere; (status, slots bytes)."""
    dst = DiskItem(it.digest, it.key, it.name, it.num_shards, it.shard_bytes,
                   tuple((6 << 20) + r * 16384 for r in range(it.num_shards)))
    for off in dst.offsets:
        card[off:off + 16384] = b"\x5a" * 16384
    s.read(1, [dst])
    status = wait(s, "read")[2][0]
    return status, [bytes(card[o:o + it.shard_bytes]) for o in dst.offsets]


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "extend",
                                    "swap", "delete", "symlink"])
def test_damaged_files_are_misses(tmp_path, card, damage):
    s = make_store(tmp_path, card)
    try:
        (a, _), (b, _) = stored(s, card, 2)
        pa, pb = (os.path.join(s.root, x.rel) for x in (a, b))
        if damage == "truncate":
            os.truncate(pa, a.nbytes - BLOCK)
        elif damage == "extend":
            os.truncate(pa, a.nbytes + BLOCK)
        elif damage in ("flip_payload", "flip_header"):
            with open(pa, "r+b") as f:
                f.seek(BLOCK + 5000 if damage == "flip_payload" else 40)
                c = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([c[0] ^ 0x10]))
        elif damage == "swap":  # another object's (valid) file under this name
            os.replace(pb, pa)
        elif damage == "delete":
            os.unlink(pa)
        else:
            os.unlink(pa)
            os.symlink(pb, pa)
        status, got = read_back(s, card, a)
        want = {"truncate": "truncated", "extend": "truncated", "flip_payload": "corrupt",
                "flip_header": "corrupt", "swap": "corrupt", "delete": "lost",
                "symlink": "foreign"}[damage]
        assert status == want
        if damage != "symlink":  # a bad file of ours is removed; a symlink is left alone
            assert not os.path.exists(pa)
    finally:
        s.close()


def test_foreign_files_never_read(tmp_path, card, monkeypatch):
    """Files that are not this uid's are skipped by the scan and never read (the uid is
    faked: the files are really ours, so the test runs as any user)."""
    s = make_store(tmp_path, card)
    (a, data), = stored(s, card, 1)
    s.close()
    real = os.geteuid()
    s2 = DiskStore(str(tmp_path / "disk"), card, 4096, threads=1)
    s2._uid = real + 1  # as if the files belonged to someone else
    s2.start()
    try:
        _, found, skipped, removed = wait(s2, "scanned")
        assert found == [] and skipped == 1 and removed == 0
        status, got = read_back(s2, card, a)
        assert status == "foreign" and got != data
        assert os.path.exists(os.path.join(s2.root, a.rel))  # not ours to remove
    finally:
        s2.close()


def test_scan_finds_objects_and_removes_unfinished_writes(tmp_path, card):
    s = make_store(tmp_path, card)
    objs = stored(s, card, 3)
    s.close()
    d = os.path.dirname(os.path.join(s.root, objs[0][0].rel))
    with open(os.path.join(d, objs[0][0].name + ".tmp-dead"), "wb") as f:
        f.write(b"\0" * BLOCK)  # a write a crash cut short
    # junk that is no object's file: skipped, never an entry (nor a crash of the loop)
    os.makedirs(os.path.join(s.root, "z" * 32, "zz"))
    for junk in ("not-hex", "abc", objs[1][0].name[:2] + "0" * 62 + "zz"):
        with open(os.path.join(d, junk), "wb") as f:
            f.write(b"\0" * BLOCK)
    wrong_dir = os.path.join(s.root, DIGEST.hex(), "00" if objs[0][0].name[:2] != "00" else "01")
    os.makedirs(wrong_dir, exist_ok=True)
    with open(os.path.join(wrong_dir, objs[0][0].name), "wb") as f:
        f.write(b"\0" * BLOCK)
    s2 = DiskStore(str(tmp_path / "disk"), card, 4096, threads=1)
    s2.start()
    try:
        _, found, skipped, removed = wait(s2, "scanned")
        assert removed == 1 and skipped == 5
        assert sorted(f[1] for f in found) == sorted(it.name for it, _ in objs)
        assert all(f[0] == DIGEST.hex() and f[2] == objs[0][0].nbytes for f in found)
        for it, data in objs:
            assert read_back(s2, card, it) == ("ok", data)
    finally:
        s2.close()


def test_disk_full_is_reported_and_leaves_nothing(tmp_path, card, monkeypatch):
    s = make_store(tmp_path, card)
    try:
        def full(*a):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ds.os, "pwritev", full)
        it = item(os.urandom(32), 1, 5000, 0, 8192)
        fill(card, it, os.urandom)
        s.write([it])
        assert wait(s, "written")[2] == ["full"]
        monkeypatch.undo()
        assert not any(files for _, _, files in os.walk(s.root))  # no temporary file left
        assert read_back(s, card, it)[0] == "lost"
    finally:
        s.close()


def test_directory_checks(tmp_path, card, monkeypatch):
    with pytest.raises(DiskError, match="does not exist and cannot be created"):
        check_dir(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(DiskError, match="cannot create"):
        check_dir("/proc/self")  # not writable, even for root
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(DiskError):
        check_dir(str(tmp_path / "f"))
    d = tmp_path / "d"
    d.mkdir()
    (d / ROOT_NAME).write_bytes(b"")
    with pytest.raises(DiskError, match="not a directory"):
        check_dir(str(d))
    os.unlink(d / ROOT_NAME)
    root, _ = check_dir(str(d))
    assert os.stat(root).st_mode & 0o777 == 0o700
    os.chmod(root, 0o755)
    with pytest.raises(DiskError, match="chmod 700"):
        check_dir(str(d))
    os.chmod(root, 0o700)
    monkeypatch.setattr(ds.os, "geteuid", lambda: 4242424)
    with pytest.raises(DiskError, match="belongs to uid"):
        check_dir(str(d))


def test_a_start_removes_probe_files_an_earlier_start_left(tmp_path):
    """A power loss between the O_DIRECT probe's create and unlink leaves its file; the next start
    removes it (only probe files: an object's temporary file is the scan's business)."""
    root, _ = check_dir(str(tmp_path))
    old = os.path.join(root, f"probe{TMP_MARK}0badcafe")
    other = os.path.join(root, f"ab{TMP_MARK}12345678")
    os.makedirs(os.path.join(root, f"probe{TMP_MARK}dir"))  # not a regular file: left alone
    for p in (old, other):
        with open(p, "wb") as f:
            f.write(b"\0" * BLOCK)
    check_dir(str(tmp_path))
    left = sorted(os.listdir(root))
    assert os.path.basename(old) not in left and os.path.basename(other) in left
    assert f"probe{TMP_MARK}dir" in left and not any(
        n.startswith(f"probe{TMP_MARK}") and os.path.isfile(os.path.join(root, n)) for n in left)


def test_o_direct_refused_when_slots_are_not_aligned(tmp_path, card):
    with pytest.raises(DiskError, match="not a multiple"):
        DiskStore(str(tmp_path / "d"), card, 512, direct=True)
    s = DiskStore(str(tmp_path / "d"), card, 512)
    assert not s.direct  # falls back to buffered I/O
    s.close()


def test_io_threads_run_below_the_loop(tmp_path, card):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    s = make_store(tmp_path, card, nice=5)
    try:
        want = min(base + 5, 19)
        deadline = time.monotonic() + 10  # each thread sets its own as it starts
        while any(os.getpriority(os.PRIO_PROCESS, t.native_id) != want for t in s._threads):
            assert time.monotonic() < deadline, "I/O threads kept the loop's priority"
            time.sleep(0.01)
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the calling thread is unchanged
    finally:
        s.close()


@pytest.mark.parametrize("writer, reader", [(True, False), (False, True)])
def test_files_checked_the_same_by_libdeflate_and_zlib(tmp_path, card, monkeypatch, writer,
                                                       reader):
    """A file written with one CRC-32 code verifies with the other (the format's checksum is
    zlib's either way), and a flipped payload bit fails with both."""
    from xkv.gateway.disk_crc import SlotCrc

    def using(flag):
        monkeypatch.setattr(ds, "SlotCrc", lambda c: SlotCrc(c, use_libdeflate=flag))

    using(writer)
    s = make_store(tmp_path, card)
    objs = stored(s, card, 2)  # 2 shards of 10000 B (12288 B strides in the file)
    s.close()
    using(reader)
    s = DiskStore(str(tmp_path / "disk"), card, 4096, threads=2)
    s.start()
    try:
        if not reader:
            assert s.crc_kind == "zlib"
        wait(s, "scanned")
        assert read_back(s, card, objs[0][0]) == ("ok", objs[0][1])
        with open(os.path.join(s.root, objs[1][0].rel), "r+b") as f:
            f.seek(BLOCK + 12288 + 9999)  # the second shard's last byte
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x80]))
        assert read_back(s, card, objs[1][0])[0] == "corrupt"
    finally:
        s.close()
