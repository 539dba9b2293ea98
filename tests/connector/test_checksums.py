"""Verified restores through the connector (issue 25), on vLLM's CPU caches and the fake gateway.

Engine 1 computes and saves a prompt: every COMMIT carries one checksum word per layer of each
object (checked against the definition on the card bytes). Engine 2 restores it: clean, every
block is verified and none fails; after one flipped bit in one object on the card, exactly that
object's blocks are load errors (vLLM recomputes them), the object is reported CORRUPT (the fake
gateway drops it), one warning names its key and the counters say so. ``verify_checksums: false``
sends no words at all.
"""

import logging

import numpy as np
import pytest
import torch
from connector_fakes import Warnings

from xkv.connector.checksums import check_words, restore_checks, save_checks, with_checks
from xkv.connector.loads import CORRUPT_LINE
from xkv.connector.metadata import ChunkRef, GroupTransfer
from xkv.kernels import checksum

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
import vllm_harness as H  # noqa: E402

CHUNK = 64


def _prompt(n, base=10):
    return [(base + i) % 1000 + 4 for i in range(n)]


def _engine(llama_dir, *, mla=False, extra=None):
    bs = 16 if mla else 32
    vc = H.make_vllm_config(llama_dir, policy="recompute", block_size=bs,
                            extra={"chunk_size": CHUNK, "verify_checksums": True,  # opt-in
                                   **(extra or {})})
    layout = "LBNHC" if mla else "LBHNC"
    kcfg = H.attention_cache_config(block_size=bs, mla=mla)
    kcfg.kv_cache_layout = layout
    sched = H.make_scheduler(vc, kcfg)
    wk, caches = H.make_worker_caches(vc, H.attention_cache_config(block_size=bs, mla=mla),
                                      layout=layout)
    return sched, wk, caches, bs


def _run(sched, wk, caches, bs, req):
    sched.add_request(req)
    while sched.has_unfinished_requests():
        H.step_with_worker(sched, wk, caches, bs)


def _commits(gw):
    return [m for m in gw.messages if m[0] == "commit"]


def _card_words(gw, lid, key, plan_bytes, layers):
    """The words of one committed object from the fake card (numpy definition)."""
    o = gw.objects[(lid, key)]
    start = o["offsets"][0]
    kb = plan_bytes
    b = bytes(gw.card[start:start + layers * kb])
    return [checksum.words_numpy(b[i * kb:(i + 1) * kb]) for i in range(layers)]


