"""The gateway under hostile input and sudden death.

* fuzz: >= 10,000 malformed, truncated, oversized and wrong-version messages while a well-behaved
  client keeps being served; every fuzz message that reaches the loop gets an answer.
* SIGKILL mid-traffic: every client call fails within its deadline; a restarted gateway has a new
  epoch and refuses the old epoch's leases and layouts.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import msgspec
import pytest
import zmq

from xkv.gateway import GatewayClient, GatewayUnavailable
from xkv.gateway import protocol as P
from xkv.gateway.testing import spawn_gateway, stop_gateway
from xkv.gateway.transport import control_path

N_FUZZ = 10_000


def _valid_messages(epoch: int) -> list[bytes]:
    keys = [bytes([i]) * 32 for i in range(8)]
    msgs = [
        P.Hello(P.PROTOCOL_VERSION, "fuzz", "fp", 2, 10_000),
        P.Hello(P.PROTOCOL_VERSION, "fuzz", "fp-words", 2, 10_000, 0, 3),
        P.Card(), P.Ping(), P.Stats(),
        P.Lookup(epoch, [P.LookupGroup(1, keys), P.LookupGroup(2, keys)]),
        P.Reserve(epoch, 1, keys), P.Commit(epoch, 1, 1, keys, [0] * 8, [0] * 8),
        P.Abort(epoch, 1, 0, keys, [4096] * 8, [1] * 8),
        P.Commit(epoch, 2, 0, keys, [0] * 8, [0] * 8, b"\1" * 96),
        P.Corrupt(epoch, 1, 0, keys, [0] * 8, [0] * 8),
        P.Release(epoch, 7),
    ]
    return [P.encoder.encode(m) for m in msgs]


def _fuzz_message(rng: random.Random, valid: list[bytes], epoch: int) -> list[bytes]:
    """One DEALER message (list of frames) that is wrong in one of many ways."""
    rid = P.pack_id(rng.getrandbits(64))
    kind = rng.randrange(10)
    base = rng.choice(valid)
    if kind == 0:  # random bytes
        body = rng.randbytes(rng.randrange(0, 300))
    elif kind == 1:  # truncated valid message
        body = base[: rng.randrange(0, len(base))]
    elif kind == 2:  # bit flips in a valid message
        b = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        body = bytes(b)
    elif kind == 3:  # wrong protocol version
        body = P.encoder.encode(P.Hello(rng.choice([0, P.PROTOCOL_VERSION - 1, 99, -1, 2**40]), "ns", "fp", 1, 4096))
    elif kind == 4:  # right tags, wrong field types / ranges / unknown fields
        tag = rng.choice(["Hello", "Lookup", "Reserve", "Commit", "Abort", "Release", "Corrupt",
                          "Nope"])
        junk = rng.choice([None, -1, 2**64 - 1, "x" * 300, [], {}, [b"k"] * 3, 1.5, True])
        fields = {"type": tag, rng.choice(["epoch", "keys", "groups", "shard", "version",
                                           "namespace", "num_shards", "lease_id", "extra"]): junk}
        body = msgspec.msgpack.encode(fields)
    elif kind == 5:  # too many keys / key too long / too many groups / shard out of range
        body = P.encoder.encode(rng.choice([
            P.Reserve(epoch, 1, [b"k%d" % i for i in range(P.MAX_KEYS + 1)]),
            P.Reserve(epoch, 1, [b"x" * (P.MAX_KEY_BYTES + 1)]),
            P.Lookup(epoch, [P.LookupGroup(1, [b"k"])] * (P.MAX_GROUPS + 1)),
            P.Lookup(epoch, [P.LookupGroup(1, [b"k%d" % i for i in range(3000)])] * 2),
            P.Commit(epoch, 1, 5000, [b"k"], [0], [0]),
            P.Commit(epoch, 1, 0, [b"k"], [0], [0], b"c" * 100_000),  # wrong length
            P.Corrupt(epoch, 1, 5000, [b"k"], [0], [0]),
            P.Hello(P.PROTOCOL_VERSION, "ns", "fp", 1, 4096, 0, P.MAX_CHECK_WORDS + 1),
            P.Hello(P.PROTOCOL_VERSION, "ns", "fp", 1, 1 << 60),
        ]))
    elif kind == 6:  # stale epoch or unknown layout
        body = P.encoder.encode(rng.choice([
            P.Release(epoch ^ 1, 1), P.Lookup(epoch, [P.LookupGroup(999, [b"k"])]),
            P.Reserve(epoch ^ 5, 1, [b"k"]), P.Commit(epoch, 12345, 0, [b"k"], [0], [0])]))
    elif kind == 7:  # wrong frame structure
        return rng.choice([[base], [rid, base, b"extra"], [b"short", base], [rid]])
    elif kind == 8:  # valid msgpack, not a struct
        body = msgspec.msgpack.encode(rng.choice([1, "str", [1, 2, 3], {"a": 1}, None, b"\x00"]))
    else:  # deep nesting
        body = b"\x91" * rng.randrange(1, 2000) + b"\xc0"
    return [rid, body]


@pytest.mark.slow
def test_fuzz_never_stops_the_gateway():
    proc, port = spawn_gateway("16M")
    ctx = zmq.Context()
    try:
        good = GatewayClient("127.0.0.1", port, timeout_s=2.0)
        lid = good.register_layout("good", "fp", 1, 4096).layout_id
        good.commit(lid, 0, good.reserve(lid, [b"g"]))
        epoch = good.epoch
        valid = _valid_messages(epoch)
        rng = random.Random(1234)
        fuzz = ctx.socket(zmq.DEALER)
        fuzz.setsockopt(zmq.LINGER, 0)
        fuzz.connect(f"ipc://{control_path(port)}")
        sent = answered = 0
        batch = 200
        while sent < N_FUZZ:
            for _ in range(batch):
                fuzz.send_multipart(_fuzz_message(rng, valid, epoch))
            sent += batch
            got = 0
            while got < batch and fuzz.poll(5000):
                frames = fuzz.recv_multipart()
                assert len(frames) == 2
                P.reply_decoder.decode(frames[1])  # every answer is a well-formed reply
                got += 1
            answered += got
            assert got == batch, f"{batch - got} of a batch of fuzz messages got no answer"
            # the well-behaved client is served between every batch
            assert good.lookup([(lid, [b"g"])], lease=False).num_chunks == 1
        # oversized messages: ZMQ_MAXMSGSIZE drops the sender's connection, nobody else's
        for _ in range(5):
            big = ctx.socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.connect(f"ipc://{control_path(port)}")
            big.send_multipart([P.pack_id(1), b"\x00" * (P.MAX_MESSAGE_BYTES + 1)])
            assert not big.poll(200), "an oversized message was answered instead of dropped"
            big.close()
            sent += 1
            assert good.ping().epoch == epoch
        stats = good.stats()
        errors = sum(v for k, v in stats.items() if k.startswith("errors_"))
        assert answered == N_FUZZ and errors >= N_FUZZ * 0.9, stats
        assert {"errors_malformed", "errors_too_large", "errors_bad_version",
                "errors_bad_epoch"} <= set(stats), stats
        assert good.lookup([(lid, [b"g"])]).num_chunks == 1
        assert proc.poll() is None
        good.close()
    finally:
        ctx.destroy(linger=0)
        assert stop_gateway(proc) == 0


@pytest.mark.slow
def test_sigkill_mid_traffic_then_restart_refuses_stale_state():
    timeout = 0.1
    proc, port = spawn_gateway("8M")
    failures: list[tuple[str, float]] = []
    killed = threading.Event()
    stop = threading.Event()

    def traffic(i: int, client: GatewayClient, lid: int) -> None:
        n = 0
        while not stop.is_set():
            keys = [b"t%d-%d" % (i, n + j) for j in range(4)]
            n += 4
            res: list = []
            for call in (lambda res=res, keys=keys: res.extend(client.reserve(lid, keys)),
                         lambda res=res: client.commit(lid, 0, res),
                         lambda keys=keys: client.lookup([(lid, keys)])):
                t0 = time.monotonic()
                try:
                    call()
                except GatewayUnavailable:
                    failures.append((f"client {i} killed={killed.is_set()}",
                                     time.monotonic() - t0))
                    time.sleep(0.01)

    clients = [GatewayClient("127.0.0.1", port, timeout_s=timeout) for _ in range(3)]
    lids = [c.register_layout("kill", "fp", 1, 4096).layout_id for c in clients]
    old_epoch = clients[0].epoch
    old_card = clients[0]._call(P.Card(), P.CardInfo, 2.0)
    held = clients[0].lookup([(lids[0], [b"none"])])
    clients[0].commit(lids[0], 0, clients[0].reserve(lids[0], [b"leased"]))
    lease = clients[0].lookup([(lids[0], [b"leased"])]).lease_id
    assert held.num_chunks == 0 and lease
    threads = [threading.Thread(target=traffic, args=(i, c, lid))
               for i, (c, lid) in enumerate(zip(clients, lids, strict=False))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed.set()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a client call hung after the gateway died"
    after = [d for who, d in failures if "killed=True" in who]
    assert len(after) >= 3, failures
    # within the deadline (plus scheduling slack on a loaded 2-core machine)
    assert max(after) < timeout + 0.4, sorted(after)[-5:]

    proc2, port2 = spawn_gateway("8M", port=port)
    try:
        assert port2 == port
        fresh = GatewayClient("127.0.0.1", port, timeout_s=2.0)
        # the dead gateway's sockets were replaced by the new one's (same private directory;
        # its lock, not its pid, told the new gateway it was gone)
        new_card = fresh._call(P.Card(), P.CardInfo, 2.0)
        assert old_card.kind == "memfd" and new_card.path == old_card.path
        assert new_card.epoch != old_epoch and fresh.map_card() is not None
        assert fresh.ping().epoch != old_epoch
        # the old client sees the new epoch and refuses to go on with its stale state
        with pytest.raises(GatewayUnavailable, match="restarted|epoch"):
            clients[0].ping(timeout_s=2.0)
        with pytest.raises(GatewayUnavailable):
            clients[0].release(lease)
        # raw stale requests: the new gateway refuses the old epoch's lease and layout ids
        for stale in (P.Release(old_epoch, lease), P.Lookup(old_epoch, [P.LookupGroup(1, [b"k"])])):
            reply = _raw(port, stale)
            assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.BAD_EPOCH
            assert reply.epoch != old_epoch
        fresh.close()
    finally:
        for c in clients:
            c.close()
        assert stop_gateway(proc2) == 0


def _raw(port: int, msg) -> P.ErrorReply:
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{control_path(port)}")
        s.send_multipart([P.pack_id(42), P.encoder.encode(msg)])
        assert s.poll(2000)
        rid, body = s.recv_multipart()
        assert P.unpack_id(rid) == 42
        return P.reply_decoder.decode(body)
    finally:
        ctx.destroy(linger=0)


def test_stalled_gateway_times_out_then_client_recovers():
    proc, port = spawn_gateway("1M")
    try:
        c = GatewayClient("127.0.0.1", port, timeout_s=0.1)
        lid = c.register_layout("stall", "fp", 1, 100).layout_id
        c.commit(lid, 0, c.reserve(lid, [b"a"]))
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(GatewayUnavailable, match="within 100 ms"):
            c.lookup([(lid, [b"a"])])
        assert time.monotonic() - t0 < 0.5
        proc.send_signal(signal.SIGCONT)
        # the stalled LOOKUP's late reply must not be taken for the next call's answer
        assert c.reserve(lid, [b"b"], timeout_s=2.0).status == [P.ReserveStatus.OK]
        assert c.lookup([(lid, [b"a", b"b"])], timeout_s=2.0).num_chunks == 1
        c.close()
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_gateway(proc) == 0
