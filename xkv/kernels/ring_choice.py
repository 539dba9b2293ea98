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
records the result per GPU; :func:`ring_wins` is what ``auto`` follows: the ring
when it copied at least :data:`MIN_GAIN` x the Triton kernel's rate, the Triton kernel otherwise.
Unprobed (no worker start, e.g. tests and the page mover) the ring is taken, as before the probe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xkv.kernels import _launch
from xkv.kernels.calibrate import copy_rates, device_index
from xkv.kernels.jobs import build_job, offsets_arg
from xkv.layout import PagePool

__all__ = ["MIN_GAIN", "PROBE_BYTES", "Probe", "choice", "probe", "ring_wins", "set_choice"]

#: the ring's rate over the Triton kernel's from which ``auto`` takes the ring: above stop 41's
#: H200 (1.05-1.07, where the ring lost end to end), below stop 40's H100 (~1.6, where it won)
MIN_GAIN = 1.15
#: bytes one probe restores per path (~1.3 ms at 50 GB/s): a whole ring's worth of chunks
PROBE_BYTES = 64 << 20


@dataclass(frozen=True)
class Probe:
    """Rates of one probe restore (GB/s, best of its repetitions; each path planned beforehand)."""

    triton_gbps: float
    ring_gbps: float
    nbytes: int
    error: str = ""  # the probe raised: the ring is not taken

    @property
    def ring_wins(self) -> bool:
        return not self.error and self.ring_gbps >= MIN_GAIN * self.triton_gbps


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


def ring_wins(device) -> bool:
    """What ``auto`` follows on ``device``: its probe's verdict, True where none ran."""
    p = _CHOICE.get(device_index(device))
    return True if p is None else p.ring_wins


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
    from xkv.kernels import copy_engine, staged, staged_restore

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
    p = Probe(triton_gbps=rates[0], ring_gbps=rates[1], nbytes=n * bb)
    set_choice(p, dev)
    return p
