"""Configuration of the NVLink fan-out (the ``nvlink_fanout*`` keys of ``kv_connector_extra_config``).

The only validator of those keys (the connector's ``ConnectorConfig`` holds a ``FanoutConfig``).
Every key is validated before anything is allocated; a bad value raises ``FanoutConfigError``
(a ``ValueError``) naming the key, the value and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20

#: Staging memory per rank (both slots together), bytes. 128 MiB holds ~58k bf16 DeepSeek tokens
#: of one layer per slot at TP 1 and more per round at larger TP.
DEFAULT_STAGING_BYTES = 128 * MiB
#: Smallest layer restore (bytes, one layer, all its caches) worth fanning out. A cost model of
#: one host copy split N ways plus an NVLink all-gather (docs/fanout.md) puts break-even at
#: 1.0-1.75 MB on an H200; 4 MiB leaves margin for launch jitter.
DEFAULT_MIN_LAYER_BYTES = 4 * MiB
#: Smallest staging buffer accepted (two slots of 1 MiB).
MIN_STAGING_BYTES = 2 * MiB

KEYS = (
    "nvlink_fanout",
    "nvlink_fanout_groups",
    "nvlink_fanout_staging_bytes",
    "nvlink_fanout_min_layer_bytes",
)


class FanoutConfigError(ValueError):
    """A ``nvlink_fanout*`` key has a value that cannot be used."""


@dataclass(frozen=True)
class FanoutConfig:
    """Validated fan-out settings.

    ``groups`` is ``"auto"`` (NVLink cliques found through NVML) or a tuple of disjoint groups of
    TP ranks; a TP rank listed in no group restores on its own. ``staging_bytes`` is the GPU
    staging memory per rank (split into ``slots`` equal slots, double-buffered by default) and
    ``min_layer_bytes`` the smallest layer restore that is fanned out.
    """

    enabled: bool = False
    groups: str | tuple[tuple[int, ...], ...] = "auto"
    staging_bytes: int = DEFAULT_STAGING_BYTES
    min_layer_bytes: int = DEFAULT_MIN_LAYER_BYTES
    slots: int = 2

    def __post_init__(self) -> None:
        _check_bool("nvlink_fanout", self.enabled)
        object.__setattr__(self, "groups", _check_groups(self.groups))
        _check_int("nvlink_fanout_staging_bytes", self.staging_bytes, MIN_STAGING_BYTES,
                   " (two 1 MiB staging slots)")
        _check_int("nvlink_fanout_min_layer_bytes", self.min_layer_bytes, 0)
        _check_int("slots", self.slots, 1)
        if self.staging_bytes // self.slots < 1 * MiB:
            raise FanoutConfigError(
                f"nvlink_fanout_staging_bytes={self.staging_bytes} gives {self.slots} slots of "
                f"less than 1 MiB; expected at least {self.slots} MiB"
            )

    @property
    def slot_bytes(self) -> int:
        """Bytes of one staging slot (slots are 256-byte aligned)."""
        return (self.staging_bytes // self.slots) // 256 * 256

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> FanoutConfig:
        """Read the ``nvlink_fanout*`` keys of ``kv_connector_extra_config``.

        Other keys are ignored (they belong to the connector); an unknown key starting with
        ``nvlink_fanout`` is an error, so a typo cannot silently leave the defaults in place.
        """
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k.startswith("nvlink_fanout") and k not in KEYS)
        if unknown:
            raise FanoutConfigError(
                f"unknown fan-out key(s) {unknown} in kv_connector_extra_config; expected one of {list(KEYS)}"
            )
        kwargs: dict[str, Any] = {}
        if "nvlink_fanout" in extra:
            kwargs["enabled"] = extra["nvlink_fanout"]
        if "nvlink_fanout_groups" in extra:
            kwargs["groups"] = extra["nvlink_fanout_groups"]
        if "nvlink_fanout_staging_bytes" in extra:
            kwargs["staging_bytes"] = extra["nvlink_fanout_staging_bytes"]
        if "nvlink_fanout_min_layer_bytes" in extra:
            kwargs["min_layer_bytes"] = extra["nvlink_fanout_min_layer_bytes"]
        return cls(**kwargs)

    def explicit_groups(self, tp_size: int) -> tuple[tuple[int, ...], ...] | None:
        """The explicit groups checked against ``tp_size`` (``None`` for ``"auto"``)."""
        if self.groups == "auto":
            return None
        for g in self.groups:
            for r in g:
                if r >= tp_size:
                    raise FanoutConfigError(
                        f"nvlink_fanout_groups={[list(x) for x in self.groups]} names TP rank {r}, "
                        f"but tensor_parallel_size is {tp_size}: ranks >= {tp_size} do not exist; "
                        f"expected ranks 0..{tp_size - 1}"
                    )
        return self.groups


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FanoutConfigError(f"{key}={value!r}: expected true or false (a JSON boolean)")


def _check_int(key: str, value: Any, minimum: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FanoutConfigError(f"{key}={value!r}: expected an integer number of bytes")
    if value < minimum:
        raise FanoutConfigError(f"{key}={value}: expected an integer >= {minimum}{why}")


def _check_groups(value: Any) -> str | tuple[tuple[int, ...], ...]:
    key = "nvlink_fanout_groups"
    if isinstance(value, str):
        if value != "auto":
            raise FanoutConfigError(f'{key}={value!r}: expected "auto" or a list of lists of TP ranks')
        return value
    if not isinstance(value, Sequence) or not value:
        raise FanoutConfigError(f'{key}={value!r}: expected "auto" or a non-empty list of lists of '
                                "TP ranks (at least one group)")
    seen: set[int] = set()
    groups = []
    for g in value:
        if isinstance(g, str | bytes) or not isinstance(g, Sequence) or not g:
            raise FanoutConfigError(f"{key}: group {g!r} is not a non-empty list of TP ranks")
        members = []
        for r in g:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise FanoutConfigError(f"{key}: {r!r} in group {list(g)} is not a TP rank "
                                        "(expected TP ranks: integers >= 0)")
            if r in seen:
                raise FanoutConfigError(f"{key}: TP rank {r} appears more than once; groups must be disjoint")
            seen.add(r)
            members.append(r)
        if len(members) < 2:  # a rank listed in no group restores on its own anyway
            raise FanoutConfigError(f"{key}: group {list(g)}: a group needs >= 2 ranks")
        groups.append(tuple(sorted(members)))
    return tuple(sorted(groups))
