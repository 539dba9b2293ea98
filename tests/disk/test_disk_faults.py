"""The disk tier's faults made real, not injected (issue 26's list): a file system that really
fills up (a 1 MiB tmpfs), files that really belong to another uid (made by that uid with
``setpriv``), and a directory that the gateway's uid really cannot write (the check run in a
child process that dropped to another uid). Each is a clear error or a miss, never wrong bytes.

These need root (mount, setpriv, setresuid) and skip without it; the injected versions of the
same faults, which run as any user, are in test_disk_store.py and test_disk_tier.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

import pytest

from xkv.gateway.client import GatewayClient
from xkv.gateway.disk_dir import DiskError, check_dir
from xkv.gateway.disk_format import ROOT_NAME, TMP_MARK, file_bytes, file_name, rel_path
from xkv.gateway.testing import spawn_gateway, stop_gateway
from xkv.gateway.tier_store import layout_digest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mount, setpriv, setuid")

SHARDS, SHARD_BYTES = 2, 50000
FILE = file_bytes(SHARDS, SHARD_BYTES)  # 108 KiB on disk
NOBODY = 65534


def stats_when(c, pred, timeout_s=20.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not pred(s := c.stats()):
        assert time.monotonic() < deadline, s
        time.sleep(0.01)
    return s


def store(c, lid, n):
    """``n`` objects stored one at a time (each written to disk, or refused, before the next);
    returns {key: [shard bytes]}."""
    card = c.map_card()
    data = {}
    for _ in range(n):
        k = os.urandom(32)
        s0 = c.stats()
        done0 = s0["disk_written"] + s0["disk_full"] + s0["disk_write_errors"]
        (r,) = c.reserve(lid, [k])
        data[k] = []
        for off in r.offsets:
            b = os.urandom(SHARD_BYTES)
            card[off:off + SHARD_BYTES] = b
            data[k].append(b)
        for s in range(SHARDS):
            assert c.commit(lid, s, [r]) == 1
        stats_when(c, lambda s, d=done0: s["disk_written"] + s["disk_full"]
                   + s["disk_write_errors"] == d + 1 and not s["disk_write_backlog_bytes"])
    return data


def path_of(d, ns, key):
    digest = layout_digest(ns, "fp", SHARDS, SHARD_BYTES)
    return os.path.join(d, ROOT_NAME, rel_path(digest, file_name(key)))


def check_restored(c, lid, keys, data) -> int:
    """Look up ``keys`` (the card empty): the prefix restored from disk must be bit-exact."""
    card = c.map_card()
    r = c.lookup([(lid, keys)])
    for i, k in enumerate(keys[:r.num_chunks]):
        for s, off in enumerate(r.slots[0][i].offsets):
            assert bytes(card[off:off + SHARD_BYTES]) == data[k][s], (i, s)
    if r.lease_id:
        c.release(r.lease_id)
    return r.num_chunks


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs (O_DIRECT works on tmpfs since Linux 6.6): ENOSPC for real."""
    m = tmp_path / "small"
    m.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs", str(m)],
                       capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield str(m)
    finally:
        subprocess.run(["umount", "-l", str(m)], check=False)


def test_real_disk_full(tiny_fs):
    """The tier believes it has 8 MiB, the file system has 1 MiB: the write that meets ENOSPC
    is dropped with its temporary file, the capacity is lowered to what fits, and later writes
    delete the oldest files to make room (no second ENOSPC: deletes run before writes). After a
    restart every file left is served bit-exact and nothing else is."""
    args = ["--disk", tiny_fs, "--disk-capacity", "8M", "--disk-wait-ms", "5000"]
    proc, port = spawn_gateway("16M", extra_args=args)
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
            lid = c.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
            data = store(c, lid, 16)  # 16 x 108 KiB: about 9 fit
            s = c.stats()
            assert s["disk_full"] == 1, s  # once: after it the capacity is what fits
            assert s["disk_capacity_bytes"] < 1 << 20
            assert s["disk_written"] == 15 and s["disk_write_errors"] == 0
            assert s["disk_evicted"] == 15 - s["disk_objects"]
    finally:
        stop_gateway(proc)
    names = [f for _, _, fs in os.walk(tiny_fs) for f in fs]
    assert not [f for f in names if TMP_MARK in f]  # no temporary file left behind
    keys = list(data)
    on_disk = [os.path.exists(path_of(tiny_fs, "prod", k)) for k in keys]
    assert on_disk[-1] and not on_disk[0] and len(names) == sum(on_disk)
    first = on_disk.index(True)
    # the oldest went first; the one write that met the full disk is the only other gap
    (gap,) = [i for i in range(first, len(keys)) if not on_disk[i]]
    proc, port = spawn_gateway("16M", extra_args=args)
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
            lid = c.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
            s = stats_when(c, lambda s: s["disk_scanned"])
            assert s["disk_scan_found"] == len(names)
            assert check_restored(c, lid, keys[first:gap], data) == gap - first
            assert check_restored(c, lid, keys[gap + 1:], data) == len(keys) - gap - 1
            assert check_restored(c, lid, keys[gap:gap + 1], data) == 0  # never written
            assert check_restored(c, lid, keys[:first], data) == 0  # deleted: a miss
    finally:
        stop_gateway(proc)


