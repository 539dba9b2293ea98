"""Engine children of the GPU benches (``e2e_ttft.py``, ``shared_prefix.py``): one process per
engine kind, each with its own ``xkv-gateway`` where the kind uses xkv, measured one at a time.

Two ways to run them:

- one after the other (the default): each child starts its engine, measures, exits; the next
  starts after it. A kind's engine start (50-100 s on the H200: imports, torch.compile, CUDA
  graph capture, kernel warm-up) is paid once per kind, in series: four kinds spent ~370 s of a
  600 s device call starting engines (bench/RESULTS.md, stop 36).
- ``together`` (``--start-together``): every child starts its engine at once and reports
  ``E2E_READY``; only when every child is ready (or dead) does the first one get ``go`` on its
  stdin, measure and exit; then the next. No engine starts, compiles or captures while another
  measures; idle engines hold their GPU memory and do nothing. The engines must then fit the GPU
  together and must not profile memory beside each other (vLLM's profiling reads device-wide free
  memory: another engine starting meanwhile falsifies it), so the benches pass an explicit KV
  cache size (``kv_cache_memory_bytes``) in this mode. Each child gets its own compile-cache root
  (``VLLM_CACHE_ROOT``): engines of one configuration compiling at once would write one cache
  entry together. A child that dies while starting beside the others runs again alone at the
  end (say, it ran out of GPU memory beside them).

``on_line(kind, line)`` sees every line of every child, one child at a time and each child's in
its order (together: every start up to ``E2E_READY`` in kind order, then each measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: Seconds to wait for a killed child's last lines (its output closes when its last process dies).
KILL_GRACE_S = 15.0
READY = "E2E_READY"  # a held child's engine is up; it waits for GO on its stdin
GO = "go\n"


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (a vLLM child's engine-core process holds the
    child's output open and the GPU's memory: killing the child alone left both, and a stalled
    step, in the H200 run of 2026-12-05). Linux ``/proc``; children first found, then killed."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    for p in reversed(tree):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def wait_for_go(emit: Callable[[str, dict], None]) -> None:
    """In a held child (``--hold``): report the engine ready and wait for the parent's go (exit
    quietly when the parent is gone: stdin closed)."""
    emit(READY, {})
    if sys.stdin.readline() != GO:
        raise SystemExit(0)


def add_args(ap) -> None:
    """The options every bench with engine children takes: ``--start-together``, ``--kv-gib``
    and the child's hidden ``--hold``."""
    ap.add_argument("--start-together", action="store_true",
                    help="start every engine at once, measure them one at a time "
                         "(bench/engine_children.py); needs --kv-gib and a --gpu-util low enough "
                         "for all engines together (vLLM checks that much is free at each start)")
    ap.add_argument("--together-max", type=int, default=0,
                    help="with --start-together: at most this many engines at once, in waves "
                         "(kind order; a wave is measured and gone before the next starts); "
                         "0: all (an H100's 80 GB holds three Llama-3-8B engines, two of the "
                         "MLA model at their start-up peak)")
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="GPU KV cache GiB per engine (vLLM's kv_cache_memory_bytes: no memory "
                         "profiling)")
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)


def engine_kwargs(a) -> dict:
    """vLLM engine keywords of these options: the explicit KV cache size, if any."""
    return {} if a.kv_gib is None else {"kv_cache_memory_bytes": int(a.kv_gib * 2**30)}


def check_together(engines: int, gpu_util: float, kv_gib: float | None, wave: int = 0) -> None:
    """Refuse, before anything starts, settings with which engines started together cannot come
    up: no explicit KV size (they would profile memory beside each other), or a
    ``gpu_memory_utilization`` that vLLM checks is free at each start and that the engines
    together exceed (the later ones would fail at start and rerun alone, one after the other).
    ``wave``: at most this many engines at once (0: all)."""
    if wave < 0:
        raise SystemExit(f"--together-max {wave}: expected 0 (all) or a positive count")
    if wave:
        engines = min(engines, wave)
    if kv_gib is None:
        raise SystemExit("--start-together needs --kv-gib: engines starting beside each other "
                         "cannot profile GPU memory (each would count the others' allocations)")
    if engines * gpu_util > 0.9:
        raise SystemExit(f"--start-together with {engines} engines and --gpu-util {gpu_util}: "
                         f"vLLM checks at each start that {gpu_util} of the GPU is free; expected "
                         f"--gpu-util <= {0.9 / engines:.2f} (the KV cache size is --kv-gib)")


