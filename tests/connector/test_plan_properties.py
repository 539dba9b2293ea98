"""Load plans for any prompt length, local hit, block and chunk size (hypothesis, no vLLM).

Invariants: never more than num_tokens - 1 - local tokens; a hit ends on a chunk boundary, or,
when the stored prefix reaches the last token, right before it (vLLM computes at least that
token; issue 24: restore every token it lets us, so a full hit computes one token, as vLLM's
own asynchronous full hits do); the job names exactly the blocks holding tokens
[local, local + ext) in order, each with its chunk's key and its position inside the chunk, and
marks a last block the step also writes as its tail; vLLM asking twice costs one message.
"""

import random
from dataclasses import dataclass, field

from connector_fakes import FakeGateway
from hypothesis import given
from hypothesis import strategies as st

from xkv.connector.config import ConnectorConfig
from xkv.connector.registry import CacheGroup, build_registry
from xkv.connector.scheduler import SchedulerSide


@dataclass
class Req:
    request_id: str
    block_hashes: list
    num_tokens: int
    num_prompt_tokens: int
    kv_transfer_params: dict | None = None
    cache_salt: str | None = None
    extra: dict = field(default_factory=dict)


@given(
    bs=st.sampled_from([1, 16, 32]),
    k=st.integers(1, 4),
    n=st.integers(1, 700),
    stored_frac=st.floats(0, 1),
    local_frac=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_plan_geometry(bs, k, n, stored_frac, local_frac, seed):
    chunk = bs * k
    gw = FakeGateway(capacity=1 << 24)
    cfg = ConnectorConfig.from_extra({"chunk_size": chunk}, {"PYTHONHASHSEED": "0"})
    reg = build_registry([CacheGroup(0, "attention", ("l0", "l1"), bs, 64)], tp_size=1, pp_size=1,
                         chunk_size=chunk)
    s = SchedulerSide(cfg, reg, ["fp"], hash_block_size=bs, world_size=1,
                      gateway_factory=gw.client)
    hashes = [seed.to_bytes(4, "little") + i.to_bytes(4, "little") for i in range(n // bs)]
    full = len(hashes) // k
    m = int(stored_frac * full)  # chunks [0, m) stored
    keys = [hashes[(c + 1) * k - 1] for c in range(m)]
    c = gw.client()
    c.reserve(1, keys)
    c.commit(1, 0, keys)
    local = int(local_frac * (n - 1)) // bs * bs
    req = Req("r", hashes, n, n)
    n0 = len(gw.messages)
    ext = s.get_num_new_matched_tokens(req, local)
    assert s.get_num_new_matched_tokens(req, local) == ext
    assert len([x for x in gw.messages[n0:] if x[0] == "lookup"]) <= 1
    start, stop = local // chunk, full
    hits = max(0, min(m, stop) - start)
    assert ext == max(0, min((start + hits) * chunk, n - 1) - local)
    assert 0 <= ext <= max(0, n - 1 - local)
    if ext:
        assert (local + ext) % chunk == 0 or local + ext == n - 1
    ids = list(range(1, -(-n // bs) + 1))
    random.Random(seed).shuffle(ids)
    s.update_state_after_alloc(req, [ids], ext)
    meta = s.build_connector_meta(_Empty())
    if not ext:
        assert not meta.loads and not gw.leases
        return
    (job,) = meta.loads
    (gt,) = job.groups
    first, last = local // bs, -(-(local + ext) // bs)
    assert list(gt.block_ids) == ids[first:last]
    assert gt.tail == int((local + ext) % bs != 0)  # a partly restored last block
    for pos, (ci, j) in enumerate(zip(gt.chunk_of, gt.block_in_chunk, strict=True)):
        b = first + pos
        assert j == b % k and gt.chunks[ci].key == hashes[(b // k + 1) * k - 1]
    s.request_finished(req)
    assert not gw.leases


class _Empty:
    scheduled_new_reqs = []
    num_scheduled_tokens = {}

    class scheduled_cached_reqs:  # noqa: N801
        req_ids = []
        resumed_req_ids = set()
        new_block_ids = []
        num_computed_tokens = []
