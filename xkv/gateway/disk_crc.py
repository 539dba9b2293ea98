"""The disk tier's payload checksum (CRC-32, zlib's polynomial and conventions, as the file header
records it: xkv/gateway/disk_format.py) over card slots, as cheap in CPU as this host allows.

zlib's ``crc32`` runs at about 2 GB/s on one core here; at the disk's speed that was three
quarters of the tier's CPU time (0.45 of 0.6 CPU-seconds per GB moved; the kernel's O_DIRECT
work is the rest) and, on a 2-core machine shared with other work, what the I/O threads and the
gateway's loop competed for. libdeflate's ``libdeflate_crc32`` computes the same value with
carry-less multiplication at about 11 GB/s. It is a C library, not a Python package: it is used
through ctypes where the system has it (``libdeflate.so.0``; Debian's ``libdeflate0``, which
libtiff pulls into most images), and zlib otherwise; both give the same numbers
(tests/disk/test_disk_crc.py). ctypes releases the GIL for the call, as zlib does for large
buffers. bench/RESULTS.md "Disk tier" has the measurements.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import zlib

log = logging.getLogger("xkv.gateway")

__all__ = ["SlotCrc", "libdeflate_crc32"]


def _load():
    """``libdeflate_crc32`` as a ctypes function, or None where the library is missing (or
    ``XKV_DISK_CRC=zlib`` asks for zlib)."""
    if os.environ.get("XKV_DISK_CRC", "") == "zlib":
        return None
    for name in ("libdeflate.so.0", ctypes.util.find_library("deflate")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fn = lib.libdeflate_crc32
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        probe = b"123456789" * 1000
        if fn(0, probe, len(probe)) == zlib.crc32(probe):  # the same CRC, or not used at all
            return fn
    return None


libdeflate_crc32 = _load()


class SlotCrc:
    """CRC-32 of byte ranges of one card (an mmap): ``crc(offset, length, crc)`` continues
    ``crc`` over ``card[offset:offset + length]``, exactly as ``zlib.crc32`` would. Ranges
    outside the card raise ValueError (ctypes reads raw memory: never past the mapping).
    :meth:`close` drops the hold on the card's buffer so the card can be unmapped."""

    def __init__(self, card: mmap.mmap, *, use_libdeflate: bool = True):
        self._view = memoryview(card)
        self._size = len(card)
        self._fn = libdeflate_crc32 if use_libdeflate else None
        self._anchor = None
        self._base = 0
        if self._fn is not None:
            self._anchor = (ctypes.c_char * self._size).from_buffer(card)
            self._base = ctypes.addressof(self._anchor)

    @property
    def kind(self) -> str:
        return "libdeflate" if self._fn is not None else "zlib"

    def crc(self, offset: int, length: int, crc: int = 0) -> int:
        if offset < 0 or length < 0 or offset + length > self._size:
            raise ValueError(f"checksum of card bytes [{offset}, {offset + length}) outside the "
                             f"card of {self._size} bytes")
        if self._fn is not None:
            return self._fn(crc, self._base + offset, length)
        return zlib.crc32(self._view[offset:offset + length], crc)  # releases the GIL

    def close(self) -> None:
        self._fn = None
        self._anchor = None
        self._view.release()
