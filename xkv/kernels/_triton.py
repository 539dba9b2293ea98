"""The Triton kernel behind every launcher (private; host side in ``_launch.py``).

Imported on the first launch, never by ``import xkv.kernels``.

One row = one contiguous run of one fragment of one layer: ``(layer l, fragment i, run r)``.
Pool side:  ``layer_off[l] + block_ids[i] * block_stride + run_off[r]``.
Flat side:  ``flat_off[l, i] + run_cum[r]`` (or ``flat_base + (l * n + i) * block_bytes + run_cum[r]``).
All offsets are int64 and in words of ``WORD_T`` (``WORD`` bytes), except the ``flat_off`` table, which
holds bytes so that callers can upload it before the word size is known. A program copies a ``[ROWS, COLS]`` tile per step
(several fragments at once, so few programs keep many bytes in flight) and walks row groups
grid-stride. ``SLICED`` copies only bytes ``[lo, hi)`` of the concatenation of all fragments.
``CHECK`` adds the checksum terms of the bytes read (``SPLIT`` > 1: as that many partial sums per
row, each added atomically); ``STORE=False`` (default True, so every
other launch is the same variant) stores nothing: with ``SAVE`` and ``CHECK`` it hashes pages in
place (:mod:`xkv.kernels.hashing`) and never touches the flat buffer.

The integer arguments that change from step to step (counts, ``flat_base``, ``lo``/``hi``) are
not specialised (``do_not_specialize``): without it Triton compiles a new variant whenever a count
happens to be 1 or a multiple of 16, so the first step of a new size would compile mid-serving.
They are also typed ``tl.int64``: Triton otherwise types an int argument i32 or i64 by its value,
another variant again (the H200's 8 x 16k restore, 2026-12-04: ``hi``, the job's bytes in words,
passed 2**31 and the step compiled for ~1 s).
The geometry of a cache (``n_runs``, ``block_stride``, ``block_words``, ``max_run_words``) is fixed
per pool and stays specialised: its divisibility by 16 lets Triton prove aligned addresses (with
every integer unspecialised, 4 KiB restores at 4 programs measured 0.61 of the copy engine on the
H200, against 0.92 before; bench/RESULTS.md "Page mover"). A compiled variant depends on the constexprs, on that geometry and on which
pointers are 16-byte aligned (the pool and flat buffers are fixed per cache; the tables are laid
out so that theirs always are), which :mod:`xkv.kernels.warmup` enumerates with the real pools.
"""

import triton
import triton.language as tl

# xkv.kernels.checksum: mix(x, p) = fmix32(x ^ ((p + 1) * GOLDEN)), summed mod 2**32
# (constexpr: a compiled kernel may read no other globals; the interpreter does not check that)
GOLDEN = tl.constexpr(0x9E3779B9)
M1 = tl.constexpr(0x85EBCA6B)
M2 = tl.constexpr(0xC2B2AE35)


G2 = tl.constexpr(0x3C6EF372)  # 2 * GOLDEN mod 2**32


@triton.jit
def _fmix(x, k):
    """``mix(x, p)`` on uint32 tensors given ``k = (p + 1) * GOLDEN`` (uint32 arithmetic wraps
    mod 2**32, so ``k`` is linear in ``p``: callers add a row and a column term, no product per
    word)."""
    h = x ^ k
    h ^= h >> 16
    h *= M1
    h ^= h >> 13
    h *= M2
    h ^= h >> 16
    return h


@triton.jit
def _terms(b_x, k, WORD: tl.constexpr):
    """Checksum terms of a tile of ``WORD``-byte words (4 or 8); ``k`` (uint32, same shape) is
    ``(p + 1) * GOLDEN`` of each word's first 4-byte position ``p`` (:func:`_keys`): an 8-byte
    word is its two little-endian halves, at ``p`` and ``p + 1``."""
    if WORD == 8:
        lo = _fmix(b_x.to(tl.uint32), k)
        hi = _fmix((b_x >> 32).to(tl.uint32), k + GOLDEN)
        return lo + hi
    else:
        return _fmix(b_x.to(tl.uint32, bitcast=True), k)


