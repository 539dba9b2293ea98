"""Two xkv-gateways with separate cards and ports (hosts A and B) on one Mooncake master."""

from __future__ import annotations

import contextlib
import os
import time

from xkv.gateway.client import GatewayClient
from xkv.gateway.testing import spawn_gateway, stop_gateway


class Host:
    def __init__(self, master, log_path: str, capacity: str = "64M", extra=()):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc, self.port = spawn_gateway(
            capacity, extra_args=[*master.gateway_args(), "--log-level", "INFO", *extra],
            stderr=self._log)
        self.client = GatewayClient("127.0.0.1", self.port, timeout_s=10)

    def tier(self) -> dict:
        return {k: v for k, v in self.client.stats().items() if k.startswith("tier_")}

    def wait(self, pred, timeout_s: float = 30.0, what: str = "condition") -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            t = self.tier()
            if pred(t):
                return t
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached in {timeout_s} s: {t}")
            time.sleep(0.05)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        self.client.close()
        stop_gateway(self.proc)
        self._log.close()


@contextlib.contextmanager
def hosts(master, tmp_path, n=2, tag="", **kw):
    out = []
    try:
        for name in "AB"[:n]:
            out.append(Host(master, str(tmp_path / f"gateway_{tag}{name}.log"), **kw))
        for h in out:
            h.wait(lambda t: t["tier_up"] == 1, what="tier up")
        yield out
    finally:
        for h in out:
            h.stop()


def store(host, layout_id: int, keys, shards: int, shard_bytes: int) -> dict:
    """Reserve, fill with random bytes, commit every shard; returns {(key, shard): bytes}."""
    card = host.client.map_card()
    data = {}
    res = host.client.reserve(layout_id, keys)
    assert all(r is not None for r in res), res.status
    for k, r in zip(keys, res, strict=True):
        for s, off in enumerate(r.offsets):
            data[(k, s)] = os.urandom(shard_bytes)
            card[off:off + shard_bytes] = data[(k, s)]
    for s in range(shards):
        assert host.client.commit(layout_id, s, res) == len(keys)
    return data


def check(host, result, keys, data, shard_bytes: int) -> None:
    card = host.client.map_card()
    for c, k in enumerate(keys[:result.num_chunks]):
        for s, off in enumerate(result.slots[0][c].offsets):
            assert bytes(card[off:off + shard_bytes]) == data[(k, s)], (c, s)


def start_backends(master, secrets, card_bytes: int = 4 << 20) -> list:
    """One started ``MooncakeBackend`` per secret (None: no MAC), each over its own card of
    ``card_bytes``, all attached to ``master``: ``[(backend, card)]`` once every one is up."""
    import mmap

    from xkv.gateway.tier_store import MooncakeBackend, MooncakeSettings

    out = []
    for secret in secrets:
        card = mmap.mmap(-1, card_bytes)
        b = MooncakeBackend(MooncakeSettings(master.address, master.metadata,
                                             segment_bytes=32 << 20, secret=secret), card)
        b.start()
        out.append((b, card))
    deadline = time.monotonic() + 30
    while any(b.state != "up" for b, _ in out):
        assert time.monotonic() < deadline, [b.state for b, _ in out]
        time.sleep(0.02)
    return out
