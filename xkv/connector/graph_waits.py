"""Per-layer restore waits inside vLLM's full CUDA graphs (``full_cuda_graphs``).

Why: vLLM replays a decode-shaped step (one token per request, e.g. a full hit's first token)
as one full CUDA graph, and no Python hook runs during a replay. Without this module such a
step's restore is fenced before the forward, the whole copy exposed (stop 52, H100, 8k: +15.9 %
restore TTFT on the Llama shape, +18.0 % on the Qwen shape against piecewise steps, whose
restores overlap the forward), yet the same full graphs make every later decode step faster
(stop 52, Qwen shape, TRITON_ATTN: 6.96 against 13.01 ms per output token with piecewise graphs;
bench/RESULTS.md).

How: while vLLM *captures* a full graph it runs the model's Python once, hooks included. The
façade lets the per-layer hook run then (``has_connector_metadata`` is true while the stream
captures), and the hook makes the capturing stream wait on a persistent, external CUDA event
of that layer (``torch.cuda.Event(external=True)``): an event-wait node in the graph, before
that layer's attention. Every restore step re-records each layer's event on the load stream
right after that layer's copy (:meth:`GraphWaits.record`). A wait on an event waits for its
most recent record made before the wait is submitted (CUDA's stream semantics; that a graph's
wait node takes the record made before the graph's launch is what
``tests/connector/test_graph_waits.py``'s back-to-back GPU test checks), and the step's copies
are issued before its graph is launched: the replay's layer ``l`` waits for layer ``l``'s
copy only, and the copy overlaps the forward as in a piecewise step. A step without restores
waits on records that completed long ago (one no-op node per layer).

When is a replay safe without the fence: only when every layer the step restores has a wait
node in *every* full graph vLLM captured. vLLM captures all its full graphs with the same code
path, each running every layer's hook once, so :meth:`GraphWaits.covers` asks that every such
layer was captured, and the same number of times as every other captured layer; otherwise
the worker fences as before (``worker.WorkerSide.fence_full_graph_step``).

Measured (H100, bench/RESULTS.md "stop 53" / "stop 54", raw
bench/results/h100_2026-12-07_stop53/ and _stop54/c0/): full-graph restores with these waits
took 17.8 / 34.0 ms on the Llama shape (2k / 8k) against 17.9 / 33.9 with piecewise graphs,
21.2 / 51.1 ms on the MLA model (4k / 32k) against 27.1 / 52.3; decode after a restore 6.69
against 7.48 ms per token (Llama), 5.79 against 12.01 (MLA); the back-to-back GPU test passed.

``XKV_GRAPH_WAITS=0`` turns it off (the fence, as before stop 52: an A/B switch).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping

import torch


def enabled() -> bool:
    """``XKV_GRAPH_WAITS``: ``1`` (default) or ``0``."""
    v = os.environ.get("XKV_GRAPH_WAITS", "1")
    if v not in ("0", "1"):
        raise ValueError(f"XKV_GRAPH_WAITS={v!r}: expected '0' or '1'")
    return v == "1"


def covers(captured: Mapping[str, int], names: Iterable[str]) -> bool:
    """Every layer of ``names`` has a wait node in every captured full graph: each was captured,
    and every captured layer the same number of times (one capture run hooks every layer once;
    a count that differs means some graph lacks some layer's node). Empty ``names``: True."""
    names = list(names)
    if not names:
        return True
    if any(captured.get(n, 0) == 0 for n in names):
        return False
    return len(set(captured.values())) == 1


class GraphWaits:
    """One external event per layer (``names``), created and recorded once on ``stream`` now:
    torch creates an event at its first record, and a wait on an event never created is
    skipped, which would capture no node."""

    def __init__(self, names: Iterable[str], stream: torch.cuda.Stream):
        self.events = {n: torch.cuda.Event(external=True) for n in names}
        for ev in self.events.values():
            ev.record(stream)
        self.captured: Counter = Counter()  # layer -> capture runs that waited on its event

    def capture(self, name: str, stream: torch.cuda.Stream) -> None:
        """The capturing ``stream`` waits on layer ``name``'s event: a node in the graph."""
        ev = self.events.get(name)
        if ev is not None:
            stream.wait_event(ev)
            self.captured[name] += 1

    def record(self, name: str, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Record layer ``name``'s event on ``stream`` (after its copy); returns it."""
        ev = self.events[name]
        ev.record(stream)
        return ev

    def covers(self, names: Iterable[str]) -> bool:
        """:func:`covers` of this rank's captures."""
        return covers(self.captured, names)


def supported() -> bool:
    """This torch has external CUDA events (torch >= 2.7)."""
    try:
        torch.cuda.Event(external=True)
    except TypeError:
        return False
    return True
