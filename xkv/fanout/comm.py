"""The byte exchange of a fan-out group: an in-place all-gather of raw bytes, plus a host-side
agreement (every rank OK?) issued before any collective of a batch.

Backends behind one small interface (``Exchanger``):
- ``LocalExchanger``: group of one (no communicator is ever created), or ``virtual=True``: one
  process plays every rank and copies all shares itself (single-GPU tests of the layout);
- ``NcclExchanger``: NCCL through ctypes over the ``libnccl.so.2`` torch already loaded (from the
  ``nvidia-nccl-cu12``/``-cu13`` wheel); never a second NCCL;
- ``PyncclExchanger``: adapter over vLLM's TP ``PyNcclCommunicator`` (group == whole TP group);
- ``TorchExchanger``: ``torch.distributed`` (gloo for CPU tests).
All-gathers run on the current (compute) stream. ``agree`` runs on the TP CPU (gloo) group so
that every TP rank, also one in a group of its own, takes part in the same host collectives.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

NCCL_MIN_VERSION = 21900  # 2.19: in-place all-gather and the calls below are stable since long
_NCCL_UINT8 = 1


class ExchangeError(RuntimeError):
    """The exchange backend failed (library missing, init or collective error)."""


def _check_buf(buf: torch.Tensor, share: int, size: int) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"exchange buffer must be a contiguous 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    if share < 0 or buf.numel() < share * size:
        raise ValueError(f"exchange buffer of {buf.numel()} bytes cannot hold {size} shares of {share} bytes")


def agree(cpu_group: Any, ok: bool) -> bool:
    """True iff ``ok`` on every rank of ``cpu_group`` (the TP CPU group; None: the default group).
    A host collective: every rank must call it at the same point. The one "every rank OK?" of
    the fan-out: set-up steps (``build_restorer``, ``NcclExchanger.create``) and each batch."""
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group)
    return bool(flag.item())


class Exchanger:
    """Interface. ``size``: ranks in the group; ``rank``: this process's index in it."""

    size: int = 1
    rank: int = 0
    #: True when this process copies every share itself (no exchange needed)
    copies_all_shares: bool = False

    def __init__(self, cpu_group: Any = None, agree_with_peers: bool = False) -> None:
        self._cpu_group = cpu_group
        self._agree_with_peers = agree_with_peers

    def all_gather_inplace(self, buf: torch.Tensor, share: int) -> None:
        """``buf[r*share:(r+1)*share]`` of every rank ``r`` ends up in ``buf[:size*share]`` of all."""
        raise ExchangeError(f"{type(self).__name__} cannot exchange")

    def agree(self, ok: bool) -> bool:
        """True iff ``ok`` on every TP rank (host collective over the TP CPU group; every TP rank
        calls it at the same point, including ranks that exchange with nobody)."""
        if not self._agree_with_peers:
            return bool(ok)
        return agree(self._cpu_group, ok)

    def close(self) -> None:
        return None


class LocalExchanger(Exchanger):
    """No communicator. ``size`` > 1 only with ``virtual=True`` (one process copies all shares)."""

    def __init__(self, size: int = 1, *, virtual: bool = False, cpu_group: Any = None,
                 agree_with_peers: bool = False) -> None:
        super().__init__(cpu_group, agree_with_peers)
        if size < 1 or (size > 1 and not virtual):
            raise ValueError(f"LocalExchanger(size={size}, virtual={virtual}): size > 1 needs virtual=True")
        self.size = size
        self.rank = 0
        self.copies_all_shares = virtual

    def all_gather_inplace(self, buf: torch.Tensor, share: int) -> None:
        _check_buf(buf, share, self.size)  # every share is already in place


class TorchExchanger(Exchanger):
    """``torch.distributed`` all-gather over ``pg`` (gloo on CPU in tests, NCCL process groups)."""

    def __init__(self, pg: Any, size: int, rank: int, *, cpu_group: Any = None,
                 agree_with_peers: bool = True) -> None:
        super().__init__(cpu_group, agree_with_peers)
        self._pg, self.size, self.rank = pg, size, rank

    def all_gather_inplace(self, buf: torch.Tensor, share: int) -> None:
        import torch.distributed as dist

        _check_buf(buf, share, self.size)
        out = buf[: self.size * share]
        mine = out[self.rank * share:(self.rank + 1) * share]
        if buf.device.type == "cpu":
            mine = mine.clone()  # gloo makes no promise about aliased input/output
            dist.all_gather(list(out.chunk(self.size)) if share else [out[:0]] * self.size, mine, group=self._pg)
        else:
            dist.all_gather_into_tensor(out, mine, group=self._pg)


class PyncclExchanger(Exchanger):
    """Adapter over vLLM's ``PyNcclCommunicator`` of the TP group (no extra communicator)."""

    def __init__(self, comm: Any, size: int, rank: int, *, cpu_group: Any = None) -> None:
        super().__init__(cpu_group, agree_with_peers=True)
        if getattr(comm, "disabled", False):
            raise ExchangeError("vLLM's TP PyNcclCommunicator is disabled")
        self._comm, self.size, self.rank = comm, size, rank

    def all_gather_inplace(self, buf: torch.Tensor, share: int) -> None:
        _check_buf(buf, share, self.size)
        out = buf[: self.size * share]
        self._comm.all_gather(out, out[self.rank * share:(self.rank + 1) * share],
                              stream=torch.cuda.current_stream(buf.device))


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def uid_to_bytes(uid: _UniqueId) -> bytes:
    """The 128 raw bytes of an ``ncclUniqueId`` (c_byte is signed: never go through ints)."""
    return ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))


