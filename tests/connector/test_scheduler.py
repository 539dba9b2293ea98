"""Scheduler side against a real vLLM 0.29 ``Scheduler`` on the CPU and a fake gateway."""

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
import vllm_harness as H  # noqa: E402

CHUNK = 64
EXTRA = {"chunk_size": CHUNK}


def _commit(gw, meta, shards=1):
    """Stand in for the workers: mark every reserved chunk of this step as written."""
    c = gw.client()
    for job in meta.saves:
        for gt in job.groups:
            for s in range(shards):
                c.commit(meta.layout_ids[gt.group], s, [r.key for r in gt.chunks])


def _run(sched, gw, req, steps=50):
    """Add and run a request to completion, committing its saves; returns the metadata list."""
    sched.add_request(req)
    metas = []
    for _ in range(steps):
        if not sched.has_unfinished_requests():
            break
        _, meta = H.step(sched)
        _commit(gw, meta)
        metas.append(meta)
    assert not sched.has_unfinished_requests()
    return metas


@pytest.fixture
def make(fake_gateway, llama_dir):
    def build(extra=EXTRA, **kw):
        vc = H.make_vllm_config(llama_dir, policy="recompute", extra=extra, **kw)
        return H.make_scheduler(vc, H.attention_cache_config())

    return build


def _prompt(n, base=10):
    return [(base + i) % 1000 + 4 for i in range(n)]


def _loads(metas):
    return [j for m in metas for j in m.loads]


@pytest.mark.parametrize("full_hit,n,expect", [
    (False, 300, 256), (False, 200, 192), (False, 256, 224), (False, 65, 64), (False, 64, 32),
    (False, 40, 0),
    (True, 300, 256), (True, 200, 192), (True, 256, 255), (True, 65, 64), (True, 64, 63),
    (True, 40, 0)])
