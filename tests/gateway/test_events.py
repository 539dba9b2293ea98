"""KV events of the gateway, decoded with vLLM's own decoder (``vllm.distributed.kv_events``):
a stored prompt's blocks, then their eviction, then AllBlocksCleared at shutdown."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from xkv.gateway import ErrorCode, GatewayClient, GatewayError
from xkv.gateway.events import DEFAULT_EVENTS_PORT
from xkv.gateway.testing import spawn_gateway, stop_gateway

pytestmark = pytest.mark.vllm
PAGE = 4096


def _chain(n: int, seed: bytes) -> list[bytes]:
    """n chained 32-byte hashes, like vLLM's sha256 block hashes."""
    out, h = [], seed
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        out.append(h)
    return out


def _low64(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


class Sub:
    """A subscriber as a router writes one against vLLM: SUB socket, vLLM's decoder."""

    def __init__(self, port: int):
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.seqs: list[int] = []

    def events(self, timeout_s: float = 5.0, until=None) -> list:
        """Events received until ``until(events)`` is true (or the timeout)."""
        out, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (until and until(out)):
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == b"" and len(seq) == 8
                self.seqs.append(int.from_bytes(seq, "big"))
                out.extend(self.decoder.decode(payload).events)
        return out

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def _connect(client: GatewayClient, sub: Sub, layout_id: int) -> None:
    """Beat ZMQ's slow joiner: store probe objects until the subscriber sees one."""
    for i in range(100):
        key = hashlib.sha256(b"probe%d" % i).digest()
        client.commit(layout_id, 0, client.reserve(layout_id, [key]))
        if sub.events(0.1):
            sub.events(0.2)  # drain the rest of the probes
            return
    raise AssertionError("the subscriber never received an event")


@pytest.fixture
def events_gateway():
    proc, port = spawn_gateway("64K", extra_args=["--kv-events-port", "0"])
    yield proc, port
    stop_gateway(proc)


def test_stored_prompt_then_eviction_then_cleared(events_gateway):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    proc, port = events_gateway
    with GatewayClient("127.0.0.1", port) as c:
        probe = c.register_layout("probe", "fp-probe", 1, PAGE)
        info = c.register_layout("ns", "fp", 1, PAGE)
        assert info.events and c.events_enabled
        sub = Sub(c.stats()["kv_events_port"])
        try:
            _connect(c, sub, probe.layout_id)
            k = 4  # hash blocks per chunk
            hashes = _chain(3 * k, b"prompt")
            keys = [hashes[(i + 1) * k - 1] for i in range(3)]
            blocks = [(hashes[i * k:(i + 1) * k], hashes[i * k - 1] if i else None)
                      for i in range(3)]
            res = c.reserve(info.layout_id, keys, blocks=blocks, block_size=16, group_idx=0)
            assert all(r is not None for r in res)
            assert sub.events(0.3) == []  # reserved is not stored: nothing visible yet
            assert c.commit(info.layout_id, 0, res) == 3
            got = sub.events(until=lambda ev: len(ev) >= 3)
            assert [type(e) for e in got] == [BlockStored] * 3
            for i, e in enumerate(got):
                assert e.block_hashes == [_low64(h) for h in blocks[i][0]]
                assert e.parent_block_hash == (None if i == 0 else _low64(hashes[i * k - 1]))
                assert (e.block_size, e.medium, e.group_idx, e.token_ids) == (16, "CPU", 0, [])
            # 64K card = 16 one-page objects: 16 more keys evict the probes and the prompt
            others = _chain(16, b"other")
            c.reserve(info.layout_id, others)
            removed = sub.events(until=lambda ev: sum(
                isinstance(e, BlockRemoved) and e.block_hashes[-1] == _low64(keys[-1])
                for e in ev))
            ours = [e for e in removed if isinstance(e, BlockRemoved)
                    and e.block_hashes[-1] in {_low64(x) for x in keys}]
            assert [e.block_hashes for e in ours] == [[_low64(h) for h in b[0]] for b in blocks]
            assert all(e.medium == "CPU" and e.group_idx == 0 for e in ours)
            assert c.lookup([(info.layout_id, keys[:1])]).num_chunks == 0
            s = c.stats()
            assert s["kv_events_stored"] >= 3 and s["kv_events_removed"] >= 3
            assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
            stop_gateway(proc)
            assert any(isinstance(e, AllBlocksCleared) for e in sub.events(3.0, until=bool))
        finally:
            sub.close()


def test_reserve_checks_the_blocks_before_reserving(events_gateway):
    _, port = events_gateway
    with GatewayClient("127.0.0.1", port) as c:
        info = c.register_layout("ns", "fp", 1, PAGE)
        hashes = _chain(4, b"x")
        with pytest.raises(GatewayError, match="last block hash") as e:
            c.reserve(info.layout_id, [hashes[2]], blocks=[(hashes, None)], block_size=16)
        assert e.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(GatewayError, match="one BlockInfo per key"):
            c.reserve(info.layout_id, [hashes[1], hashes[3]], blocks=[(hashes, None)],
                      block_size=16)
        with pytest.raises(GatewayError, match="block_size"):
            c.reserve(info.layout_id, [hashes[3]], blocks=[(hashes, None)], block_size=0)
        assert c.stats()["reserved"] == 0  # nothing was reserved by the refused requests
        assert c.reserve(info.layout_id, [hashes[3]], blocks=[(hashes, None)], block_size=16)[0]


def test_bytes_hashes_and_placeholder_without_blocks():
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (vLLM's switch) keeps the 32-byte hashes; a RESERVE
    without blocks is announced as vLLM's offloading connector does: [key], block_size 0."""
    from vllm.distributed.kv_events import BlockStored

    env_before = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    try:
        proc, port = spawn_gateway("1M", extra_args=["--kv-events-port", "0",
                                                     "--kv-events-medium", "CPU_PINNED"])
    finally:
        if env_before is None:
            del os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"]
        else:
            os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = env_before
    try:
        with GatewayClient("127.0.0.1", port) as c:
            info = c.register_layout("ns", "fp", 2, PAGE)
            sub = Sub(c.stats()["kv_events_port"])
            try:
                _connect(c, sub, c.register_layout("probe", "p", 1, PAGE).layout_id)
                h = _chain(2, b"b")
                res = c.reserve(info.layout_id, [h[1]], blocks=[(h, None)], block_size=8)
                res += c.reserve(info.layout_id, [h[0]])
                c.commit(info.layout_id, 0, res)
                assert sub.events(0.3) == []  # shard 1 has not committed: not visible
                c.commit(info.layout_id, 1, res)
                got = sub.events(until=lambda ev: len(ev) >= 2)
                assert all(type(e) is BlockStored and e.medium == "CPU_PINNED" for e in got)
                assert [(e.block_hashes, e.block_size) for e in got] == [(h, 8), ([h[0]], 0)]
            finally:
                sub.close()
    finally:
        stop_gateway(proc)


def test_events_off_by_default_and_port_rules(gateway):
    _, port = gateway
    with GatewayClient("127.0.0.1", port) as c:
        info = c.register_layout("ns", "fp", 1, PAGE)
        assert not info.events and not c.events_enabled
        h = _chain(2, b"off")
        # blocks are dropped by the client for a gateway without events (an older gateway
        # would refuse the unknown field)
        assert c.reserve(info.layout_id, [h[1]], blocks=[(h, None)], block_size=16)[0]
        assert "kv_events_port" not in c.stats()
    r = subprocess.run([sys.executable, "-m", "xkv.gateway", "--port", "6001",
                        "--kv-events-port", "6001"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "control port" in r.stderr
    r = subprocess.run([sys.executable, "-m", "xkv.gateway", "--kv-events-replay-port", "6002"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "needs --kv-events" in r.stderr
    out = subprocess.run([sys.executable, "-m", "xkv.gateway", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--kv-events" in out and str(DEFAULT_EVENTS_PORT) in out
    assert DEFAULT_EVENTS_PORT not in (5557, *range(5557, 5557 + 64))


def test_replay_socket_answers_like_vllms():
    """--kv-events-replay-port: vLLM's replay protocol (ROUTER; request = 8-byte big-endian start
    sequence; answer = every kept batch from there as [topic, seq, payload], then END_SEQ)."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    proc, port = spawn_gateway("1M", extra_args=["--kv-events-port", "0",
                                                 "--kv-events-replay-port", "0"])
    ctx = zmq.Context()
    try:
        with GatewayClient("127.0.0.1", port) as c:
            info = c.register_layout("ns", "fp", 1, PAGE)
            keys = _chain(3, b"r")
            for k in keys:  # three commits: three loop passes, usually three batches
                c.commit(info.layout_id, 0, c.reserve(info.layout_id, [k]))
            replay_port = c.stats()["kv_events_replay_port"]
        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        decoder = msgspec.msgpack.Decoder(KVEventBatch)

        def replay(start: int) -> list[tuple[int, list]]:
            req.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while req.poll(5000):
                empty, topic, seq, payload = req.recv_multipart()
                assert empty == b""
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return out
                out.append((int.from_bytes(seq, "big"), decoder.decode(payload).events))
            raise AssertionError("no END_SEQ")

        everything = replay(0)
        assert [s for s, _ in everything] == list(range(len(everything)))
        stored = [e for _, evs in everything for e in evs]
        assert all(isinstance(e, BlockStored) for e in stored)
        assert [e.block_hashes for e in stored] == [[_low64(k)] for k in keys]
        assert replay(len(everything)) == []
        assert replay(everything[-1][0]) == everything[-1:]
    finally:
        ctx.destroy(linger=0)
        stop_gateway(proc)


def test_events_port_in_use_is_named():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "xkv.gateway", "--capacity", "1M", "--port",
                            "0", "--kv-events-port", str(taken)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode != 0
    assert f"port {taken}" in r.stderr and "--kv-events-port" in r.stderr and "5557" in r.stderr
