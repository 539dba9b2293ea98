"""NVLink groups of the TP ranks, found through NVML and keyed by GPU UUID.

NVML numbers GPUs in physical (PCI) order and ignores ``CUDA_VISIBLE_DEVICES``; CUDA ordinals
are relative to that variable, which may also hold UUIDs. So every rank names its GPU by UUID
(``torch.cuda.get_device_properties(d).uuid``, or ``CUDA_VISIBLE_DEVICES`` resolved through NVML
when torch cannot say), TP rank 0 looks the UUIDs up in NVML, builds the partition and broadcasts
it, and every rank holds the identical partition.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from xkv.fanout.config import FanoutConfig
from xkv.fanout.eligibility import Reason

_UUID_BYTES = 96
_PARTITION_BYTES = 16384


class TopologyError(RuntimeError):
    """NVML could not be used or did not know a GPU."""


class Nvml(Protocol):
    def device_count(self) -> int: ...
    def handle_by_index(self, index: int) -> Any: ...
    def handle_by_uuid(self, uuid: str) -> Any: ...
    def uuid(self, handle: Any) -> str: ...
    def nvlink_ok(self, a: Any, b: Any) -> bool: ...


class _PynvmlBackend:
    def __init__(self, pynvml: Any) -> None:
        self._n = pynvml
        pynvml.nvmlInit()

    def device_count(self) -> int:
        return int(self._n.nvmlDeviceGetCount())

    def handle_by_index(self, index: int) -> Any:
        return self._n.nvmlDeviceGetHandleByIndex(index)

    def handle_by_uuid(self, uuid: str) -> Any:
        return self._n.nvmlDeviceGetHandleByUUID(uuid.encode())  # bytes: old and new pynvml

    def uuid(self, handle: Any) -> str:
        u = self._n.nvmlDeviceGetUUID(handle)
        return u.decode() if isinstance(u, bytes) else str(u)

    def nvlink_ok(self, a: Any, b: Any) -> bool:
        # NVML_P2P_CAPS_INDEX_NVLINK (2); NVML_P2P_CAPS_INDEX_READ is a tuple in some pynvml releases
        status = self._n.nvmlDeviceGetP2PStatus(a, b, self._n.NVML_P2P_CAPS_INDEX_NVLINK)
        return status == self._n.NVML_P2P_STATUS_OK


class _CtypesNvml:
    """The few NVML calls we need, straight from libnvidia-ml.so.1 (no pynvml installed)."""

    _P2P_CAPS_INDEX_NVLINK = 2
    _P2P_STATUS_OK = 0

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise TopologyError(f"libnvidia-ml.so.1 not found: {e}") from e
        self._call("nvmlInit_v2")

    def _call(self, name: str, *args: Any) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != 0:
            raise TopologyError(f"NVML {name} failed with status {rc}")

    def device_count(self) -> int:
        n = ctypes.c_uint()
        self._call("nvmlDeviceGetCount_v2", ctypes.byref(n))
        return n.value

    def handle_by_index(self, index: int) -> Any:
        h = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(h))
        return h

    def handle_by_uuid(self, uuid: str) -> Any:
        h = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByUUID", ctypes.c_char_p(uuid.encode()), ctypes.byref(h))
        return h

    def uuid(self, handle: Any) -> str:
        buf = ctypes.create_string_buffer(96)
        self._call("nvmlDeviceGetUUID", handle, buf, ctypes.c_uint(96))
        return buf.value.decode()

    def nvlink_ok(self, a: Any, b: Any) -> bool:
        st = ctypes.c_int()
        self._call("nvmlDeviceGetP2PStatus", a, b, ctypes.c_int(self._P2P_CAPS_INDEX_NVLINK), ctypes.byref(st))
        return st.value == self._P2P_STATUS_OK


def open_nvml() -> Nvml:
    """pynvml (nvidia-ml-py) when importable, else ctypes; raises ``TopologyError``."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return _CtypesNvml()
    try:
        return _PynvmlBackend(pynvml)
    except Exception as e:  # pynvml.NVMLError and friends
        raise TopologyError(f"NVML init failed: {e}") from e


def normalise_uuid(uuid: str) -> str:
    u = str(uuid).strip()
    return u if u.startswith(("GPU-", "MIG-")) else "GPU-" + u


def local_gpu_uuid(logical_index: int, *, torch_uuid: str | None = None,
                   env: Mapping[str, str] | None = None, nvml: Nvml | None = None) -> str:
    """UUID (``GPU-...``) of CUDA device ``logical_index`` of this process.

    ``torch_uuid`` (from ``torch.cuda.get_device_properties``) wins. Otherwise the entry of
    ``CUDA_VISIBLE_DEVICES`` is resolved through NVML: an integer is an NVML (physical) index, a
    ``GPU-`` entry may be a unique UUID prefix; MIG instances are refused.
    """
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible is not None else None
    entry = entries[logical_index] if entries is not None and logical_index < len(entries) else None
    if (entry or "").startswith("MIG-") or (torch_uuid or "").startswith("MIG-"):
        raise TopologyError(f"CUDA device {logical_index} is a MIG instance ({entry or torch_uuid}); fan-out needs whole GPUs")
    if torch_uuid:
        return normalise_uuid(torch_uuid)
    if nvml is None:
        raise TopologyError("no GPU UUID from torch and no NVML to resolve CUDA_VISIBLE_DEVICES")
    if entries is None:
        physical: int | str = logical_index
    elif entry is None or entry == "":
        raise TopologyError(f"CUDA_VISIBLE_DEVICES={visible!r} has no entry for CUDA device {logical_index}")
    elif entry.isdigit():
        physical = int(entry)
    else:
        physical = entry
    if isinstance(physical, int):
        return nvml.uuid(nvml.handle_by_index(physical))
    prefix = normalise_uuid(physical)
    matches = [u for u in (nvml.uuid(nvml.handle_by_index(i)) for i in range(nvml.device_count()))
               if u.startswith(prefix)]
    if len(matches) != 1:
        raise TopologyError(f"CUDA_VISIBLE_DEVICES entry {physical!r} matches {len(matches)} NVML GPUs; expected 1")
    return matches[0]


