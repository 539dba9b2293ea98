"""A verified restore in two passes: copy unchecked at the link's rate, then hash in HBM (issue 25).

A checked restore kernel hashes what it reads over PCIe and runs at 0.74-0.92 of the unchecked
rate on the H200 even at 16 programs (bench/RESULTS.md, stop 31). Here the copy is the unchecked
prepared restore, and a second prepared job hashes the pages once they are in the cache
(:func:`xkv.kernels.hashing.build_hash_job`: reads at HBM rate, writes nothing) into residuals
against the expected words, on a stream of the caller's choosing, so layer ``l``'s hash can run
beside layer ``l + 1``'s copy, or (``hash_groups``) layers are hashed together by one launch,
e.g. every layer at once after the last copy (the connector's ``checksum_pass`` "end").

``checks.hash_only`` fragments (pages of an object that this copy does not write: the step's
forward writes them, or another call restores them) are not in the cache when the hash runs, so
they are hashed from the flat buffer by the checked restore kernel (hash-only, nothing written),
into the SAME word buffer: ``words[l, c] = -expected[l, c] + terms of the pages hashed in HBM +
terms of the hash-only pages read from the flat buffer``, 0 exactly where layer ``l`` of object
``c`` matched, as a one-pass checked restore computes it.

:func:`prepare_page_hash` is the hash half alone, for pages another path wrote into the cache
(the NVLink fan-out's all-gather): ``launch(l)`` hashes layer ``l`` after its pages landed.

:func:`prepare_hashed_restore` returns a :class:`HashedRestore`: ``launch(l)`` issues layer
``l``'s copy (the prepare stream), ``launch_check(l, stream)`` its hash (and its hash-only
pages), ``checks`` the shared :class:`~xkv.kernels.verify.CheckWords`; with ``layer_groups`` /
``hash_groups`` (partitions of the layers into runs, as ``prepare_restore``'s ``layer_groups``)
the indices are those of the copy's / the hash's groups, and :meth:`HashedRestore.launch_checks`
issues every hash. Shapes as in :mod:`xkv.kernels.prepared`; everything is validated before
anything is issued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xkv.kernels.hashing import HASH_ENGINES, build_hash_job, hash_engine
from xkv.kernels.jobs import IndexLike, as_index, build_job, offsets_arg, pools_arg
from xkv.kernels.prepared import PreparedCopy, _prepare, prepare_restore
from xkv.kernels.verify import Checks, CheckWords
from xkv.layout import PagePool

__all__ = ["HashedRestore", "PageHash", "prepare_hashed_restore", "prepare_page_hash"]


@dataclass
class PageHash:
    """The verification of pages already in the cache (:func:`prepare_page_hash`)."""

    hash: PreparedCopy  # per layer: the written pages hashed in the cache
    tail: PreparedCopy | None  # per layer: the hash-only fragments hashed from the flat buffer
    checks: CheckWords  # residuals [L, C], shared by hash and tail

    def __len__(self) -> int:
        return len(self.hash)

    def launch(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Layer ``layer``'s hash (with ``hash_groups``: group ``layer``'s), once its pages are in
        the cache: the caller orders ``stream`` after what wrote them; None: the prepare stream."""
        self.hash.launch(layer, stream)
        if self.tail is not None:
            self.tail.launch(layer, stream)