def together(a, engines: int) -> dict:
    """:func:`run`'s ``together`` / ``wave`` keywords of these options (:func:`add_args`) for
    ``engines`` children, after refusing, before anything starts, settings that cannot come up
    (:func:`check_together`) and ``--together-max`` without ``--start-together``."""
    if not a.start_together:
        if a.together_max:
            raise SystemExit(f"--together-max {a.together_max} needs --start-together")
        return {"together": False}
    check_together(engines, a.gpu_util, a.kv_gib, a.together_max)
    return {"together": True, "wave": a.together_max}


@dataclass
class Spec:
    """One child: ``kind`` (the label), ``cmd`` (without the hold/port flags), ``env``,
    ``gateway`` (start an xkv-gateway of ``card`` bytes for it; its port is passed as
    ``--port P`` and its pid as ``--gateway-pid N`` when ``pass_pid``)."""

    kind: str
    cmd: list[str]
    env: dict[str, str]
    gateway: bool = False
    card: str = "256M"
    gateway_args: list[str] = field(default_factory=list)
    port: int = 0
    pass_pid: bool = True


class Child:
    """A running child: its gateway, its process, its log file and a thread that queues its
    lines (so that a held child never blocks on a full pipe while another one measures)."""

    def __init__(self, spec: Spec, log_path: Path, hold: bool) -> None:
        self.spec, self.hold = spec, hold
        self.log = open(log_path, "w")  # noqa: SIM115 (closed by finish)
        self.gw = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ready = False
        self.killed = False  # drain() killed it at its time limit
        self.t_spawn = self.t_ready = self.t_go = self.t_end = None
        cmd = list(spec.cmd)
        if spec.gateway:
            from xkv.gateway.testing import spawn_gateway

            t = time.perf_counter()
            self.gw, port = spawn_gateway(spec.card, spec.port, timeout_s=300.0, stderr=self.log,
                                          extra_args=spec.gateway_args)
            print(f"[gateway {spec.kind}] {spec.card} card up in {time.perf_counter() - t:.1f} s "
                  f"on port {port}", flush=True)
            cmd += ["--port", str(port)]
            if spec.pass_pid:
                cmd += ["--gateway-pid", str(self.gw.pid)]
        if hold:
            cmd += ["--hold"]
        self.t_spawn = time.time()
        self.proc = subprocess.Popen(cmd, env=spec.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.PIPE if hold else subprocess.DEVNULL)
        threading.Thread(target=self._read, daemon=True, name=f"child-{spec.kind}").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(READY):
                self.t_ready = time.time()
            self.lines.put(line)
        self.lines.put(None)

    def drain(self, on_line: Callable[[str, str], None], timeout_s: float,
              until: str | None = None) -> bool:
        """Pass this child's lines to ``on_line`` (and its log) until a line starting with
        ``until`` (True) or its end (False); killed after ``timeout_s`` (a hung child prints
        nothing)."""
        deadline, killed = time.monotonic() + timeout_s, False
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if killed:  # a process we could not see still holds its output: give up on it
                    print(f"[{self.spec.kind}] output still open {KILL_GRACE_S:.0f} s after the "
                          f"kill: left", flush=True)
                    return False
                print(f"[{self.spec.kind}] no end after {timeout_s:.0f} s: killed with its "
                      f"processes", flush=True)
                kill_tree(self.proc.pid)
                self.killed = True
                deadline, killed = time.monotonic() + KILL_GRACE_S, True  # its last lines
                continue
            if line is None:
                return False
            self.log.write(line)
            on_line(self.spec.kind, line)
            if until is not None and line.startswith(until):
                return True

    def go(self) -> None:
        self.t_go = time.time()
        with contextlib.suppress(BrokenPipeError):  # died while waiting: drain() sees its end
            self.proc.stdin.write(GO)
            self.proc.stdin.flush()

    def finish(self) -> int:
        """Wait for the process, stop its gateway, close the log; the exit code."""
        if self.hold and self.proc.stdin and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()  # a child never sent go exits
        rc = self.proc.wait()
        self.t_end = time.time()
        if self.gw is not None:
            from xkv.gateway.testing import stop_gateway

            stop_gateway(self.gw)
        self.log.close()
        return rc

    def times(self) -> dict:
        """Wall-clock times (epoch s) of spawn, ready, go and end: whether starts overlapped
        and measurements did not."""
        return {"spawn": self.t_spawn, "ready": self.t_ready, "go": self.t_go, "end": self.t_end}


