"""Verified restores and checksummed saves (``verify_checksums``, on by default): what the kernels'
checksums (``xkv.kernels.checksum``: one uint32 word per layer of an object's shard) mean for a
step's transfers. No tensors of the pages here; the copies compute the words (``xkv.kernels``
``checks=``).

* HELLO: a group's ``check_words`` is its number of layers (:func:`check_words`); 0 (unverified,
  said once in the log) when a page is not a multiple of 4 bytes or verification is off.
* saves: one column per (transfer, chunk) of the step's save table (:func:`save_checks`); after
  the fence the ``[L, C]`` words become each key's COMMIT bytes (:func:`commit_words`).
* restores: the expected words of every chunk travel from the scheduler's LOOKUP in
  ``GroupTransfer.checks``; :func:`restore_checks` adds, for every page of a chunk the step does
  not write (a restore that starts or ends inside an object, a window's tail, the blocks a tail
  fence copies before the forward), a *hash-only* fragment (read and hashed, never written), so
  every object is checked whole (a window's early object: only the positions that exist,
  ``GroupTransfer.first_page`` on); a chunk without words makes the whole group's restore
  unverified (counted in ``blocks_unverified``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from xkv.connector.metadata import GroupTransfer
from xkv.kernels import Checks

log = logging.getLogger("xkv.connector")

#: The gateway's cap on words per shard (xkv.gateway.protocol.MAX_CHECK_WORDS).
MAX_CHECK_WORDS = 4096


def check_words(plan, enabled: bool = True) -> int:
    """uint32 checksum words per shard of one object of ``plan``'s group (``GroupPlan``): one per
    layer; 0 when ``enabled`` is False, when a layer's page is not a multiple of 4 bytes (the
    checksum's word), when the group has more layers than the gateway keeps words, or when
    the words would take more than 1/8 of the object's slot (the gateway refuses that HELLO)."""
    if not enabled:
        return 0
    g = plan.group
    sizes = [g.bytes_of(i) for i in range(len(g.layer_names))]
    if not sizes or any(s % 4 for s in sizes) or len(sizes) > MAX_CHECK_WORDS:
        return 0
    if len(sizes) * 4 * 8 > _slot_bytes(plan):
        return 0
    return len(sizes)


