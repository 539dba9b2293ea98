"""Commits of saved chunks, sent once the save copies' fence completed: one :class:`SaveBatch`
per step and rank (which objects to COMMIT or ABORT, with their checksum words), and the
:class:`Committer` thread that waits for each batch's fence and sends it (``xkv.connector.saves``
decides the batches; a failed wait aborts the batch: torn bytes are never published).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xkv.gateway.client import ChunkRef

log = logging.getLogger("xkv.connector")


@dataclass
class SaveBatch:
    """One step's save decisions on one rank: ``items[(group, shard, commit?)]`` = the objects
    (``ChunkRef``: key and COMMIT/ABORT token), the request id of each job (for log lines) and,
    with checksums, a function giving each key's COMMIT words (called once the fence passed)."""

    items: dict[tuple[int, int, bool], list[tuple[list[ChunkRef], str, Any]]] = field(
        default_factory=dict)

    def add(self, group: int, shard: int, ok: bool, keys: list[ChunkRef], req_id: str,
            words: Callable[[], list[bytes]] | None = None) -> None:
        if keys:
            self.items.setdefault((group, shard, ok), []).append(
                (list(keys), req_id, words if ok else None))

    def __bool__(self) -> bool:
        return bool(self.items)

    def num_keys(self) -> int:
        return sum(len(k) for v in self.items.values() for k, _, _ in v)

    def as_aborts(self) -> SaveBatch:
        """The same keys, every one to be aborted (its bytes are not known to be complete)."""
        out = SaveBatch()
        for (g, shard, _), jobs in self.items.items():
            for keys, req, _ in jobs:
                out.add(g, shard, False, keys, req)
        return out



class Committer:
    """Sends each :class:`SaveBatch` once its fence completed (see the module docstring).

    ``send(batch)`` does the gateway calls and must not raise for gateway errors (it counts them).
    """

    def __init__(self, send: Callable[[SaveBatch], None], name: str = "xkv-commit"):
        self._send = send
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[tuple[Any, SaveBatch]] = deque()
        self._pending = 0  # batches queued or being sent
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fence: Any, batch: SaveBatch) -> None:
        """Send ``batch`` after ``fence`` (an object with ``synchronize()``) completed; ``None``:
        now, on this thread."""
        if not batch:
            return
        if fence is None or self._closed:
            if fence is not None:  # closing: no thread would send it later
                batch = self._wait(fence, batch)
            self._send(batch)
            return
        with self._cv:
            self._queue.append((fence, batch))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    @property
    def pending(self) -> int:
        """Batches submitted with a fence and not yet sent."""
        with self._cv:
            return self._pending

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted batch was sent; False if ``timeout_s`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Send what is queued (waiting on each fence), stop the thread; False on timeout."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            t = self._thread
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():
                log.warning("xkv: %d save commit batch(es) still waiting at shutdown; the "
                            "gateway's write TTL frees their slots", self.pending)
                return False
        return True

    def _wait(self, fence: Any, batch: SaveBatch) -> SaveBatch:
        try:
            fence.synchronize()
        except Exception:  # a CUDA error: the bytes may be torn, never publish them
            log.exception("xkv: waiting for the save copies failed; aborting %d chunk(s)",
                          batch.num_keys())
            return batch.as_aborts()
        return batch

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                fence, batch = self._queue.popleft()
            try:
                self._send(self._wait(fence, batch))
            except Exception:
                log.exception("xkv: sending a save commit batch failed")
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()
