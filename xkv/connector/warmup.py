"""A worker rank's start-up on a GPU, after its caches are registered and its card mapped: the
restore path (:func:`choose_restore_path`), every copy-kernel variant compiled before serving
(:func:`compile_copies`), and the lines saying what restores verify (:func:`check_lines`).

Compiling now makes the first restore after start cost what later ones cost (Triton would
compile on first use: ~250 ms on the H200), the multi-layer launches of light steps and tails
too. Warmup launches have zero rows: no byte of the caches or the card moves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from xkv import kernels
from xkv.connector import light_steps
from xkv.connector.checksums import unverified_reason
from xkv.connector.registry import Registry
from xkv.connector.saves import save_groups
from xkv.kernels import ring_choice
from xkv.layout import PagePool

log = logging.getLogger("xkv.connector")


def choose_restore_path(handler: Any, pools: Mapping[str, PagePool],
                        card: torch.Tensor | None) -> str | None:
    """``auto`` / ``staged`` (the handler's ``load_engine``): reserve the copy engine's staging
    ring now, not in the first restore; ``auto``: the start-up probe (``kernels.probe_ring``, on
    the first cache whose pages fit a ring slot) decides whether restores take it. Returns the
    probe's verdict for the start-up log (None: no probe). Run before :func:`compile_copies`:
    the probe's own compiles are not mid-serving ones. It overwrites the first pages of one
    cache, harmless before anything is served."""
    engine = getattr(handler, "load_engine", None)
    if engine not in ("auto", "staged"):
        return None
    ring_choice.min_gain()  # XKV_RING_MIN_GAIN: a bad value refuses to start, here
    kernels.reserve_staging(next(iter(pools.values())).device)
    fit = [p for p in pools.values() if p.block_bytes <= kernels.RING_PAGE_BYTES]
    if engine != "auto" or card is None or not fit:
        return None
    p = kernels.probe_ring(fit[0], card, kernels.light_restore_programs())
    if p is None:
        return None
    if p.error:
        return f"XKV: restores stay on the Triton kernel (ring probe: {p.error})"
    start = p.ring_from_bytes
    size = f"{-(-start // (1 << 20))} MiB" if start is not None else "8 MiB"
    return (f"XKV: restores of >= {size} through the copy engine and the ring: "
            f"{'yes' if start is not None else 'no, the Triton kernel'} (start-up probe of "
            f"{p.nbytes >> 20} MiB: ring {p.ring_gbps:.1f} GB/s, Triton kernel "
            f"{p.triton_gbps:.1f} GB/s; the ring from {p.gain:g}x and where its "
            f"copy saves {kernels.RING_EXTRA_S * 1e3:g} ms)")


def restores_may_take_copy_engine(handler: Any, device: Any) -> bool:
    """Whether restores of this rank may run on the copy engine (the ring, or copy-engine
    fragments) instead of the Triton kernel at ordinary sizes, after
    :func:`choose_restore_path`: where :func:`copy_engine_from_bytes` says some restore may,
    except on a host whose probe found the ring faster only by less than
    ``ring_choice.MIN_GAIN`` (the default's margin: ``XKV_RING_MIN_GAIN`` below it gives such a
    host's ring its large restores only)."""
    start = copy_engine_from_bytes(handler, device)
    if start is None:
        return False
    p = ring_choice.choice(device)
    return start == 0 or p is None or p.wins_at(ring_choice.MIN_GAIN)


def copy_engine_from_bytes(handler: Any, device: Any) -> int | None:
    """The smallest restore (bytes, a step's whole restore) that may run on the copy engine on
    this rank, after :func:`choose_restore_path`: None where none does (``load_engine``
    ``triton``, ``auto`` whose probe kept the kernel at every size, a handler without engines:
    the CPU one), 0 where any may (every other engine, or a calibration installed: it decides
    per fragment size), else ``auto``'s ``ring_choice.ring_from``. ``XKV_EARLY_ISSUE`` issues a
    step early only below it."""
    engine = getattr(handler, "load_engine", None)
    if engine is None or engine == "triton":
        return None
    if engine != "auto" or kernels.calibration(device) is not None:
        return 0
    return ring_choice.ring_from(device)


def compile_copies(registry: Registry, pools: Mapping[str, PagePool], card: torch.Tensor | None,
                   handler: Any, check_words: list[int], *, tp_rank: int, save_mode: str,
                   tails: bool) -> None:
    """Compile every copy variant this rank's restores and saves will launch: per-layer and
    light-step layer groups (``tails``: the all-layer tail launch of full hits), ``save_mode``
    step's save groups, the checked variants where a group has ``check_words``, the hash launches
    of ``checksum_pass`` ``hbm`` / ``end``; then reserve the page-locked staging of the copies'
    tables, words and flags and the device memory they go to on the copy streams (an allocation
    inside a step is an implicit synchronisation: the host or the forward would wait for the
    copies queued before it)."""
    t0 = time.perf_counter()
    align = min(p.slot_alignment for p in registry.groups)
    names = list(pools)
    mode = light_steps.group_mode()
    groups = light_steps.warm_groups(registry, names, mode, tails=tails)
    saves = (save_groups(registry, names, tp_rank, {n: p.block_bytes for n, p in pools.items()})
             if save_mode == "step" else [])
    log.info("XKV: compiling copy kernels (%d caches, %d restore and %d save layer groups)",
             len(pools), len(groups), len(saves))
    checks = any(check_words)
    cpass = handler.checksum_pass if checks else None
    # checksum_pass "end": one hash launch per group over all its layers
    whole = light_steps.group_layers(registry, names) if cpass == "end" else []
    variants = kernels.warmup(list(pools.values()), card, offset_alignment=max(1, align),
                              restore_groups=groups, save_groups=saves, checks=checks,
                              hashes=cpass == "hbm", hash_groups=whole,
                              hash_programs=kernels.WHOLE_HASH_PROGRAMS,
                              light_programs=kernels.light_restore_programs())
    log.info("XKV: %d copy-kernel variants compiled in %.1f s", len(variants),
             time.perf_counter() - t0)
    large = kernels.pinned.reserve_for(max(p.num_blocks for p in pools.values()), len(pools))
    # the device side of those buffers
    handler.hold_stream_memory(kernels.pinned.RESERVE_COUNT * large)


def check_lines(registry: Registry, check_words: list[int], verify: bool,
                fanout: bool) -> list[str]:
    """What restores verify (``verify_checksums``), per group, for the start-up log;
    ``check_words`` per group (0: that group's restores are not checked), ``fanout``: MLA groups
    restore through the NVLink fan-out on this rank."""
    if not verify:
        return ["XKV: restores are NOT verified by checksums (verify_checksums off)"]
    out = []
    for g, (plan, cw) in enumerate(zip(registry.groups, check_words, strict=True)):
        if not cw:
            out.append(f"XKV: group {g} ({plan.group.kind}): restores NOT verified "
                       f"({unverified_reason(plan)})")
        elif fanout and plan.group.kind == "mla" and not plan.is_state:
            out.append(f"XKV: group {g} ({plan.group.kind}): restores verified by "
                       f"checksums ({cw} words per object shard; NVLink fan-out restores "
                       "hashed in GPU memory after the all-gather)")
        else:
            out.append(f"XKV: group {g} ({plan.group.kind}): restores verified by "
                       f"checksums ({cw} words per object shard)")
    return out