@triton.jit
def _keys(o_q, c, o_cols, WORD: tl.constexpr):
    """uint32 ``[ROWS, COLS]``: ``(p + 1) * GOLDEN`` for the tile whose row ``r`` starts at word
    ``o_q[r] + c`` (WORD units, int64) and column ``j`` adds ``o_cols[j]``; ``p`` counts 4-byte
    words. Only the low 32 bits of the positions matter (the products wrap), so the row term is
    one product per row and the column term one per column, not one per word."""
    if WORD == 8:
        r = (o_q + c).to(tl.uint32) * G2 + GOLDEN
        j = o_cols.to(tl.uint32) * G2
    else:
        r = (o_q + c).to(tl.uint32) * GOLDEN + GOLDEN
        j = o_cols.to(tl.uint32) * GOLDEN
    return r[:, None] + j[None, :]


INT_ARGS = ("n_frag", "n_rows", "n_groups", "flat_base", "lo", "hi")  # per step; geometry stays


@triton.jit(do_not_specialize=INT_ARGS)
def page_copy_kernel(
    p_pool,  # uint8*: pool base of the lowest layer (every layer_off is >= 0 from here)
    p_flat,  # uint8*: the contiguous side (GPU memory or pinned/registered host memory)
    p_ids,  # int64 [n]: block ids
    p_flat_off,  # int64 [L, n]: flat offsets in BYTES (only if HAS_FLAT_OFF)
    p_layer_off,  # int64 [L]: layer pool bases in words from p_pool (only if HAS_LAYERS)
    p_runs,  # int64 [3, R]: run offset in block, run length, run offset in fragment (words)
    p_res,  # int32*: checksum words [L, C] (only if CHECK; xkv.kernels.verify)
    p_res_off,  # int64 [Lg]: element offset in p_res of this launch's layer rows (CHECK)
    p_chk,  # int64 [3, n]: object column, page index in object, flags (1 written, 2 hashed)
    n_frag: tl.int64,
    n_runs,
    n_rows: tl.int64,  # L * n * R
    n_groups: tl.int64,  # cdiv(n_rows, ROWS)
    block_stride,
    block_words,
    flat_base: tl.int64,
    lo: tl.int64,
    hi: tl.int64,
    max_run_words,
    WORD_T: tl.constexpr,
    WORD: tl.constexpr,  # bytes of WORD_T
    SAVE: tl.constexpr,  # pool -> flat (else flat -> pool)
    HAS_FLAT_OFF: tl.constexpr,
    HAS_LAYERS: tl.constexpr,
    SLICED: tl.constexpr,
    EVEN: tl.constexpr,  # every run is max_run_words long, a multiple of COLS, and not SLICED
    VEC: tl.constexpr,  # every row start is a multiple of VEC words (16-byte accesses)
    CHECK: tl.constexpr,  # add the checksum terms of the bytes read into p_res (WORD 4 or 8)
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STORE: tl.constexpr = True,  # False: read and hash only, write nothing (xkv.kernels.hash_pages)
    SPLIT: tl.constexpr = 1,  # CHECK: partial sums per row (divides COLS; XKV_CHECK_SPLIT)
):
    i_p = tl.program_id(0).to(tl.int64)
    n_p = tl.num_programs(0).to(tl.int64)
    p_pool_w = p_pool.to(tl.pointer_type(WORD_T))
    p_flat_w = p_flat.to(tl.pointer_type(WORD_T))
    o_cols = tl.arange(0, COLS).to(tl.int64)  # [COLS]
    for i_g in range(i_p, n_groups, n_p):
        o_k = i_g * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS] row ids
        m_k = o_k < n_rows
        o_k = tl.where(m_k, o_k, 0)
        i_lf = o_k // n_runs  # layer * n + fragment
        i_r = o_k - i_lf * n_runs
        i_l = i_lf // n_frag
        i_f = i_lf - i_l * n_frag
        b_blk = tl.load(p_ids + i_f, mask=m_k, other=0)
        b_roff = tl.load(p_runs + i_r, mask=m_k, other=0)
        b_rlen = tl.load(p_runs + n_runs + i_r, mask=m_k, other=0)
        b_rcum = tl.load(p_runs + 2 * n_runs + i_r, mask=m_k, other=0)
        o_pool = b_blk * block_stride + b_roff
        if HAS_LAYERS:
            o_pool += tl.load(p_layer_off + i_l, mask=m_k, other=0)
        if HAS_FLAT_OFF:
            o_flat = tl.load(p_flat_off + i_lf, mask=m_k, other=0) // WORD + b_rcum
        else:
            o_flat = flat_base + i_lf * block_words + b_rcum
        if VEC > 1:
            o_pool = tl.multiple_of(o_pool, VEC)
            o_flat = tl.multiple_of(o_flat, VEC)
        if SLICED:
            o_pos = i_lf * block_words + b_rcum  # where this run starts in the concatenation
            c_lo = tl.maximum(lo - o_pos, 0)
            c_hi = tl.minimum(hi - o_pos, b_rlen)
        else:
            c_lo = tl.zeros_like(b_rlen)
            c_hi = b_rlen
        if SAVE:
            p_src = p_pool_w + o_pool
            p_dst = p_flat_w + o_flat
        else:
            p_src = p_flat_w + o_flat
            p_dst = p_pool_w + o_pool
        if CHECK:
            b_col = tl.load(p_chk + i_f, mask=m_k, other=0)
            b_page = tl.load(p_chk + n_frag + i_f, mask=m_k, other=0)
            b_flag = tl.load(p_chk + 2 * n_frag + i_f, mask=m_k, other=0)
            b_keep = (b_flag & 1) != 0
            b_hash = m_k & ((b_flag & 2) != 0)
            b_res = tl.load(p_res_off + i_l, mask=m_k, other=0) + b_col
            # position (in WORD units) of the row's first word in its object's layer range
            o_q = b_page * block_words + b_rcum
            # summed per word over the whole run and reduced across the tile once: a reduction
            # per column step synchronises the program's warps between its loads
            acc = tl.zeros([ROWS, COLS], dtype=tl.uint32)
        for c in range(0, max_run_words, COLS):
            o_c = c + o_cols
            if EVEN:
                m_t = m_k[:, None]  # [ROWS, 1]: constant along a row, keeps accesses vectorized
            else:
                m_t = (
                    m_k[:, None] & (o_c[None, :] >= c_lo[:, None]) & (o_c[None, :] < c_hi[:, None])
                )
            b_x = tl.load(p_src[:, None] + o_c[None, :], mask=m_t)  # [ROWS, COLS]
            if CHECK:
                t = _terms(b_x, _keys(o_q, c, o_cols, WORD), WORD)
                acc += tl.where(m_t, t, 0)
                if STORE:
                    if SAVE:
                        tl.store(p_dst[:, None] + o_c[None, :], b_x, mask=m_t)
                    else:  # hash-only fragments (b_keep False) are read, never written
                        tl.store(p_dst[:, None] + o_c[None, :], b_x, mask=m_t & b_keep[:, None])
            elif STORE:
                tl.store(p_dst[:, None] + o_c[None, :], b_x, mask=m_t)
        if CHECK:
            if SPLIT == 1:
                b_sum = tl.where(b_hash, tl.sum(acc, axis=1), 0)
                tl.atomic_add(p_res + b_res, b_sum.to(tl.int32, bitcast=True), mask=m_k)
            else:
                # SPLIT partial sums per row, added atomically (the same sum mod 2**32): a
                # row's whole-width sum crosses warps through shared memory and barriers,
                # which hold every warp's next loads (bench/ptx_probe.py: 13 barriers -> 2)
                b_part = tl.sum(tl.reshape(acc, [ROWS, SPLIT, COLS // SPLIT]), axis=2)
                b_part = tl.where(b_hash[:, None], b_part, 0)
                o_res = b_res[:, None] + tl.zeros([ROWS, SPLIT], dtype=tl.int64)
                tl.atomic_add(p_res + o_res, b_part.to(tl.int32, bitcast=True),
                              mask=m_k[:, None], sem="relaxed")


WORD_TYPES = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}

__all__ = ["INT_ARGS", "WORD_TYPES", "page_copy_kernel", "triton"]
