"""Probe: does a copy kernel reach every piece of a card registered in pieces (``card_pin``)?

The H200 run of 2026-12-03 13:42 (bench/RESULTS.md) stopped an engine with "illegal memory
access" at the first save past the card's first 1 GiB piece, while the same run with the card
registered at once (``XKV_CARD_SEGMENT_MIB`` larger than the card) was clean. This script maps a
card as the gateway does (``memfd`` shared memory, prefaulted) or as anonymous memory, registers
it in pieces or at once, and copies a few pages into and out of piece 0, piece 1 and across the
boundary, with the copy engine and the Triton kernel — each case in its own process (an illegal
address poisons the CUDA context). Prints one line per case and what the machine says about
huge pages and host-pointer registration.

  python3 bench/card_pieces_probe.py [--gib 3] [--seg-mib 1024]
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys

CASES = [(backing, pieces) for backing in ("memfd", "anon") for pieces in (True, False)]
WHERE = ("p0:copy_engine", "p0:triton", "p1:copy_engine", "p1:triton", "cross:triton",
         "cross:copy_engine", "last:triton")


def _device_pointers(ptr: int, pieces: list[tuple[int, int]]) -> None:
    """What the driver says (libcuda, on the context torch made current): whether a registered
    range's device pointer is its host pointer on this GPU, and each piece's device pointer."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        print(f"  libcuda: {e}", flush=True)
        return
    dev, v = ctypes.c_int(), ctypes.c_int()
    cu.cuCtxGetDevice(ctypes.byref(dev))
    rc = cu.cuDeviceGetAttribute(ctypes.byref(v), 91, dev)  # CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
    print(f"  CanUseHostPointerForRegisteredMem = {v.value} (rc {rc})", flush=True)
    for off, _ in pieces:
        for at in (off, off + 4096):
            d = ctypes.c_uint64()
            rc = cu.cuMemHostGetDevicePointer_v2(ctypes.byref(d), ctypes.c_void_p(ptr + at), 0)
            print(f"  piece at {at:#x}: device pointer {d.value:#x} == host {ptr + at:#x}: "
                  f"{d.value == ptr + at} (rc {rc})", flush=True)


def _child(a) -> None:
    import torch

    from xkv import kernels
    from xkv.connector import card_pin
    from xkv.layout import PagePool

    size, seg = a.gib << 30, a.seg_mib << 20
    if a.backing == "memfd":
        fd = os.memfd_create("probe", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        m.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
    else:
        m = mmap.mmap(-1, size)
    card = torch.frombuffer(m, dtype=torch.uint8)
    ptr = card.data_ptr()
    card_pin.pin(card, seg if a.pieces else size + mmap.PAGESIZE)
    from xkv.kernels import host
    pieces = host.registered_ranges(card)
    print(f"  ptr {ptr:#x} (mod 2M {ptr % (2 << 20)}), pieces {pieces[:3]}", flush=True)
    _device_pointers(ptr, pieces)
    bb = 12288 + 64
    first = card_pin.segments(size, ptr, seg)
    b1 = first[1][0] if len(first) > 1 else seg
    at = {"p0": 4096, "p1": b1 + 8192, "cross": b1 - bb // 2, "last": size - 3 * bb}
    g = torch.Generator().manual_seed(1)
    for w in WHERE:
        place, engine = w.split(":")
        o = at[place]
        src = torch.randint(0, 256, (2 * bb,), dtype=torch.uint8, generator=g).cuda()
        pool = PagePool(base=src, num_blocks=2, block_bytes=bb, block_stride=bb,
                        runs=((0, bb),), kind="mla")
        offs = torch.tensor([o, o + bb], dtype=torch.int64)
        try:
            kernels.save(pool, torch.arange(2), card, offs, engine=engine)
            torch.cuda.synchronize()
            ok_save = torch.equal(card[o:o + 2 * bb], src.cpu())
            dst = torch.full((2 * bb,), 0xA5, dtype=torch.uint8, device="cuda")
            dpool = PagePool(base=dst, num_blocks=2, block_bytes=bb, block_stride=bb,
                             runs=((0, bb),), kind="mla")
            kernels.restore(card, offs, dpool, torch.arange(2), engine=engine)
            torch.cuda.synchronize()
            ok = ok_save and torch.equal(dst.cpu(), card[o:o + 2 * bb])
            print(f"  {w:18s} offset {o}: {'bit-exact' if ok else 'WRONG BYTES'}", flush=True)
        except Exception as e:  # noqa: BLE001 (the probe reports and stops)
            print(f"  {w:18s} offset {o}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            sys.exit(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=int, default=3)
    ap.add_argument("--seg-mib", type=int, default=1024)
    ap.add_argument("--backing", default=None)
    ap.add_argument("--pieces", type=int, default=None)
    a = ap.parse_args()
    if a.backing is not None:
        _child(a)
        return
    for f in ("/sys/kernel/mm/transparent_hugepage/enabled",
              "/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        try:
            with open(f) as fh:
                print(f, fh.read().strip())
        except OSError as e:
            print(f, e)
    for backing, pieces in CASES:
        how = f"pieces of {a.seg_mib} MiB" if pieces else "one registration"
        print(f"{backing}, {how}:", flush=True)
        rc = subprocess.call([sys.executable, __file__, "--gib", str(a.gib), "--seg-mib",
                              str(a.seg_mib), "--backing", backing, "--pieces", str(int(pieces))])
        print(f"  rc {rc}", flush=True)


if __name__ == "__main__":
    main()
