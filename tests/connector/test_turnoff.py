"""Issue 27 item 1: a dead (or restarted) gateway never stalls the engine thread.

On the H200 the first request after a gateway SIGKILL took 1-5.6 s, growing with the card: the
worker drained its commit thread and unregistered the card (``cudaHostUnregister``, ~0.13 s per
GiB) inside ``get_finished``, and a re-attach registered the new card inside ``bind``. Here the
slow parts are injected (a sleep in the commit drain, the card unregister and register) on a
real vLLM scheduler and worker over CPU caches with the in-process fake gateway: every step
must return in a fraction of the injected time, the release must happen on the worker's
background thread after the drain, nothing may touch the card after it was let go, and a
re-attached card must serve the right bytes from the step after it was attached.
"""

import threading
import time

import pytest
import torch

from xkv.connector.turnoff import OffPath, record_fences

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
import vllm_harness as H  # noqa: E402

CHUNK = 64
SLOW_S = 1.5  # each injected slow part
STEP_BUDGET_S = 0.5  # a step may take this much at most (3 x SLOW_S before the fix)


def _prompt(n, base=10):
    return [(base + i) % 1000 + 4 for i in range(n)]


def _engine(llama_dir, reattach=False):
    return H.gateway_engine(llama_dir, chunk_size=CHUNK, reattach=reattach)


def _run_timed(sched, wk, caches, req):
    """Run ``req`` to the end; (outputs, the longest step in seconds)."""
    sched.add_request(req)
    outs, longest = [], 0.0
    while sched.has_unfinished_requests():
        t0 = time.perf_counter()
        outs.append(H.step_with_worker(sched, wk, caches, 32))
        longest = max(longest, time.perf_counter() - t0)
    return outs, longest