def as_nobody(*cmd: str) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    *cmd], check=True, capture_output=True)


def test_another_uids_files_are_never_read(tmp_path):
    """A valid object file made by another uid (a copy of a real one, by ``cp`` as uid 65534)
    under a key's name: the scan skips it, a lookup misses it and it is left where it is; one
    swapped in after the scan is refused at open (``foreign``), also left alone."""
    d = str(tmp_path / "disk")
    stage = tempfile.mkdtemp(dir="/var/tmp")
    os.chmod(stage, 0o777)
    args = ["--disk", d, "--disk-wait-ms", "5000"]
    try:
        proc, port = spawn_gateway("16M", extra_args=args)
        try:
            with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
                lid = c.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
                data = store(c, lid, 4)
        finally:
            stop_gateway(proc)
        keys = list(data)

        def plant(key):
            """Replace ``key``'s file with a byte-identical one that uid 65534 owns."""
            p = path_of(d, "prod", key)
            shutil.copy(p, os.path.join(stage, "mine"))
            os.chmod(os.path.join(stage, "mine"), 0o644)
            as_nobody("cp", os.path.join(stage, "mine"), os.path.join(stage, "theirs"))
            assert os.stat(os.path.join(stage, "theirs")).st_uid == NOBODY
            os.replace(os.path.join(stage, "theirs"), p)  # rename keeps the owner
            return p

        p0 = plant(keys[0])
        proc, port = spawn_gateway("16M", extra_args=args)
        try:
            with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
                lid = c.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
                s = stats_when(c, lambda s: s["disk_scanned"])
                assert s["disk_scan_skipped"] == 1 and s["disk_scan_found"] == 3
                assert check_restored(c, lid, keys, data) == 0  # chunk 0 is not ours: a miss
                assert os.stat(p0).st_uid == NOBODY  # not ours to remove
                p2 = plant(keys[2])  # after the scan: the tier still lists it
                assert check_restored(c, lid, keys[1:], data) == 1  # key 1, then key 2 refused
                s = c.stats()
                assert s["disk_foreign"] == 1 and s["disk_hits"] == 2  # keys 1 and 3 read
                assert os.stat(p2).st_uid == NOBODY
        finally:
            stop_gateway(proc)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _check_dir_as(uid: int, path: str) -> str:
    """check_dir(path) in a child that dropped to ``uid`` (real permissions); its error text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery from here on
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            try:
                check_dir(path)
                msg = "ok"
            except DiskError as e:
                msg = str(e)
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_directory_the_gateways_uid_cannot_use():
    """Run as uid 65534: a root-owned directory it cannot write, a missing one it cannot
    create, and a root-owned ``xkv-disk-1`` are each refused with the path and the uid."""
    base = tempfile.mkdtemp(dir="/var/tmp")
    try:
        os.chmod(base, 0o755)  # root's, readable by all, writable by root only
        msg = _check_dir_as(NOBODY, base)
        assert f"cannot create {base}/{ROOT_NAME}" in msg and f"uid {NOBODY}" in msg, msg
        msg = _check_dir_as(NOBODY, os.path.join(base, "sub"))
        assert "does not exist and cannot be created (Permission denied)" in msg, msg
        os.chmod(base, 0o777)
        os.mkdir(os.path.join(base, ROOT_NAME), 0o700)  # root's cache
        msg = _check_dir_as(NOBODY, base)
        assert f"belongs to uid 0, not to this gateway's uid {NOBODY}" in msg, msg
        shutil.rmtree(os.path.join(base, ROOT_NAME))
        assert _check_dir_as(NOBODY, base) == "ok"  # its own: fine
        st = os.stat(os.path.join(base, ROOT_NAME))
        assert st.st_uid == NOBODY and st.st_mode & 0o777 == 0o700
        assert "belongs to uid 65534" in _check_dir_as(0, base)  # and root keeps out of it
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)
