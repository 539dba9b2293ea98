"""Host side of the Triton kernel: launch sizes, descriptor tables, prepared launches.

A copy is bound by bytes in flight, not by arithmetic. Each program loads a 2-D tile of
``rows`` fragments x ``cols`` words at once (16 fragments x 512 int64 words = 64 KiB), so a
handful of programs keeps enough reads outstanding to fill PCIe; ``max_programs`` is the SM
budget the caller grants (the rest of the GPU keeps running the model).

Measured on an H200 (bench/RESULTS.md): host reads at 4 KiB fragments reach, with 4 programs,
32.6 GB/s with 32 KiB tiles and 51.2 GB/s (the SM-read plateau) with 64 KiB tiles; with 2 programs,
34.8 GB/s with 64 KiB tiles and 46.8 GB/s with 128 KiB tiles. Writes to host saturate at 52 GB/s
with 64 KiB tiles and 2 programs.

Descriptor tables (int64: block ids, byte offsets in the flat buffer, per-launch layer/run tables
in words) of one copy go to the GPU in ONE pinned, non-blocking upload on the current stream
(:class:`Tables`); every section starts 16-byte aligned, so the kernel's pointer specialisation
never depends on a count. A :class:`Launch` holds everything a launch needs; calling it again
repeats the copy without rebuilding anything. Triton itself is imported on the first plan.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from xkv.kernels import _compile_watch, pinned
from xkv.kernels._budgets import CHECKED_RESTORE_IN_FLIGHT
from xkv.kernels.jobs import Job
from xkv.layout import PagePool

__all__ = [
    "Launch",
    "LaunchConfig",
    "LaunchPlan",
    "Tables",
    "checked_restore_tile",
    "geometry_groups",
    "launch_config",
    "launches",
    "plan",
    "resized",
    "run",
    "variant_key",
    "word_bytes",
]

READ_TILE_BYTES = 128 * 1024  # bytes a program loads per step when the flat side is read (restore)
WRITE_TILE_BYTES = 64 * 1024  # ... when pages are read and the flat side written (save, pack)
MAX_COL_BYTES = 4096  # widest tile row


def _env_count(name: str, default: int, unit: str = "bytes", *, pow2: bool = False) -> int:
    """A positive integer setting (``pow2``: a power of two), else a ValueError naming it."""
    v = os.environ.get(name, str(default))
    if not v.isdigit() or int(v) < 1 or (pow2 and int(v) & (int(v) - 1)):
        what = "a power of two" if pow2 else "a positive number"
        raise ValueError(f"{name}={v!r}: expected {what} of {unit}")
    return int(v)


#: narrowest tile row chosen to divide a run (launch_config; 2 KiB: 64 such rows still fill a
#: restore's 128 KiB tile); env ``XKV_MIN_EVEN_ROW_BYTES``
#: (an A/B switch: a value above 4096 restores the masked 4 KiB rows of 18 KiB MLA pages)
MIN_EVEN_COL_BYTES = _env_count("XKV_MIN_EVEN_ROW_BYTES", 2048)
#: checked copies: partial checksum sums per tile row (1: one whole-row sum); env
#: ``XKV_CHECK_SPLIT`` (a power of two; an A/B switch until the GPU measures it)
CHECK_SPLIT = _env_count("XKV_CHECK_SPLIT", 1, "partial sums", pow2=True)
MAX_ROWS = 64
MAX_TILE_ELEMS = 16384  # registers: at most 32 words per thread at 16 warps


@dataclass(frozen=True)
class LaunchConfig:
    programs: int  # grid size (programs walk row groups grid-stride)
    rows: int  # fragments per tile (power of two)
    cols: int  # words per tile row (power of two)
    num_warps: int


def checked_restore_tile(max_programs: int) -> int:
    """Tile bytes of a verified restore at ``max_programs`` programs: together they keep
    :data:`CHECKED_RESTORE_IN_FLIGHT` of host reads in flight (a power of two between 4 KiB and
    :data:`READ_TILE_BYTES`): a checked program holds its tile and the tile's checksum terms in
    registers for the whole copy, so a larger tile takes an SM from the forward beside it."""
    if max_programs < 1:
        raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    per = CHECKED_RESTORE_IN_FLIGHT // max_programs
    return max(4096, min(READ_TILE_BYTES, 1 << max(0, per.bit_length() - 1)))


def word_bytes(alignment: int) -> int:
    """Widest copy word (8, 4, 2 or 1 bytes) that divides ``alignment`` (a gcd of every address
    and length of the copy; 0 means everything is zero, i.e. any word)."""
    for w in (8, 4, 2):
        if alignment % w == 0:
            return w
    return 1


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_config(
    run_bytes: int,
    n_rows: int,
    max_programs: int,
    *,
    word: int = 8,
    save: bool = True,
    tile_bytes: int | None = None,
    check: bool = False,
) -> LaunchConfig:
    """Tile shape and grid for copying ``n_rows`` fragments of at most ``run_bytes`` each.

    Restores (``save=False``) read the flat side, often host memory over PCIe: latency-bound, they
    get the larger tile; verified restores (``check``) :func:`checked_restore_tile`, their share
    of :data:`CHECKED_RESTORE_IN_FLIGHT`. ``cols`` covers a fragment (up to ``MAX_COL_BYTES``); ``rows`` fills
    ``tile_bytes`` but never exceeds the rows each of ``max_programs`` programs would get, so small
    jobs still spread over the whole budget; ``programs`` never exceeds the number of row groups.
    """
    if max_programs < 1:
        raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    if word not in (1, 2, 4, 8):
        raise ValueError(f"word must be 1, 2, 4 or 8 bytes, got {word}")
    if tile_bytes is None:
        tile_bytes = (WRITE_TILE_BYTES if save else
                      checked_restore_tile(max_programs) if check else READ_TILE_BYTES)
    run_words = max(1, -(-run_bytes // word))
    cols = min(_pow2_at_least(run_words), MAX_COL_BYTES // word)
    if run_words > cols and run_words % cols:
        # A run longer than a tile row that the row does not divide (the MLA page of 576 bf16
        # per token: 18 KiB = 4.5 rows of 4 KiB) takes the masked path, whose per-column bounds
        # keep Triton from proving 16-byte accesses. The largest power of two that divides the
        # run, if a row of it is still >= MIN_EVEN_COL_BYTES, keeps it unmasked (2 KiB rows there).
        d = run_words & -run_words
        if d * word >= MIN_EVEN_COL_BYTES:
            cols = d
    tile_elems = min(max(tile_bytes // word, cols), MAX_TILE_ELEMS)
    rows = max(1, min(tile_elems // cols, MAX_ROWS))
    per_program = -(-max(n_rows, 1) // max_programs)
    rows = max(1, min(rows, _pow2_at_least(per_program)))
    groups = -(-max(n_rows, 1) // rows)
    programs = max(1, min(max_programs, groups))
    num_warps = max(1, min(16, (rows * cols) // 512))
    return LaunchConfig(programs=programs, rows=rows, cols=cols, num_warps=num_warps)


# --------------------------------------------------------------------------------------------------
# planning (host only) and binding (device tables) of one launch


@dataclass(frozen=True)
class LaunchPlan:
    """One launch over layers of one geometry, before its tables are on the device."""

    pools: tuple[PagePool, ...]
    base: torch.Tensor  # base of the lowest-addressed pool: every layer offset is >= 0 from it
    table: np.ndarray  # int64 words: layer offsets (padded to even), run offsets, lengths, starts
    scalars: tuple  # n, R, n_rows, n_groups, block_stride, block_words, flat_base, lo, hi, max_run
    meta: dict  # the kernel's constexprs and num_warps
    programs: int

    @property
    def key(self) -> tuple:
        return variant_key(self.meta, self.scalars)


#: The launch scalars (``LaunchPlan.scalars`` positions) Triton specialises: the geometry
#: (``n_runs``, ``block_stride``, ``block_words``, ``max_run_words``; the others are in
#: ``_triton.INT_ARGS``). An int equal to 1 becomes a constant, a multiple of 16 a divisibility
#: hint: each class is another compiled variant.
SPECIALISED_SCALARS = (("n_runs", 1), ("block_stride", 4), ("block_words", 5),
                       ("max_run_words", 9))
#: the position of the first launch scalar in ``Launch.args``
_ARG_SCALARS = 9


def int_class(v: int) -> str:
    """Triton's specialisation class of an int argument: "1", "D" (multiple of 16) or ""."""
    return "1" if v == 1 else ("D" if v % 16 == 0 else "")