@dataclass
class HashedRestore:
    """A prepared two-pass verified restore (module docstring)."""

    copy: PreparedCopy  # unchecked, the written fragments
    check: PageHash  # its verification

    @property
    def checks(self) -> CheckWords:
        return self.check.checks

    def __len__(self) -> int:
        return len(self.copy)

    def launch(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Layer ``layer``'s copy (unchecked)."""
        self.copy.launch(layer, stream)

    def launch_check(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Layer ``layer``'s hash (with ``hash_groups``: group ``layer``'s), after its copy
        landed: the caller orders ``stream`` after the copy (an event recorded after
        :meth:`launch`); None: the prepare stream."""
        self.check.launch(layer, stream)

    def launch_checks(self, stream: torch.cuda.Stream | None = None) -> None:
        """Every hash (group), after every copy landed (``stream`` as :meth:`launch_check`)."""
        for g in range(len(self.check)):
            self.check.launch(g, stream)


def prepare_hashed_restore(src: torch.Tensor, src_offsets: IndexLike, dsts: list[PagePool],
                           block_ids: IndexLike, checks: Checks, *, engine: str = "auto",
                           max_programs: int | None = None,
                           hash_programs: int | None = None,
                           layer_groups: Sequence[Sequence[int]] | None = None,
                           hash_groups: Sequence[Sequence[int]] | None = None) -> HashedRestore:
    """Prepare :func:`~xkv.kernels.prepare_restore` of the fragments ``checks.hash_only`` does
    not mark (unchecked, ``engine``, ``max_programs``, ``layer_groups``) and their verification
    (module docstring; ``hash_programs``: the hash's SM budget, default a checked save's;
    ``hash_groups``: the layers one hash launch covers, default one launch per layer).
    ``ValueError`` before anything is issued: bad arguments, ``checks`` without ``expected``, or
    a page listed both as written and as hash-only."""
    v = _validated(src_offsets, dsts, block_ids, checks)
    copy = prepare_restore(src, v.offs[:, v.written], v.dsts, v.ids[v.written], engine=engine,
                           max_programs=max_programs, layer_groups=layer_groups)
    # the hash follows the copy's engine where it can (copy_engine / staged do not hash: auto)
    he = engine if engine in HASH_ENGINES else "auto"
    return HashedRestore(copy, _page_hash(src, v, checks, he, engine, hash_programs, hash_groups))


def prepare_page_hash(src: torch.Tensor, src_offsets: IndexLike, dsts: list[PagePool],
                      block_ids: IndexLike, checks: Checks, *, engine: str = "auto",
                      hash_programs: int | None = None) -> PageHash:
    """The verification half of :func:`prepare_hashed_restore` alone: fragments that
    ``checks.hash_only`` does not mark are already in ``dsts`` (another path wrote them, e.g.
    the NVLink fan-out) and are hashed there; hash-only fragments are hashed from ``src`` at
    ``src_offsets``. Same arguments, words and errors as :func:`prepare_hashed_restore`."""
    v = _validated(src_offsets, dsts, block_ids, checks)
    return _page_hash(src, v, checks, engine, engine, hash_programs)


@dataclass
class _Args:
    dsts: list[PagePool]
    ids: np.ndarray
    offs: np.ndarray  # [L, n]
    objects: np.ndarray
    pages: np.ndarray
    written: np.ndarray  # indices of the fragments in the cache
    hashed_only: np.ndarray  # indices of the hash-only fragments


def _validated(src_offsets, dsts, block_ids, checks) -> _Args:
    dsts = pools_arg(dsts, "dsts")
    L = len(dsts)
    ids = as_index(block_ids, "block_ids")
    offs_np = as_index(src_offsets, "src_offsets")
    if offs_np.shape != (L, int(ids.size)):
        raise ValueError(f"src_offsets must be [{L}, {int(ids.size)}] (layers, fragments), got "
                         f"{offs_np.shape}")
    if not isinstance(checks, Checks) or checks.expected is None:
        raise ValueError("a hashed restore needs kernels.Checks with expected words")
    n = int(ids.size)
    objects = as_index(checks.objects, "checks.objects")
    pages = as_index(checks.pages, "checks.pages")
    if objects.shape != (n,) or pages.shape != (n,):
        raise ValueError(f"checks.objects / checks.pages must be [{n}], got {objects.shape} / "
                         f"{pages.shape}")
    ho = (np.zeros(n, dtype=bool) if checks.hash_only is None
          else np.asarray(checks.hash_only))
    if ho.dtype != np.bool_ or ho.shape != (n,):
        raise ValueError(f"checks.hash_only must be bool [{n}], got {ho.dtype} {ho.shape}")
    w = np.flatnonzero(~ho)
    h = np.flatnonzero(ho)
    # (object, page) as one integer: a page in both halves would be counted twice
    key = objects * (int(pages.max(initial=0)) + 1) + pages
    both = np.intersect1d(key[w], key[h])
    if both.size:
        i = int(np.flatnonzero(key == both[0])[0])
        raise ValueError(f"page {int(pages[i])} of object {int(objects[i])} is listed as written "
                         "and as hash-only")
    return _Args(dsts, ids, offs_np, objects, pages, w, h)


def _page_hash(src: torch.Tensor, v: _Args, checks: Checks, engine: str, tail_engine: str,
               hash_programs: int | None,
               groups: Sequence[Sequence[int]] | None = None) -> PageHash:
    """``engine``: the in-cache hash's (``hashing.hash_engine``); ``tail_engine``: the hash-only
    fragments' checked restore kernel's (checked restores' own budget and engine rule);
    ``groups``: layers hashed by one launch (both halves), None: per layer."""
    w, h, L = v.written, v.hashed_only, len(v.dsts)
    hjob = build_hash_job(v.dsts, v.ids[w], Checks(v.objects[w], v.pages[w], checks.num_objects,
                                                   expected=checks.expected))
    words = hjob.checks.buf
    tail = None
    if h.size:
        tjob = build_job(v.dsts, v.ids[h], src, offsets_arg(v.offs[:, h], L, "src_offsets"),
                         save=False, per_layer=True,
                         checks=Checks(v.objects[h], v.pages[h], checks.num_objects,
                                       expected=checks.expected,
                                       hash_only=np.ones(h.size, dtype=bool)))
        tjob.checks.buf = words  # adds its terms into the same residuals (-expected once)
        tail = _prepare(tjob, tail_engine, None, groups)
    hash_prep = _prepare(hjob, hash_engine(engine, v.dsts[0].device), hash_programs, groups)
    return PageHash(hash_prep, tail, words)
