"""SM budgets of the copy kernels: how many Triton programs a copy runs when its caller names none.

A copy is bound by bytes in flight (``_launch``'s docstring): the budget is the share of the GPU
a copy takes from the model running beside it. Each kind of copy has its own default, each from
a measurement named beside it; ``XKV_MAX_PROGRAMS`` sets them all, ``XKV_LIGHT_PROGRAMS`` a light
step's verified restore. :func:`copy_programs` is the one rule launches and warmup share.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from xkv.layout import PagePool

__all__ = [
    "CHECKED_RESTORE_IN_FLIGHT",
    "DEFAULT_PROGRAMS",
    "LIGHT_VERIFIED_RESTORE_PROGRAMS",
    "SMALL_CHECKED_RUN_BYTES",
    "VERIFIED_RESTORE_PROGRAMS",
    "WHOLE_HASH_PROGRAMS",
    "copy_programs",
    "default_programs",
    "light_restore_programs",
    "min_run_bytes",
]

DEFAULT_PROGRAMS = 4  # restore reaches the host-read plateau with 4 programs when tiles are 2-D
#: Restores that hash while they copy (checksums): each program's loop is longer, so it takes more
#: programs to keep enough host reads in flight. H200, bench/page_mover.py --checksums
#: (2026-12-03): 4 programs reach 0.46-0.63 x the unverified restore, 16 reach 0.74-0.93 (>= 16 KiB
#: fragments: 0.87-0.93). Checked saves hash what they read from HBM: 4 programs suffice (0.99-1.0)
#: for runs of 8 KiB and more (:data:`SMALL_CHECKED_RUN_BYTES`).
VERIFIED_RESTORE_PROGRAMS = 16
#: Checked saves (and hashes) of pages whose smallest contiguous run is below this many bytes take
#: :data:`VERIFIED_RESTORE_PROGRAMS` instead of :data:`DEFAULT_PROGRAMS`: each run is a tile row
#: whose checksum terms cost the same however short it is. H100, bench/page_mover.py --checksums
#: (bench/RESULTS.md "stop 56"): a checked save of 4 KiB pages at 4 programs copied at 0.78-0.82 x
#: the unchecked one (40.8 of 52.2 GB/s), at 16 programs 0.999; 8-32 KiB pages at 4 programs
#: 0.979-0.998. 4 KiB runs: a Llama-3-8B-shaped model at tensor parallel 8 (one KV head per rank).
SMALL_CHECKED_RUN_BYTES = 8 << 10
#: A light step's verified restore (``xkv.connector.light_steps``: a full hit computes one token,
#: so its short forward cannot hide the copy): more programs keep more host reads in flight while
#: each hashes, but the forward still runs beside them. H200, bench/page_mover.py --checksums (2026-12-04): at 32 programs
#: 0.93-0.99 x the unverified restore for 16-256 KiB pages, at 16 programs 0.87-0.98. Stop 43
#: (H100, bench/checked_interference.py): with 128 KiB tiles the 64 programs this was took most
#: of 64 SMs' registers for the whole copy and slowed a one-token forward beside it 1.34-1.36 x
#: (the unchecked restore at 4 programs: 1.11 x); 32 programs of 32 KiB tiles
#: (:data:`CHECKED_RESTORE_IN_FLIGHT`) slowed it 1.13 x and copied at 46.9-50.8 GB/s beside it
#: (64 programs of 128 KiB: 46.5-48.7). ``XKV_LIGHT_PROGRAMS`` overrides it (an A/B switch).
LIGHT_VERIFIED_RESTORE_PROGRAMS = 32
#: Host bytes a verified restore keeps in flight, split over its programs
#: (``_launch.checked_restore_tile``): 1 MiB. Stop 43, H100, bench/checked_interference.py (512 MiB
#: of 64 and 16 KiB pages beside a one-token forward of the Llama-3-8B shape): 16 programs x 64
#: KiB and 32 x 32 KiB copied at 50.5-50.8 GB/s beside the forward and slowed it 1.13-1.15 x;
#: 16 x 128 KiB (the former tile) 36-39 GB/s, 1.17 x; 2 MiB in flight (32 x 64 KiB, 64 x 32
#: KiB) slowed it 1.7-2.6 x, 8 MiB (64 x 128 KiB) 1.34 x.
CHECKED_RESTORE_IN_FLIGHT = 1 << 20
#: The hash of every restored layer at once, after the last copy (the connector's ``checksum_pass``
#: "end"): nothing else copies then, and a light step's forward has one layer left, so it may take
#: about one program per SM of an H200 (132) and read at HBM rate, where the per-layer hash at 16
#: programs read 238-516 GB/s (bench/RESULTS.md, stop 32). Not yet measured end to end.
WHOLE_HASH_PROGRAMS = 128


def default_programs(verified_restore: bool = False) -> int:
    """The SM budget used when a caller passes ``max_programs=None`` (env ``XKV_MAX_PROGRAMS``,
    which sets both): :data:`VERIFIED_RESTORE_PROGRAMS` for a restore that checks checksums,
    else :data:`DEFAULT_PROGRAMS`."""
    v = os.environ.get("XKV_MAX_PROGRAMS")
    if v is None:
        return VERIFIED_RESTORE_PROGRAMS if verified_restore else DEFAULT_PROGRAMS
    return _env_programs("XKV_MAX_PROGRAMS", v)


def light_restore_programs() -> int:
    """The SM budget of a light step's verified restore: env ``XKV_LIGHT_PROGRAMS``, else
    :data:`LIGHT_VERIFIED_RESTORE_PROGRAMS`."""
    v = os.environ.get("XKV_LIGHT_PROGRAMS")
    if v is None:
        return LIGHT_VERIFIED_RESTORE_PROGRAMS
    return _env_programs("XKV_LIGHT_PROGRAMS", v)


def _env_programs(name: str, v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return n


def copy_programs(max_programs: int | None, *, save: bool, check: bool,
                  run_bytes: int | None = None) -> int:
    """The SM budget of one copy: ``max_programs``, or the default for its kind (a checked
    restore has its own, :func:`default_programs`, and so has a checked save whose pages'
    smallest contiguous run, ``run_bytes``, is below :data:`SMALL_CHECKED_RUN_BYTES`). The one
    rule launches and warmup share."""
    if max_programs is not None:
        return int(max_programs)
    small = run_bytes is not None and 0 < run_bytes < SMALL_CHECKED_RUN_BYTES
    return default_programs(verified_restore=check and (not save or small))


def min_run_bytes(pools: Sequence[PagePool]) -> int | None:
    """The shortest contiguous run of a page of ``pools`` (bytes; None: no pools): the row a
    copy's tile hashes (:func:`copy_programs`)."""
    runs = [n for p in pools for _, n in p.runs]
    return min(runs) if runs else None
