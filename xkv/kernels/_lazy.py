"""Tables built at the first use, not at prepare time.

A restore's copies that need not be planned before its first copy is queued (the staged
restore's unpacks, a prepared restore's launches after the first) are planned and their tables
uploaded by the first call that needs them, while that first copy runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def deferred(build: Callable[[], Callable[[int], T]]) -> Callable[[int], T]:
    """``f(k) = build()(k)``, ``build`` called once, at the first call."""
    got: list = []

    def f(k: int) -> T:
        if not got:
            got.append(build())
        return got[0](k)
    return f
