"""``XKV_TIMING``'s restore line (xkv/connector/load_timing.py) with fake timing events: the
fields bench/ reads, and nothing recorded or logged when off or when no group was issued."""

import re
import time

import pytest

from xkv.connector.load_timing import LoadTiming

LINE = re.compile(r"^XKV_TIMING restore bytes=(\d+) copy_ms=([\d.]+) issue_ms=([\d.]+) "
                  r"issue_cpu_ms=([\d.]+) pre_ms=([\d.]+) plan_ms=([\d.]+) launch_ms=([\d.]+) launch_max_ms=([\d.]+) readback_ms=([\d.]+) "
                  r"tail_ms=([\d.]+) "
                  r"launches=(\d+) checked=(\d+)/(\d+) GBps=([\d.]+)$")


class FakeEvent:
    """Records on a stream at a fake GPU time (ms); ``elapsed_time`` is the difference."""

    clock = 0.0
    made: list = []

    def __init__(self):
        self.at = None
        FakeEvent.made.append(self)

    def record(self, stream):
        assert stream == "load"
        self.at = FakeEvent.clock

    def elapsed_time(self, other):
        return other.at - self.at


@pytest.fixture(autouse=True)
def _fresh():
    """Fresh fake clock; no real collection inside a test (it would add ``gc_ms`` to a line)."""
    import gc

    FakeEvent.clock, FakeEvent.made = 0.0, []
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def _busy(seconds: float) -> int:
    """Keep this thread on the CPU for ``seconds`` (``issue_cpu_ms`` counts thread CPU time)."""
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def test_one_step_line():
    t = LoadTiming(True, FakeEvent)
    t.begin("load")
    _busy(0.002)  # 2 ms on the CPU before the first group's planning
    t.planned(0.0015, time.perf_counter())
    t.launched(0.0002, 0.00015)
    t.read_back(0.0001)
    FakeEvent.clock = 4.0
    t.issued(200_000_000, 4, "load", checked=True)
    t.tail(1_000_000, 0.0007)
    t.planned(0.0005, time.perf_counter())  # a second group's start: not the first
    t.launched(0.0003, 0.0001)
    t.read_back(0.0004)
    FakeEvent.clock = 8.0
    t.issued(68_000_000, 2, "load")  # a second group: the end moves, bytes and launches add
    m = LINE.match(t.report())
    assert m, t.report
    (nbytes, copy_ms, issue_ms, issue_cpu_ms, pre_ms, plan_ms, launch_ms, launch_max_ms,
     readback_ms, tail_ms, launches, checked, groups, gbps) = m.groups()
    # the thread spun 2 ms before planning: on the CPU all along (a loaded CI box may steal some)
    assert 2.0 <= float(pre_ms) <= float(issue_ms)
    assert 0.5 <= float(issue_cpu_ms) <= float(issue_ms) + 0.5
    assert int(nbytes) == 269_000_000 and float(copy_ms) == 8.0 and int(launches) == 6
    assert (int(checked), int(groups)) == (1, 2)  # the first group verified, the second not
    assert float(plan_ms) == 2.0 and float(tail_ms) == 0.7
    assert float(launch_ms) == 0.5 and float(readback_ms) == 0.5 and float(launch_max_ms) == 0.15
    assert float(issue_ms) >= 0 and float(gbps) == pytest.approx(269_000_000 / 8.0 / 1e6, abs=0.05)


def test_modules_imported_inside_the_step_are_named():
    """A module first imported during the step (a first-time cost) is named on the line."""
    import sys
    import types

    t = LoadTiming(True, FakeEvent)
    t.begin("load")
    sys.modules["xkv_test_late_module"] = types.ModuleType("xkv_test_late_module")
    try:
        FakeEvent.clock = 1.0
        t.issued(1000, 1, "load")
        line = t.report()
    finally:
        del sys.modules["xkv_test_late_module"]
    assert line.endswith(" imported=xkv_test_late_module"), line
    t.begin("load")  # nothing imported: no field
    FakeEvent.clock = 2.0
    t.issued(1000, 1, "load")
    assert LINE.match(t.report())
    assert t.report() is None  # closed: one line per step


