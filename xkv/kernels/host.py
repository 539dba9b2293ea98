"""Host memory the GPU can read and write directly: pinned tensors and ``cudaHostRegister``.

``register_host`` page-locks an existing host buffer (e.g. the gateway's shared-memory card, mapped
with ``torch.frombuffer``) once, so kernels and the copy engine address it by its host pointer
(unified virtual addressing). On a machine without CUDA it is a no-op: the CPU path never needs it.

A buffer may be registered as several adjacent pieces (``register_host`` of slices: the connector
pins the card in segments so that letting go of it never holds the driver's lock for long,
``xkv.connector.card_pin``); a tensor spanning adjacent registered pieces counts as accessible, and
:func:`registered_ranges` lists the pieces inside a tensor.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np
import torch

__all__ = ["copy_bytes", "crossing", "is_host_accessible", "piece_boundaries", "register_host",
           "registered_ranges", "split_at", "unregister_host"]

_CUDA_HOST_REGISTER_DEFAULT = 0  # with UVA: mapped and portable, device pointer == host pointer
_lock = threading.Lock()
_registered: dict[int, int] = {}  # host address -> bytes
_spans: list[tuple[int, int]] = []  # registered [start, end) merged where adjacent, sorted
_bounds = np.zeros(0, dtype=np.uint64)  # where one registered piece ends and an adjacent one begins


def register_host(t: torch.Tensor) -> torch.Tensor:
    """Page-lock host tensor ``t`` for direct GPU access and return it (unchanged).

    Already pinned or registered tensors are returned as they are. Raises ``ValueError`` for a
    GPU tensor or a non-contiguous one, and ``RuntimeError`` if CUDA refuses.
    """
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ValueError(f"register_host needs a CPU tensor, got {getattr(t, 'device', type(t))}")
    if not t.is_contiguous():
        raise ValueError("register_host needs a contiguous tensor")
    if not torch.cuda.is_available() or t.numel() == 0:
        return t
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    with _lock:
        if _covered(ptr, nbytes) or _pinned_by_torch(t):
            return t
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_DEFAULT)
        if _err_code(err) != 0:
            raise RuntimeError(f"cudaHostRegister({ptr:#x}, {nbytes}) failed: {err}")
        _registered[ptr] = nbytes
        _merge()
    return t


def unregister_host(t: torch.Tensor) -> None:
    """Undo :func:`register_host` for the buffer starting at ``t.data_ptr()`` (no-op otherwise)."""
    if not torch.cuda.is_available():
        return
    ptr = t.data_ptr()
    with _lock:
        if _registered.pop(ptr, None) is None:
            return
        _merge()
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        if _err_code(err) != 0:
            raise RuntimeError(f"cudaHostUnregister({ptr:#x}) failed: {err}")


def is_host_accessible(t: torch.Tensor) -> bool:
    """True if the GPU can address CPU tensor ``t`` directly (pinned, or inside a registered range)."""
    if t.device.type != "cpu":
        return False
    nbytes = t.numel() * t.element_size()
    with _lock:
        return _covered(t.data_ptr(), nbytes) or _pinned_by_torch(t)


def registered_ranges(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(byte offset from t.data_ptr(), bytes)`` of every registered piece that lies inside
    ``t``'s bytes, in address order (``[]`` without CUDA or for a GPU tensor)."""
    if t.device.type != "cpu":
        return []
    ptr = t.data_ptr()
    end = ptr + t.numel() * t.element_size()
    with _lock:
        return sorted((a - ptr, n) for a, n in _registered.items() if ptr <= a and a + n <= end)


def piece_boundaries() -> np.ndarray:
    """Addresses (uint64, ascending) where one registered piece ends and an adjacent one begins.

    A kernel reads across them (each byte is registered), but one copy-engine copy must not
    cross one: on the H200 ``cuMemcpyBatchAsync`` refused a copy spanning two registrations
    (CUresult 1, 2026-12-03). Empty when every registration is alone (the card at once)."""
    with _lock:
        return _bounds


def _inside(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, b: np.ndarray) -> list:
    """Per side (source, then destination), the index range ``[lo, hi)`` of the boundaries
    ``b`` strictly inside each copy's range: the copy crosses them where ``hi > lo``."""
    return [(np.searchsorted(b, a, side="right"), np.searchsorted(b, a + sizes, side="left"))
            for a in (srcs, dsts)]


def _cut(inside: list) -> np.ndarray:
    """bool per copy of :func:`_inside`'s ranges: a boundary inside its source or destination."""
    (slo, shi), (dlo, dhi) = inside
    return (shi > slo) | (dhi > dlo)


def crossing(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
             bounds: np.ndarray) -> np.ndarray:
    """bool per copy: whether :func:`split_at` would cut it (a ``bounds`` address strictly inside
    its source or destination range)."""
    if bounds.size == 0 or sizes.size == 0:
        return np.zeros(sizes.shape, dtype=bool)
    return _cut(_inside(dsts, srcs, sizes, bounds.astype(dsts.dtype)))


