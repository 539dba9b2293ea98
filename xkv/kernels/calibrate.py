"""Which engine ``engine="auto"`` picks: per GPU, direction and fragment size, once measured.

:func:`calibrate` times every engine host <-> GPU in both directions at a few fragment sizes and
installs the ranking (:class:`Calibration`) for that GPU; :func:`auto_engine` follows it. Without a
calibration CUDA copies use Triton; CPU copies always use the torch engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xkv.kernels import _budgets, _launch, copy_engine, staged
from xkv.kernels.jobs import Job, build_job, offsets_arg

__all__ = ["Calibration", "auto_engine", "calibrate", "calibration", "copy_gbps", "copy_rates",
           "device_index", "set_calibration"]


@dataclass(frozen=True)
class Calibration:
    """Which engine moved each fragment size fastest on one GPU, per direction (from :func:`calibrate`)."""

    sizes: tuple[int, ...]  # measured fragment sizes, ascending
    restore: tuple[tuple[str, ...], ...]  # per size: engines, fastest first
    save: tuple[tuple[str, ...], ...]
    gbps: dict  # {"restore"|"save": {size: {engine: GB/s}}}

    def engine_for(self, save: bool, run_bytes: int, total_bytes: int, flat_on_host: bool) -> str:
        """The engine for fragments whose smallest run is ``run_bytes``: the ranking of the largest
        measured size not above it (or of the smallest size), minus engines that do not apply here
        (staged needs host memory and enough bytes to fill its pipeline)."""
        k = 0
        for j, size in enumerate(self.sizes):
            if size <= run_bytes:
                k = j
        for eng in (self.save if save else self.restore)[k]:
            if eng == "staged" and (not flat_on_host or total_bytes < staged.STAGED_MIN_BYTES):
                continue
            if eng == "copy_engine" and not copy_engine.available():
                continue
            return eng
        return "triton"


_CALIBRATION: dict[int, Calibration | None] = {}  # device index -> calibration


def device_index(device) -> int:
    """CUDA device index of ``device`` (None: the current one); -1 for CPU."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else -1
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        return -1
    if d.index is not None:
        return d.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def calibration(device: torch.device | int | None = None) -> Calibration | None:
    """The calibration ``engine="auto"`` follows on ``device`` (None: Triton always)."""
    return _CALIBRATION.get(device_index(device))


def set_calibration(cal: Calibration | None, device: torch.device | int | None = None) -> None:
    """Install (or clear, with None) the calibration of ``device``."""
    _CALIBRATION[device_index(device)] = cal


def auto_engine(job: Job) -> str:
    """What ``engine="auto"`` means for ``job``: the torch engine off CUDA, else the calibrated
    choice for its direction and smallest run (Triton without a calibration, and for slices)."""
    dev = job.pools[0].device
    if dev.type != "cuda":
        return "reference"
    cal = _CALIBRATION.get(device_index(dev))
    if cal is None or not job.block_bytes or job.sliced:
        return "triton"
    run = min(n for p in job.pools for _, n in p.runs)
    total = len(job.pools) * job.n * job.block_bytes
    return cal.engine_for(job.save, run, total, job.flat.device.type == "cpu")


def copy_gbps(go: Callable[[], None], nbytes: int, dev: torch.device, reps: int = 3) -> float:
    """GB/s of ``go()`` (issues one copy of ``nbytes`` on ``dev``'s streams): one warm-up (and
    compile), then the best of ``reps`` timed issues, each to the last byte (synchronized)."""
    return copy_rates([go], nbytes, dev, reps)[0]


def copy_rates(gos: Sequence[Callable[[], None]], nbytes: int, dev: torch.device | None,
               reps: int = 3, *, sync: Callable[[], None] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """GB/s of each ``gos[i]()`` (each issues one copy of ``nbytes``): one warm-up of each, then
    ``reps`` rounds that time every one once, each to the last byte, the order rotated from round
    to round; the best of each. Interleaved because what the rates are compared for is their
    ratio: a transient load on the GPU or the host's memory (another engine starting beside this
    one, the other TP ranks probing) then falls on every path alike instead of on one path's
    repetitions (stop 42: two engines starting together, one timed the Triton kernel at 18.1
    GB/s, the other at 48.4). ``sync`` (default: synchronize ``dev``) and ``clock``: tests."""
    if sync is None:
        with torch.cuda.device(dev):
            return copy_rates(gos, nbytes, dev, reps, clock=clock,
                              sync=lambda: torch.cuda.synchronize(dev))
    for go in gos:
        go()
    sync()
    best = [float("inf")] * len(gos)
    for r in range(max(1, int(reps))):
        for k in range(len(gos)):
            i = (r + k) % len(gos)
            t0 = clock()
            gos[i]()
            sync()
            best[i] = min(best[i], clock() - t0)
    return [nbytes / b / 1e9 for b in best]


def _time(job: Job, eng: str, budget: int, dev: torch.device) -> float:
    """GB/s of ``engine`` on ``job`` (:func:`copy_gbps`)."""
    go = {
        "triton": lambda: _launch.run(job, budget),
        "copy_engine": lambda: copy_engine.run(job),
        "staged": lambda: staged.run(job, budget),
    }[eng]
    return copy_gbps(go, job.n * job.block_bytes, dev)


def calibrate(
    device: torch.device | int | None = None,
    *,
    sizes: Sequence[int] = (4096, 16384, 65536, 262144),
    total_bytes: int = 128 << 20,
    max_programs: int | None = None,
    engines: Sequence[str] = ("triton", "copy_engine", "staged"),
) -> Calibration | None:
    """Time every engine at each fragment size, host <-> GPU, both directions, once; install and
    return the ranking that ``engine="auto"`` follows from then on. ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    idx = device_index(device)
    dev = torch.device("cuda", idx)
    budget = _budgets.default_programs() if max_programs is None else int(max_programs)
    engines = [e for e in engines if e != "copy_engine" or copy_engine.available()]
    from xkv.layout import describe_cache

    gb: dict[str, dict[int, dict[str, float]]] = {"restore": {}, "save": {}}
    for size in sorted(sizes):
        n = max(4, total_bytes // size)
        cache = torch.empty((n * 2, size), dtype=torch.uint8, device=dev)
        pool = describe_cache(cache)
        host = torch.empty(n * size, dtype=torch.uint8, pin_memory=True)
        ids = torch.randperm(n * 2)[:n]
        offs = np.arange(n, dtype=np.int64) * size
        for direction in ("restore", "save"):
            job = build_job([pool], ids, host, offsets_arg(offs, 1, "offsets"),
                            save=direction == "save")
            gb[direction][size] = {eng: _time(job, eng, budget, dev) for eng in engines}
        del cache, host
    ss = tuple(sorted(sizes))

    def rank(d: str) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(sorted(gb[d][z], key=lambda e: -gb[d][z][e])) for z in ss)

    cal = Calibration(sizes=ss, restore=rank("restore"), save=rank("save"), gbps=gb)
    _CALIBRATION[idx] = cal
    return cal
