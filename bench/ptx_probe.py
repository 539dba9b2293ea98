"""The global loads and stores the copy kernel compiles to for sm_90, without a GPU: 8-byte
(``.b64``) against 16-byte (``.v2.b64``) data accesses of the variant the launcher picks for a
page size (bench/RESULTS.md "stop 39": 18 KiB MLA pages took masked 4 KiB rows, compiled to
8-byte accesses, while 32 KiB runs get 16-byte ones) and the barriers per program step (the
checked variants' per-row checksum reduction; ``split=8``: XKV_CHECK_SPLIT's partial sums).

    env -u TRITON_INTERPRET python bench/ptx_probe.py [--pages 4096,18432,32768]

Each variant is what ``xkv.kernels._launch.plan`` chooses for a restore of one such page at 64
programs, with ``XKV_MIN_EVEN_ROW_BYTES`` at its default ("now") and off ("masked"). Pointers and
the cache geometry are marked 16-byte divisible, as the real pools' are. Counts are per
program step, row metadata loads included. :func:`compile_sm90` is also what
``tests/kernels/test_compile_sm90.py`` compiles every variant with.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: pointer arguments of ``page_copy_kernel`` and their Triton types
PTR = {"p_pool": "*u8", "p_flat": "*u8", "p_ids": "*i64", "p_flat_off": "*i64",
       "p_layer_off": "*i64", "p_runs": "*i64", "p_res": "*i32", "p_res_off": "*i64",
       "p_chk": "*i64"}


def compile_sm90(const: dict, num_warps: int = 4, aligned: bool = False):
    """``page_copy_kernel`` compiled for sm_90 with the constexprs ``const`` (Triton's real front
    and back end, no GPU; this process must not set TRITON_INTERPRET). ``aligned``: pointers and
    the pool geometry marked 16-byte divisible, as the launcher's pools are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xkv.kernels._triton import page_copy_kernel

    names = page_copy_kernel.arg_names
    # constexprs the launcher leaves out (STORE, SPLIT) take their defaults, as a launch does
    const = {**{q.name: q.default for q in page_copy_kernel.params
                if q.is_constexpr and q.has_default}, **const}
    sig = {a: "constexpr" if a in const else PTR.get(a, "i64") for a in names}
    div = [a for a in names if a in PTR or a in ("block_stride", "block_words")] if aligned else []
    src = ASTSource(fn=page_copy_kernel, signature=sig,
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in div},
                    constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def accesses(ptx: str) -> dict[str, int]:
    """Global load/store instructions by width, and the barriers (``bar.sync``: a program's
    warps wait for each other, so no warp issues its next loads meanwhile)."""
    found = re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)*|bar\.sync", ptx)
    return {k: found.count(k) for k in sorted(set(found))}


def planned(page: int, check: bool) -> dict:
    """The launcher's constexprs (``num_warps`` included) for a restore of ``page``-byte pages
    at 64 programs, as ``_launch.plan`` picks them now."""
    import torch

    from xkv.kernels import _launch
    from xkv.layout import PagePool

    pool = PagePool(base=torch.zeros(2 * page, dtype=torch.uint8), num_blocks=2,
                    block_bytes=page, block_stride=page, runs=((0, page),))
    flat = torch.zeros(4 * page, dtype=torch.uint8)
    p = _launch.plan([pool], flat, n=4096, has_flat_off=True, flat_off_gcd=page, flat_base=0,
                     save=False, sliced=False, lo=0, hi=0, max_programs=64, check=check)
    return dict(p.meta)


def main() -> None:
    from xkv.kernels import _launch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="4096,18432,32768", help="page (run) sizes in bytes")
    a = ap.parse_args()
    row0, split0 = _launch.MIN_EVEN_COL_BYTES, _launch.CHECK_SPLIT
    try:
        for page in (int(x) for x in a.pages.split(",")):
            for label, min_row in (("now", row0), ("masked", 1 << 30)):
                for check, split in ((False, 1), (True, 1), (True, 8)):
                    _launch.MIN_EVEN_COL_BYTES, _launch.CHECK_SPLIT = min_row, split
                    meta = planned(page, check)
                    warps = meta.pop("num_warps")
                    ptx = compile_sm90(meta, warps, aligned=True).asm["ptx"]
                    print(f"{page} B page, {label}: rows {meta['ROWS']} x cols {meta['COLS']} "
                          f"(EVEN={meta['EVEN']}, VEC={meta['VEC']}), checked={check}, "
                          f"split={split}: {accesses(ptx)}", flush=True)
    finally:
        _launch.MIN_EVEN_COL_BYTES, _launch.CHECK_SPLIT = row0, split0


if __name__ == "__main__":
    main()
