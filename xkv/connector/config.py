"""Connector settings: every key of ``kv_connector_extra_config``, validated once at start.

``ConnectorConfig.from_extra(extra, env)`` is the only way in. It refuses, with a message naming
the key, the value and what was expected: unknown keys (listing the valid ones), wrong types,
out-of-range values, and a ``PYTHONHASHSEED`` other than ``"0"`` (vLLM's block hashes, hence
every key on the card, would change across restarts). ``docs/configuration.md`` documents each key;
``OPTIONS`` below is the single source of names and defaults.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The nvlink_fanout* keys are validated by xkv.fanout alone; ConnectorConfig holds the result.
from xkv.fanout.config import KEYS as FANOUT_KEYS
from xkv.fanout.config import FanoutConfig, FanoutConfigError
from xkv.gateway import transport

# The gateway's defaults have one home, the gateway's transport module (its CLI reads them too).
DEFAULT_GATEWAY_PORT = transport.DEFAULT_PORT
DEFAULT_GATEWAY_HOST = transport.DEFAULT_HOST
#: chunk_size when the key is absent: the largest multiple of the block size vLLM chose (the lcm
#: of the groups' block sizes) not above this, at least one block; one block for models with
#: recurrent-state groups (``resolve_chunk_size``).
DEFAULT_CHUNK_TOKENS = 256

#: Values of ``load_mode`` (``xkv.connector.async_loads``); the first is the default.
LOAD_MODES = ("sync", "async", "auto")

#: Values of ``save_mode`` (``xkv.connector.saves``); the first is the default.
SAVE_MODES = ("step", "layer")

#: Values of ``checksum_pass`` (``xkv.connector.group_copies``); the first is the default.
CHECKSUM_PASSES = ("copy", "hbm", "end")

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class ConfigError(ValueError):
    """A setting of the connector (or its environment) that it refuses to start with."""


@dataclass(frozen=True)
class Option:
    default: Any
    types: tuple[type, ...]
    help: str


#: name -> (default, accepted types, meaning). Order = order in docs/configuration.md. The
#: ``nvlink_fanout*`` keys (``FANOUT_KEYS``) are ``xkv.fanout.FanoutConfig``'s.
OPTIONS: dict[str, Option] = {
    "xkv_gateway_port": Option(DEFAULT_GATEWAY_PORT, (int,), "gateway instance / TCP port"),
    "chunk_size": Option(None, (int,), "tokens per stored object; multiple of the block size"),
    "slot_alignment_bytes": Option(4096, (int,), "slot size rounding on the card (power of 2)"),
    "require_cache_salt": Option(False, (bool,), "unsalted requests never reach the gateway"),
    "key_namespace": Option("default", (str,), "separates deployments sharing one gateway"),
    "lookup_timeout_ms": Option(50.0, (int, float), "deadline of one LOOKUP (scheduler)"),
    "gateway_timeout_ms": Option(1000.0, (int, float), "deadline of HELLO/RESERVE/COMMIT"),
    "verify_restores": Option(False, (bool,), "debug: compare restored/saved pages with the card"),
    "verify_checksums": Option(True, (bool,), "check every restored page against the checksum its save computed (on by default; its H200 cost: docs/verification.md)"),
    "allow_unverified_requests": Option(False, (bool,), "benchmarks: a request whose kv_transfer_params hold {\"xkv_verify\": false} restores without its checks (same-engine checked/unchecked comparison); off: that field is ignored"),
    "reattach": Option(False, (bool,), "after a gateway restart, use the new gateway (re-attach)"),
    "load_mode": Option("sync", (str,), "restores: 'sync' (layer-wise), 'async' or 'auto'"),
    "full_hit_restore": Option(True, (bool,), "a full hit restores all but the last token (the step computes one)"),
    "full_cuda_graphs": Option(True, (bool,), "let vLLM keep full CUDA graphs for decode-only batches (their captures wait for each layer's restore, XKV_GRAPH_WAITS; where a graph lacks a wait, such a step's restore is fenced before the forward); false: piecewise graphs only"),
    "piecewise_restores_from": Option(0, (int,), "with full_cuda_graphs, on a model of one attention cache group (not MLA): a synchronous whole-prompt restore of at least this many tokens leaves vLLM two tokens to compute, a step it runs with piecewise graphs, so the restore overlaps the forward layer by layer (shorter ones leave one: a full-graph step after the fenced restore); 0: never"),
    "checksum_pass": Option("copy", (str,), "verified restores: hash inside the copy ('copy'), each layer's pages in GPU memory after its copy ('hbm'), or every layer's at once after the last copy ('end')"),
    "save_mode": Option("step", (str,), "stores: 'step' (one launch per group after the forward) or 'layer' (one copy per save_kv_layer)"),
    "xkv_gateway_curve_server_key": Option(None, (str,), "gateway's public certificate file: TCP+CURVE"),
    "xkv_gateway_curve_client_key": Option(None, (str,), "this client's secret certificate file"),
}


def keeps_full_graphs(extra: Mapping[str, Any] | None) -> bool:
    """vLLM may keep its full CUDA graphs (``requires_piecewise_for_cudagraph`` false, the worker's
    graph waits on): ``full_cuda_graphs`` true (its default from :data:`OPTIONS`) and the NVLink
    fan-out off (its all-gathers run in the per-layer hooks). Reads the raw
    ``kv_connector_extra_config`` because vLLM asks before the connector validates it: a value of
    the wrong type gives False here and is refused at start."""
    extra = extra or {}
    return (extra.get("full_cuda_graphs", OPTIONS["full_cuda_graphs"].default) is True
            and not extra.get("nvlink_fanout"))


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated settings. ``chunk_size`` None = pick from the block size (``resolve_chunk_size``)."""

    xkv_gateway_port: int = DEFAULT_GATEWAY_PORT
    xkv_gateway_curve_server_key: str | None = None
    xkv_gateway_curve_client_key: str | None = None
    chunk_size: int | None = None
    slot_alignment_bytes: int = 4096
    require_cache_salt: bool = False
    key_namespace: str = "default"
    lookup_timeout_ms: float = 50.0
    gateway_timeout_ms: float = 1000.0
    verify_restores: bool = False
    verify_checksums: bool = True
    allow_unverified_requests: bool = False
    reattach: bool = False
    load_mode: str = "sync"
    full_hit_restore: bool = True
    full_cuda_graphs: bool = True
    piecewise_restores_from: int = 0
    save_mode: str = "step"
    checksum_pass: str = "copy"
    gateway_host: str = DEFAULT_GATEWAY_HOST
    fanout: FanoutConfig = field(default_factory=FanoutConfig)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config`` and the environment (``os.environ`` by default)."""
        env = os.environ if env is None else env
        check_hash_seed(env)
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in OPTIONS and k not in FANOUT_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown} for FusIOnXConnector; "
                f"valid keys: {', '.join([*OPTIONS, *FANOUT_KEYS])}"
            )
        values: dict[str, Any] = {}
        for name, opt in OPTIONS.items():
            value = extra.get(name, opt.default)
            if value is None and opt.default is None:
                values[name] = None
                continue
            values[name] = _check_type(name, value, opt)
        try:
            fanout = FanoutConfig.from_extra_config({k: extra[k] for k in FANOUT_KEYS if k in extra})
        except FanoutConfigError as e:
            raise ConfigError(str(e)) from e
        cfg = cls(**values, gateway_host=gateway_host(env), fanout=fanout, extra=extra)
        cfg._check_ranges()
        return cfg

    def _check_ranges(self) -> None:
        if not 1 <= self.xkv_gateway_port <= 65535:
            raise ConfigError(f"xkv_gateway_port={self.xkv_gateway_port}: expected 1..65535")
        server, client = self.xkv_gateway_curve_server_key, self.xkv_gateway_curve_client_key
        if (server is None) != (client is None):
            raise ConfigError(
                "xkv_gateway_curve_server_key and xkv_gateway_curve_client_key go together (the "
                "gateway's public certificate and this client's secret one, both listed in the "
                f"gateway's --curve-allowed-clients); got server={server!r}, client={client!r}")
        for name, path in (("xkv_gateway_curve_server_key", server),
                           ("xkv_gateway_curve_client_key", client)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name}={path!r}: expected a readable certificate file "
                                  "(zmq.auth.create_certificates format)")
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
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(
                f"load_mode={self.load_mode!r}: expected one of {', '.join(map(repr, LOAD_MODES))}"
                " ('sync': layer-wise restores inside the step, the default; 'async': vLLM parks "
                "the request until its restore landed; 'auto': async while other requests run)")
        if self.save_mode not in SAVE_MODES:
            raise ConfigError(
                f"save_mode={self.save_mode!r}: expected one of {', '.join(map(repr, SAVE_MODES))}"
                " ('step': nothing per layer, every layer copied by one launch after the forward, "
                "the default; 'layer': each layer's pages copied as its save_kv_layer comes)")
        if self.checksum_pass not in CHECKSUM_PASSES:
            raise ConfigError(
                f"checksum_pass={self.checksum_pass!r}: expected one of "
                f"{', '.join(map(repr, CHECKSUM_PASSES))} ('copy': restores hash what they copy, "
                "the default; 'hbm': copy unchecked, then hash each layer's pages in GPU memory; 'end': "
                "copy unchecked, then hash every layer's pages in GPU memory at once after the "
                "last copy)")
        n = self.piecewise_restores_from
        if n < 0:
            raise ConfigError(f"piecewise_restores_from={n}: expected a token count >= 0 "
                              "(0: never)")
        if n and not self.full_cuda_graphs:
            raise ConfigError(
                f"piecewise_restores_from={n} needs full_cuda_graphs: true (without it vLLM runs "
                "every step with piecewise graphs already, and every restore overlaps the forward)")
        for name in ("lookup_timeout_ms", "gateway_timeout_ms"):
            v = getattr(self, name)
            if not 0 < v <= 60_000:
                raise ConfigError(f"{name}={v}: expected a deadline in (0, 60000] milliseconds")

    def resolve_chunk_size(self, *block_sizes: int, states: bool = False) -> int:
        """Tokens per stored object for the block sizes (tokens) vLLM chose for the KV cache
        groups: a multiple of every one, i.e. of their lcm. Without ``chunk_size``: the largest
        multiple of the lcm not above ``DEFAULT_CHUNK_TOKENS``, at least one lcm; one lcm when
        the model has recurrent-state groups (``states``: a state is restorable only at a chunk
        end, so a larger chunk only removes restore points). An explicit ``chunk_size`` that is
        not a multiple is refused, naming a value that works."""
        if not block_sizes or any(b <= 0 for b in block_sizes):
            raise ConfigError(f"block sizes {list(block_sizes)}: expected positive token counts")
        unit = math.lcm(*block_sizes)
        if self.chunk_size is None:
            return unit if states else max(unit, DEFAULT_CHUNK_TOKENS // unit * unit)
        if self.chunk_size % unit:
            sizes = "" if len(set(block_sizes)) == 1 else (
                f" (the lcm of the groups' block sizes {', '.join(map(str, block_sizes))})")
            raise ConfigError(
                f"chunk_size={self.chunk_size} is not a multiple of the KV cache block size "
                f"{unit}{sizes} vLLM chose; use e.g. {max(unit, self.chunk_size // unit * unit)}, "
                "or leave chunk_size out to derive it from the block size"
            )
        return self.chunk_size

    def chunk_line(self, chunk: int, *block_sizes: int, states: bool = False) -> str:
        """The start-up log line (rank 0) saying which chunk size is used and why."""
        unit = math.lcm(*block_sizes) if block_sizes else chunk
        blocks = (f"block size {unit}" if len(set(block_sizes)) <= 1 else
                  f"block sizes {', '.join(map(str, block_sizes))} (lcm {unit})")
        why = ("kv_connector_extra_config" if self.chunk_size is not None else
               "default: one block, states are restorable at chunk ends only" if states else
               f"default: the largest multiple of the block size not above {DEFAULT_CHUNK_TOKENS}")
        return f"XKV: chunk_size {chunk} tokens ({why}; vLLM's KV cache {blocks} tokens)"

    def check_fanout_groups(self, tp_size: int) -> None:
        """Explicit fan-out groups must name TP ranks that exist (once the TP size is known)."""
        try:
            self.fanout.explicit_groups(tp_size)
        except FanoutConfigError as e:
            raise ConfigError(str(e)) from e

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


def gateway_host(env: Mapping[str, str] | None = None) -> str:
    """The gateway's host (:func:`xkv.gateway.transport.gateway_host`) as a ``ConfigError``."""
    try:
        return transport.gateway_host(env)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