def nvlink_matrix(uuids: Sequence[str], nvml: Nvml) -> list[list[bool]]:
    """``m[i][j]``: GPUs ``i`` and ``j`` are NVLink peers. A UUID NVML does not know (another
    host) is nobody's peer. Same UUID twice (two ranks on one GPU) is not a peer either."""
    handles: list[Any] = []
    for u in uuids:
        try:
            handles.append(nvml.handle_by_uuid(normalise_uuid(u)))
        except Exception:
            handles.append(None)
    n = len(uuids)
    m = [[False] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            if handles[i] is None or handles[j] is None or uuids[i] == uuids[j]:
                continue
            ok = bool(nvml.nvlink_ok(handles[i], handles[j]))
            m[i][j] = m[j][i] = ok
    return m


def clique_partition(matrix: Sequence[Sequence[bool]]) -> list[tuple[int, ...]]:
    """Greedy partition into NVLink cliques in rank order (NVSwitch: one group; bridges: pairs)."""
    n = len(matrix)
    left = list(range(n))
    groups: list[tuple[int, ...]] = []
    while left:
        g = [left.pop(0)]
        for j in list(left):
            if all(matrix[j][k] for k in g):
                g.append(j)
                left.remove(j)
        groups.append(tuple(g))
    return groups


def partition_for(config: FanoutConfig, uuids: Sequence[str],
                  nvml_factory: Any = open_nvml) -> tuple[list[tuple[int, ...]], Reason, str]:
    """Partition of TP ranks ``0..len(uuids)-1`` into fan-out groups, and why it is what it is.

    Explicit groups are checked against NVML when NVML answers (a pair without NVLink refuses);
    an NVML failure with explicit groups trusts the user (the warm-up probe still checks speed).
    """
    n = len(uuids)
    explicit = config.explicit_groups(n)
    try:
        nvml = nvml_factory()
        matrix = nvlink_matrix(uuids, nvml)
    except Exception as e:
        if explicit is None:
            return [(r,) for r in range(n)], Reason.TOPOLOGY, f"NVML: {e}"
        matrix = None
    if explicit is None:
        groups = clique_partition(matrix)
    else:
        listed = {r for g in explicit for r in g}
        groups = sorted(list(explicit) + [(r,) for r in range(n) if r not in listed])
        for g in groups:
            for a in g:
                for b in g:
                    if matrix is not None and a < b and not matrix[a][b]:
                        return [(r,) for r in range(n)], Reason.NO_NVLINK, \
                            f"nvlink_fanout_groups puts TP ranks {a} and {b} together, but NVML reports no NVLink between them"
    if all(len(g) == 1 for g in groups):
        return groups, Reason.NO_NVLINK, f"{n} TP ranks, GPUs {list(uuids)}"
    return groups, Reason.OK, ""


@dataclass(frozen=True)
class GroupAssignment:
    partition: tuple[tuple[int, ...], ...]
    reason: Reason
    detail: str
    tp_rank: int

    @property
    def group(self) -> tuple[int, ...]:
        return next(g for g in self.partition if self.tp_rank in g)

    @property
    def index(self) -> int:
        return self.group.index(self.tp_rank)


def resolve_groups(config: FanoutConfig, tp_rank: int, tp_size: int, my_uuid: str, *,
                   cpu_group: Any = None, nvml_factory: Any = open_nvml) -> GroupAssignment:
    """Collective over the TP CPU (gloo) group: gather every rank's UUID, let TP rank 0 decide,
    broadcast. Every TP rank must call it. ``cpu_group=None``: the default process group."""
    import torch
    import torch.distributed as dist

    # fixed-size byte tensors, no pickled objects on the wire
    mine = torch.zeros(_UUID_BYTES, dtype=torch.uint8)
    raw = my_uuid.encode()[:_UUID_BYTES]
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    gathered = [torch.zeros(_UUID_BYTES, dtype=torch.uint8) for _ in range(tp_size)]
    dist.all_gather(gathered, mine, group=cpu_group)
    uuids = [bytes(t.tolist()).rstrip(b"\0").decode() for t in gathered]
    box = torch.zeros(_PARTITION_BYTES, dtype=torch.uint8)
    if tp_rank == 0:
        try:
            groups, reason, detail = partition_for(config, uuids, nvml_factory)
        except Exception as e:  # never leave the other ranks waiting in the broadcast
            groups, reason, detail = [(r,) for r in range(tp_size)], Reason.TOPOLOGY, str(e)
        msg = json.dumps({"groups": [list(g) for g in groups], "reason": reason.name,
                          "detail": detail[:1024]}).encode()
        if len(msg) > _PARTITION_BYTES:
            msg = json.dumps({"groups": [[r] for r in range(tp_size)], "reason": Reason.TOPOLOGY.name,
                              "detail": "partition too large to broadcast"}).encode()
        box[: len(msg)] = torch.tensor(list(msg), dtype=torch.uint8)
    src = dist.get_global_rank(cpu_group, 0) if cpu_group is not None else 0
    dist.broadcast(box, src=src, group=cpu_group)
    got = json.loads(bytes(box.tolist()).rstrip(b"\0").decode())
    partition = tuple(tuple(int(r) for r in g) for g in got["groups"])
    return GroupAssignment(partition, Reason[got["reason"]], got["detail"], tp_rank)
