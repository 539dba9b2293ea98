"""Connector settings: every key of ``kv_connector_extra_config``, validated once at start.

``ConnectorConfig.from_extra(extra, env)`` is the only way in. It refuses, with a message naming
the key, the value and what was expected: unknown keys (listing the valid ones), wrong types,
out-of-range values, and a ``PYTHONHASHSEED`` other than ``"0"`` (vLLM's block hashes, hence
every key on the card, would change across restarts). ``docs/configuration.md`` documents each key;
``OPTIONS`` below is the single source of names and defaults.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# One source for the fan-out defaults: xkv.fanout validates the same keys at run time.
from xkv.fanout.config import DEFAULT_MIN_LAYER_BYTES, DEFAULT_STAGING_BYTES, MIN_STAGING_BYTES

MiB = 1 << 20

#: The gateway's control port also is vLLM's KV-events publisher default (tcp://*:5557).
DEFAULT_GATEWAY_PORT = 5557
#: chunk_size when the key is absent: the largest multiple of the block size not above this.
DEFAULT_CHUNK_TOKENS = 256

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class ConfigError(ValueError):
    """A setting of the connector (or its environment) that it refuses to start with."""


@dataclass(frozen=True)
class Option:
    default: Any
    types: tuple[type, ...]
    help: str


#: name -> (default, accepted types, meaning). Order = order in docs/configuration.md.
OPTIONS: dict[str, Option] = {
    "xkv_gateway_port": Option(DEFAULT_GATEWAY_PORT, (int,), "gateway control port (TCP)"),
    "chunk_size": Option(None, (int,), "tokens per stored object; multiple of the block size"),
    "slot_alignment_bytes": Option(4096, (int,), "slot size rounding on the card (power of 2)"),
    "require_cache_salt": Option(False, (bool,), "unsalted requests never reach the gateway"),
    "key_namespace": Option("default", (str,), "separates deployments sharing one gateway"),
    "lookup_timeout_ms": Option(50.0, (int, float), "deadline of one LOOKUP (scheduler)"),
    "gateway_timeout_ms": Option(1000.0, (int, float), "deadline of HELLO/RESERVE/COMMIT"),
    "nvlink_fanout": Option(False, (bool,), "MLA restores fanned out over NVLink"),
    "nvlink_fanout_groups": Option("auto", (str, list), '"auto" or lists of TP ranks'),
    "nvlink_fanout_staging_bytes": Option(DEFAULT_STAGING_BYTES, (int,), "per-GPU fan-out staging buffer"),
    "nvlink_fanout_min_layer_bytes": Option(DEFAULT_MIN_LAYER_BYTES, (int,), "smallest layer restore fanned out"),
    "verify_restores": Option(False, (bool,), "debug: compare restored/saved pages with the card"),
}


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated settings. ``chunk_size`` None = pick from the block size (``resolve_chunk_size``)."""

    xkv_gateway_port: int = DEFAULT_GATEWAY_PORT
    chunk_size: int | None = None
    slot_alignment_bytes: int = 4096
    require_cache_salt: bool = False
    key_namespace: str = "default"
    lookup_timeout_ms: float = 50.0
    gateway_timeout_ms: float = 1000.0
    nvlink_fanout: bool = False
    nvlink_fanout_groups: str | tuple[tuple[int, ...], ...] = "auto"
    nvlink_fanout_staging_bytes: int = DEFAULT_STAGING_BYTES
    nvlink_fanout_min_layer_bytes: int = DEFAULT_MIN_LAYER_BYTES
    verify_restores: bool = False
    gateway_host: str = "localhost"
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config`` and the environment (``os.environ`` by default)."""
        env = os.environ if env is None else env
        check_hash_seed(env)
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown} for FusIOnXConnector; "
                f"valid keys: {', '.join(OPTIONS)}"
            )
        values: dict[str, Any] = {}
        for name, opt in OPTIONS.items():
            value = extra.get(name, opt.default)
            if value is None and opt.default is None:
                values[name] = None
                continue
            values[name] = _check_type(name, value, opt)
        values["nvlink_fanout_groups"] = _check_groups(values["nvlink_fanout_groups"])
        host = env.get("XKV_GATEWAY_HOSTNAME", "localhost").strip()
        if not host:
            raise ConfigError("XKV_GATEWAY_HOSTNAME is set but empty; unset it or name the host")
        cfg = cls(**values, gateway_host=host, extra=extra)
        cfg._check_ranges()
        return cfg

    def _check_ranges(self) -> None:
        if not 1 <= self.xkv_gateway_port <= 65535:
            raise ConfigError(f"xkv_gateway_port={self.xkv_gateway_port}: expected 1..65535")
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ConfigError(f"chunk_size={self.chunk_size}: expected a positive token count")
        a = self.slot_alignment_bytes
        if a <= 0 or a & (a - 1):
            raise ConfigError(f"slot_alignment_bytes={a}: expected a power of two (e.g. 4096)")
        if not _NAMESPACE_RE.match(self.key_namespace):
            raise ConfigError(
                f"key_namespace={self.key_namespace!r}: expected 1-64 characters from "
                "[A-Za-z0-9._:-]"
            )
        for name in ("lookup_timeout_ms", "gateway_timeout_ms"):
            v = getattr(self, name)
            if not 0 < v <= 60_000:
                raise ConfigError(f"{name}={v}: expected a deadline in (0, 60000] milliseconds")
        if self.nvlink_fanout_staging_bytes < MIN_STAGING_BYTES:
            raise ConfigError(
                f"nvlink_fanout_staging_bytes={self.nvlink_fanout_staging_bytes}: "
                f"expected at least {MIN_STAGING_BYTES} bytes (two 1 MiB staging slots)"
            )
        if self.nvlink_fanout_min_layer_bytes < 0:
            raise ConfigError(
                f"nvlink_fanout_min_layer_bytes={self.nvlink_fanout_min_layer_bytes}: "
                "expected >= 0 bytes"
            )

    def resolve_chunk_size(self, block_size: int) -> int:
        """Tokens per stored object for a scheduler block size (tokens); a multiple of it."""
        if block_size <= 0:
            raise ConfigError(f"block size {block_size}: expected a positive token count")
        if self.chunk_size is None:
            return max(block_size, DEFAULT_CHUNK_TOKENS // block_size * block_size)
        if self.chunk_size % block_size:
            raise ConfigError(
                f"chunk_size={self.chunk_size} is not a multiple of the KV cache block size "
                f"{block_size}; use e.g. {max(block_size, self.chunk_size // block_size * block_size)}"
            )
        return self.chunk_size

    def check_fanout_groups(self, tp_size: int) -> None:
        """Explicit groups must name TP ranks that exist (called once the TP size is known)."""
        if isinstance(self.nvlink_fanout_groups, str):
            return
        for g in self.nvlink_fanout_groups:
            bad = [r for r in g if r >= tp_size]
            if bad:
                raise ConfigError(
                    f"nvlink_fanout_groups: ranks {bad} do not exist with tensor parallel size "
                    f"{tp_size} (valid ranks 0..{tp_size - 1})"
                )

    def check_port_clash(self, kv_events_endpoint: str | None) -> None:
        """vLLM's KV-events publisher binds tcp://*:5557 by default: the same port as the gateway."""
        if not kv_events_endpoint:
            return
        m = re.search(r":(\d+)$", kv_events_endpoint)
        if m and int(m.group(1)) == self.xkv_gateway_port:
            raise ConfigError(
                f"vLLM's KV events publisher ({kv_events_endpoint}) uses port "
                f"{self.xkv_gateway_port}, the xkv gateway's control port; move one of them "
                "(kv_events_config endpoint, or xkv_gateway_port plus xkv-gateway --port)"
            )


