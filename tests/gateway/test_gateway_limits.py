"""Per-client limits keyed by what the client cannot choose (issue 27 item 7): the layout cap
counts per process (uid and pid from SO_PEERCRED, as libzmq reports them to the authenticator),
not per ZMQ routing id; one client's leases are capped with a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xkv.gateway import ErrorCode, GatewayClient, GatewayError
from xkv.gateway.index import Index, RequestError
from xkv.gateway.protocol import MAX_LAYOUTS_PER_CLIENT
from xkv.gateway.testing import running_gateway

A = 64


def test_layout_cap_is_per_process_not_per_connection():
    """Today's gap: every new connection (a fresh routing id) got a fresh cap of 64 layouts, so
    one process could fill the gateway's 4,096 and lock every other client out."""
    with running_gateway("1M") as port:
        ok = refused = 0
        for i in range(MAX_LAYOUTS_PER_CLIENT + 20):
            with GatewayClient("localhost", port, timeout_s=2.0) as c:  # a new connection
                try:
                    c.register_layout("ns", f"fp{i}", 1, 4096)
                    ok += 1
                except GatewayError as e:
                    assert e.code == ErrorCode.BAD_REQUEST and "per client" in str(e)
                    refused += 1
        assert ok == MAX_LAYOUTS_PER_CLIENT and refused == 20
        # another process is another client: it still registers
        code = ("from xkv.gateway import GatewayClient\n"
                f"c = GatewayClient('localhost', {port}, timeout_s=2.0)\n"
                "print(c.register_layout('ns', 'other-process', 1, 4096).layout_id)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        assert int(out) > MAX_LAYOUTS_PER_CLIENT


def test_one_clients_leases_are_capped_with_a_clear_error(monkeypatch):
    import xkv.gateway.index as index_mod

    monkeypatch.setattr(index_mod, "MAX_LEASED_PER_CLIENT", 10)
    ix = Index(64 * A, slot_alignment=A)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    keys = [b"k%d" % i for i in range(8)]
    ix.reserve(lid, keys, now=0)
    ix.commit(lid, 0, keys)
    first = ix.lookup([(lid, keys)], now=0, owner=b"conn1", client=b"proc")[1]
    with pytest.raises(RequestError) as e:  # 8 + 8 > 10, from another connection of the process
        ix.lookup([(lid, keys)], now=0, owner=b"conn2", client=b"proc")
    assert e.value.code == ErrorCode.TOO_LARGE and "release" in str(e.value)
    assert ix.snapshot()["leases"] == 1  # nothing leased by the refused lookup
    assert ix.lookup([(lid, keys[:2])], now=0, owner=b"conn2", client=b"proc")[1]
    assert ix.lookup([(lid, keys)], now=0, owner=b"x", client=b"other")[1]  # others unaffected
    assert ix.lookup([(lid, keys)], now=0, lease=False, client=b"proc")[0] == 8
    assert ix.release(first, b"conn1") == 1
    assert ix.lookup([(lid, keys)], now=0, owner=b"conn1", client=b"proc")[1]  # room again
    ix.expire(1e9)  # TTL drops count too
    assert ix._leased_by == {}