def variant_key(meta: dict, scalars: tuple = ()) -> tuple:
    """Identifies a compiled kernel variant: its constexprs and warps, and (given the launch
    ``scalars``) the specialisation class of each :data:`SPECIALISED_SCALARS` (the table pointers
    are always 16-byte aligned, the pool and flat pointers fixed per buffer)."""
    key = [(k, str(v)) for k, v in meta.items()]
    if scalars:
        key += [(f"int:{name}", int_class(int(scalars[i]))) for name, i in SPECIALISED_SCALARS]
    return tuple(sorted(key))


def plan(
    pools: list[PagePool],
    flat: torch.Tensor,
    *,
    n: int,
    has_flat_off: bool,
    flat_off_gcd: int,
    flat_base: int,
    save: bool,
    sliced: bool,
    lo: int,
    hi: int,
    max_programs: int,
    tile_bytes: int | None = None,
    check: bool = False,
    store: bool = True,
) -> LaunchPlan:
    """The word size from the alignment of everything touched (``flat_off_gcd``: gcd of the byte
    offsets table), the tile from :func:`launch_config`, the layer/run table in words.
    ``check``: the variant that computes checksums (``CHECK``; needs 4-byte words).
    ``store=False``: the variant that writes nothing (``STORE``; only in ``meta`` then, so every
    other launch keeps its variant and key)."""
    from xkv.kernels import _triton as K

    low = min(pools, key=lambda p: p.data_ptr)
    layer_off = [p.data_ptr - low.data_ptr for p in pools]
    runs = pools[0].runs
    run_off = [o for o, _ in runs]
    run_len = [ln for _, ln in runs]
    run_cum = list(itertools.accumulate([0, *run_len[:-1]]))
    bb = sum(run_len)
    vals = [pools[0].block_stride, low.data_ptr, flat.data_ptr(), bb, flat_base]
    vals += run_off + run_len + layer_off
    if has_flat_off:
        vals.append(flat_off_gcd)
    if sliced:
        vals += [lo, hi]
    align = math.gcd(*vals)
    word = word_bytes(align)
    if check and word < 4:
        raise ValueError(f"checksums need 4-byte aligned copies; this one is aligned to {word}")
    vec = 2 if word == 8 and align % 16 == 0 else 1
    R, Lg = len(runs), len(pools)
    n_rows = Lg * n * R
    max_run = max(run_len)
    kw = {"tile_bytes": tile_bytes} if tile_bytes else {}
    cfg = launch_config(max_run, n_rows, max_programs, word=word, save=save, check=check, **kw)
    max_run_w = max_run // word
    even = (not sliced) and min(run_len) == max_run and max_run_w % cfg.cols == 0
    lpad = Lg + (Lg & 1)  # the run table starts 16-byte aligned
    table = np.array(layer_off + [0] * (lpad - Lg) + run_off + run_len + run_cum, np.int64) // word
    scalars = (n, R, n_rows, -(-n_rows // cfg.rows), pools[0].block_stride // word, bb // word,
               flat_base // word, lo // word, hi // word, max_run_w)
    meta = dict(WORD_T=K.WORD_TYPES[word], WORD=word, SAVE=save, HAS_FLAT_OFF=has_flat_off,
                HAS_LAYERS=Lg > 1, SLICED=sliced, EVEN=even, VEC=vec, CHECK=check, ROWS=cfg.rows,
                COLS=cfg.cols, num_warps=cfg.num_warps)
    if not store:
        meta["STORE"] = False
    if check and CHECK_SPLIT > 1:  # only then in meta: every other variant keeps its key
        meta["SPLIT"] = min(CHECK_SPLIT, cfg.cols)
    return LaunchPlan(tuple(pools), low.base, table, scalars, meta, cfg.programs)


def resized(p: LaunchPlan, n: int, max_programs: int) -> LaunchPlan:
    """``p`` (unsliced, its table-driven layers) for ``n`` fragments per layer instead of its
    own: the same kernel variant (constexprs and tile), only the counts and the grid change. A
    staged restore plans its unpack once, for a full slot, and runs every chunk with it, so a
    shorter chunk (a layer's last, a short restore) compiles nothing new."""
    _, R, _, _, bs, bw, fb, lo, _, mr = p.scalars
    Lg = len(p.pools)
    n_rows = Lg * n * R
    groups = -(-n_rows // p.meta["ROWS"])
    hi = Lg * n * bw
    return replace(p, scalars=(n, R, n_rows, groups, bs, bw, fb, lo, hi, mr),
                   programs=max(1, min(max_programs, groups)))


class Tables:
    """int64 sections packed into one host buffer, each 16-byte aligned, uploaded at once."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._size = 0

    def add(self, values: np.ndarray) -> int:
        """Queue ``values``; returns their offset (in int64 elements) in the packed buffer."""
        at = self._size
        v = np.ascontiguousarray(values, dtype=np.int64).ravel()
        self._parts.append(v)
        self._size += v.size + (v.size & 1)
        if v.size & 1:
            self._parts.append(np.zeros(1, np.int64))
        return at

    def upload(self, dev: torch.device) -> torch.Tensor:
        """One tensor on ``dev``; on CUDA a staging buffer of the pinned pool (no allocation in
        a copy step: :mod:`xkv.kernels.pinned`) and one non-blocking H2D copy on the current
        stream, the staging given back with an event after it."""
        n = max(self._size, 2)
        if dev.type == "cuda":
            return pinned.upload(n, torch.int64, dev, self._fill)
        host = torch.empty(n, dtype=torch.int64)
        self._fill(host)
        return host

    def _fill(self, host: torch.Tensor) -> None:
        h, at = host.numpy(), 0
        for part in self._parts:  # straight into the (pinned) buffer: one host copy
            h[at : at + part.size] = part
            at += part.size


class Launch:
    """One launch with its device tables bound: ``launch()`` only calls the kernel."""

    __slots__ = ("args", "dev", "grid", "kernel", "meta")

    def __init__(self, p: LaunchPlan, flat: torch.Tensor, ids_t, flat_off_t, tab_t,
                 check: tuple | None = None) -> None:
        """``check``: ``(words int32 [L, C], row offsets int64 [Lg], p_chk int64 [3, n])``
        device tensors of a ``CHECK`` plan (``xkv.kernels.verify``)."""
        from xkv.kernels import _triton as K

        Lg = len(p.pools)
        lpad = Lg + (Lg & 1)
        self.kernel, self.grid, self.meta = K.page_copy_kernel, (p.programs,), p.meta
        self.dev = p.base.device
        res, res_off, chk = check if check is not None else (ids_t, ids_t, ids_t)  # unread
        self.args = (p.base, flat, ids_t, ids_t if flat_off_t is None else flat_off_t,
                     tab_t[:Lg], tab_t[lpad:], res, res_off, chk, *p.scalars)

    @property
    def key(self) -> tuple:
        """The variant this launch runs: its constexprs and its scalars' specialisation."""
        return variant_key(self.meta, self.args[_ARG_SCALARS:])

    def __call__(self) -> None:
        if self.dev.type == "cuda":
            with torch.cuda.device(self.dev):
                _compile_watch.launch(self.kernel, self.grid, self.args, self.meta,
                                      "save" if self.meta["SAVE"] else "restore")
        else:
            self.kernel[self.grid](*self.args, **self.meta)


def geometry_groups(pools: list[PagePool]) -> list[list[int]]:
    """Layer indices grouped by geometry (block stride and runs): one launch each."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(pools):
        groups.setdefault((p.block_stride, p.runs), []).append(i)
    return list(groups.values())


def launches(job: Job, max_programs: int, *, groups: list[list[int]] | None = None,
             tile_bytes: int | None = None) -> list[Launch]:
    """Launches of ``job``, one per group of layers (default: per geometry; a group must share
    one geometry), with every table in one upload. ``groups=[[0], [1], ...]`` gives one launch
    per layer (prepared steps)."""
    n, bb = job.n, job.block_bytes
    groups = geometry_groups(job.pools) if groups is None else groups
    use_table = job.flat_off is not None or len(groups) > 1
    offs_all = job.flat_offsets() if use_table else None
    ids, lo, hi = job.ids, job.lo, job.hi
    if job.sliced:  # only the fragments that meet [lo, hi)
        f0, f1 = lo // bb, -(-hi // bb)
        ids, offs_all = ids[f0:f1], job.flat_offsets()[:, f0:f1]
        lo, hi, n = lo - f0 * bb, hi - f0 * bb, f1 - f0
    tables = Tables()
    at_ids = tables.add(ids)
    jc = job.checks
    if jc is not None:
        if job.sliced:
            raise ValueError("checksums are not computed for slices")
        buf = jc.bind(job.pools[0].device, job.save)
        at_chk = tables.add(jc.table())
        C = jc.num_objects
        at_res = [tables.add(np.array([jc.rows[k] * C for k in layers], np.int64))
                  for layers in groups]
    plans, at, at_table = [], [], {}  # run tables shared by layers of one geometry: sent once
    same: dict[tuple, LaunchPlan] = {}  # one-layer plans differ only in the base address
    for layers in groups:
        if offs_all is None:
            flat_off = None
        elif len(layers) == 1:  # a view, not a copy
            flat_off = offs_all[layers[0] : layers[0] + 1]
        else:
            flat_off = offs_all[layers]
        gcd = int(np.gcd.reduce(flat_off.ravel())) if flat_off is not None and flat_off.size else 0
        pools = [job.pools[i] for i in layers]
        key = None
        if len(layers) == 1 and flat_off is not None:
            # word size and hints only see alignments up to 16 bytes: the low 4 bits decide
            key = (pools[0].block_stride, pools[0].runs, pools[0].data_ptr & 15, gcd & 15)
        if key in same:
            p = replace(same[key], pools=tuple(pools), base=pools[0].base)
        else:
            p = plan(pools, job.flat, n=n, has_flat_off=flat_off is not None, flat_off_gcd=gcd,
                     flat_base=job.flat_base + layers[0] * job.n * bb if flat_off is None else 0,
                     save=job.save, sliced=job.sliced, lo=lo, hi=hi, max_programs=max_programs,
                     tile_bytes=tile_bytes, check=jc is not None, store=job.store)
            if key is not None:
                same[key] = p
        at_off = None if flat_off is None else tables.add(flat_off)
        plans.append(p)
        key = p.table.tobytes()
        if key not in at_table:
            at_table[key] = tables.add(p.table)
        at.append((at_off, at_table[key]))
    dev = job.pools[0].device
    t = tables.upload(dev)
    ids_t = t[at_ids : at_ids + n]
    out = []
    for g, (p, (at_off, at_tab), layers) in enumerate(zip(plans, at, groups, strict=True)):
        off_t = None if at_off is None else t[at_off : at_off + len(layers) * n]
        check = None
        if jc is not None:
            check = (buf.words, t[at_res[g] : at_res[g] + len(layers)],
                     t[at_chk : at_chk + 3 * n])
        out.append(Launch(p, job.flat, ids_t, off_t, t[at_tab : at_tab + p.table.size], check))
    return out


def run(job: Job, max_programs: int, *, tile_bytes: int | None = None) -> None:
    """Execute ``job`` with the Triton kernel on the current stream."""
    for launch in launches(job, max_programs, tile_bytes=tile_bytes):
        launch()
