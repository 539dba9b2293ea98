"""Random verified-copy cases for the checksum tests (test_verify, test_hash_pages and the tests
that import those): L layer pools, C objects of k pages stored layer-major in card slots, and the
numpy statement of the words of those slots."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from xkv.kernels import checksum as C


@st.composite
def cases(draw, max_layers=3, *, max_r0=40, max_r1=9, objects=(0, 3), spare=(1, 3),
          padded=False):
    """L layer pools (4-byte multiple pages of ``r0`` (+ ``r1``) words: odd word counts,
    sometimes two runs with a gap, sometimes 8-byte aligned), ``objects`` = (min, max) objects
    of k pages each (0 allowed: C is then 1 with no page), ``spare`` = (min, max) blocks no
    fragment uses, block ids in a random order; the card a save would fill: offset(l, c, j) =
    c * slot + (l * k + j) * bb, with ``padded`` slots rounded up to 16 bytes plus 0-2 more
    (and 16 spare card bytes). Returns a dict."""
    L = draw(st.integers(1, max_layers))
    unit = draw(st.sampled_from([4, 8]))
    r0 = unit * draw(st.integers(1, max_r0))
    two = draw(st.booleans())
    r1 = unit * draw(st.integers(1, max_r1)) if two else 0
    gap = unit * draw(st.integers(0, 2))
    runs = ((0, r0),) + (((r0 + gap, r1),) if two else ())
    stride = r0 + gap + r1 + unit * draw(st.integers(0, 2))
    bb = r0 + r1
    Cn, k = draw(st.integers(*objects)), draw(st.integers(1, 3))
    n = Cn * k
    nblocks = n + draw(st.integers(*spare))
    order = draw(st.permutations(range(n)))
    ids = np.array(draw(st.permutations(range(nblocks)))[:n], dtype=np.int64)
    slot = L * k * bb
    if padded:
        slot = -(-slot // 16) * 16 + 16 * draw(st.integers(0, 2))
    obj = np.array([o // k for o in order], dtype=np.int64)
    page = np.array([o % k for o in order], dtype=np.int64)
    offs = np.array([[c * slot + (li * k + j) * bb for c, j in zip(obj, page, strict=True)]
                     for li in range(L)], dtype=np.int64).reshape(L, n)
    card_bytes = Cn * slot + 16 if padded else max(Cn, 1) * slot
    return dict(L=L, runs=runs, stride=stride, bb=bb, C=max(Cn, 1), k=k, n=n, nblocks=nblocks,
                ids=ids, obj=obj, page=page, offs=offs, slot=slot, card_bytes=card_bytes,
                seed=draw(st.integers(0, 2**31)))


def oracle_words(card: torch.Tensor, c) -> np.ndarray:
    """uint32 [L, C] from the card bytes by the numpy definition (layer li of object o is the
    k * bb contiguous bytes at o * slot + li * k * bb); no page at all: every word is the
    empty word 0."""
    if c["n"] == 0:
        return np.zeros((c["L"], c["C"]), np.uint32)
    kb = c["k"] * c["bb"]
    b = card.cpu().numpy().tobytes()
    return np.array([[C.words_numpy(b[o * c["slot"] + li * kb:o * c["slot"] + (li + 1) * kb])
                      for o in range(c["C"])] for li in range(c["L"])], np.uint32)
