"""Batched copy-engine (DMA) path: one ``cuMemcpyBatchAsync`` for a whole list of fragments.

The copy engine costs no SMs, so beside a running model it is the least intrusive way to move
large fragments; below ~28-64 KiB its per-copy cost loses to an SM kernel. :func:`calibrate`
measures where the crossover is on this GPU, once, and ``engine="auto"`` follows it.

The entry point is resolved with ``cuGetProcAddress(..., 12080)``: the CUDA 12.8 signature (with
``failIdx``) that every driver since 12.8 keeps serving, whatever the driver's own version.

:func:`plan` turns a validated job into its fragment plan (one address triple per run of every
fragment, numpy, host only); :func:`run` executes a job as one batch on the current stream.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from xkv.kernels import host
from xkv.kernels.jobs import Job

__all__ = ["available", "batch_copy", "plan", "run", "runner", "side_stream"]

_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _CUmemLocation),
        ("dstLocHint", _CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


_BATCH_FN_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)

_lock = threading.Lock()
_fn = None
_resolved = False
_side_streams: dict[tuple[int, str], torch.cuda.Stream] = {}


def _resolve():
    global _fn, _resolved
    with _lock:
        if _resolved:
            return _fn
        _resolved = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        pfn = ctypes.c_void_p()
        name = b"cuMemcpyBatchAsync"
        # both take (name, &fn, version, flags); _v2 adds a symbol-status out-argument
        args = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64]
        call = [name, ctypes.byref(pfn), 12080, 0]
        if hasattr(lib, "cuGetProcAddress_v2"):
            get = lib.cuGetProcAddress_v2
            args.append(ctypes.c_void_p)
            call.append(ctypes.byref(ctypes.c_int(0)))
        elif hasattr(lib, "cuGetProcAddress"):
            get = lib.cuGetProcAddress
        else:
            return None
        get.argtypes = args
        rc = get(*call)
        if rc != 0 or not pfn.value:
            return None
        _fn = _BATCH_FN_TYPE(pfn.value)
        return _fn


def available() -> bool:
    """True when the driver offers ``cuMemcpyBatchAsync`` (CUDA >= 12.8) and a GPU is present."""
    return torch.cuda.is_available() and _resolve() is not None


def batch_copy(
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    *,
    device: torch.device,
    src_is_host: bool,
    stream: torch.cuda.Stream | None = None,
    presplit: bool = False,
) -> None:
    """Copy ``sizes[k]`` bytes from address ``srcs[k]`` to ``dsts[k]`` for every k, on the current
    stream of ``device`` (or ``stream``, a non-default one), as one batch. Addresses are device pointers or (UVA) pinned host pointers.

    A host source that nothing on the GPU writes may be read out of stream order
    (``SRC_ACCESS_ORDER_ANY``, faster); a device source keeps stream order, since the model may
    still be writing it. A copy over the boundary of two registered pieces of host memory (a card
    pinned in segments) is cut there (``host.split_at``): the driver refuses one copy spanning two.
    ``presplit``: the caller passes contiguous uint64 arrays already cut so (the staged restore's
    plan, :func:`~xkv.kernels.staged_restore.absolute_ranges`): no conversion or cut per call.
    """
    fn = _resolve()
    if fn is None:
        raise RuntimeError("cuMemcpyBatchAsync is not available (needs a CUDA 12.8+ driver)")
    if int(sizes.size) == 0:
        return
    if presplit:
        d, s, z = dsts, srcs, sizes
        if not all(a.dtype == np.uint64 and a.flags.c_contiguous for a in (d, s, z)):
            raise ValueError("presplit copies take contiguous uint64 arrays")
    else:
        d, s, z = host.split_at(np.ascontiguousarray(dsts, dtype=np.uint64),
                                np.ascontiguousarray(srcs, dtype=np.uint64),
                                np.ascontiguousarray(sizes, dtype=np.uint64),
                                host.piece_boundaries())
    count = int(z.size)
    attrs = _CUmemcpyAttributes(
        srcAccessOrder=_CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        if src_is_host
        else _CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    )
    attr_idx = ctypes.c_size_t(0)
    fail_idx = ctypes.c_size_t(0)
    cur = torch.cuda.current_stream(device) if stream is None else stream
    stream = cur
    if cur.cuda_stream == 0:  # the batch API refuses the legacy NULL stream: hop to a side stream
        stream = side_stream(device)
        stream.wait_stream(cur)
    with torch.cuda.device(device):
        rc = fn(
            d.ctypes.data,
            s.ctypes.data,
            z.ctypes.data,
            count,
            ctypes.addressof(attrs),
            ctypes.addressof(attr_idx),
            1,
            ctypes.addressof(fail_idx),
            stream.cuda_stream,
        )
    if rc != 0:
        raise RuntimeError(
            f"cuMemcpyBatchAsync failed: CUresult {rc} at copy {fail_idx.value} of {count}"
        )
    if stream is not cur:
        cur.wait_stream(stream)


def side_stream(device: torch.device, purpose: str = "batch") -> torch.cuda.Stream:
    """One copy stream per device and purpose (``"h2d"``, ``"d2h"``, ``"batch"``), so copies in the
    two directions never queue behind each other."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        st = _side_streams.get((idx, purpose))
        if st is None:
            st = _side_streams[(idx, purpose)] = torch.cuda.Stream(device=idx)
        return st


def plan(job: Job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(destination addresses, source addresses, sizes), uint64, of every run of every fragment
    of ``job`` (slices clipped to ``[lo, hi)``, empty pieces dropped)."""
    n, bb = job.n, job.block_bytes
    offs = job.flat_offsets()  # [L, n]
    fptr = np.uint64(job.flat.data_ptr())
    srcs, dsts, sizes = [], [], []
    for layer, pool in enumerate(job.pools):
        runs = np.array(pool.runs, dtype=np.int64).reshape(-1, 2)
        cum = np.concatenate([[0], np.cumsum(runs[:, 1])[:-1]])
        pool_addr = pool.data_ptr + job.ids[:, None] * pool.block_stride + runs[None, :, 0]  # [n, R]
        flat_addr = offs[layer][:, None] + cum[None, :]
        size = np.broadcast_to(runs[None, :, 1], pool_addr.shape).copy()
        if job.sliced:
            pos = (layer * n + np.arange(n))[:, None] * bb + cum[None, :]
            a = np.clip(job.lo - pos, 0, size)
            b = np.clip(job.hi - pos, 0, size)
            pool_addr, flat_addr, size = pool_addr + a, flat_addr + a, b - a
        keep = size.ravel() > 0
        p = pool_addr.ravel()[keep].astype(np.uint64)
        f = flat_addr.ravel()[keep].astype(np.uint64) + fptr
        z = size.ravel()[keep].astype(np.uint64)
        (srcs, dsts) = (srcs + [p], dsts + [f]) if job.save else (srcs + [f], dsts + [p])
        sizes.append(z)
    return np.concatenate(dsts), np.concatenate(srcs), np.concatenate(sizes)


def runner(job: Job):
    """A closure that issues ``job`` as one batch (the plan built once, here)."""
    dsts, srcs, sizes = plan(job)
    dev = job.pools[0].device
    src_is_host = (not job.save) and job.flat.device.type == "cpu"
    return lambda: batch_copy(dsts, srcs, sizes, device=dev, src_is_host=src_is_host)


def run(job: Job) -> None:
    """Execute ``job`` with the copy engine on the current stream (no SMs)."""
    runner(job)()
