"""Variant kinds of ``bench/e2e_ttft.py``: ``xkv@KEY=VALUE[+KEY=VALUE...]`` is an xkv engine with
those ``kv_connector_extra_config`` options, measured in the same call as the plain kinds (e.g.
``--kinds none,xkv,xkv@save_mode=step,xkv@verify_checksums=on,offload``), so a setting's cost
is a same-call comparison. ``on``/``off``/``true``/``false`` are booleans, digits integers.
A key that starts with ``XKV_``, ``CUDA_``, ``VLLM_`` or ``TORCH_`` is an environment variable of
that kind's engine instead (e.g. ``xkv@XKV_MAX_PROGRAMS=16``: the copy kernels' SM budget;
``xkv@CUDA_MODULE_LOADING=EAGER``: every CUDA kernel loaded at start, not on first use), its
value passed as written. ``xkv@XKV_TREE=DIR``: that engine imports ``xkv`` and the connector
from the directory ``DIR`` (another checkout, e.g. ``git archive <commit> xkv xkv_vllm_connector
| tar -x -C .base`` for the code before a change), first on its ``PYTHONPATH``, so one call
measures two versions of the worker; its gateway is this tree's."""

from __future__ import annotations

import os
from pathlib import Path

_BOOL = {"on": True, "true": True, "off": False, "false": False}
ENV_PREFIXES = ("XKV_", "CUDA_", "VLLM_", "TORCH_")


def base(kind: str) -> str:
    """The engine a kind runs: ``xkv@save_mode=step`` -> ``xkv``."""
    return kind.split("@", 1)[0]


def _pairs(kind: str) -> list[tuple[str, str]]:
    if "@" not in kind:
        return []
    if base(kind) != "xkv":
        raise SystemExit(f"kind {kind!r}: only xkv takes options (xkv@KEY=VALUE[+KEY=VALUE])")
    out = []
    for kv in kind.split("@", 1)[1].split("+"):
        k, sep, v = kv.partition("=")
        if not sep or not k or not v:
            raise SystemExit(f"kind {kind!r}: expected xkv@KEY=VALUE[+KEY=VALUE], got {kv!r}")
        out.append((k, v))
    return out


def options(kind: str) -> dict:
    """The connector options of a variant kind ({} for a plain one); SystemExit names a bad one."""
    return {k: _BOOL.get(v.lower(), int(v) if v.isdigit() else v)
            for k, v in _pairs(kind) if not k.startswith(ENV_PREFIXES)}


def env(kind: str) -> dict[str, str]:
    """The environment variables (:data:`ENV_PREFIXES` keys) a variant kind sets for its
    engine; ``XKV_TREE`` also puts that tree first on ``PYTHONPATH`` (SystemExit when it holds
    no ``xkv`` package)."""
    out = {k: v for k, v in _pairs(kind) if k.startswith(ENV_PREFIXES)}
    if "XKV_TREE" in out:
        root = Path(out["XKV_TREE"]).resolve()
        if not (root / "xkv" / "__init__.py").is_file():
            raise SystemExit(f"kind {kind!r}: XKV_TREE {str(root)!r} holds no xkv package "
                             "(expected DIR/xkv/__init__.py)")
        out["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return out


def check(kinds: list[str], known: tuple[str, ...]) -> None:
    """Every kind is known or a valid variant (before any engine starts)."""
    for k in kinds:
        if base(k) not in known:
            raise SystemExit(f"unknown kind {k!r}: expected one of {known} or xkv@KEY=VALUE")
        options(k)
        env(k)


def report(rows: list[dict], lens: list[int], median) -> list[str]:
    """A table of the variant kinds against plain xkv and no connector (empty without variants).
    ``median(rows, kind, phase, n)``: e2e_ttft's median (None when absent)."""
    variants = sorted({r["kind"] for r in rows if "@" in r["kind"]})
    if not variants:
        return []
    f = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    pc = lambda x, y: "—" if x is None or not y else f"{(x / y - 1) * 100:+.1f}%"  # noqa: E731
    out = ["", "Variants (same call), TTFT ms, median:", "",
           "| kind | tokens | restore | restore vs xkv | cold with stores | vs recompute |",
           "|---|---|---|---|---|---|"]
    for v in variants:
        for n in lens:
            rs, xr = median(rows, v, "restore", n), median(rows, "xkv", "restore", n)
            cs, rc = median(rows, v, "cold", n), median(rows, "none", "cold", n)
            out.append(f"| {v} | {n} | {f(rs)} | {pc(rs, xr)} | {f(cs)} | {pc(cs, rc)} |")
    return out
