"""Compile and load, before the first real copy, every Triton variant the caches will need.

Triton compiles a kernel variant on its first launch (hundreds of ms, then the module load), and
the variant of a restore or save depends on the cache's geometry (word size, 16-byte hint, tile
shape) and on the step's size: the tile's ``ROWS`` follows the number of fragments up to a cap.
:func:`warmup` enumerates, for each pool and direction, every variant a one-layer launch can take
(:func:`~xkv.kernels.restore`, :func:`~xkv.kernels.save` and the prepared steps of
:mod:`xkv.kernels.prepared`, whatever the number of blocks) and launches each once with zero rows:
the kernel starts and returns without reading or writing a byte, so nothing of the caller's
buffers is touched. Integer arguments are not specialised (see ``_triton.py``), so a zero-row
launch compiles exactly the variant a real one uses.

Multi-layer restore and save launches (grouped prepared restores, ``restore_layers``,
``save_layers``) are warmed for the layer groups the caller names (``restore_groups``,
``save_groups``); ``checks=True`` adds the checksum variants of all of them and runs the
torch ops that read a checked restore's flags back once. Not covered:
slices, pack/unpack, the staged engine's ring (fan-out and calibrated large copies).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from xkv.kernels import _budgets, _compile_watch, _launch
from xkv.kernels.hashing import null_flat
from xkv.kernels.jobs import build_job, pools_arg
from xkv.kernels.page_copy import ENGINES, check_engine
from xkv.kernels.verify import CheckWords
from xkv.layout import PagePool

__all__ = ["warmup"]


def _samples(pools: list[PagePool], flat: torch.Tensor, save: bool, gcd: int,
             budget: int, check: bool = False, store: bool = True,
             has_flat_off: bool = True) -> list:
    """Plans of copies of ``pools`` (one launch: one layer, or a layer group of one geometry)
    for block counts that reach every ``ROWS`` value.

    ``ROWS = min(cap, pow2_at_least(ceil(n * R * L / budget)))`` (:func:`~._launch.launch_config`):
    a power of two ``r`` is reachable iff the smallest ``n`` with ``ceil(n * R * L / budget) > r /
    2``, ``n = r * budget // (2 * R * L) + 1``, reaches it; ``n = 1`` gives the smallest value.
    """
    R, counts = len(pools[0].runs) * len(pools), {1}
    r = 2
    while r <= _launch.MAX_ROWS:
        counts.add(r * budget // (2 * R) + 1)
        r *= 2
    try:
        return [
            _launch.plan(list(pools), flat, n=n, has_flat_off=has_flat_off, flat_off_gcd=gcd,
                         flat_base=0, save=save, sliced=False, lo=0,
                         hi=n * pools[0].block_bytes, max_programs=budget, check=check,
                         store=store)
            for n in sorted(counts)
        ]
    except ValueError:  # a checked variant of a copy that is not 4-byte aligned: never used
        if not check:
            raise
        return []


def _watched(fn):
    """``XKV_TIMING``'s compile watch (``_compile_watch``) is off while a warmup runs (its
    compiles are the point) and on after it, however it ends."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _compile_watch.armed = False
        try:
            return fn(*args, **kwargs)
        finally:
            _compile_watch.armed = True
    return run


