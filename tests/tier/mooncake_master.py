"""A real ``mooncake_master`` on loopback for the tier tests: start, SIGKILL, restart (same ports)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    found = here if os.path.exists(here) else shutil.which("mooncake_master")
    if not found:
        raise RuntimeError("mooncake_master not found next to the Python interpreter or on PATH "
                           "(pip install 'xkv[mooncake]')")
    return found


class Master:
    """``rpc`` and ``http`` ports are fixed at construction, so a restart comes back where the
    gateways' clients look for it. Its log goes to ``log_path``."""

    def __init__(self, log_path: str, *, lease_ttl_ms: int = 1000, client_ttl_s: int = 10):
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.log_path = log_path
        self.args = [_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
                     "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                     f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
                     f"--metrics_port={self.metrics}", f"--default_kv_lease_ttl={lease_ttl_ms}",
                     f"--client_ttl={client_ttl_s}"]
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def gateway_args(self, segment: str = "64M") -> list[str]:
        return ["--mooncake-master", self.address, "--mooncake-metadata", self.metadata,
                "--mooncake-segment-size", segment]

    def start(self, timeout_s: float = 30.0) -> Master:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        for port in (self.rpc, self.http):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited {self.proc.returncode}; "
                                       f"log {self.log_path}")
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mooncake_master did not listen on {port}")
                time.sleep(0.05)
        return self

    def kill(self) -> None:
        """SIGKILL: no goodbye to the clients (what a crashed master looks like)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def capacity(self) -> int:
        """Bytes of segments mounted now (master_total_capacity_bytes); -1 if it does not answer."""
        import urllib.request

        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics",
                                          timeout=2).read().decode()
        except OSError:
            return -1
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        return -1

    def wait_capacity(self, nbytes: int, timeout_s: float = 60.0) -> None:
        """Until the gateways' segments (re-)mounted: ``nbytes`` in all."""
        deadline = time.monotonic() + timeout_s
        while self.capacity() < nbytes:
            if time.monotonic() > deadline:
                raise AssertionError(f"master has {self.capacity()} B of segments, not {nbytes}")
            time.sleep(0.1)

    def client(self, segment: int = 32 << 20):
        """A plain Mooncake client (the tests' hand on the shared store)."""
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", self.metadata, segment, 16 << 20, "tcp", "", self.address)
        if rc != 0:
            raise RuntimeError(f"mooncake client setup returned {rc}")
        return s


@contextlib.contextmanager
def running_master(log_path: str, **kw):
    m = Master(log_path, **kw).start()
    try:
        yield m
    finally:
        m.stop()