def test_off_records_nothing():
    t = LoadTiming(False, FakeEvent)
    t.begin("load")
    t.planned(1.0)
    t.launched(1.0)
    t.read_back(1.0)
    t.issued(10, 1, "load")
    t.tail(10, 1.0)
    assert t.report() is None and FakeEvent.made == []


def test_no_group_issued_gives_no_line():
    t = LoadTiming(True, FakeEvent)
    t.issued(10, 1, "load")  # before any begin: ignored
    assert t.report() is None
    t.begin("load")
    t.tail(4096, 0.001)  # a tail alone has no end event: no copy time to report
    assert t.report() is None
    t.begin("load")  # the next step starts from zero
    FakeEvent.clock = 2.0
    t.issued(2_000_000, 1, "load")
    m = LINE.match(t.report())
    assert m and int(m.group(1)) == 2_000_000 and float(m.group(2)) == 2.0
    assert float(m.group(7)) == 0.0


def test_timing_2_dumps_the_stacks_of_slow_launches(monkeypatch):
    """XKV_TIMING=2: launches slower than WATCH_S write every thread's stack (faulthandler);
    fast ones and XKV_TIMING=1 arm nothing that fires."""
    import faulthandler

    from xkv.connector import load_timing

    armed = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later",
                        lambda s, repeat, file: armed.append(("arm", s, repeat)))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: armed.append("off"))
    for enabled, watch in ((True, False), (False, True)):  # XKV_TIMING=1; timing off
        t = LoadTiming(enabled, FakeEvent, watch=watch)
        t.begin("load")
        t.watch()
        t.unwatch()
    assert armed == []
    t = LoadTiming(True, FakeEvent, watch=True)  # XKV_TIMING=2
    t.watch()  # before begin: no step open
    assert armed == []
    t.begin("load")
    t.watch()
    t.unwatch()
    assert armed == [("arm", load_timing.WATCH_S, False), "off"]


def test_collections_inside_the_step_are_counted_and_long_ones_logged(monkeypatch, caplog):
    """``gc_ms``: the collections between ``begin`` and ``report`` (not those before or after);
    a collection of at least ``GC_LOG_MS`` logs a line saying whether a restore was open. The
    collection's clock is driven by hand (``gc.callbacks`` phases)."""
    import gc
    import logging

    from xkv.connector import load_timing

    clock = [100.0]
    monkeypatch.setattr(load_timing.time, "perf_counter", lambda: clock[0])
    t = LoadTiming(True, FakeEvent)
    off = LoadTiming(False, FakeEvent)
    assert load_timing._on_gc in gc.callbacks

    def collect(ms, gen=2):
        load_timing._on_gc("start", {"generation": gen})
        clock[0] += ms / 1e3
        load_timing._on_gc("stop", {"generation": gen, "collected": 7})

    with caplog.at_level(logging.INFO, logger="xkv.connector"):
        collect(5.0)  # before the step: not counted
        t.begin("load")
        off.begin("load")
        collect(1.0, gen=0)
        collect(3.0)
        FakeEvent.clock = 4.0
        t.issued(1_000_000, 1, "load")
        line = t.report()
        collect(9.0)  # after: not counted
    assert line.endswith(" gc_ms=4.00"), line
    logged = [r.getMessage() for r in caplog.records if "XKV_TIMING gc" in r.getMessage()]
    assert logged == [
        "XKV_TIMING gc generation=2 ms=5.00 collected=7 in_restore=False",
        "XKV_TIMING gc generation=2 ms=3.00 collected=7 in_restore=True",
        "XKV_TIMING gc generation=2 ms=9.00 collected=7 in_restore=False",
    ]
    t.begin("load")
    FakeEvent.clock = 8.0
    t.issued(1_000_000, 1, "load")
    assert "gc_ms" not in t.report()  # a step without a collection: no field
    assert off.gc_s == 0.0