@_watched
def warmup(pools: Sequence[PagePool], flat: torch.Tensor | None = None, *,
           offset_alignment: int = 4096, max_programs: int | None = None,
           engine: str = "auto",
           restore_groups: Sequence[Sequence[int]] = (),
           save_groups: Sequence[Sequence[int]] = (), checks: bool = False,
           hashes: bool = False, hash_groups: Sequence[Sequence[int]] = (),
           hash_programs: int | None = None,
           light_programs: int | None = None) -> set[tuple]:
    """Launch every Triton variant one-layer copies between ``pools`` and ``flat`` can use.

    Args:
        pools: the registered caches (one pool per layer; identical geometries cost nothing more).
        flat: the flat buffer the copies will use (the card): only its address matters. None: a
            small 4096-aligned host buffer (pinned on CUDA) stands in, like a mapped card.
        offset_alignment: a power of two every object (slot) start in ``flat`` is a multiple of
            (the card's ``slot_alignment_bytes``); fragments lie at a slot start plus multiples of
            ``block_bytes``. Every word size such offsets can give is warmed.
        max_programs: the SM budget the copies will use (None: ``default_programs()``, and
            ``default_programs(True)`` for checked restores).
        engine: ``"auto"`` warms Triton for CUDA pools (nothing to compile on CPU, where the torch
            engine runs); ``"triton"`` also on CPU pools (under ``TRITON_INTERPRET=1``).
        restore_groups: lists of indices into ``pools`` restored by one launch together (grouped
            prepared restores, ``restore_layers``); a list whose pools differ in geometry is
            skipped (those copies run per layer).
        save_groups: the same for multi-layer saves (``save_layers``).
        checks: also the variants that compute checksums (``CHECK``, verified copies;
            only where every address can be 4-byte aligned).
        hashes: also the store-free checked variants that hash pages in the cache
            (``hash_pages``, the two-pass verified restore of ``checksum_pass`` "hbm").
        hash_groups: lists of indices into ``pools`` hashed in the cache by one launch at the
            budget ``hash_programs`` (``prepare_hashed_restore``'s ``hash_groups``: every layer of
            a group at once, ``checksum_pass`` "end"); a list whose pools differ in geometry
            is skipped.
        light_programs: with ``checks``, the SM budget of verified restores of the
            ``restore_groups`` (a light step's, ``light_restore_programs``); their variants are
            warmed at it too, single-layer groups included (the tile's ``ROWS`` follows the
            budget). None: at ``max_programs`` only.

    Returns the set of variant keys launched (:func:`xkv.kernels._launch.variant_key`). Runs on
    the current stream; every launch copies nothing.
    """
    pools = pools_arg(pools, "pools")
    if engine not in ("auto", "triton"):
        raise ValueError(f"warmup engine must be 'auto' or 'triton' (of {ENGINES}), got {engine!r}")
    if offset_alignment < 1 or offset_alignment & (offset_alignment - 1):
        raise ValueError(f"offset_alignment must be a power of two, got {offset_alignment}")
    if not pools:
        return set()
    dev = pools[0].device
    if engine == "auto" and dev.type != "cuda":
        return set()
    if flat is None:
        flat = torch.empty(8192, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        flat = flat[-flat.data_ptr() % 4096 :][:4096]
    if any(p.device != dev for p in pools):
        raise ValueError(f"warmup: pools on several devices: {sorted({str(p.device) for p in pools})}")
    probe = build_job(pools[:1], [], flat, None, save=False, flat_name="flat")  # the buffer's checks
    flat = probe.flat
    check_engine(probe, "triton", max_programs)  # interpreter / budget refusals

    def budget(save: bool, check: bool, grp: list[PagePool]) -> int:  # what check_engine gives
        return _budgets.copy_programs(max_programs, save=save, check=check,
                                     run_bytes=_budgets.min_run_bytes(grp))

    tables = _launch.Tables()
    zeros = tables.add(np.zeros(4, np.int64))  # stand-in tables, never read
    warmed: dict[tuple, _launch.LaunchPlan] = {}
    seen_geoms = set()
    variants = (False, True) if checks else (False,)
    for pool in pools:
        geom = (pool.block_stride, pool.runs, pool.data_ptr % 16, pool.device)
        if geom in seen_geoms:
            continue
        seen_geoms.add(geom)
        for save in (False, True):
            for g in sorted({min(16, offset_alignment << k) for k in range(5)}):
                for check in variants:
                    for p in _samples([pool], flat, save, g, budget(save, check, [pool]), check):
                        warmed.setdefault(p.key, p)
        if hashes:  # a hash job's flat offsets are multiples of block_bytes (4-byte words)
            for g in (4, 8, 16):
                for p in _samples([pool], null_flat(dev), True, g, budget(True, True, [pool]), True,
                                  store=False):
                    warmed.setdefault(p.key, p)
    for idx in hash_groups:  # store-free checked launches of one geometry at their own budget
        grp = [pools[i] for i in idx]
        if not grp or len(_launch.geometry_groups(grp)) != 1:
            continue
        # one launch over a whole hash job: its null flat side needs no offset table
        for p in _samples(grp, null_flat(dev), True, 0,
                          _budgets.copy_programs(hash_programs, save=True, check=True,
                                                run_bytes=_budgets.min_run_bytes(grp)), True,
                          store=False, has_flat_off=False):
            warmed.setdefault(p.key, p)
    seen_groups = set()
    for save, idx in [(False, i) for i in restore_groups] + [(True, i) for i in save_groups]:
        grp = [pools[i] for i in idx]
        if not grp or len(_launch.geometry_groups(grp)) != 1:
            continue
        # (check, budget) pairs; a single layer's at the default budgets are warmed above
        runs = [(c, budget(save, c, grp)) for c in variants] if len(grp) > 1 else []
        if checks and not save and light_programs is not None:
            runs.append((True, int(light_programs)))
        key = (save, len(grp), grp[0].block_stride, grp[0].runs,
               np.gcd.reduce([p.data_ptr - grp[0].data_ptr for p in grp] + [0]) & 15,
               grp[0].data_ptr % 16)
        if not runs or key in seen_groups:
            continue
        seen_groups.add(key)
        for g in sorted({min(16, offset_alignment << k) for k in range(5)}):
            for check, b in runs:
                for p in _samples(grp, flat, save, g, b, check):
                    warmed.setdefault(p.key, p)
    t = tables.upload(dev)
    z = t[zeros : zeros + 4]
    z32 = torch.zeros(4, dtype=torch.int32, device=dev)  # the word buffer's pointer type
    for p in warmed.values():
        # zero fragments, rows and row groups (never specialised: _triton.INT_ARGS); the
        # geometry as it is: Triton specialises it (n_runs == 1 is compiled as a constant, so
        # warming K/V-first pages, 2 runs, with 1 would leave their real variant uncompiled)
        empty = _launch.LaunchPlan(p.pools, p.base, p.table,
                                   (0, p.scalars[1], 0, 0, *p.scalars[4:]), p.meta, p.programs)
        check = (z32, z, z) if p.meta["CHECK"] else None
        _launch.Launch(empty, flat, z, z, z, check)()  # zero rows: every program returns at once
    if checks:
        # A checked copy's words go up (the expected words' upload) and come back (a D2H copy
        # into the pinned pool) in every step: run both once per direction. No kernel is
        # involved (the flags are reduced on the host: CheckWords.readback).
        for save in (False, True):
            CheckWords(np.zeros((3, 5), np.uint32), dev, save=save).readback()
    return set(warmed)
