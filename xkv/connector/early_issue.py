"""``XKV_EARLY_ISSUE=1``: a step's restores issued when the scheduler builds the step, not when the
worker starts it.

Between the scheduler's ``build_connector_meta`` and the worker's ``start_load_kv`` vLLM prepares
the step's inputs and attention metadata on the same thread: 2.2-3 ms of a 2k restore step on
stop 43's H100, 4.9 ms of a 16k one on stop 48's (``bench/profile_steps.py``'s hook positions,
bench/RESULTS.md "stop 48"), during which the GPU's copy engine and the load stream are idle and
the step's copies have not started. Where both roles live on one thread (one worker: tensor and
pipeline parallel size 1, vLLM's in-process executor), the scheduler side hands the step's
metadata to its own engine's worker as soon as it is built; the worker binds it and issues the
restores then, on the same CUDA stream order as ``start_load_kv`` would (the load stream waits
for the compute stream's queued work first), and the step's own ``bind_connector_metadata`` /
``start_load_kv`` find it done and only add what belongs to the forward (fences of layers
without hooks, async loads).

Conditions, each checked for every step (otherwise the step runs as without the switch):
the switch is on (``1``, or ``auto`` for an engine that qualifies); the worker of the same
engine (``kv_transfer_config.engine_id``) registered in this process with a world size of 1 and
no NVLink fan-out; the call comes on the thread that ran that worker's last step (a
thread-local CUDA stream and no concurrent step); the worker is between steps (its last
metadata cleared); the step has synchronous restores, fewer bytes than the copy engine may take
(``WorkerSide.may_take_copy_engine``: early issue was measured faster with the Triton kernel's
restores only; a ring restore issued early lost 30 % at stop 49, and with ``XKV_RING_MIN_GAIN``
a Triton-path host gives the ring its large restores only).

``auto`` (the default) turns it on only where it was measured faster (:func:`auto_off_reason`):
vLLM replays full CUDA graphs whose captures wait for each layer's restore (``graph_waits``) and
the restores run on the Triton kernel (not the copy engine's ring). Measured on H100s
(bench/RESULTS.md): with full graphs the Qwen shape (TRITON_ATTN) restored 7.3 / 6.0 % faster at
2k / 8k (stop 55) and 3.4 / 3.2 % (stop 56, the default against ``0``), the Llama shape
(FLASH_ATTN) 4-9 % at 2k-8k (stop 51) and 3.3-14.6 % at 2k-8k, equal at 32k (stop 56), the MLA
model (TRITON_MLA) 1.8 / 6.6 % at 4k / 32k (stop 56); with piecewise graphs the Qwen shape and
the MLA model lost 10-47 % (stop 51: every host phase of the early restores ~1.7 x slower, the
early issue queued behind the previous step's launch-heavy piecewise forward), and on a host
whose probe chose the ring a 2k restore lost 30 % (stop 49).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

log = logging.getLogger("xkv.connector")

ENV = "XKV_EARLY_ISSUE"
LINE = "XKV: restores issued when the scheduler builds the step (XKV_EARLY_ISSUE)"
OFF_LINE = ("XKV: XKV_EARLY_ISSUE has no effect here ({why}): restores are issued by "
            "start_load_kv")

_PEERS: dict[str, weakref.ref] = {}  # engine id -> the worker-role façade of that engine


def mode() -> str:
    """The switch: ``auto`` (unset: the default), ``1`` on, ``0`` off; anything else refuses to
    start."""
    v = os.environ.get(ENV, "auto")
    if v not in ("0", "1", "auto"):
        raise ValueError(f"{ENV}={v!r}: expected 0, 1 or auto")
    return v


def enabled() -> bool:
    """Whether an engine may issue early (``1``, or ``auto`` subject to :func:`auto_off_reason`
    at registration)."""
    return mode() != "0"


def auto_off_reason(*, full_graphs: bool, copy_engine: bool) -> str:
    """Why ``auto`` leaves early issue off for an engine ('' = on). ``full_graphs``: vLLM
    replays full CUDA graphs with per-layer restore waits captured (the worker's
    ``graph_waits`` and a full ``cudagraph_mode``); ``copy_engine``: a restore may run on the
    copy engine instead of the Triton kernel (``warmup.restores_may_take_copy_engine``: the ring
    where the start-up probe chose it). Each condition is where it was measured slower (the
    module's docstring)."""
    return ("no full CUDA graphs with per-layer restore waits" if not full_graphs else
            "restores may take the copy engine" if copy_engine else "")


def register(engine_id: str, worker: Any, world_size: int, fanout: bool, *,
             auto_why: str = "") -> None:
    """The worker-role façade of ``engine_id`` offers early issue (when the switch is on, or
    ``auto`` and ``auto_why`` is empty, and it is the engine's only worker); says once why not
    otherwise."""
    m = mode()
    if m == "0":
        return
    why = (f"world size {world_size}" if world_size != 1 else
           "the NVLink fan-out exchanges every restore" if fanout else
           f"auto: {auto_why}" if m == "auto" and auto_why else "")
    if why:
        log.info(OFF_LINE.format(why=why))
        return
    _PEERS[engine_id] = weakref.ref(worker)


def peer(engine_id: str) -> Any | None:
    """The registered worker-role façade of ``engine_id`` in this process, or None."""
    ref = _PEERS.get(engine_id)
    return ref() if ref is not None else None


def key(step: Any) -> tuple[int, ...]:
    """A step's identity for the hand-over: its load jobs' ids (unique per scheduler; equal on a
    copy of the metadata, so a serialised hand-over still matches)."""
    return tuple(job.job_id for job in step.loads)


class Handover:
    """The worker-role façade's record of a step issued early (one at a time)."""

    def __init__(self) -> None:
        self.pending: tuple[int, ...] | None = None  # key of the step issued, not yet started
        self.thread: int | None = None  # the thread of the worker's last step
        self.logged = False

    def note_thread(self) -> None:
        self.thread = threading.get_ident()

    def may_issue(self, step: Any, between_steps: bool) -> bool:
        """Whether a step built now may be issued now (see the module's conditions)."""
        return (bool(step.loads) and self.pending is None and between_steps
                and self.thread == threading.get_ident())

    def issued(self, step: Any) -> None:
        self.pending = key(step)
        if not self.logged:
            self.logged = True
            log.info(LINE)

    def take(self, step: Any) -> bool:
        """At ``bind_connector_metadata``: True when this step was issued early (then its bind
        and issue are done). A different step while one is pending is a broken invariant: its
        copies would run without their step, so it stops with a clear error."""
        if self.pending is None:
            return False
        if key(step) != self.pending:
            raise RuntimeError(
                f"xkv: {ENV}: the step bound (load jobs {list(key(step))}) is not the one whose "
                f"restores were issued when it was scheduled (load jobs {list(self.pending)})")
        return True

    def started(self) -> bool:
        """At ``start_load_kv``: True when the bound step was issued early (its copies are under
        way: nothing to issue); the worker's current step from now on, none pending."""
        early, self.pending = self.pending is not None, None
        return early