def check_hash_seed(env: Mapping[str, str]) -> None:
    seed = env.get("PYTHONHASHSEED")
    if seed != "0":
        shown = "unset" if seed is None else f"{seed!r}"
        raise ConfigError(
            f"FusIOnXConnector needs PYTHONHASHSEED=0 in the environment of the vLLM process "
            f"(it is {shown}): vLLM's block hashes, and so every key on the card, depend on it, "
            "and would change across restarts, so stored prefixes would never be found again. "
            "Start vLLM with `export PYTHONHASHSEED=0`."
        )


def _check_type(name: str, value: Any, opt: Option) -> Any:
    # bool is an int subclass: never accept True for a count, nor 1 for a switch.
    ok = isinstance(value, opt.types) and not (
        isinstance(value, bool) and bool not in opt.types
    )
    if not ok:
        expected = " or ".join(t.__name__ for t in opt.types)
        raise ConfigError(
            f"kv_connector_extra_config[{name!r}] = {value!r} ({type(value).__name__}): "
            f"expected {expected} ({opt.help})"
        )
    return float(value) if float in opt.types and not isinstance(value, bool) else value


def _check_groups(value: Any) -> str | tuple[tuple[int, ...], ...]:
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(
                f'nvlink_fanout_groups={value!r}: expected "auto" or a list of lists of TP ranks'
            )
        return value
    groups: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for g in value:
        if not isinstance(g, (list, tuple)) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in g
        ):
            raise ConfigError(
                f"nvlink_fanout_groups entry {g!r}: expected a list of TP ranks (ints >= 0)"
            )
        if len(g) < 2:
            raise ConfigError(f"nvlink_fanout_groups entry {list(g)}: a group needs >= 2 ranks")
        dup = seen.intersection(g) | {r for r in g if list(g).count(r) > 1}
        if dup:
            raise ConfigError(f"nvlink_fanout_groups: rank(s) {sorted(dup)} appear more than once")
        seen.update(g)
        groups.append(tuple(g))
    if not groups:
        raise ConfigError('nvlink_fanout_groups=[]: expected "auto" or at least one group')
    return tuple(groups)
