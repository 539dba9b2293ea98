"""Re-attach after a gateway restart (``reattach: true``, off by default), on a real vLLM
scheduler and worker over CPU caches, with the in-process fake gateway.

The gateway dies: both roles turn off (one line per rank), zero hits. It comes back as a new
process (new epoch, empty card): the scheduler re-attaches at its next step, the worker follows
the epoch in the metadata (one "re-attached" line per rank), hits come back with the right
bytes. Loads promised against the old epoch are load errors, never read. Off by default: a
restarted gateway is never used again.
"""

import logging

import pytest
import torch

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
import vllm_harness as H  # noqa: E402

CHUNK = 64
OFF = "External KV cache turned off on this rank"
BACK = "External KV cache re-attached on this rank"


def _prompt(n, base=10):
    return [(base + i) % 1000 + 4 for i in range(n)]


def _engine(llama_dir, reattach=True):
    sched, wk, caches = H.gateway_engine(llama_dir, chunk_size=CHUNK, reattach=reattach)
    # the worker attaches on its background thread and uses the card from the step in which
    # the attach finished (production waits one lookup deadline for it; test_turnoff.py covers
    # a slow one): here bind waits for it, so the steps below see it on any machine load
    wk._worker.attach_wait_s = 30.0
    return sched, wk, caches


def _run(sched, wk, caches, req):
    sched.add_request(req)
    outs = []
    while sched.has_unfinished_requests():
        outs.append(H.step_with_worker(sched, wk, caches, 32))
    return outs


def _restored_exactly(meta, caches, p):
    (gt,) = meta.loads[0].groups
    return all(torch.equal(H.page(kv, bid), H.pattern(p[: (i + 1) * 32], name, H.page(kv, 0).numel()))
               for i, bid in enumerate(gt.block_ids) for name, kv in caches.items())


class _Lines(logging.Handler):
    """Every WARNING of the ``xkv`` loggers, once each (whatever other handlers are set up)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def count(self, text):
        return sum(text in ln for ln in self.lines)


def test_restart_then_reattach_serves_hits_again(fake_gateway, llama_dir):
    s, w, c = _engine(llama_dir)
    p, q = _prompt(300), _prompt(300, base=500)
    lines = _Lines()
    logging.getLogger("xkv").addHandler(lines)
    try:
        _run(s, w, c, H.make_request("a", p))
        fake_gateway.dead = True
        for i in range(3):  # three unanswered calls in a row: both roles off, zero hits
            so, meta, _ = _run(s, w, c, H.make_request(f"x{i}", _prompt(300, base=100 * i)))[0]
            assert not meta.loads
        assert meta.turned_off and w._worker.turned_off and w._worker.card is None  # unmapped
        old_epoch = fake_gateway.epoch
        fake_gateway.restart()  # a new process: new epoch, nothing stored
        s.reset_prefix_cache()
        outs = _run(s, w, c, H.make_request("b", q))  # a miss, stored on the new gateway
        assert not outs[0][1].loads and not outs[0][1].turned_off
        assert outs[0][1].epoch == fake_gateway.epoch != old_epoch
        assert w._worker.session.epoch == fake_gateway.epoch and not w._worker.turned_off
        assert len(fake_gateway.committed(1)) == 4
        s.reset_prefix_cache()
        s.add_request(H.make_request("c", q))
        so, meta, out = H.step_with_worker(s, w, c, 32)
    finally:
        logging.getLogger("xkv").removeHandler(lines)
    assert so.num_scheduled_tokens["c"] == 300 - 256 and not out.invalid_block_ids
    assert _restored_exactly(meta, c, q)
    assert lines.count(OFF) == 1 and lines.count(BACK) == 1, lines.lines
    assert lines.count("xkv scheduler: re-attached") == 1


def test_loads_of_the_old_epoch_are_errors_never_read(fake_gateway, llama_dir):
    s, w, c = _engine(llama_dir)
    p = _prompt(300)
    _run(s, w, c, H.make_request("a", p))
    s.reset_prefix_cache()
    s.add_request(H.make_request("b", p))
    assert s.connector.get_num_new_matched_tokens(s.requests["b"], 0) == (256, False)
    # after the lookup, before the load: the gateway restarts and this rank is on the new one
    fake_gateway.restart()
    fake_gateway.card[:] = b"\x5a" * len(fake_gateway.card)  # what a read of the new card gives
    ws = w._worker.session
    ws.turn_off("test: the gateway restarted")
    assert ws.reattach() and ws.epoch == fake_gateway.epoch
    so, meta, out = H.step_with_worker(s, w, c, 32)
    (gt,) = meta.loads[0].groups
    assert meta.epoch != fake_gateway.epoch  # promised against the old gateway
    assert out.invalid_block_ids == set(gt.block_ids)
    for bid in gt.block_ids:  # never read: no byte of the new card in the pages
        for kv in c.values():
            assert not bool((H.page(kv, bid) == 0x5A).all())


def test_off_by_default_a_restarted_gateway_is_not_used(fake_gateway, llama_dir):
    s, w, c = _engine(llama_dir, reattach=False)
    _run(s, w, c, H.make_request("a", _prompt(300)))
    fake_gateway.dead = True
    for i in range(3):
        _run(s, w, c, H.make_request(f"x{i}", _prompt(300, base=100 * i)))
    fake_gateway.restart()
    n0 = len(fake_gateway.messages)
    for i in range(3):  # re-probes see another epoch: off for good, nothing but probes sent
        outs = _run(s, w, c, H.make_request(f"b{i}", _prompt(300, base=500 + i)))
        assert outs[0][1].turned_off
    assert {m[0] for m in fake_gateway.messages[n0:]} <= {"ping"}
    assert s.connector._scheduler.session._final


def test_transient_misses_back_off_then_resume_on_the_same_gateway(fake_gateway, llama_dir):
    """Not off for good (default): after the misses the session backs off, re-probes, and is
    on again when the same gateway process answers; the worker follows."""
    s, w, c = _engine(llama_dir, reattach=False)
    p = _prompt(300)
    _run(s, w, c, H.make_request("a", p))
    fake_gateway.dead = True
    for i in range(3):
        _run(s, w, c, H.make_request(f"x{i}", _prompt(300, base=100 * i)))
    assert s.connector._scheduler.turned_off and w._worker.turned_off
    fake_gateway.dead = False  # it was only slow: same epoch, everything still stored
    _run(s, w, c, H.make_request("y", _prompt(300, base=900)))  # the probe and re-attach
    assert not s.connector._scheduler.turned_off and not w._worker.turned_off
    s.reset_prefix_cache()
    s.add_request(H.make_request("b", p))
    so, meta, out = H.step_with_worker(s, w, c, 32)
    assert so.num_scheduled_tokens["b"] == 300 - 256 and not out.invalid_block_ids
    assert _restored_exactly(meta, c, p)
