"""Checksums computed inside a copy (the definition: :mod:`xkv.kernels.checksum`).

A caller describes which stored object each fragment belongs to with :class:`Checks`; the
launchers then compute, while they copy, the checksum word of every (layer, object) the copy
touches, into one small int32 buffer on the pools' device (:class:`CheckWords`):

* saves: ``words[l, c]`` = the word of layer ``l`` of object ``c`` from the bytes written (every
  page of the object must be in the copy: a save writes whole objects). COMMIT sends them;
* restores: the buffer starts at ``-expected[l, c]`` and the copy adds the terms of every byte it
  READS from the flat buffer, so ``words[l, c] == 0`` exactly when layer ``l`` of object ``c``
  matched. The comparison is on the device; nothing waits for the host until a caller reads the
  result once per step (:meth:`CheckWords.mismatched`, or :meth:`CheckWords.readback` + a
  stream sync + :func:`mismatch_flags`). A restore that writes only some pages of an object lists the others as
  ``hash_only`` fragments: read and hashed, never written, so the object is still checked whole.

Shapes and units: ``objects`` int64 ``[n]`` (object column of fragment ``i``, ``0 <= c < C``),
``pages`` int64 ``[n]`` (page index ``j`` of fragment ``i`` inside its object: its first word is
at position ``j * block_bytes / 4``), ``expected`` uint32 ``[L, C]`` (restores), ``hash_only``
bool ``[n]`` (restores). Verified copies need pages of a multiple of 4 bytes (``ValueError``
otherwise, before anything moves); the Triton kernel also needs every run offset and length, the
block stride, both buffers' addresses and every flat offset a multiple of 4: a verified copy
that is not runs the torch engine instead (``page_copy.check_engine``; rare, slow, correct). Slices (``restore_slice``) are not verified
(``ValueError``). The copy engine does not hash: a verified copy runs the Triton kernel instead on
CUDA (``page_copy.check_engine``), the torch engine on CPU. The staged engine hashes in its
kernel half, from the staging slot in GPU memory (restores: the bytes the copy engine brought
from the flat buffer; saves: the pages it packs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from xkv.kernels import pinned
from xkv.kernels._arrays import first_occurrences
from xkv.kernels.checksum import check_page_bytes

__all__ = ["CheckWords", "Checks", "JobChecks", "validate_checks"]


@dataclass(frozen=True)
class Checks:
    """What a verified copy needs to know (see the module docstring for shapes)."""

    objects: object  # IndexLike [n]
    pages: object  # IndexLike [n]
    num_objects: int
    expected: object | None = None  # uint32 [L, C] (restores; required there)
    hash_only: object | None = None  # bool [n] (restores; None: every fragment is written)


class CheckWords:
    """The ``[L, C]`` int32 word buffer of one verified copy, on the pools' device.

    Saves: the words (read them after the copy: :meth:`host_words`). Restores: residuals, 0 where
    the bytes read matched (:meth:`mismatched`)."""

    def __init__(self, init: np.ndarray, device: torch.device, save: bool) -> None:
        self.save = save
        host = torch.from_numpy(np.ascontiguousarray(init).view(np.int32))
        if device.type != "cuda":
            self.words = host.clone()
            return
        # staged in the pinned pool: no page-locked allocation inside a copy step
        self.words = pinned.upload(host.numel(), torch.int32, device,
                                   lambda b: b.copy_(host.reshape(-1))).view(host.shape)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.words.shape)

    def readback(self) -> torch.Tensor:
        """Queue, on the current stream, the copy of the int32 ``[L, C]`` words to the host
        (restores: residuals, 0 where a layer of an object matched: :func:`mismatch_flags` gives
        the bool ``[C]``; saves: the words). Valid once the stream reached it (CPU: at once).
        No kernel runs, only the copy: a restore's flags are reduced on the host, since a torch
        reduction's CUDA kernel loads on its first use, which waited for the restore's copies
        (the H200's first checked restore: 17.7 ms). On CUDA it is a buffer of the pinned pool,
        returned to it when this tensor is dropped: copy what you keep (numpy views of it do
        not keep it)."""
        src = self.words
        if src.device.type != "cuda":
            return src.clone()
        # a buffer of the pinned pool (no allocation here: it would make the host wait for the
        # copies just queued); back to the pool once the caller dropped the result
        raw = pinned.pool().take(src.numel() * src.element_size())
        out = raw.view(src.dtype).view(src.shape)
        out.copy_(src, non_blocking=True)
        pinned.pool().give_when_collected(out, pinned.record_event())
        return out

    def mismatched(self) -> np.ndarray:
        """Restores: bool ``[C]``, True for every object whose bytes did not match (waits for
        the device)."""
        if self.save:
            raise ValueError("mismatched() is for restores; a save's words are host_words()")
        if self.words.numel() == 0:
            return np.zeros(self.words.shape[1], dtype=bool)
        return self.words.ne(0).any(0).cpu().numpy()

    def host_words(self) -> np.ndarray:
        """Saves: uint32 ``[L, C]`` (waits for the device)."""
        return self.words.cpu().numpy().view(np.uint32)


def mismatch_flags(words: np.ndarray) -> np.ndarray:
    """bool ``[C]``: True for every object some layer of which did not match, from a restore's
    int32 ``[L, C]`` residual words (:meth:`CheckWords.readback`, read on the host)."""
    w = np.asarray(words)
    if w.ndim != 2:
        raise ValueError(f"mismatch_flags: expected [L, C] words, got shape {w.shape}")
    return (w != 0).any(axis=0)


@dataclass
class JobChecks:
    """Validated checks of one job: per fragment its object column, page index, whether it is
    written (``store``) and hashed (``hashed``: False for a repeated (object, page)); ``rows[l]``: the buffer row of job layer ``l``; ``buf``: bound by the
    launcher (:meth:`bind`). A part (:meth:`layer`, :meth:`select`) shares its whole's buffer
    whichever of them binds first (``parent``): taken before the bind, it still adds its terms
    into the one buffer the whole reads."""

    objects: np.ndarray  # int64 [n]
    pages: np.ndarray  # int64 [n]
    store: np.ndarray  # bool [n]
    hashed: np.ndarray  # bool [n]
    num_objects: int
    init: np.ndarray  # uint32 [L, C]: -expected (restores) or 0 (saves)
    rows: list[int]
    buf: CheckWords | None = None
    aligned: bool = True  # every address, stride, run and offset a multiple of 4 (Triton can hash)
    parent: JobChecks | None = field(default=None, repr=False, compare=False)

    def bind(self, device: torch.device, save: bool) -> CheckWords:
        if self.buf is None:
            self.buf = (self.parent.bind(device, save) if self.parent is not None
                        else CheckWords(self.init, device, save))
        return self.buf

    def layer(self, k: int) -> JobChecks:
        """The checks of job layer ``k`` alone (same buffer, its row)."""
        return JobChecks(self.objects, self.pages, self.store, self.hashed, self.num_objects,
                         self.init, [self.rows[k]], self.buf, self.aligned, self)

    def select(self, layers: list[int], i0: int, i1: int) -> JobChecks:
        """The checks of fragments ``[i0, i1)`` of job layers ``layers`` (same buffer): a
        staged copy's chunk."""
        s = slice(i0, i1)
        return JobChecks(self.objects[s], self.pages[s], self.store[s], self.hashed[s],
                         self.num_objects, self.init, [self.rows[k] for k in layers], self.buf,
                         self.aligned, self)

    def table(self) -> np.ndarray:
        """int64 ``[3, n]``: object column, page index, flags (1: written, 2: hashed; the
        kernel's ``p_chk``)."""
        flags = self.store.astype(np.int64) | (self.hashed.astype(np.int64) << 1)
        return np.stack([self.objects, self.pages, flags])


def _index(x, name: str, n: int) -> np.ndarray:
    from xkv.kernels.jobs import as_index

    a = as_index(x, name)
    if a.shape != (n,):
        raise ValueError(f"checks.{name} must have shape ({n},), got {a.shape}")
    return a


def validate_checks(checks: Checks, *, L: int, n: int, save: bool, pools, flat,
                    flat_off: np.ndarray | None, sliced: bool) -> JobChecks:
    """``ValueError`` naming the value unless ``checks`` fits a copy of ``L`` layers x ``n``
    fragments of ``pools``/``flat`` (module docstring)."""
    if not isinstance(checks, Checks):
        raise ValueError(f"checks must be a xkv.kernels.Checks, got {type(checks).__name__}")
    if sliced:
        raise ValueError("checksums are not computed for slices (restore_slice): not verified")
    C = checks.num_objects
    if not isinstance(C, (int, np.integer)) or C < 0 or (n and C < 1):
        raise ValueError(f"checks.num_objects must be an int >= 1, got {C!r}")
    objects = _index(checks.objects, "objects", n)
    pages = _index(checks.pages, "pages", n)
    if n and (objects.min() < 0 or objects.max() >= C):
        raise ValueError(f"checks.objects out of range [0, {C}): {objects[:8].tolist()}")
    if n and pages.min() < 0:
        raise ValueError(f"checks.pages must be >= 0, got {pages[:8].tolist()}")
    aligned = flat.data_ptr() % 4 == 0 and not (
        flat_off is not None and flat_off.size and (flat_off % 4).any())
    if pools:
        p0 = pools[0]
        check_page_bytes(p0.block_bytes, f"page of {p0.describe()}")
        aligned = aligned and all(p.alignment % 4 == 0 for p in pools)
    if save:
        if checks.expected is not None or checks.hash_only is not None:
            raise ValueError("a save computes its words: checks.expected and hash_only are "
                             "for restores")
        store = np.ones(n, dtype=bool)
        init = np.zeros((L, C), dtype=np.uint32)
    else:
        if checks.expected is None:
            raise ValueError("a verified restore needs checks.expected (uint32 [L, C])")
        exp = np.asarray(checks.expected)
        if exp.shape != (L, C) or not np.issubdtype(exp.dtype, np.integer):
            raise ValueError(f"checks.expected must be integer [{L}, {C}], got {exp.dtype} "
                             f"{exp.shape}")
        if exp.size and (exp.min() < 0 or exp.max() > 0xFFFFFFFF):
            raise ValueError("checks.expected must hold uint32 words")
        init = (-exp.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)
        if checks.hash_only is None:
            store = np.ones(n, dtype=bool)
        else:
            ho = np.asarray(checks.hash_only)
            if ho.shape != (n,) or ho.dtype != np.bool_:
                raise ValueError(f"checks.hash_only must be bool [{n}], got {ho.dtype} {ho.shape}")
            store = ~ho
    hashed = np.ones(n, dtype=bool)
    if n:
        first = first_occurrences(objects * (int(pages.max()) + 1) + pages)
        hashed[:] = False
        hashed[first] = True
    return JobChecks(objects, pages, store, hashed, int(C), init, list(range(L)), None,
                     bool(aligned))
