"""The compile watch (xkv/kernels/_compile_watch.py): with XKV_TIMING set and after warmup, a
launch that grew Triton's variant cache is logged once with its specialisation; otherwise the
launch just runs."""

import importlib
import logging
from collections import defaultdict

from xkv.kernels import _compile_watch as cw


class FakeKernel:
    """``kernel[grid](*args, **meta)`` that compiles (grows its cache) for unseen ``meta``."""

    def __init__(self):
        self.calls = 0
        self.device_caches = defaultdict(lambda: ({}, "target", "backend", self._binder))

    def _binder(self, *args, **meta):
        return args, [("i32", "D" if a % 16 == 0 else "") for a in args], dict(meta)

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.calls += 1
            self.device_caches[0][0].setdefault(tuple(sorted(meta.items())), object())
        return run


def test_logs_a_compile_after_warmup_once(monkeypatch, caplog):
    monkeypatch.setattr(cw, "ENABLED", True)
    monkeypatch.setattr(cw, "armed", True)
    monkeypatch.setattr(cw, "_device", lambda: 0)
    monkeypatch.setattr(cw, "_logged", set())
    k = FakeKernel()
    with caplog.at_level(logging.WARNING, logger="xkv.kernels"):
        cw.launch(k, (4,), (16, 3), {"ROWS": 8}, "restore")  # new variant: logged
        cw.launch(k, (4,), (16, 3), {"ROWS": 8}, "restore")  # cached: nothing
        cw.launch(k, (4,), (16, 3), {"ROWS": 16}, "save")  # another new one
    lines = [r.getMessage() for r in caplog.records]
    assert k.calls == 3 and len(lines) == 2
    assert "restore copy compiled a Triton variant after warmup" in lines[0]
    assert "('i32', 'D'), ('i32', '')" in lines[0] and "'ROWS': 8" in lines[0]
    assert "save copy" in lines[1] and "'ROWS': 16" in lines[1]


def test_off_or_before_warmup_only_launches(monkeypatch, caplog):
    monkeypatch.setattr(cw, "_device", lambda: 0)
    monkeypatch.setattr(cw, "_logged", set())
    k = FakeKernel()
    with caplog.at_level(logging.WARNING, logger="xkv.kernels"):
        monkeypatch.setattr(cw, "ENABLED", False)
        monkeypatch.setattr(cw, "armed", True)
        cw.launch(k, (1,), (1,), {"ROWS": 1}, "restore")
        monkeypatch.setattr(cw, "ENABLED", True)
        monkeypatch.setattr(cw, "armed", False)  # warmup's own compiles
        cw.launch(k, (1,), (1,), {"ROWS": 2}, "restore")
    assert k.calls == 2 and caplog.records == []


def test_a_kernel_without_caches_still_launches(monkeypatch):
    monkeypatch.setattr(cw, "ENABLED", True)
    monkeypatch.setattr(cw, "armed", True)
    calls = []

    class Bare:
        def __getitem__(self, grid):
            return lambda *a, **m: calls.append(grid)

    cw.launch(Bare(), (2,), (), {}, "restore")
    assert calls == [(2,)]


def test_warmup_disarms_while_it_runs_and_arms_after(monkeypatch):
    import pytest

    import xkv.kernels as K
    W = importlib.import_module("xkv.kernels.warmup")  # the module (the package exports the function)

    states = []
    real = W.pools_arg
    monkeypatch.setattr(W, "pools_arg", lambda *a: states.append(cw.armed) or real(*a))
    monkeypatch.setattr(cw, "armed", True)
    assert K.warmup([], None, engine="triton") == set()
    with pytest.raises(ValueError):
        K.warmup([], None, engine="copy_engine")  # refused: armed again after it too
    assert states == [False, False] and cw.armed is True