def log_name(kind: str) -> str:
    """The log file of a child: ``KIND.log``, characters other than letters, digits and
    ``._@=+-`` made ``_`` (``xkv:graphs`` -> ``xkv_graphs.log``)."""
    return re.sub(r"[^A-Za-z0-9._@=+-]", "_", kind) + ".log"


def run(specs: list[Spec], out: Path, on_line: Callable[[str, str], None], timeout_s: float,
        together: bool = False, on_done: Callable[[str, int, dict], None] | None = None,
        wave: int = 0) -> None:
    """Run every child of ``specs`` (logs ``out/KIND.log``, :func:`log_name`), one after the
    other or started together (module docstring); ``on_done(kind, rc, times)`` after each.
    ``timeout_s``: one after the other, a child's limit for its whole run; started together,
    for its engine start and again, once told to go, for its measurements. ``wave`` (together
    only): at most this many children at once, in kind order, each wave measured and ended
    before the next starts (0: all); children that died starting rerun alone after the last,
    except one that started alone (a wave of one) and ran out of time."""
    if not together:
        for spec in specs:
            c = Child(spec, out / log_name(spec.kind), hold=False)
            c.drain(on_line, timeout_s)
            rc = c.finish()
            print(f"[{spec.kind}] rc={rc} in {c.t_end - c.t_spawn:.0f} s", flush=True)
            if on_done is not None:
                on_done(spec.kind, rc, c.times())
        return
    caches = Path(tempfile.mkdtemp(prefix="xkv-e2e-caches-"))  # not under out: out is shipped
    try:
        n = wave if wave > 0 else max(len(specs), 1)
        again = []
        for w in range(0, len(specs), n):
            again += _together(specs[w:w + n], out, on_line, timeout_s, on_done, caches, w)
        for spec in again:
            log = out / log_name(spec.kind)
            os.replace(log, log.with_suffix(".together.log"))
        if again:
            run(again, out, on_line, timeout_s, together=False, on_done=on_done)
    finally:
        shutil.rmtree(caches, ignore_errors=True)


def _together(specs, out, on_line, timeout_s, on_done, caches: Path, first: int) -> list[Spec]:
    """One wave: start ``specs`` at once, measure them one at a time; return those that died
    while starting (``first``: the wave's first index, for the compile-cache roots)."""
    t0, kids = time.time(), []
    for i, spec in enumerate(specs, first):
        env = dict(spec.env, VLLM_CACHE_ROOT=str(caches / f"vllm-{i}"))
        kids.append(Child(dataclasses.replace(spec, env=env, port=0),
                          out / log_name(spec.kind), hold=True))
    for c in kids:  # every engine up (or dead) before anyone measures
        left = max(1.0, timeout_s - (time.time() - c.t_spawn))
        c.ready = c.drain(on_line, left, until=READY)
    ready = [c.spec.kind for c in kids if c.ready]
    print(f"[together] {len(ready)} of {len(kids)} engines up in {time.time() - t0:.0f} s: "
          f"{ready}", flush=True)
    again = []
    for c in kids:
        if c.ready:
            c.go()
            c.drain(on_line, timeout_s)
        rc = c.finish()
        if not c.ready and c.killed and len(kids) == 1:
            # it started alone and ran out of time: alone again it would too (stop 42: an MLA
            # engine took 129-136 s to start on an H100, the limit was 140 s, and its rerun
            # spent the step's remaining time)
            print(f"[{c.spec.kind}] did not start within {timeout_s:.0f} s alone: not run again "
                  f"(a longer --child-timeout)", flush=True)
            if on_done is not None:
                on_done(c.spec.kind, rc, c.times())
            continue
        if not c.ready:
            print(f"[{c.spec.kind}] died while starting beside the others (rc={rc}): it runs "
                  f"again alone at the end", flush=True)
            again.append(c.spec)
            continue
        print(f"[{c.spec.kind}] rc={rc}; measured in {c.t_end - c.t_go:.0f} s", flush=True)
        if on_done is not None:
            on_done(c.spec.kind, rc, c.times())
    return again