def uid_from_bytes(raw: bytes) -> _UniqueId:
    if len(raw) != ctypes.sizeof(_UniqueId):
        raise ValueError(f"an ncclUniqueId is {ctypes.sizeof(_UniqueId)} bytes, got {len(raw)}")
    uid = _UniqueId()
    ctypes.memmove(ctypes.addressof(uid), raw, len(raw))
    return uid


def _nccl_candidates() -> list[str]:
    out = [p for p in (os.environ.get("XKV_NCCL_SO_PATH"), os.environ.get("VLLM_NCCL_SO_PATH")) if p]
    out.append("libnccl.so.2")  # by soname: the copy torch already loaded
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        out.append(str(Path(root) / "nccl" / "lib" / "libnccl.so.2"))
    return out


class NcclLib:
    """The handful of NCCL entry points fan-out needs, through ctypes."""

    def __init__(self) -> None:
        errors = []
        for cand in _nccl_candidates():
            try:
                self._lib = ctypes.CDLL(cand)
                self.path = cand
                break
            except OSError as e:
                errors.append(f"{cand}: {e}")
        else:
            raise ExchangeError("libnccl.so.2 not found (torch's nvidia-nccl wheel): " + "; ".join(errors))
        L = self._lib
        L.ncclGetErrorString.restype = ctypes.c_char_p
        L.ncclGetErrorString.argtypes = [ctypes.c_int]
        L.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        L.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        L.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        L.ncclAllGather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_void_p]
        L.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        L.ncclCommAbort.argtypes = [ctypes.c_void_p]
        v = ctypes.c_int()
        self._check(L.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value
        if self.version < NCCL_MIN_VERSION:
            raise ExchangeError(f"NCCL {self.version} at {self.path} is older than {NCCL_MIN_VERSION}")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise ExchangeError(f"{what} failed: NCCL error {rc} ({self._lib.ncclGetErrorString(rc).decode()})")

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid_to_bytes(uid)

    def init_rank(self, size: int, uid: bytes, rank: int) -> ctypes.c_void_p:
        u = uid_from_bytes(uid)
        comm = ctypes.c_void_p()
        self._check(self._lib.ncclCommInitRank(ctypes.byref(comm), size, u, rank), "ncclCommInitRank")
        return comm

    def all_gather(self, send: int, recv: int, count: int, comm: Any, stream: int) -> None:
        self._check(self._lib.ncclAllGather(send, recv, count, _NCCL_UINT8, comm, stream), "ncclAllGather")

    def destroy(self, comm: Any) -> None:
        self._check(self._lib.ncclCommDestroy(comm), "ncclCommDestroy")


class NcclExchanger(Exchanger):
    """A dedicated NCCL communicator for one fan-out group (``members`` = its TP ranks).

    Build it with ``NcclExchanger.create`` on every TP rank (the unique ids travel over the TP
    CPU group, so ranks outside any group take part too and get ``None``).
    """

    def __init__(self, lib: NcclLib, comm: Any, size: int, rank: int, device: torch.device,
                 cpu_group: Any) -> None:
        super().__init__(cpu_group, agree_with_peers=True)
        self._lib, self._comm, self.size, self.rank, self.device = lib, comm, size, rank, device

    @classmethod
    def create(cls, partition: tuple[tuple[int, ...], ...], tp_rank: int, tp_size: int,
               device: torch.device, cpu_group: Any = None, lib: NcclLib | None = None) -> NcclExchanger | None:
        import torch.distributed as dist

        group = next(g for g in partition if tp_rank in g)
        lead = len(group) > 1 and group[0] == tp_rank
        mine = torch.zeros(128, dtype=torch.uint8)
        error = None
        try:  # local steps first; every rank learns whether all of them worked before the uid exchange
            if lib is None and len(group) > 1:
                lib = NcclLib()
            if lead:
                mine[:] = torch.tensor(list(lib.unique_id()), dtype=torch.uint8)
        except Exception as e:
            error = e
        if not agree(cpu_group, error is None):
            raise ExchangeError(f"NCCL unavailable on this rank: {error}" if error else
                                "NCCL unavailable on another TP rank")
        uids = [torch.zeros(128, dtype=torch.uint8) for _ in range(tp_size)]
        dist.all_gather(uids, mine, group=cpu_group)
        if len(group) == 1:
            return None
        uid = bytes(uids[group[0]].tolist())
        with torch.cuda.device(device):
            comm = lib.init_rank(len(group), uid, group.index(tp_rank))
        return cls(lib, comm, len(group), group.index(tp_rank), device, cpu_group)

    def all_gather_inplace(self, buf: torch.Tensor, share: int) -> None:
        _check_buf(buf, share, self.size)
        if buf.device != self.device:
            raise ValueError(f"buffer on {buf.device}, communicator on {self.device}")
        if share == 0:
            return
        base = buf.data_ptr()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._lib.all_gather(base + self.rank * share, base, share, self._comm, stream)

    def close(self) -> None:
        if self._comm is not None:
            comm, self._comm = self._comm, None
            self._lib.destroy(comm)
