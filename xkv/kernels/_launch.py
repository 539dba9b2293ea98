"""Launch sizes for the page-copy kernel: small pure functions, no autotuning.

A copy is bound by bytes in flight, not by arithmetic. Each program loads a 2-D tile of
``rows`` fragments x ``cols`` words at once (16 fragments x 512 int64 words = 64 KiB), so a
handful of programs keeps enough reads outstanding to fill PCIe; ``max_programs`` is the SM
budget the caller grants (the rest of the GPU keeps running the model).

Measured on an H200 (bench/RESULTS.md): host reads at 4 KiB fragments reach, with 4 programs,
32.6 GB/s with 32 KiB tiles and 51.2 GB/s (the SM-read plateau) with 64 KiB tiles; with 2 programs,
34.8 GB/s with 64 KiB tiles and 46.8 GB/s with 128 KiB tiles. Writes to host saturate at 52 GB/s
with 64 KiB tiles and 2 programs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DEFAULT_PROGRAMS", "LaunchConfig", "default_programs", "launch_config", "word_bytes"]

DEFAULT_PROGRAMS = 4  # restore reaches the host-read plateau with 4 programs when tiles are 2-D
READ_TILE_BYTES = 128 * 1024  # bytes a program loads per step when the flat side is read (restore)
WRITE_TILE_BYTES = 64 * 1024  # ... when pages are read and the flat side written (save, pack)
TILE_BYTES = WRITE_TILE_BYTES
MAX_COL_BYTES = 4096  # widest tile row
MAX_ROWS = 64
MAX_TILE_ELEMS = 16384  # registers: at most 32 words per thread at 16 warps


@dataclass(frozen=True)
class LaunchConfig:
    programs: int  # grid size (programs walk row groups grid-stride)
    rows: int  # fragments per tile (power of two)
    cols: int  # words per tile row (power of two)
    num_warps: int


def default_programs() -> int:
    """The SM budget used when a caller passes ``max_programs=None`` (env ``XKV_MAX_PROGRAMS``)."""
    v = os.environ.get("XKV_MAX_PROGRAMS")
    if v is None:
        return DEFAULT_PROGRAMS
    n = int(v)
    if n < 1:
        raise ValueError(f"XKV_MAX_PROGRAMS must be >= 1, got {v!r}")
    return n


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
) -> LaunchConfig:
    """Tile shape and grid for copying ``n_rows`` fragments of at most ``run_bytes`` each.

    Restores (``save=False``) read the flat side, often host memory over PCIe: latency-bound, they
    get the larger tile. ``cols`` covers a fragment (up to ``MAX_COL_BYTES``); ``rows`` fills
    ``tile_bytes`` but never
    exceeds the rows each of ``max_programs`` programs would get, so small jobs still spread over
    the whole budget; ``programs`` never exceeds the number of row groups.
    """
    if max_programs < 1:
        raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    if word not in (1, 2, 4, 8):
        raise ValueError(f"word must be 1, 2, 4 or 8 bytes, got {word}")
    if tile_bytes is None:
        tile_bytes = WRITE_TILE_BYTES if save else READ_TILE_BYTES
    run_words = max(1, -(-run_bytes // word))
    cols = min(_pow2_at_least(run_words), MAX_COL_BYTES // word)
    tile_elems = min(max(tile_bytes // word, cols), MAX_TILE_ELEMS)
    rows = max(1, min(tile_elems // cols, MAX_ROWS))
    per_program = -(-max(n_rows, 1) // max_programs)
    rows = max(1, min(rows, _pow2_at_least(per_program)))
    groups = -(-max(n_rows, 1) // rows)
    programs = max(1, min(max_programs, groups))
    num_warps = max(1, min(16, (rows * cols) // 512))
    return LaunchConfig(programs=programs, rows=rows, cols=cols, num_warps=num_warps)
