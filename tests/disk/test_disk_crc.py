"""The disk tier's payload checksum (xkv/gateway/disk_crc.py): libdeflate's CRC-32, where the
system has it, gives exactly zlib's values (the file format's checksum) for any range of the
card and any starting value; ranges outside the card are refused before any memory is read;
the zlib fallback gives the same; a closed checksum lets the card be unmapped."""

from __future__ import annotations

import mmap
import os
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xkv.gateway import disk_crc
from xkv.gateway.disk_crc import SlotCrc

CARD = 1 << 20


@pytest.fixture(scope="module")
def card():
    m = mmap.mmap(-1, CARD)
    m.write(os.urandom(CARD))
    yield m
    m.close()


def test_libdeflate_is_found_here():
    """This machine has libdeflate (the figures in bench/RESULTS.md use it); elsewhere the tier
    falls back to zlib and this test says so rather than passing silently."""
    if disk_crc.libdeflate_crc32 is None:
        pytest.skip("libdeflate.so.0 is not on this system: the tier uses zlib's crc32")
    assert SlotCrc(mmap.mmap(-1, 4096)).kind == "libdeflate"


@pytest.mark.parametrize("use_libdeflate", [True, False])
@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, CARD), length=st.integers(0, 70000), seed=st.integers(0, 2**32 - 1))
def test_same_value_as_zlib(card, use_libdeflate, start, length, seed):
    length = min(length, CARD - start)
    c = SlotCrc(card, use_libdeflate=use_libdeflate)
    try:
        assert c.crc(start, length, seed) == zlib.crc32(card[start:start + length], seed)
    finally:
        c.close()


def test_chained_over_shards_as_the_file_header_has_it(card):
    c = SlotCrc(card)
    try:
        crc = 0
        for off in (0, 300000, 8192):  # shards in file order, slots anywhere in the card
            crc = c.crc(off, 123457, crc)
        assert crc == zlib.crc32(card[8192:8192 + 123457], zlib.crc32(
            card[300000:300000 + 123457], zlib.crc32(card[0:123457])))
    finally:
        c.close()


@pytest.mark.parametrize("use_libdeflate", [True, False])
def test_out_of_range_refused(card, use_libdeflate):
    c = SlotCrc(card, use_libdeflate=use_libdeflate)
    try:
        for off, n in ((CARD - 10, 11), (CARD, 1), (-1, 5), (0, -1), (CARD + 4096, 4096)):
            with pytest.raises(ValueError, match="outside the card"):
                c.crc(off, n)
        assert c.crc(CARD, 0) == 0  # empty at the very end: fine
    finally:
        c.close()


def test_close_lets_the_card_go():
    m = mmap.mmap(-1, 8192)
    c = SlotCrc(m)
    with pytest.raises(BufferError):
        m.close()  # held while the checksum may read it
    c.close()
    m.close()
