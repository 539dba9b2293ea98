"""Whether ``engine="auto"`` restores through the copy engine and the ring on a GPU: measured once.

How fast SMs read host memory depends on the host, the copy engine's rate does not (bench/RESULTS.md
"stop 40", "stop 41"): on stop 40's H100 the Triton restore read 29-33 GB/s against ~53 for the
copy engine and the ring (the ring's restores were 20-25 % faster end to end); on stop 41's H200
the Triton restore read 50.8 GB/s against 53.4-54.3 for the ring, and in the engine the ring's own
host work (its plan before the first copy, then each chunk's copy, events and unpack issued by
Python) made it 4-14 % slower at 2k-8k tokens on the Llama shape and 6-30 % slower at every
measured length on the Qwen and MLA models. A copy rate 5-7 % higher does not pay for that work; a
rate 1.6x higher does. Stop 42's H100 (another machine) read 43-48 GB/s with SMs against 48-52 for the
ring (1.02-1.13x): the probe kept the Triton kernel, and the ring forced was 15 % / 3 % slower at
2k / 8k tokens and 3 % faster at 32k in the same call.

:func:`probe` times both paths' copies on one restore of real pages (a layer's cache, before
serving) from the card, as the page mover does (bench/page_mover.py: prepared launches), and
records the result per GPU; ``auto`` follows its verdict (:attr:`Probe.ring_wins`): the ring
when it copied at least :func:`min_gain` x the Triton kernel's rate (:data:`MIN_GAIN`, or
``XKV_RING_MIN_GAIN`` as the probe read it, :attr:`Probe.gain`), the Triton kernel otherwise.
Unprobed (no worker start, e.g. tests and the page mover) the ring is taken, as before the probe.

A ring that copies faster still costs more host time per restore than the kernel (its plan, each
chunk's batched copy, events and unpack issued by Python): :data:`RING_EXTRA_S`. So even where
the ring wins the probe, :func:`takes_ring` gives it only restores large enough for the faster
copy to pay that back (:attr:`Probe.ring_from_bytes`); smaller ones stay on the kernel.

``XKV_RING_MIN_GAIN=1`` (an A/B switch until a GPU measures it) drops the gain's margin and lets
the size rule alone decide: on a host whose SMs read host memory nearly as fast as the copy
engine (stop 56's H100: ring 52.6, kernel 49.9 GB/s) the ring then takes only restores of about
2 GB and more, where its faster copy is worth tens of milliseconds (8 x 16k restores: 17.2 GB in
347 ms at the kernel's 49.5 GB/s, 310 ms at the copy engine's 55.5; stop 41's H200 at 1.05-1.07 x:
the ring forced was 3-4 % faster at Llama 16k / 32k, 10 % slower at a 36-layer Qwen shape's 32k,
before the ring's plan got cheaper at stops 44-45).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from xkv.kernels import _launch, staged
from xkv.kernels.calibrate import copy_rates, device_index
from xkv.kernels.jobs import build_job, offsets_arg
from xkv.layout import PagePool

__all__ = ["GAIN_ENV", "MIN_GAIN", "PROBE_BYTES", "RING_EXTRA_S", "Probe", "choice", "min_gain",
           "probe", "ring_from", "set_choice", "takes_ring"]

#: the ring's rate over the Triton kernel's from which ``auto`` takes the ring: above stop 41's
#: H200 (1.05-1.07, where the ring lost end to end), below stop 40's H100 (~1.6, where it won)
MIN_GAIN = 1.15
GAIN_ENV = "XKV_RING_MIN_GAIN"
#: bytes one probe restores per path (~1.3 ms at 50 GB/s): a whole ring's worth of chunks
PROBE_BYTES = 64 << 20
#: seconds of engine time a restore through the ring costs beyond one through the Triton kernel
#: at equal copy rates. Stop 50's H100 (probe: ring 51.8, kernel 31.3 GB/s), the same call,
#: engine time of a full-hit restore, ring / kernel forced: the MLA model's 4k restore (75.8 MB)
#: 15.2 / 13.7 ms, the ring 1.5 ms slower where its copy should save 1.0 (~2.5 ms extra); the
#: Llama-3-8B shape's 2k (270.5 MB) 16.1 / 17.7 ms, 1.6 faster where its copy should save 3.4
#: (~1.8 extra); 4k (541 MB) 19.6 / 26.9 ms (bench/RESULTS.md "stop 50",
#: bench/results/h100_2026-12-07_stop50/c1.tgz, c2.tgz)
RING_EXTRA_S = 2.0e-3


def min_gain() -> float:
    """The ring's rate over the kernel's from which ``auto`` may take it: ``XKV_RING_MIN_GAIN``
    (a number >= 1), else :data:`MIN_GAIN`; anything else refuses with a clear error."""
    v = os.environ.get(GAIN_ENV)
    if v is None:
        return MIN_GAIN
    try:
        g = float(v)
    except ValueError:
        g = math.nan
    if not (math.isfinite(g) and g >= 1.0):
        raise ValueError(f"{GAIN_ENV}={v!r}: expected a number >= 1 (the ring's copy rate over "
                         f"the Triton kernel's from which auto may take it; default {MIN_GAIN})")
    return g


@dataclass(frozen=True)
class Probe:
    """Rates of one probe restore (GB/s, best of its repetitions; each path planned beforehand)."""

    triton_gbps: float
    ring_gbps: float
    nbytes: int
    error: str = ""  # the probe raised: the ring is not taken
    #: the gain ``auto`` asks of this probe's ring (:func:`min_gain` when :func:`probe` ran: the
    #: environment is read once, not at every restore)
    gain: float = MIN_GAIN

    def wins_at(self, gain: float) -> bool:
        """The ring copied at least ``gain`` x the Triton kernel's rate (and the probe ran)."""
        return not self.error and self.ring_gbps >= gain * self.triton_gbps

    @property
    def ring_wins(self) -> bool:
        return self.wins_at(self.gain)

    @property
    def ring_from_bytes(self) -> int | None:
        """The smallest restore (bytes) the ring takes: where copying it at the ring's rate
        instead of the kernel's saves :data:`RING_EXTRA_S`, and at least
        ``staged.STAGED_MIN_BYTES``; None where the ring never wins."""
        if not self.ring_wins:
            return None
        saved_per_byte = (1.0 / self.triton_gbps - 1.0 / self.ring_gbps) / 1e9  # seconds
        if saved_per_byte <= 0:  # equal rates (a gain of 1): the ring's copy saves nothing
            return None
        return max(staged.STAGED_MIN_BYTES, math.ceil(RING_EXTRA_S / saved_per_byte))


