"""Where the gateway's Unix sockets live, and whose they are: nothing another local user could
plant is ever trusted (issue 27 item 4).

Layout: ``<base>/xkv-<uid>/gateway-<port>/{control.sock,card.sock,lock}``, every directory
mode 0700 and owned by ``<uid>``, the user both the gateway and vLLM run as. ``<base>``:

1. ``$XKV_GATEWAY_SOCKET_DIR`` when set (containers sharing a volume): that one only;
2. else the first of ``$XDG_RUNTIME_DIR`` and ``/run/user/<uid>`` that exists, is a directory
   owned by this user and closed to others (the per-user runtime directory of a login session:
   no other user can create anything in it);
3. else ``/tmp``, where another user *can* create ``/tmp/xkv-<uid>`` first: it is used only if
   it is ours with mode 0700, and refused otherwise, with an error naming the path, its owner
   and mode and what is expected.

A base must be owned by this user or root and not writable by others unless sticky (``/tmp``):
otherwise another user could rename our directory and put theirs in its place.

The gateway takes the first base of that list (:func:`candidate_bases`). A client does not
assume the same environment (a gateway started by a service manager may have no
``XDG_RUNTIME_DIR`` while vLLM's shell has one): it looks at every candidate in order and uses
the first whose socket a live gateway of its own uid serves (:func:`find_control`), so both
agree without configuration. Before the client trusts a socket it checks the chain of
directories (ours, 0700) and the listening process's uid with ``SO_PEERCRED`` (:func:`check_peer`,
also on the card hand-over socket): a socket served by another uid is refused, never used.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
import time

SOCKET_DIR_ENV = "XKV_GATEWAY_SOCKET_DIR"
_CREDS = struct.calcsize("3i")


def _euid(uid: int | None) -> int:
    return os.geteuid() if uid is None else uid


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _runtime_dir_ok(path: str, uid: int) -> bool:
    """A per-user runtime directory we may use: a real directory of ``uid``, closed to others."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077


def candidate_bases(uid: int | None = None, env=None) -> list[str]:
    """Socket bases in the order they are tried (see the module docstring); the gateway uses
    the first."""
    env = os.environ if env is None else env
    uid = _euid(uid)
    explicit = env.get(SOCKET_DIR_ENV)
    if explicit:
        return [explicit]
    out = []
    for d in (env.get("XDG_RUNTIME_DIR"), f"/run/user/{uid}"):
        if d and d not in out and _runtime_dir_ok(d, uid):
            out.append(d)
    return [*out, "/tmp"]


def socket_base(uid: int | None = None, env=None) -> str:
    """The base the gateway of ``uid`` uses in this environment."""
    return candidate_bases(uid, env)[0]


def user_dir(uid: int | None = None, base: str | None = None) -> str:
    return os.path.join(base or socket_base(uid), f"xkv-{_euid(uid)}")


def instance_dir(port: int, uid: int | None = None, base: str | None = None) -> str:
    return os.path.join(user_dir(uid, base), f"gateway-{port}")


def control_path(port: int, uid: int | None = None, base: str | None = None) -> str:
    return os.path.join(instance_dir(port, uid, base), "control.sock")


def check_base(path: str) -> None:
    """Raise PermissionError unless nobody but this user (or root) can rename entries of the
    base directory ``path``: owned by us or root, and not writable by others unless sticky."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"socket base {path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise PermissionError(
            f"socket base {path} belongs to {_owner_name(st.st_uid)}, expected this user "
            f"({os.geteuid()}) or root: its owner could replace our directory; set "
            f"{SOCKET_DIR_ENV} to a directory of your own")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise PermissionError(
            f"socket base {path} has mode {stat.S_IMODE(st.st_mode):o}: writable by others "
            f"without the sticky bit, so another user could rename our directory; expected "
            f"no write for group/others, or the sticky bit as on /tmp (chmod +t {path})")


def check_private_dir(path: str, create: bool = False) -> None:
    """Raise PermissionError unless ``path`` is a real directory owned by this user that nobody
    else may enter; with ``create`` make it (0700) when missing. The error names the path, its
    owner and mode, and what is expected."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    st = os.lstat(path)
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(
            f"{path} is not a directory (owner {_owner_name(st.st_uid)}; a symlink or file "
            f"placed there by someone else?): expected a directory of uid {me} with mode 700; "
            f"remove it or set {SOCKET_DIR_ENV}")
    if st.st_uid != me:
        raise PermissionError(
            f"{path} belongs to {_owner_name(st.st_uid)} (mode {stat.S_IMODE(st.st_mode):o}), "
            f"expected uid {me} with mode 700: another user may have planted it to catch this "
            f"user's gateway traffic; remove it (as root) or set {SOCKET_DIR_ENV}")
    if st.st_mode & 0o077:
        raise PermissionError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}, expected 700 (owner uid {me} "
            f"only): other users could reach the gateway's sockets; chmod 700 {path}")


def check_chain(port: int, base: str) -> str:
    """Check the directories of the instance ``port`` under ``base`` (base, ``xkv-<uid>``,
    ``gateway-<port>``); returns its control socket path. FileNotFoundError when one is missing,
    PermissionError when one could be another user's."""
    udir = user_dir(base=base)
    idir = os.path.join(udir, f"gateway-{port}")
    os.lstat(udir)  # FileNotFoundError first: a missing directory is no gateway, not an attack
    check_base(base)
    check_private_dir(udir)
    check_private_dir(idir)
    return os.path.join(idir, "control.sock")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected AF_UNIX socket (for a client:
    the process that listens; ``SO_PEERCRED``)."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS))
    return uid


def check_peer(sock: socket.socket, path: str) -> None:
    """Raise PermissionError unless ``sock`` (connected to ``path``) is served by this user."""
    uid, me = peer_uid(sock), os.geteuid()
    if uid != me:
        raise PermissionError(
            f"{path} is served by a process of {_owner_name(uid)}, not by this user (uid "
            f"{me}): refusing to talk to it or map its card (another local user may run a fake "
            f"gateway there)")


def probe(path: str, timeout_s: float) -> bool:
    """Connect to ``path`` and check who listens. True: a process of this user serves it;
    False: nobody does (no such file, or a dead gateway's socket); PermissionError: another
    user's process does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(max(timeout_s, 0.001))
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                return False
            raise
        check_peer(s, path)
        return True


def find_control(port: int, deadline: float, env=None) -> str:
    """The control socket of this user's live gateway instance ``port``: the first candidate
    base (:func:`candidate_bases`) whose directories check out and whose socket a process of
    this user serves. Waits (polling every 10 ms) until ``deadline`` (``time.monotonic()``) for
    one to appear. Raises PermissionError at once for a planted directory or a socket of
    another user when no good one exists, ConnectionRefusedError when only a dead gateway's
    socket is there, FileNotFoundError at the deadline when there is none."""
    while True:
        planted: PermissionError | None = None
        dead = None
        for base in candidate_bases(None, env):
            try:
                path = check_chain(port, base)
                if probe(path, deadline - time.monotonic()):
                    return path
                if os.path.lexists(path):
                    dead = path
            except FileNotFoundError:
                continue
            except PermissionError as e:
                planted = planted or e
        if planted is not None:
            raise planted
        if dead is not None:
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"nothing listens on {dead} (the gateway died or stopped)")
        if time.monotonic() >= deadline:
            bases = ", ".join(candidate_bases(None, env))
            raise FileNotFoundError(
                errno.ENOENT, f"no xkv gateway socket for port {port} under {bases} "
                              f"(xkv-{os.geteuid()}/gateway-{port}/control.sock)")
        time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
