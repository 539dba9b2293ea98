"""The disk tier's directory: created (mode 0700) and checked before the tier starts, and whether
O_DIRECT works in it (probed with one aligned block, like vLLM's file tier): anything that is not
this user's private directory is refused with a message naming the path and what to do."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat

from xkv.gateway.disk_format import BLOCK, ROOT_NAME, TMP_MARK

__all__ = ["DiskError", "check_dir", "sync_dir"]


class DiskError(Exception):
    """The directory cannot be used: the message says why and what to do."""


def sync_dir(path: str) -> None:
    """Make ``path``'s entries durable (fsync of the directory): a file renamed or a directory
    made in it survives a power loss only after this (issue 26)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_old_probes(root: str) -> None:
    """Remove probe files an earlier start left behind (a power loss between the probe's create
    and its unlink leaves one; never read, but they would pile up). Only our regular files."""
    for name in os.listdir(root):
        if not name.startswith(f"probe{TMP_MARK}"):
            continue
        p = os.path.join(root, name)
        # gone meanwhile or not ours to remove: the scan ignores it either way
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(p)


def check_dir(path: str) -> tuple[str, bool]:
    """Make ``<path>/xkv-disk-1`` (mode 0700) and check it is usable; returns (its path, whether
    O_DIRECT works there). Raises DiskError naming the path and the problem."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        try:
            os.mkdir(path, 0o700)
            sync_dir(os.path.dirname(path))
        except OSError as e:
            raise DiskError(f"--disk {path}: the directory does not exist and cannot be created "
                            f"({e.strerror}); create it, owned by this user") from None
    root = os.path.join(path, ROOT_NAME)
    try:
        os.mkdir(root, 0o700)
        sync_dir(path)
    except FileExistsError:
        pass
    except OSError as e:
        raise DiskError(f"--disk {path}: cannot create {root} ({e.strerror}); the directory must "
                        f"be writable by uid {os.geteuid()}") from None
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise DiskError(f"--disk {path}: {root} is not a directory (a symlink or file is in the "
                        f"way); remove it")
    if st.st_uid != os.geteuid():
        raise DiskError(f"--disk {path}: {root} belongs to uid {st.st_uid}, not to this "
                        f"gateway's uid {os.geteuid()}; another user's cache is never read: use "
                        f"another directory")
    if st.st_mode & 0o077:
        raise DiskError(f"--disk {path}: {root} has mode {st.st_mode & 0o777:o}; other users "
                        f"could read or plant objects: chmod 700 it")
    _remove_old_probes(root)
    probe = os.path.join(root, f"probe{TMP_MARK}{secrets.token_hex(4)}")
    buf = mmap.mmap(-1, BLOCK)
    direct = hasattr(os, "O_DIRECT")
    try:
        for attempt in ((True, False) if direct else (False,)):
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(probe, flags | (os.O_DIRECT if attempt else 0), 0o600)
            except OSError as e:
                if attempt and e.errno == 22:  # EINVAL: no O_DIRECT on this file system
                    direct = False
                    continue
                raise
            try:
                os.pwrite(fd, buf, 0)
                os.fdatasync(fd)
            except OSError as e:
                os.close(fd)
                os.unlink(probe)
                if attempt and e.errno == 22:
                    direct = False
                    continue
                raise
            os.close(fd)
            os.unlink(probe)
            direct = attempt
            break
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(probe)
        raise DiskError(f"--disk {path}: cannot write a test file in {root} ({e.strerror})") from None
    finally:
        buf.close()
    return root, direct
