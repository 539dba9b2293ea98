"""A cache group's prepared copies of one step (``transfer.py``'s handlers) and the host copy of
their checksum words.

The kernels prepare layers of one block size together; a group whose layers differ in page size
(an MLA latent and its indexer cache) is prepared per size (:func:`prepare_by_size`), its
``Checks`` restricted to each size's layers. :class:`WordsReadback` queues the copy of a verified
copy's words to the host on the current stream (the copies' own) and reads it once that stream
reached it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from xkv import kernels
from xkv.connector.config import CHECKSUM_PASSES

__all__ = ["CHECKSUM_PASSES", "WordsReadback", "prepare_by_size", "prepare_group_restore",
           "record_loads", "restore_all", "save_all", "written"]

# checksum_pass: "copy" hashes inside the restore kernel as it copies; "hbm" copies unchecked,
# then hashes each layer's pages in the cache after its copy (kernels.prepare_hashed_restore);
# "end" copies unchecked, then hashes every layer's pages by one launch after the last copy


class _BySize:
    """A group's prepared copies when its layers differ in page size (an MLA latent and its
    indexer cache): the kernels prepare layers of one block size together, so one prepared step
    per size; ``launch(l)`` takes the group's layer index as a single step's would."""

    def __init__(self, parts: list[tuple[list[int], object]]) -> None:
        self.parts = parts
        self._where = {i: (prep, j) for idx, prep in parts for j, i in enumerate(idx)}

    def launch(self, layer: int) -> None:
        prep, j = self._where[layer]
        prep.launch(j)

    def launch_check(self, layer: int, stream=None) -> None:
        """A two-pass verified restore's hash of ``layer`` (``HashedRestore.launch_check``)."""
        prep, j = self._where[layer]
        prep.launch_check(j, stream)

    def launch_checks(self, stream=None) -> None:
        """Every size's hashes (``HashedRestore.launch_checks``)."""
        for _, prep in self.parts:
            prep.launch_checks(stream)


def _sub_checks(checks, idx: list[int] | None):
    """``checks`` (kernels ``Checks``) for the layers ``idx`` of the group (None: all)."""
    if checks is None or idx is None or checks.expected is None:
        return checks
    return replace(checks, expected=np.asarray(checks.expected)[idx])


def prepare_by_size(make, pools, offsets: torch.Tensor, checks=None):
    """``make(pools, offsets, checks)`` for the whole group, or per page size
    (:class:`_BySize`; ``checks`` restricted to each size's layers); the common case (one size)
    is the kernels' own prepared step, unchanged."""
    sizes = sorted({p.block_bytes for p in pools})
    if len(sizes) <= 1:
        return make(pools, offsets, checks)
    parts = []
    for size in sizes:
        idx = [i for i, p in enumerate(pools) if p.block_bytes == size]
        parts.append((idx, make([pools[i] for i in idx], offsets[idx], _sub_checks(checks, idx))))
    return _BySize(parts)


class WordsReadback:
    """The host copy of a verified copy's checksum words, queued on the current stream when
    built (the copies' stream): :meth:`get` once that stream reached it (after ``sync_loads`` /
    the save fence; at once on CPU). Restores: bool ``[C]`` (object mismatched in some layer);
    saves: uint32 ``[L, C]``."""

    def __init__(self, prep, num_layers: int) -> None:
        parts = prep.parts if isinstance(prep, _BySize) else [(None, prep)]
        self.save = None
        self._L = num_layers
        self._host = []
        for idx, p in parts:
            cw = p.checks
            if cw is None:
                continue
            self.save = cw.save
            self._host.append((idx, cw.readback()))

    def get(self) -> np.ndarray:
        if not self.save:
            # new arrays (the reductions): the host buffers go back to the pinned pool when
            # this readback is dropped
            flags = [kernels.mismatch_flags(h.numpy()) for _, h in self._host]
            return np.logical_or.reduce(np.stack(flags)) if flags else np.zeros(0, bool)
        C = self._host[0][1].shape[1] if self._host else 0
        out = np.zeros((self._L, C), np.uint32)
        for idx, h in self._host:
            out[slice(None) if idx is None else idx] = h.numpy().view(np.uint32)
        return out


def written(block_ids: torch.Tensor, checks) -> torch.Tensor | None:
    """bool [n] of the fragments a verified restore writes (None: every one): the debug
    verifier only looks at those."""
    if checks is None or checks.hash_only is None:
        return None
    return torch.from_numpy(~np.asarray(checks.hash_only))