def split_at(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
             bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies ``sizes[k]`` bytes ``srcs[k] -> dsts[k]`` (addresses, one dtype), cut so that no
    copy's source or destination range ``[a, a + size)`` has a ``bounds`` address strictly
    inside: the same bytes to the same places, a copy crossing ``j`` boundaries becoming ``j + 1``
    copies (appended after the uncut ones; a batch has no order). ``bounds`` ascending."""
    if bounds.size == 0 or sizes.size == 0:
        return dsts, srcs, sizes
    b = bounds.astype(dsts.dtype)
    inside = _inside(dsts, srcs, sizes, b)
    cut = _cut(inside)
    if not cut.any():
        return dsts, srcs, sizes
    keep = ~cut
    out_d, out_s, out_z = [dsts[keep]], [srcs[keep]], [sizes[keep]]
    for k in np.flatnonzero(cut):  # rare: a fragment over a piece boundary
        d, s, z = int(dsts[k]), int(srcs[k]), int(sizes[k])
        at = {int(x) - s for x in b[inside[0][0][k]:inside[0][1][k]]}
        at |= {int(x) - d for x in b[inside[1][0][k]:inside[1][1][k]]}
        edges = np.array([0, *sorted(at), z], dtype=np.int64)
        lo, n = edges[:-1], np.diff(edges)
        out_d.append((d + lo).astype(dsts.dtype))
        out_s.append((s + lo).astype(srcs.dtype))
        out_z.append(n.astype(sizes.dtype))
    return np.concatenate(out_d), np.concatenate(out_s), np.concatenate(out_z)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> None:
    """``dst.copy_(src, non_blocking)`` for two contiguous 1-D ``uint8`` tensors of one length,
    cut where either crosses a boundary between registered pieces.

    torch's own copy of a card slice spanning two registrations fails like the copy engine's
    ("invalid argument", H200 2026-12-03, ``test_card_pin``'s GPU test): every torch copy of card
    bytes that may cross a piece goes through here. One plain copy when nothing is cut."""
    n = src.numel()
    if dst.numel() != n or src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.dim() != 1 \
            or dst.dim() != 1 or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"copy_bytes takes two contiguous 1-D uint8 tensors of one length, got "
                         f"{tuple(dst.shape)} {dst.dtype} <- {tuple(src.shape)} {src.dtype}")
    bounds = piece_boundaries()
    if bounds.size == 0 or n == 0:
        dst.copy_(src, non_blocking=non_blocking)
        return
    d, s, z = split_at(np.array([dst.data_ptr()], dtype=np.uint64),
                       np.array([src.data_ptr()], dtype=np.uint64),
                       np.array([n], dtype=np.uint64), bounds)
    at_d, at_s = (d - dst.data_ptr()).tolist(), (s - src.data_ptr()).tolist()
    for a, b, size in zip(at_d, at_s, z.tolist(), strict=True):
        dst[a:a + size].copy_(src[b:b + size], non_blocking=non_blocking)


def _merge() -> None:
    """Rebuild ``_spans`` and ``_bounds`` (under ``_lock``): registrations change rarely, checks
    are per copy."""
    global _bounds
    spans: list[list[int]] = []
    bounds: list[int] = []
    for a, n in sorted(_registered.items()):
        if spans and spans[-1][1] == a:
            spans[-1][1] = a + n
            bounds.append(a)
        else:
            spans.append([a, a + n])
    _spans[:] = [(a, b) for a, b in spans]
    _bounds = np.array(bounds, dtype=np.uint64)


def _covered(ptr: int, nbytes: int) -> bool:
    """``[ptr, ptr + nbytes)`` lies inside one span of adjacent registered pieces."""
    i = bisect.bisect_right(_spans, (ptr, float("inf"))) - 1
    return i >= 0 and _spans[i][0] <= ptr and ptr + nbytes <= _spans[i][1]


def _pinned_by_torch(t: torch.Tensor) -> bool:
    """torch says ``t`` is page-locked, and that answer holds for ``t``'s own bytes (under ``_lock``).

    ``Tensor.is_pinned`` asks the driver about the tensor's *storage base*, not its bytes: a slice
    of a card registered in pieces reads as pinned once the first piece is. Trusting it skipped
    every piece after the first, and a kernel faulted on the first unregistered byte ("illegal
    memory access" on the H200, 2026-12-03, ``bench/card_pieces_probe.py``). So the answer counts
    only where the base is not one of our registrations (then our ranges decide): memory from
    torch's pinned allocator, which is page-locked as a whole.
    """
    if _covered(t.untyped_storage().data_ptr(), 1):
        return False
    try:
        return bool(t.is_pinned())
    except RuntimeError:
        return False


def _err_code(err: object) -> int:
    return int(getattr(err, "value", err))