def _slot_bytes(plan) -> int:
    """The gateway's slot for one shard: the registered bytes rounded up to 4 KiB."""
    b = getattr(plan, "registered_bytes", None)
    return 1 << 62 if b is None else -(-b // 4096) * 4096


def session_words(session) -> dict[int, int]:
    """{group: checksum words per shard} of a session's layouts (HELLO's ``check_words``;
    empty for a session without them, e.g. a test stand-in)."""
    return dict(enumerate(getattr(session, "check_words", ()) or ()))


def unverified_reason(plan) -> str:
    """Why :func:`check_words` gives 0 for an enabled group (for the start-up log)."""
    g = plan.group
    sizes = sorted({g.bytes_of(i) for i in range(len(g.layer_names))})
    if len(g.layer_names) > MAX_CHECK_WORDS:
        return f"{len(g.layer_names)} layers > {MAX_CHECK_WORDS} words"
    if len(g.layer_names) * 32 > _slot_bytes(plan):
        return "the words would take more than 1/8 of the object's slot"
    return f"page sizes {sizes} bytes are not all multiples of 4"


def with_checks(gt: GroupTransfer, by_key: dict[bytes, bytes]) -> GroupTransfer:
    """``gt`` with each chunk's expected words (``by_key``: key -> words of every shard, from
    the LOOKUP); a chunk without any gets b"" (its group's restore is then unverified)."""
    if not by_key:
        return gt
    return replace(gt, checks=tuple(by_key.get(ref.key, b"") for ref in gt.chunks))


def save_checks(transfers: Sequence[GroupTransfer]) -> tuple[Checks, list[tuple[int, int]]]:
    """The kernels' ``Checks`` of a save table built from ``transfers`` (in order, as
    ``transfer.copy_table`` builds it) and the column of each ``(transfer index, chunk)``."""
    cols: list[tuple[int, int]] = []
    objects: list[int] = []
    pages: list[int] = []
    for t, gt in enumerate(transfers):
        base = len(cols)
        cols += [(t, c) for c in range(len(gt.chunks))]
        objects += [base + c for c in gt.chunk_of]
        pages += list(gt.block_in_chunk)
    return Checks(np.array(objects, np.int64), np.array(pages, np.int64), len(cols)), cols


def commit_words(words: np.ndarray, cols: list[tuple[int, int]], t: int, n_chunks: int) -> list[
        bytes]:
    """COMMIT bytes of transfer ``t``'s ``n_chunks`` chunks from the save's uint32 ``[L, C]``
    ``words``: chunk ``c``'s layers' words, little-endian (``check_words * 4`` bytes each)."""
    at = {tc: i for i, tc in enumerate(cols)}
    return [np.ascontiguousarray(words[:, at[(t, c)]]).astype("<u4").tobytes()
            for c in range(n_chunks)]


@dataclass(frozen=True)
class RestoreChecks:
    """A group's verified restore: ``transfers`` = the step's transfers followed by one
    hash-only transfer per original (block ids -1); ``checks`` the kernels' argument; ``cols[i]``
    = (index into the ORIGINAL transfers, chunk) of column ``i``; ``hash_only`` bool ``[n]``."""

    transfers: list[GroupTransfer]
    checks: Checks
    cols: list[tuple[int, int]]
    hash_only: np.ndarray

    def with_hash_only(self, mask: np.ndarray) -> RestoreChecks:
        """The same, with ``mask``'s fragments hash-only too (copied by another call)."""
        ho = self.hash_only | mask
        return replace(self, checks=replace(self.checks, hash_only=ho), hash_only=ho)


def expected_words(gt: GroupTransfer, c: int, shard: int, num_shards: int,
                   cw: int) -> np.ndarray | None:
    """uint32 ``[cw]``: the words of chunk ``c``'s object, shard ``shard``, as the LOOKUP
    returned them (``gt.checks[c]``: ``num_shards * cw`` little-endian words); None if absent."""
    if len(gt.checks) != len(gt.chunks):
        return None
    b = gt.checks[c]
    if len(b) != num_shards * cw * 4:
        return None
    return np.frombuffer(b, dtype="<u4")[shard * cw:(shard + 1) * cw].astype(np.uint32)


def restore_checks(plan, tp_rank: int, transfers: Sequence[GroupTransfer],
                   cw: int) -> RestoreChecks | None:
    """The verified form of a group's restore (see the module docstring), or None when some
    chunk has no expected words (or the group has none: ``cw == 0``)."""
    if cw == 0 or not transfers:
        return None
    shard, k = plan.shard_of(tp_rank), plan.blocks_per_object
    per = plan.num_shards * cw * 4
    cols: list[tuple[int, int]] = []
    exp_parts: list[np.ndarray] = []
    extra: list[GroupTransfer] = []
    obj_parts: list[np.ndarray] = []
    page_parts: list[np.ndarray] = []
    extra_obj: list[np.ndarray] = []
    extra_page: list[np.ndarray] = []
    for t, gt in enumerate(transfers):  # vectorised per transfer: the restore's host path
        nc, base = len(gt.chunks), len(cols)
        if len(gt.checks) != nc or any(len(b) != per for b in gt.checks):
            return None
        words = np.frombuffer(b"".join(gt.checks), dtype="<u4").reshape(nc, plan.num_shards, cw)
        exp_parts.append(words[:, shard, :].astype(np.uint32))  # [nc, cw]
        cols += [(t, c) for c in range(nc)]
        chunk_of = np.asarray(gt.chunk_of, np.int64)
        in_chunk = np.asarray(gt.block_in_chunk, np.int64)
        obj_parts.append(base + chunk_of)
        page_parts.append(in_chunk)
        have = np.zeros((nc, k), dtype=bool)
        have[:, :gt.first_page] = True  # positions that do not exist in these objects
        have[chunk_of, in_chunk] = True
        mc, mj = np.nonzero(~have)
        extra.append(GroupTransfer(gt.group, (-1,) * mc.size, tuple(mc.tolist()),
                                   tuple(mj.tolist()), gt.chunks))
        extra_obj.append(base + mc)
        extra_page.append(mj)
    objects = np.concatenate(obj_parts + extra_obj).astype(np.int64)
    pages = np.concatenate(page_parts + extra_page).astype(np.int64)
    n_orig = sum(len(gt.block_ids) for gt in transfers)
    hash_only = np.zeros(objects.size, dtype=bool)
    hash_only[n_orig:] = True
    expected = np.concatenate(exp_parts, axis=0).T  # [cw, C]
    checks = Checks(objects, pages, len(cols), expected=expected, hash_only=hash_only)
    return RestoreChecks([*transfers, *extra], checks, cols, hash_only)