def prepare_group_restore(card, offsets, pools, block_ids, checks=None, *, engine: str = "auto",
                          checksum_pass: str = "copy", layer_groups=None):
    """A group's restore prepared (per page size): one pass (verified while copying when
    ``checks`` is given), or, with ``checks`` and ``checksum_pass`` ``"hbm"``, the two-pass
    verified restore whose ``launch_check(l, stream)`` follows each layer's ``launch(l)``, or
    with ``"end"`` the two-pass restore whose ``launch_checks()`` hashes every layer (one launch
    per page size) after the last ``launch``. ``layer_groups`` (one page size only: the light
    step's halving groups): ``launch(g)`` copies group ``g``, verified at the light step's SM
    budget (``kernels.light_restore_programs``); not with ``"hbm"``."""
    if checks is not None and checksum_pass in ("hbm", "end"):
        whole = checksum_pass == "end"
        if layer_groups is not None and not whole:
            raise ValueError("checksum_pass 'hbm' hashes layer by layer: no layer_groups")
        return prepare_by_size(lambda ps, offs, ck: kernels.prepare_hashed_restore(
            card, offs, ps, block_ids, ck, engine=engine, layer_groups=layer_groups,
            hash_groups=[list(range(len(ps)))] if whole else None,
            hash_programs=kernels.WHOLE_HASH_PROGRAMS if whole else None), pools, offsets, checks)
    # the caller launches every group at once: plan all but the first while its copy runs
    if layer_groups is not None:  # a light step: its verified copy takes more SMs (see kernels)
        return kernels.prepare_restore(
            card, offsets, pools, block_ids, engine=engine, layer_groups=layer_groups,
            checks=checks, defer_rest=True,
            max_programs=None if checks is None else kernels.light_restore_programs())
    return prepare_by_size(lambda ps, offs, ck: kernels.prepare_restore(
        card, offs, ps, block_ids, engine=engine, checks=ck, defer_rest=True), pools, offsets,
        checks)


def record_loads(verifier, names, card, offsets, pools, block_ids, checks) -> None:
    """``verify_restores``: poison and record the fragments a load writes (a verified load's
    hash-only fragments are not written)."""
    w = written(block_ids, checks)
    vb, vo = (block_ids, offsets) if w is None else (block_ids[w], offsets[:, w])
    for i, pool in enumerate(pools):
        verifier.poison(pool, vb)
        verifier.record("restore", card, vo[i], pool, vb, names[i])


def _by_size(pools) -> list[list[int]]:
    """Layer indices per page size (the kernels take layers of one block size together)."""
    sizes: dict[int, list[int]] = {}
    for i, p in enumerate(pools):
        sizes.setdefault(p.block_bytes, []).append(i)
    return list(sizes.values())


def save_all(pools, block_ids, card, offsets, engine: str, checks=None):
    """Save ``block_ids`` of every layer (``offsets`` int64 ``[L, n]``, host), one launch per
    page size, on the current stream: :func:`xkv.kernels.save_layers`; with ``checks`` the same
    launches compute the checksum words (``kernels.prepare_save`` with one layer group per size)
    and the prepared copies are returned for :class:`WordsReadback` (None without). One launch
    where a launch per layer made ``wait_for_save``, which vLLM calls before sampling, take 5.45
    ms of host time in a 2k prefill's step against 1.82 unverified on the H100 of stop 42
    (``bench/results/h100_2026-12-06_stop42/c4.tgz``)."""
    if checks is None:
        for idx in _by_size(pools):
            kernels.save_layers([pools[i] for i in idx], block_ids, card, offsets[idx],
                                engine=engine)
        return None
    prep = prepare_by_size(lambda ps, offs, ck: kernels.prepare_save(
        ps, block_ids, card, offs, engine=engine, checks=ck,
        layer_groups=[list(range(len(ps)))]), pools, offsets, checks)
    for _, part in prep.parts if isinstance(prep, _BySize) else [(None, prep)]:
        part.launch(0)
    return prep


def restore_all(card, offsets, pools, block_ids, engine: str) -> None:
    """Restore ``block_ids`` of every layer (``offsets`` int64 ``[L, n]``) at once: one launch
    per page size (the kernels take layers of one block size together), on the current
    stream. A forced ``staged`` engine copies these with the Triton kernel, as ``auto`` does:
    they are a full hit's tail (one block of every layer, a few MiB), where staging gains
    nothing, and the staged engine's per-launch unpack is a variant the start-up warmup does
    not compile (on the H100 of stop 46 it compiled inside the first full hit: 215 ms)."""
    engine = "triton" if engine == "staged" else engine
    for idx in _by_size(pools):
        kernels.restore_layers(card, offsets[idx], [pools[i] for i in idx], block_ids,
                               engine=engine)