def test_store_then_restore(make, fake_gateway, full_hit, n, expect):
    """Full chunks are saved; a fresh prefix cache restores the longest stored prefix, never
    the whole prompt (at most n - 1 tokens; ``full_hit_restore``: a full hit computes one token,
    issue 24, else whole blocks only), and vLLM schedules only the rest."""
    s = make(extra={**EXTRA, "full_hit_restore": full_hit})
    metas = _run(s, fake_gateway, H.make_request("a", _prompt(n)))
    saved = sum(len(gt.chunks) for m in metas for j in m.saves for gt in j.groups)
    assert saved == n // CHUNK
    s.reset_prefix_cache()
    r = H.make_request("b", _prompt(n))
    s.add_request(r)
    so, meta = H.step(s)
    assert so.num_scheduled_tokens["b"] == n - expect
    assert r.num_computed_tokens == n  # whole prompt computed after this step
    loads = meta.loads
    if expect:
        (job,) = loads
        (gt,) = job.groups
        nb = -(-expect // 32)  # a partly restored last block counts
        assert len(gt.block_ids) == nb and job.num_tokens == expect
        assert list(gt.block_in_chunk) == [i % 2 for i in range(nb)]
        assert gt.tail == int(expect % 32 != 0)
    else:
        assert not loads
    st = H.LAST_STATS.connector_prefix_cache_stats
    assert st.hits == expect and st.queries == n


@pytest.mark.parametrize("from_tokens,n,expect", [
    (1, 256, 254), (1, 65, 63), (1, 300, 256), (1, 200, 192), (200, 256, 254), (200, 64, 63),
    (128, 129, 127), (129, 129, 128)])
def test_piecewise_restores_leave_two_tokens(make, fake_gateway, from_tokens, n, expect):
    """``piecewise_restores_from`` (with ``full_cuda_graphs``): a full hit of at least that many
    restored tokens leaves vLLM two tokens to compute; a shorter one, one; a hit the stored
    prefix ends before the last token is not cut."""
    s = make()
    _run(s, fake_gateway, H.make_request("a", _prompt(n)))
    s = make(extra={**EXTRA, "full_cuda_graphs": True, "piecewise_restores_from": from_tokens})
    r = H.make_request("b", _prompt(n))
    s.add_request(r)
    so, meta = H.step(s)
    assert so.num_scheduled_tokens["b"] == n - expect
    assert r.num_computed_tokens == n
    if expect:
        assert meta.loads[0].num_tokens == expect
    st = H.LAST_STATS.connector_prefix_cache_stats
    assert st.hits == expect


@pytest.mark.parametrize("load_mode,expect", [("sync", (254, False)), ("async", (255, True))])
def test_piecewise_restores_leave_asynchronous_restores_alone(make, fake_gateway, load_mode,
                                                              expect):
    """An asynchronous restore lands before its step: its one-token step stays a full graph."""
    s = make()
    _run(s, fake_gateway, H.make_request("a", _prompt(256)))
    s = make(extra={**EXTRA, "full_cuda_graphs": True, "piecewise_restores_from": 1,
                    "load_mode": load_mode})
    assert s.connector.get_num_new_matched_tokens(H.make_request("b", _prompt(256)), 0) == expect


def test_piecewise_restores_need_full_cuda_graphs():
    from xkv.connector.config import ConfigError, ConnectorConfig

    with pytest.raises(ConfigError, match="needs full_cuda_graphs: true"):
        ConnectorConfig.from_extra({"piecewise_restores_from": 1, "full_cuda_graphs": False},
                                   {"PYTHONHASHSEED": "0"})
    with pytest.raises(ConfigError, match="piecewise_restores_from=-1: expected a token count"):
        ConnectorConfig.from_extra({"piecewise_restores_from": -1, "full_cuda_graphs": True},
                                   {"PYTHONHASHSEED": "0"})
    assert ConnectorConfig.from_extra({}, {"PYTHONHASHSEED": "0"}).piecewise_restores_from == 0


def test_partly_stored_prefix(make, fake_gateway):
    s = make()
    _run(s, fake_gateway, H.make_request("a", _prompt(300)))
    s.reset_prefix_cache()
    other = _prompt(130) + _prompt(170, base=500)
    s.add_request(H.make_request("b", other))
    so, meta = H.step(s)
    assert meta.loads[0].num_tokens == 128 and so.num_scheduled_tokens["b"] == 300 - 128
    # chunks 2.. of b are new and get reserved; 0 and 1 are known present: not reserved again
    keys_b = [r.key for j in meta.saves for gt in j.groups for r in gt.chunks]
    assert len(keys_b) == 2


def test_repeated_question_is_free(make, fake_gateway):
    s = make()
    _run(s, fake_gateway, H.make_request("a", _prompt(300)))
    s.reset_prefix_cache()
    conn = s.connector
    r = H.make_request("b", _prompt(300))
    n0 = len(fake_gateway.messages)
    assert conn.get_num_new_matched_tokens(r, 0) == (256, False)
    assert conn.get_num_new_matched_tokens(r, 0) == (256, False)
    lookups = [m for m in fake_gateway.messages[n0:] if m[0] == "lookup"]
    assert len(lookups) == 1 and len(fake_gateway.leases) == 1
    # a different local hit asks again and drops the first lease
    assert conn.get_num_new_matched_tokens(r, 128) == (128, False)
    assert len(fake_gateway.leases) == 1
    conn.request_finished(r, [])
    assert not fake_gateway.leases


def test_leases_released(make, fake_gateway):
    s = make()
    _run(s, fake_gateway, H.make_request("a", _prompt(300)))
    s.reset_prefix_cache()
    _run(s, fake_gateway, H.make_request("b", _prompt(300)))
    assert any(m[0] == "release" for m in fake_gateway.messages)
    assert not fake_gateway.leases


def test_opt_out_sends_nothing(make, fake_gateway):
    s = make()
    n0 = len(fake_gateway.messages)
    metas = _run(s, fake_gateway, H.make_request("a", _prompt(300), params={"xkv_store": False}))
    assert fake_gateway.messages[n0:] == []
    assert not any(m.saves or m.loads for m in metas)
    # a normal request with the same prompt afterwards is stored
    _run(s, fake_gateway, H.make_request("b", _prompt(300), params={"xkv_store": True}))
    assert any(m[0] == "reserve" for m in fake_gateway.messages[n0:])


def test_require_cache_salt(make, fake_gateway):
    s = make(extra={**EXTRA, "require_cache_salt": True})
    n0 = len(fake_gateway.messages)
    _run(s, fake_gateway, H.make_request("a", _prompt(300)))
    assert fake_gateway.messages[n0:] == []
    _run(s, fake_gateway, H.make_request("b", _prompt(300), salt="tenant-a"))
    assert [m[0] for m in fake_gateway.messages[n0:]].count("reserve") == 1


def test_salts_do_not_share(make, fake_gateway):
    s = make()
    _run(s, fake_gateway, H.make_request("a", _prompt(300), salt="tenant-a"))
    s.reset_prefix_cache()
    s.add_request(H.make_request("b", _prompt(300), salt="tenant-b"))
    _, meta = H.step(s)
    assert not meta.loads  # different tenant: no hit
    s.reset_prefix_cache()
    s.add_request(H.make_request("c", _prompt(300), salt="tenant-a"))
    _, meta = H.step(s)
    assert meta.loads[0].num_tokens == 256  # paired: same tenant hits


def test_namespaces_do_not_share(make, fake_gateway):
    s1 = make(extra={**EXTRA, "key_namespace": "prod"})
    _run(s1, fake_gateway, H.make_request("a", _prompt(300)))
    s2 = make(extra={**EXTRA, "key_namespace": "staging"})
    s2.add_request(H.make_request("b", _prompt(300)))
    _, meta = H.step(s2)
    assert not meta.loads
    s3 = make(extra={**EXTRA, "key_namespace": "prod"})
    s3.add_request(H.make_request("c", _prompt(300)))
    _, meta = H.step(s3)
    assert meta.loads[0].num_tokens == 256


def test_shared_prefix_in_one_batch_saved_once(make, fake_gateway):
    s = make()
    p = _prompt(300)
    s.add_request(H.make_request("a", p))
    s.add_request(H.make_request("b", p[:200] + _prompt(100, base=700)))
    so, meta = H.step(s)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    keys = [r.key for j in meta.saves for gt in j.groups for r in gt.chunks]
    assert len(keys) == len(set(keys))  # a chunk is reserved by one request only


def test_gateway_dies_turns_off(make, fake_gateway):
    s = make()
    _run(s, fake_gateway, H.make_request("a", _prompt(300)))
    s.reset_prefix_cache()
    fake_gateway.dead = True
    # a failed call costs only that request its hit (a slow answer is not a death); failures
    # in a row (LOOKUP, then RESERVE of the same request, then the next LOOKUP) turn it off
    offs = []
    for i in range(3):
        s.add_request(H.make_request(f"b{i}", _prompt(300, base=100 * i + 5)))
        so, meta = H.step(s)
        assert so.num_scheduled_tokens[f"b{i}"] == 300 and not meta.loads
        offs.append(meta.turned_off)
    assert offs[0] is False and offs[-1] is True
    fake_gateway.dead = False
    n0 = len(fake_gateway.messages)
    _run(s, fake_gateway, H.make_request("c", _prompt(300, base=99)))
    assert fake_gateway.messages[n0:] == []  # off: no message until a re-probe, seconds later


def test_one_failure_then_recovery(make, fake_gateway):
    s = make()
    _run(s, fake_gateway, H.make_request("a", _prompt(300)))
    s.reset_prefix_cache()
    fake_gateway.dead = True
    s.add_request(H.make_request("b", _prompt(300)))
    H.step(s)  # LOOKUP and RESERVE fail: two in a row, not yet off
    fake_gateway.dead = False
    while s.has_unfinished_requests():
        H.step(s)
    assert s.reset_prefix_cache()
    s.add_request(H.make_request("c", _prompt(300)))
    _, meta = H.step(s)
    assert meta.loads[0].num_tokens == 256 and not meta.turned_off


def test_kv_roles(make, fake_gateway):
    s = make(kv_role="kv_consumer")
    _run(s, fake_gateway, H.make_request("a", _prompt(300)))
    assert not any(m[0] == "reserve" for m in fake_gateway.messages)
    p = make(kv_role="kv_producer")
    n0 = len(fake_gateway.messages)
    _run(p, fake_gateway, H.make_request("b", _prompt(300)))
    assert not any(m[0] == "lookup" for m in fake_gateway.messages[n0:])
