"""The global loads and stores the copy kernel compiles to for sm_90, without a GPU: 8-byte
(``.b64``) against 16-byte (``.v2.b64``) data accesses of the tile variants the launcher picks
for a page size (bench/RESULTS.md "stop 39": 18 KiB MLA pages took masked 4 KiB rows, compiled
to 8-byte accesses, while 32 KiB runs get 16-byte ones) and the barriers per program step
(the checked variants' per-row checksum reduction; ``split=8``: XKV_CHECK_SPLIT's partial sums).

    env -u TRITON_INTERPRET python bench/ptx_probe.py [--pages 18432,32768]

Each page size is planned by ``xkv.kernels._launch.launch_config`` (restores, 64 programs), with
the switch ``XKV_MIN_EVEN_ROW_BYTES`` at its default ("now") and off ("masked"); pointers and
the cache geometry are marked 16-byte divisible as the real pools are. Counts are per program
step, row metadata loads included.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xkv.kernels import _launch  # noqa: E402

PTR = {"p_pool": "*u8", "p_flat": "*u8", "p_ids": "*i64", "p_flat_off": "*i64",
       "p_layer_off": "*i64", "p_runs": "*i64", "p_res": "*i32", "p_res_off": "*i64",
       "p_chk": "*i64"}


def accesses(ptx: str) -> dict[str, int]:
    """Global load/store instructions by width, and the barriers (``bar.sync``: a program's
    warps wait for each other, so no warp issues its next loads meanwhile)."""
    found = re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)*|bar\.sync", ptx)
    return {k: found.count(k) for k in sorted(set(found))}


def compile_ptx(even: bool, rows: int, cols: int, num_warps: int, check: bool, save: bool,
                split: int = 1) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xkv.kernels._triton import INT_ARGS, WORD_TYPES, page_copy_kernel

    names = page_copy_kernel.arg_names
    const = dict(WORD_T=WORD_TYPES[8], WORD=8, SAVE=save, HAS_FLAT_OFF=True, HAS_LAYERS=True,
                 SLICED=False, EVEN=even, VEC=2, CHECK=check, ROWS=rows, COLS=cols, STORE=True,
                 SPLIT=split)
    sig = {a: "constexpr" if a in const else PTR.get(a, "i64" if a in INT_ARGS else "i32")
           for a in names}
    aligned = [a for a in names if a in PTR or a in ("block_stride", "block_words")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=page_copy_kernel, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps}).asm["ptx"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="4096,18432,32768", help="page (run) sizes in bytes")
    a = ap.parse_args()
    default = _launch.MIN_EVEN_COL_BYTES
    for page in (int(x) for x in a.pages.split(",")):
        for label, min_row in (("now", default), ("masked", 1 << 30)):
            _launch.MIN_EVEN_COL_BYTES = min_row
            c = _launch.launch_config(page, 1 << 16, 64, save=False)
            even = (page // 8) % c.cols == 0
            for check, split in ((False, 1), (True, 1), (True, 8)):
                ptx = compile_ptx(even, c.rows, c.cols, c.num_warps, check, False, split)
                print(f"{page} B page, {label}: rows {c.rows} x cols {c.cols} (EVEN={even}), "
                      f"checked={check}, split={split}: {accesses(ptx)}", flush=True)
    _launch.MIN_EVEN_COL_BYTES = default


if __name__ == "__main__":
    main()