@pytest.mark.parametrize("save_mode", ["layer", "step"])
@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
def test_commits_carry_the_words_of_the_card_bytes(fake_gateway, llama_dir, mla, save_mode):
    s1, w1, c1, bs = _engine(llama_dir, mla=mla, extra={"save_mode": save_mode})
    assert w1._worker.saver.mode == save_mode
    _run(s1, w1, c1, bs, H.make_request("a", _prompt(200), block_size=bs))
    lid = 1
    cw = fake_gateway.check_words[lid]
    assert cw == len(c1)  # one word per layer
    objs = {k: o for (i, k), o in fake_gateway.objects.items() if i == lid}
    assert len(objs) == 200 // CHUNK
    page = H.page(c1[next(iter(c1))], 0).numel()
    for key, o in objs.items():
        got = np.frombuffer(o["sums"][0], "<u4").tolist()
        assert got == _card_words(fake_gateway, lid, key, CHUNK // bs * page, len(c1))


@pytest.mark.parametrize("checksum_pass", ["copy", "hbm", "end"])
@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
def test_clean_restores_verify_every_block_and_flag_none(fake_gateway, llama_dir, mla,
                                                         checksum_pass):
    s1, w1, c1, bs = _engine(llama_dir, mla=mla)
    p = _prompt(300)
    _run(s1, w1, c1, bs, H.make_request("a", p, block_size=bs))
    s2, w2, c2, _ = _engine(llama_dir, mla=mla, extra={"checksum_pass": checksum_pass})
    s2.add_request(H.make_request("b", p, block_size=bs))
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    (gt,) = meta.loads[0].groups
    assert gt.checks and all(len(b) == len(c2) * 4 for b in gt.checks)
    assert not out.invalid_block_ids
    st = out.kv_connector_stats.data
    assert st["blocks_restored"] == len(gt.block_ids) and st["blocks_unverified"] == 0
    assert st["checksum_mismatches"] == 0


@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
@pytest.mark.parametrize(("victim", "save_mode", "checksum_pass"),
                         [(0, "layer", "copy"), (1, "layer", "copy"), (3, "layer", "copy"),
                          (1, "step", "copy"), (0, "step", "hbm"), (3, "layer", "hbm"),
                          (2, "step", "end"), (0, "layer", "end")])
def test_a_flipped_bit_fails_exactly_its_object_and_reports_it(fake_gateway, llama_dir, mla,
                                                               victim, save_mode, checksum_pass):
    s1, w1, c1, bs = _engine(llama_dir, mla=mla, extra={"save_mode": save_mode})
    p = _prompt(300)
    _run(s1, w1, c1, bs, H.make_request("a", p, block_size=bs))
    lid = 1
    keys = [k for (i, k) in fake_gateway.objects if i == lid]
    key = keys[victim]
    o = fake_gateway.objects[(lid, key)]
    size = len(c1) * (CHUNK // bs) * H.page(c1[next(iter(c1))], 0).numel()
    at = o["offsets"][0] + (victim * 7919 + 13) % size
    fake_gateway.card[at] ^= 0x08
    s2, w2, c2, _ = _engine(llama_dir, mla=mla, extra={"checksum_pass": checksum_pass})
    s2.add_request(H.make_request("b", p, block_size=bs))
    with Warnings() as warn:
        so, meta, out = H.step_with_worker(s2, w2, c2, bs)
        w2._worker.outcomes.wait_reports(10)
    (gt,) = meta.loads[0].groups
    c = [ref.key for ref in gt.chunks].index(key)
    want = {b for b, cc in zip(gt.block_ids, gt.chunk_of, strict=True) if cc == c}
    assert set(out.invalid_block_ids) == want
    assert warn.count(CORRUPT_LINE) == 1 and warn.count(key[:16].hex()) == 1
    st = out.kv_connector_stats.data
    assert st["checksum_mismatches"] == 1 and st["load_errors"] == len(want)
    assert fake_gateway.corrupt_removed == 1 and (lid, key) not in fake_gateway.objects
    # every other restored block holds exactly the saved bytes
    for i, bid in enumerate(gt.block_ids):
        if bid in want:
            continue
        for name, kv in c2.items():
            assert torch.equal(H.page(kv, bid), H.pattern(p[: (i + 1) * bs], name,
                                                           H.page(kv, 0).numel()))


@pytest.mark.parametrize(("allow", "params", "checked"),
                         [(True, {"xkv_verify": False}, False), (False, {"xkv_verify": False}, True),
                          (True, None, True), (True, {"xkv_verify": 0}, True),
                          (True, {"xkv_verify": "false"}, True), (True, {"xkv_verify": True}, True)])
def test_a_request_skips_its_checks_only_where_the_engine_allows_it(fake_gateway, llama_dir,
                                                                    allow, params, checked):
    """``allow_unverified_requests`` (benchmarks: checked and unchecked restores in one engine):
    a request with ``{"xkv_verify": false}`` restores without checks, so a flipped bit on the
    card reaches its pages; without the setting, or with any other value, the same request is
    checked and the damaged object's blocks are load errors."""
    s1, w1, c1, bs = _engine(llama_dir)
    p = _prompt(300)
    _run(s1, w1, c1, bs, H.make_request("a", p, block_size=bs))
    key = sorted(k for (i, k) in fake_gateway.objects if i == 1)[0]
    fake_gateway.card[fake_gateway.objects[(1, key)]["offsets"][0] + 101] ^= 0x10
    s2, w2, c2, _ = _engine(llama_dir, extra={"allow_unverified_requests": allow})
    s2.add_request(H.make_request("b", p, block_size=bs, params=params))
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    w2._worker.outcomes.wait_reports(10)
    st = out.kv_connector_stats.data
    assert st["blocks_restored"] > 0
    if checked:
        assert meta.loads[0].groups[0].checks
        assert st["checksum_mismatches"] == 1 and st["load_errors"] > 0
        assert st.get("blocks_unverified", 0) == 0 and out.invalid_block_ids
    else:
        assert not meta.loads[0].groups[0].checks
        assert st.get("checksum_mismatches", 0) == 0 and not out.invalid_block_ids
        assert st["blocks_unverified"] == st["blocks_restored"]
        assert (1, key) in fake_gateway.objects  # nothing reported: nothing was checked


def test_verify_off_sends_no_words(fake_gateway, llama_dir):
    s1, w1, c1, bs = _engine(llama_dir, extra={"verify_checksums": False})
    _run(s1, w1, c1, bs, H.make_request("a", _prompt(200), block_size=bs))
    assert fake_gateway.check_words[1] == 0
    assert all(not o["sums"] for o in fake_gateway.objects.values())
    s2, w2, c2, _ = _engine(llama_dir, extra={"verify_checksums": False})
    s2.add_request(H.make_request("b", _prompt(200), block_size=bs))
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    assert not meta.loads[0].groups[0].checks
    st = out.kv_connector_stats.data
    assert st["blocks_unverified"] == st["blocks_restored"] > 0


def test_start_lines_say_what_is_verified(fake_gateway, llama_dir, caplog):
    with caplog.at_level(logging.INFO):
        _, w, c, _ = _engine(llama_dir)
    lines = [ln for ln in caplog.messages if "restores verified" in ln or "NOT verified" in ln]
    assert lines == [f"XKV: group 0 (attention): restores verified by checksums ({len(c)} words "
                     "per object shard)"]


class _Plan:
    """The GroupPlan fields restore_checks reads (k pages per object, one shard)."""

    def __init__(self, k, shards=1):
        self.blocks_per_object, self.num_shards = k, shards

    def shard_of(self, rank):
        return rank if self.num_shards > 1 else 0


def _ref(key, off):
    return ChunkRef(key, (off,), (1,))


def test_restore_checks_hash_the_pages_a_restore_does_not_write():
    """A restore starting inside its first object and a window's partial tail: every page of
    every object read is listed (written or hash-only), each object once per transfer."""
    exp = np.arange(6, dtype="<u4")
    gt = GroupTransfer(0, (5, 6, 7), (0, 0, 1), (2, 3, 0), (_ref(b"a", 0), _ref(b"b", 4096)),
                       checks=(exp[:3].tobytes(), exp[3:].tobytes()))
    rc = restore_checks(_Plan(4), 0, [gt], cw=3)
    pages = sorted(zip(rc.checks.objects.tolist(), rc.checks.pages.tolist(), strict=True))
    assert pages == [(o, j) for o in (0, 1) for j in range(4)]
    assert rc.hash_only.tolist() == [False] * 3 + [True] * 5
    np.testing.assert_array_equal(rc.checks.expected, exp.reshape(2, 3).T)
    assert rc.cols == [(0, 0), (0, 1)]
    assert [b for t in rc.transfers[1:] for b in t.block_ids] == [-1] * 5
    # a chunk without words: the group's restore is not verified
    assert restore_checks(_Plan(4), 0, [with_checks(gt, {b"a": exp[:3].tobytes()})], 3) is None
    assert restore_checks(_Plan(4), 0, [gt], 0) is None


def test_save_checks_columns_and_word_counts():
    gts = [GroupTransfer(0, (1, 2), (0, 0), (0, 1), (_ref(b"a", 0),)),
           GroupTransfer(0, (3, 4, 5, 6), (0, 1, 1, 0), (0, 0, 1, 1),
                         (_ref(b"b", 0), _ref(b"c", 0)))]
    checks, cols = save_checks(gts)
    assert cols == [(0, 0), (1, 0), (1, 1)] and checks.num_objects == 3
    assert checks.objects.tolist() == [0, 0, 1, 2, 2, 1]
    assert checks.pages.tolist() == [0, 1, 0, 0, 1, 1]


def test_check_words_per_group():
    from types import SimpleNamespace as NS

    def plan(sizes):
        return NS(group=NS(layer_names=[f"l{i}" for i in range(len(sizes))],
                           bytes_of=lambda i: sizes[i]))

    assert check_words(plan([64, 64, 32])) == 3
    assert check_words(plan([64, 66])) == 0  # a page that is not 4-byte words: unverified
    assert check_words(plan([64]), enabled=False) == 0


def test_the_scheduler_passes_each_chunks_words_to_the_load(monkeypatch):
    """A hybrid model (two Mamba state groups + attention): the words COMMIT stored come back
    on the load's GroupTransfer.checks, per chunk, for the attention chunks and for the state
    read into its boundary and its running block (one object, two blocks)."""
    import test_states as S
    from connector_fakes import FakeGateway

    gw = FakeGateway()
    s = S._sched(gw, monkeypatch, verify_checksums=True)
    assert s.session.check_words == (1, 1, 1)  # one layer per group
    r0 = S._req("a", S.H3)
    s.update_state_after_alloc(r0, S.STORE_IDS, 0)
    new = S.NS(req_id="a", block_ids=S.STORE_IDS, num_computed_tokens=0)
    meta = s.build_connector_meta(S._so([new], {"a": 288}))
    c = gw.client()

    def words(g, key):
        return bytes([g]) + key[:3]  # one 4-byte word per layer, distinct per group and key

    for job in meta.saves:
        for gt in job.groups:
            c.commit(meta.layout_ids[gt.group], 0, list(gt.chunks),
                     checksums=[words(gt.group, r.key) for r in gt.chunks])
    s.request_finished(r0)
    r = S._req("b", S.H3)
    assert s.get_num_new_matched_tokens(r, 0) == 288
    load_ids = ([0, 0, 41, 42], [0, 0, 51, 52], [61, 62, 63, 64])
    s.update_state_after_alloc(r, load_ids, 288)
    meta = s.build_connector_meta(S._so([S.NS(req_id="b", block_ids=load_ids,
                                              num_computed_tokens=288)], {"b": 12}))
    (load,) = meta.loads
    by = {gt.group: gt for gt in load.groups}
    assert by[2].checks == tuple(words(2, k) for k in S.H3)
    assert by[0].block_ids == (41, 42) and by[0].checks == (words(0, S.H3[2]),)
    assert by[1].checks == (words(1, S.H3[2]),)
    s.request_finished(r)


def test_mixed_page_sizes_are_verified_per_size():
    """An MLA latent and its indexer in one group (two page sizes): the handler prepares each
    size apart and the flags of both come back as one; a flip in either layer flags the
    object."""
    from xkv.connector.transfer import SyncTransferHandler
    from xkv.layout import PagePool

    sizes = (64, 16, 64)  # layer page bytes
    k, C, nb = 2, 3, 8
    g = torch.Generator().manual_seed(1)
    src = [torch.randint(0, 256, (nb * b,), dtype=torch.uint8, generator=g) for b in sizes]
    pools = [PagePool(r, nb, b, b, ((0, b),)) for r, b in zip(src, sizes, strict=True)]
    obj_bytes = k * sum(sizes)
    card = torch.zeros(C * obj_bytes, dtype=torch.uint8)
    ids = torch.arange(C * k, dtype=torch.int64)
    starts = [k * sum(sizes[:li]) for li in range(3)]
    offs = torch.tensor([[(i // k) * obj_bytes + starts[li] + (i % k) * sizes[li]
                          for i in range(C * k)] for li in range(3)], dtype=torch.int64)
    h = SyncTransferHandler()
    from xkv.kernels import Checks
    objs, pages = (ids // k).numpy(), (ids % k).numpy()
    prep = h.prepare_saves(pools, ids, card, offs, checks=Checks(objs, pages, C))
    for li in range(3):
        h.save_prepared(prep, li, f"l{li}", pools[li], ids, card, offs[li])
    words = h.save_words(prep, 3).get()
    for o in range(C):
        for li in range(3):
            a = o * obj_bytes + starts[li]
            assert words[li, o] == checksum.words_numpy(
                card[a:a + k * sizes[li]].numpy().tobytes())
    for li, flip in ((None, None), (1, 5), (2, 0)):
        bad = card.clone()
        want = np.zeros(C, bool)
        if li is not None:
            at = int(offs[li, 2 * flip % (C * k)])
            bad[at] ^= 1
            want[(2 * flip % (C * k)) // k] = True
        dst = [PagePool(torch.zeros(nb * b, dtype=torch.uint8), nb, b, b, ((0, b),))
               for b in sizes]
        flags = h.load_group(["l0", "l1", "l2"], bad, offs, dst, ids,
                             checks=Checks(objs, pages, C, expected=words))
        np.testing.assert_array_equal(flags.get(), want)


def test_a_window_objects_missing_positions_are_not_hashed():
    """An early chunk's window object has no pages below ``first_page`` (nothing was saved
    there): the restore hashes only the positions that exist."""
    exp = np.arange(2, dtype="<u4")
    gt = GroupTransfer(1, (7, 8), (0, 0), (2, 3), (_ref(b"w", 0),), checks=(exp.tobytes(),),
                       first_page=1)
    rc = restore_checks(_Plan(4), 0, [gt], cw=2)
    assert sorted(rc.checks.pages.tolist()) == [1, 2, 3]
    assert rc.hash_only.tolist() == [False, False, True]


def test_window_load_sets_first_page():
    from types import SimpleNamespace as NS

    from xkv.connector.windows import window_load

    g = NS(block_size=16, sliding_window=64, extra_retained=0)
    plan = NS(group=g, chunk_size=32, blocks_per_chunk=2, blocks_per_object=4)
    # chunk 0 ends at block 2: its object holds positions 2, 3 only
    gt = window_load(1, plan, [5, 6, 7, 8], 0, 32, _ref(b"w", 0), "r")
    assert gt.block_in_chunk == (2, 3) and gt.first_page == 2
    gt = window_load(1, plan, [0, 6, 7, 8], 0, 64, _ref(b"w", 0), "r")  # chunk 1: all 4 exist
    assert gt.block_in_chunk == (1, 2, 3) and gt.first_page == 0


def test_checksum_pass_setting_and_refusals():
    from xkv.connector.config import ConfigError, ConnectorConfig
    from xkv.connector.transfer import SyncTransferHandler

    env = {"PYTHONHASHSEED": "0"}
    assert ConnectorConfig.from_extra({}, env=env).checksum_pass == "copy"
    assert ConnectorConfig.from_extra({"checksum_pass": "hbm"}, env=env).checksum_pass == "hbm"
    assert ConnectorConfig.from_extra({"checksum_pass": "end"}, env=env).checksum_pass == "end"
    with pytest.raises(ConfigError,
                       match=r"checksum_pass='gpu': expected one of 'copy', 'hbm', 'end'"):
        ConnectorConfig.from_extra({"checksum_pass": "gpu"}, env=env)
    h = SyncTransferHandler()
    assert h.checksum_pass == "copy"
    h.set_checksum_pass("hbm")
    assert h.checksum_pass == "hbm"
    with pytest.raises(ValueError, match="checksum_pass='HBM'"):
        h.set_checksum_pass("HBM")
    assert h.checksum_pass == "hbm"