class _Slow:
    """Injected slow parts; records (what, thread name) in call order."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def wrap(self, what, fn=None):
        def slow(*a, **k):
            self.calls.append((what, threading.current_thread().name))
            time.sleep(SLOW_S)
            return fn(*a, **k) if fn is not None else (a[0] if a else None)
        return slow

    def names(self):
        return [w for w, _ in self.calls]


def test_turn_off_lets_go_of_the_card_off_the_engine_thread(fake_gateway, llama_dir, monkeypatch):
    s, w, c = _engine(llama_dir)
    wk = w._worker
    wk.offpath.idle_s = 0.5  # idle after half a second without a step (steps here: < 0.1 s)
    slow = _Slow()
    committer = wk.saver._committer
    monkeypatch.setattr(committer, "drain", slow.wrap("drain", committer.drain))
    left = [3]  # the card's segments still registered (card_pin pins a card in segments)

    def unpin(card, limit=None):
        n = left[0] if limit is None else min(limit, left[0])
        for _ in range(n):
            slow.calls.append(("unregister", threading.current_thread().name))
            time.sleep(SLOW_S / 3)
        left[0] -= n
        return left[0]

    wk.session._unregister_card = unpin
    _run_timed(s, w, c, H.make_request("a", _prompt(300)))  # stored, while it lives
    card = wk.card
    assert card is not None
    fake_gateway.dead = True
    longest = 0.0
    for i in range(5):  # three unanswered calls turn both roles off; two more steps after
        outs, t = _run_timed(s, w, c, H.make_request(f"x{i}", _prompt(300, base=100 * i)))
        longest = max(longest, t)
        assert not any(o[1].loads for o in outs)
    assert s.connector._scheduler.turned_off and wk.turned_off
    assert wk.card is None  # taken from the session at once: no load or save can see it
    before = card.clone()
    assert longest < STEP_BUDGET_S, f"a step took {longest:.2f} s (slow parts: {slow.calls})"
    # retired, not let go while the engine steps (an unregister stalls every CUDA call)
    assert wk.offpath.retired == 1 and "unregister" not in slow.names(), slow.calls
    for i in range(2):  # later steps never touch the old card
        _run_timed(s, w, c, H.make_request(f"y{i}", _prompt(300, base=700 + 50 * i)))
    assert "unregister" not in slow.names(), slow.calls
    assert wk.offpath.wait(10 * SLOW_S)  # the engine idles: let go now
    # drained first, then unregistered one segment per step, on the worker's background thread
    assert slow.names()[-4:] == ["drain"] + ["unregister"] * 3, slow.calls
    assert wk.offpath.last_release_steps == 4
    assert {t for w_, t in slow.calls if w_ == "unregister"} == {"xkv-offpath-0"}, slow.calls
    assert torch.equal(card, before)
    assert wk.offpath.last_release_s >= 2 * SLOW_S


def test_reattach_registers_the_new_card_in_the_background(fake_gateway, llama_dir):
    s, w, c = _engine(llama_dir, reattach=True)
    wk = w._worker
    slow = _Slow()
    _run_timed(s, w, c, H.make_request("a", _prompt(300)))
    fake_gateway.dead = True
    for i in range(3):
        _run_timed(s, w, c, H.make_request(f"x{i}", _prompt(300, base=100 * i)))
    assert wk.turned_off and wk.card is None
    assert wk.offpath.wait(10)
    wk.session._register_card = slow.wrap("register")
    fake_gateway.restart()  # a new process: new epoch, nothing stored
    fake_gateway.card[:] = b"\x5a" * len(fake_gateway.card)
    q = _prompt(300, base=500)
    s.reset_prefix_cache()
    outs, longest = _run_timed(s, w, c, H.make_request("b", q))
    assert longest < STEP_BUDGET_S, f"a step took {longest:.2f} s (slow parts: {slow.calls})"
    assert outs[0][1].epoch == fake_gateway.epoch and not outs[0][1].turned_off
    # still attaching on the background thread: the rank stays off, nothing was saved by it
    assert wk.turned_off and wk.offpath.attaching
    assert not fake_gateway.committed(1)
    assert wk.offpath.wait(10 * SLOW_S)
    assert slow.calls == [("register", "xkv-offpath-0")]
    # the next step adopts the new card; saves and restores work again, bytes exact (another
    # prompt: b's chunks stay reserved until the write TTL, its aborts were never sent)
    q = _prompt(300, base=900)
    s.reset_prefix_cache()
    outs, _ = _run_timed(s, w, c, H.make_request("c", q))
    assert not wk.turned_off and wk.session.epoch == fake_gateway.epoch
    assert len(fake_gateway.committed(1)) == 4
    s.reset_prefix_cache()
    s.add_request(H.make_request("d", q))
    so, meta, out = H.step_with_worker(s, w, c, 32)
    assert so.num_scheduled_tokens["d"] == 300 - 256 and not out.invalid_block_ids
    (gt,) = meta.loads[0].groups
    assert all(torch.equal(H.page(kv, bid), H.pattern(q[: (i + 1) * 32], name, H.page(kv, 0).numel()))
               for i, bid in enumerate(gt.block_ids) for name, kv in c.items())


def test_a_multi_group_model_waits_for_the_attach_its_promised_loads_need():
    """vLLM cannot take block load errors of a model with several KV cache groups: a load
    promised against the restarted gateway while this rank still attaches in the background
    waits for the attach (instead of stopping the engine), then restores the stored state."""
    import test_worker_states as S
    from connector_fakes import FakeGateway

    from xkv.connector.metadata import ChunkRef, GroupTransfer, StepMetadata, TransferJob

    gw = FakeGateway()
    w, _, buf = S._worker(gw)
    w.session.reattach_enabled = True
    slow = _Slow()
    w.session._register_card = slow.wrap("register")
    gw.restart()
    c = gw.client()
    spec = w.session._layouts[0]  # the state group's HELLO, as the rank will send it
    lid = c.register_layout("t", spec.fingerprint, spec.num_shards, spec.shard_bytes,
                            check_words=spec.check_words).layout_id
    want = torch.randint(-128, 127, (S.STATE,), dtype=torch.int8, generator=torch.Generator()
                         .manual_seed(5))
    (r,) = c.reserve(lid, [b"m" * 32])
    torch.frombuffer(gw.card, dtype=torch.int8)[r.offsets[0]:r.offsets[0] + S.STATE] = want
    c.commit(lid, 0, [r.key])
    t0 = time.perf_counter()
    w.bind(StepMetadata(epoch=gw.epoch, layout_ids=()))  # the scheduler is on the new gateway
    assert time.perf_counter() - t0 < STEP_BUDGET_S and w.offpath.attaching
    S._state_page(buf, 7).fill_(-91)
    ref = ChunkRef(r.key, r.offsets, r.generations)
    load = TransferJob(9, "z", (GroupTransfer(0, (7,), (0,), (0,), (ref,)),), S.BS)
    w.bind(StepMetadata(loads=(load,), epoch=gw.epoch, layout_ids=(lid, lid + 1)))
    w.start_load_kv()  # waits for the background attach, then restores
    w.get_finished()
    assert slow.calls == [("register", "xkv-offpath-0")]
    assert w.session.epoch == gw.epoch and not w.turned_off
    assert torch.equal(S._state_page(buf, 7)[:S.STATE], want) and not w.take_load_errors()


class _Fence:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        time.sleep(0.2)
        self.log.append(("fence", threading.current_thread().name))


class _Session:
    def __init__(self, log):
        self.log = log

    def unpin_step(self, old):
        return 0  # nothing registered (tests/connector/test_card_pin.py: the segments)

    def let_go(self, old):
        self.log.append(("let_go", threading.current_thread().name, tuple(old)))


def test_release_waits_for_fences_then_the_drain_then_lets_go_on_its_thread():
    log: list = []

    def drain(timeout_s):
        log.append(("drain", threading.current_thread().name))
        return True

    op = OffPath(_Session(log), drain, name="xkv-offpath-test")
    t0 = time.perf_counter()
    op.release(["client", "card"], [_Fence(log), _Fence(log)])
    op.release(None, [_Fence(log)])  # nothing detached: no job
    assert time.perf_counter() - t0 < 0.1  # the caller never waits for the fences
    assert op.wait(5)
    assert log == [("fence", "xkv-offpath-test"), ("fence", "xkv-offpath-test"),
                   ("drain", "xkv-offpath-test"),
                   ("let_go", "xkv-offpath-test", ("client", "card"))]
    assert op.close() is None


def test_a_retired_card_waits_for_an_idle_engine_or_an_attach():
    """An unregister stalls every CUDA call of the process (H200: bench/cuda_register_lock.py):
    never while the engine steps; an attach lets go of it first (never two cards registered)."""
    log: list = []

    class Session(_Session):
        def connect_fresh(self):
            log.append(("connect", threading.current_thread().name))
            return ("client2", [], "card2")

    op = OffPath(Session(log), lambda t: True, name="xkv-offpath-test")
    op.idle_s = 0.3
    op.release(["c1", "card1"], [])
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # an engine stepping every 50 ms
        op.note_step()
        time.sleep(0.05)
    assert log == [] and op.retired == 1
    assert op.wait(5) and log == [("let_go", "xkv-offpath-test", ("c1", "card1"))]
    log.clear()
    op.release(["c2", "card2"], [])
    op.note_step()
    op.attach()
    assert op.take_attached(None) == ("client2", [], "card2")
    assert log == [("let_go", "xkv-offpath-test", ("c2", "card2")),
                   ("connect", "xkv-offpath-test")], log
    op.release(["c3", "card3"], [])
    op.note_step()
    assert op.close() is None and log[-1][2] == ("c3", "card3")  # shutdown: let go at once


def test_fences_are_recorded_only_on_cuda():
    class Owner:
        def __init__(self):
            self.load_stream = object()

    assert record_fences([Owner(), None], torch.device("cpu")) == []
    assert record_fences([Owner()], None) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_fences_cover_every_stream_of_the_owners():
    class Owner:
        def __init__(self):
            self.load_stream = torch.cuda.Stream()
            self.save_stream = torch.cuda.Stream()

    o = Owner()
    evs = record_fences([o, o, None], torch.device("cuda", torch.cuda.current_device()))
    assert len(evs) == 3  # the current stream and the two of the owner, once each
    for ev in evs:
        ev.synchronize()


def test_after_kill_report_names_the_worst_extra_wait(tmp_path):
    """bench/e2e_ttft.py's after-kill summary (the H200 figure of this issue), from rows."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows = [dict(kind="xkv", phase="cold", tokens=4096, ttft_ms=v) for v in (40.0, 42.0, 44.0)]
    rows += [dict(kind="xkv", phase="after_kill_ref", tokens=3073, ttft_ms=5600.0)]
    rows += [dict(kind="xkv", phase="after_kill_cold", tokens=4096, ttft_ms=v, i=i)
             for i, v in enumerate((95.0, 43.0))]
    rows += [dict(kind="xkv", phase="after_kill_idle", tokens=4096, ttft_ms=160.5)]
    res = {"args": {"model": str(root / "bench" / "models" / "llama8b"), "backend": "FLASH_ATTN"},
           "rows": rows, "ref": {"xkv": {"cold": {"ttft_ms": 30.0}}}, "verify": [], "rc": {},
           "info": {}}
    (tmp_path / "r.json").write_text(json.dumps(res))
    p = subprocess.run([sys.executable, str(root / "bench" / "e2e_ttft.py"), "--report-only",
                        str(tmp_path / "r.json"), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=root)
    assert p.returncode == 0, p.stderr
    assert ("first request (ref, 3073 tokens) 5600.0 ms vs cold 30.0 ms; then 4096-token requests "
            "[95.0, 43.0] ms vs cold median 42.0 ms; worst extra 5570.0 ms (target <= 100 ms: "
            "missed); a request sent as the idle engine lets go of the card: 160.5 ms (extra "
            "118.5 ms, target <= 100 ms: missed)") in p.stdout, p.stdout
