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

import torch

__all__ = ["is_host_accessible", "register_host", "registered_ranges", "unregister_host"]

_CUDA_HOST_REGISTER_DEFAULT = 0  # with UVA: mapped and portable, device pointer == host pointer
_lock = threading.Lock()
_registered: dict[int, int] = {}  # host address -> bytes
_spans: list[tuple[int, int]] = []  # registered [start, end) merged where adjacent, sorted


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
        if _covered(ptr, nbytes) or t.is_pinned():
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
        if _covered(t.data_ptr(), nbytes):
            return True
    try:
        return bool(t.is_pinned())
    except RuntimeError:
        return False


def registered_ranges(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(byte offset from t.data_ptr(), bytes)`` of every registered piece that lies inside
    ``t``'s bytes, in address order (``[]`` without CUDA or for a GPU tensor)."""
    if t.device.type != "cpu":
        return []
    ptr = t.data_ptr()
    end = ptr + t.numel() * t.element_size()
    with _lock:
        return sorted((a - ptr, n) for a, n in _registered.items() if ptr <= a and a + n <= end)


def _merge() -> None:
    """Rebuild ``_spans`` (under ``_lock``): registrations change rarely, checks are per copy."""
    spans: list[list[int]] = []
    for a, n in sorted(_registered.items()):
        if spans and spans[-1][1] == a:
            spans[-1][1] = a + n
        else:
            spans.append([a, a + n])
    _spans[:] = [(a, b) for a, b in spans]


def _covered(ptr: int, nbytes: int) -> bool:
    """``[ptr, ptr + nbytes)`` lies inside one span of adjacent registered pieces."""
    i = bisect.bisect_right(_spans, (ptr, float("inf"))) - 1
    return i >= 0 and _spans[i][0] <= ptr and ptr + nbytes <= _spans[i][1]


def _err_code(err: object) -> int:
    return int(getattr(err, "value", err))
