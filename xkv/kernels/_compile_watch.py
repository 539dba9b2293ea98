"""A diagnostic: name every Triton variant compiled after warmup (``XKV_TIMING`` set).

Warmup (:mod:`xkv.kernels.warmup`) compiles the variants it predicts; a copy that still compiles
mid-serving costs the step 0.3-1 s (the H200's 8 x 16k checked restore, 2026-12-04: an int
argument that passed 2**31 and was typed i64, bench/RESULTS.md "stop 35"). With ``XKV_TIMING`` set,
:func:`launch` compares the size of Triton's in-process cache of the kernel before and after
each launch and, when it grew, logs the launch's specialisation (each argument's type and
alignment class, the constexprs and options, as Triton's binder gives them) once per variant,
so the next GPU run names the argument. Off (the default) it costs one env lookup at import.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("xkv.kernels")

ENABLED = os.environ.get("XKV_TIMING", "0") not in ("", "0")
armed = False  # set by warmup once it ran: compiles before (warmup's own) are expected
_logged: set[str] = set()


def _device() -> int:
    from triton.runtime.driver import driver

    return driver.active.get_current_device()


def _cache(kernel):
    """Triton's in-process variant cache of ``kernel`` on the current device (None: unknown)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    return caches[_device()][0]


def launch(kernel, grid, args, meta, what: str) -> None:
    """``kernel[grid](*args, **meta)``; with :data:`ENABLED`, log a variant it compiled."""
    if not (ENABLED and armed):
        kernel[grid](*args, **meta)
        return
    try:
        cache = _cache(kernel)
        before = len(cache) if cache is not None else -1
    except Exception:  # another Triton: launch without the check
        cache, before = None, -1
    kernel[grid](*args, **meta)
    if cache is None or len(cache) == before:
        return
    try:
        binder = kernel.device_caches[_device()][-1]
        _, spec, options = binder(*args, **meta)
        text = f"specialisation {list(spec)} options {options}"
    except Exception as e:  # noqa: BLE001 - a diagnostic never fails a copy
        text = f"(specialisation unavailable: {e!r})"
    if text not in _logged:
        _logged.add(text)
        log.warning("XKV: a %s copy compiled a Triton variant after warmup: %s", what, text)