_CHOICE: dict[int, Probe] = {}  # device index -> its probe


def choice(device: torch.device | int | None = None) -> Probe | None:
    """The probe recorded for ``device`` (None: not probed)."""
    return _CHOICE.get(device_index(device))


def set_choice(p: Probe | None, device: torch.device | int | None = None) -> None:
    """Record (or forget, with None) the probe of ``device``."""
    if p is None:
        _CHOICE.pop(device_index(device), None)
    else:
        _CHOICE[device_index(device)] = p


def ring_from(device) -> int | None:
    """The smallest restore (bytes) :func:`takes_ring` gives the ring on ``device``: the probe's
    :attr:`~Probe.ring_from_bytes`, ``staged.STAGED_MIN_BYTES`` where no probe ran, None where
    the ring takes none."""
    p = _CHOICE.get(device_index(device))
    return staged.STAGED_MIN_BYTES if p is None else p.ring_from_bytes


def takes_ring(device, nbytes: int) -> bool:
    """What ``auto`` follows for a restore of ``nbytes`` on ``device``: the ring where no probe
    ran, else where the ring won the probe and ``nbytes`` reaches its :attr:`~Probe.ring_from_bytes`."""
    p = _CHOICE.get(device_index(device))
    if p is None:
        return True
    start = p.ring_from_bytes
    return start is not None and nbytes >= start


def probe(pool: PagePool, flat: torch.Tensor, max_programs: int, *,
          nbytes: int = PROBE_BYTES, reps: int = 5) -> Probe | None:
    """Time an unchecked restore of up to ``nbytes`` from the start of ``flat`` (host memory the
    GPU reads: the card) into the first pages of ``pool`` (a CUDA layer cache) by the Triton
    kernel at ``max_programs`` and by the ring, each planned once, then timed as issued, the two
    paths in alternating rounds (:func:`~xkv.kernels.calibrate.copy_rates`: planning aside, at 64
    MiB it would weigh as much as the copy; alternating, a load beside the probe slows both
    paths, not one); record and return the result. A probe that raised is recorded with its
    ``error``: the ring is not taken on this GPU. **Overwrites those pages**: call it at a
    worker's start, before anything is served. None (nothing recorded) where the ring cannot
    restore these pages or fewer than ``staged.STAGED_MIN_BYTES`` fit."""
    from xkv.kernels import copy_engine, staged_restore

    dev = pool.device
    bb = pool.block_bytes
    if (dev.type != "cuda" or flat.device.type != "cpu" or not copy_engine.available()
            or bb == 0 or bb > staged_restore.MAX_PAGE_BYTES):
        return None
    n = min(pool.num_blocks, int(nbytes) // bb, flat.numel() * flat.element_size() // bb)
    if n * bb < staged.STAGED_MIN_BYTES:
        return None
    job = build_job([pool], np.arange(n, dtype=np.int64), flat,
                    offsets_arg(np.arange(n, dtype=np.int64) * bb, 1, "offsets"), save=False)

    try:
        with torch.cuda.device(dev):
            # each path planned once, then only issued and timed: the copy rates decide; the
            # threshold stands for the host work a restore adds (module docstring)
            tri = _launch.launches(job, max_programs)
            calls = staged_restore.prepare(job, max_programs)
        rates = copy_rates([lambda: [launch() for launch in tri],
                            lambda: [call() for call in calls]], n * bb, dev, reps)
    except Exception as e:  # noqa: BLE001 -- whatever broke, serve without the ring
        p = Probe(0.0, 0.0, n * bb, error=f"{type(e).__name__}: {e}"[:300])
        set_choice(p, dev)
        return p
    p = Probe(triton_gbps=rates[0], ring_gbps=rates[1], nbytes=n * bb, gain=min_gain())
    set_choice(p, dev)
    return p