def test_allocator_retries_inside_the_step_are_counted():
    """The caching allocator's retries between ``begin`` and ``report`` (each a device
    synchronisation) are on the line, those before the step are not; none: no field."""
    count = [7]  # retries before the step
    t = LoadTiming(True, FakeEvent, counters=lambda: {"alloc_retries": count[0]})
    t.begin("load")
    FakeEvent.clock = 1.0
    t.issued(1000, 1, "load")
    count[0] += 2  # the forward's allocations retried twice
    line = t.report()
    head, sep, n = line.rpartition(" alloc_retries=")
    assert LINE.match(head) and sep and n == "2", line
    t.begin("load")  # the next step starts from the count it finds
    FakeEvent.clock = 2.0
    t.issued(1000, 1, "load")
    assert "alloc_retries" not in t.report()
    off = LoadTiming(False, FakeEvent, counters=lambda: 1 / 0)  # off: never read
    off.begin("load")
    off.issued(1000, 1, "load")
    assert off.report() is None


def test_sync_counters_that_grew_inside_the_step_are_on_the_line_in_order():
    """``counters`` (the CUDA handler's ``alloc_retries`` / ``device_allocs`` /
    ``pinned_allocs``): each count that grew between ``begin`` and ``report`` is on the line as
    its delta, in the mapping's order; counts from before the step and unchanged ones are not;
    one read at each end; off: never read."""
    counts = {"alloc_retries": 5, "device_allocs": 40, "pinned_allocs": 3}
    reads: list[int] = []

    def read():
        reads.append(1)
        return dict(counts)

    t = LoadTiming(True, FakeEvent, counters=read)
    t.begin("load")
    FakeEvent.clock = 1.0
    t.issued(1000, 1, "load")
    counts["device_allocs"] += 2
    counts["pinned_allocs"] += 1
    line = t.report()
    head, sep, tail = line.partition(" device_allocs=")
    assert LINE.match(head) and sep and tail == "2 pinned_allocs=1", line
    assert len(reads) == 2  # once at begin, once at report
    t.begin("load")  # the next step starts from the counts it finds
    FakeEvent.clock = 2.0
    t.issued(1000, 1, "load")
    counts["pinned_allocs"] += 4
    line = t.report()
    head, sep, tail = line.partition(" pinned_allocs=")
    assert LINE.match(head) and sep and tail == "4", line
    t.begin("load")
    FakeEvent.clock = 3.0
    t.issued(1000, 1, "load")
    line = t.report()
    assert LINE.match(line) and "allocs" not in line, line
    off = LoadTiming(False, FakeEvent, counters=lambda: 1 / 0)  # off: never read
    off.begin("load")
    off.issued(1000, 1, "load")
    assert off.report() is None


def test_the_counters_are_read_before_the_steps_host_clock_starts(monkeypatch):
    """``begin`` reads ``counters`` before it takes the host time that ``pre_ms`` and
    ``issue_ms`` count from: torch's memory stats cost host time per read."""
    order: list[str] = []
    real = time.perf_counter

    def clock():
        order.append("clock")
        return real()

    monkeypatch.setattr("xkv.connector.load_timing.time.perf_counter", clock)
    t = LoadTiming(True, FakeEvent, counters=lambda: order.append("counters") or {})
    t.begin("load")
    assert order[:2] == ["counters", "clock"], order


def test_the_end_of_step_wait_for_the_loads_is_on_the_line():
    """``sync_ms``: the host time ``sync_loads`` waited for the step's loads, last on the line
    (after the optional fields bench/ reads by name); absent where the handler does not time it
    (the CPU handler), and a step's value does not leak into the next step's line."""
    t = LoadTiming(True, FakeEvent)
    t.begin("load")
    FakeEvent.clock = 2.0
    t.issued(1000, 1, "load")
    t.synced(0.00083)
    line = t.report()
    assert line.endswith(" sync_ms=0.83") and LINE.match(line.removesuffix(" sync_ms=0.83"))
    t.begin("load")
    FakeEvent.clock = 3.0
    t.issued(1000, 1, "load")
    line = t.report()
    assert "sync_ms" not in line and LINE.match(line)
    t.synced(0.5)  # after the report: the step is closed, nothing is kept
    t.begin("load")
    t.issued(1000, 1, "load")
    assert "sync_ms" not in t.report()
