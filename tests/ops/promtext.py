"""Reading Prometheus text (a scrape) and the Grafana dashboard's PromQL selectors, for tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"')
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
# a metric name in PromQL: ours or vLLM's, optionally followed by a {selector}
_SELECTOR = re.compile(r"\b((?:xkv_gateway_|vllm:)[A-Za-z0-9_:]+)(\{[^}]*\})?")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a scrape."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = {k: v for k, op, v in _LABEL.findall(m.group(2) or "") if op == "="}
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def value(text: str, series: str) -> float:
    """The value of ``name{a="b",...}`` (exact label match on the given labels) in a scrape."""
    m = _SELECTOR.match(series) or re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?", series)
    name, want = m.group(1), dict((k, v) for k, _op, v in _LABEL.findall(m.group(2) or ""))
    found = [v for n, labels, v in samples(text)
             if n == name and all(labels.get(k) == x for k, x in want.items())]
    if len(found) != 1:
        raise AssertionError(f"{series}: {len(found)} samples in the scrape")
    return found[0]


def dashboard_selectors(path: Path = DASHBOARD) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """(metric name, equality label matchers other than job) of every panel query."""
    dash = json.loads(path.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    out = set()
    for e in exprs:
        for name, sel in _SELECTOR.findall(e):
            eq = tuple(sorted((k, v) for k, op, v in _LABEL.findall(sel)
                              if op == "=" and k != "job"))
            out.add((name, eq))
    return out


def missing(text: str, selectors, prefix: str) -> list[str]:
    """Selectors starting with ``prefix`` that no sample of ``text`` satisfies."""
    have = samples(text)
    out = []
    for name, eq in sorted(selectors):
        if not name.startswith(prefix):
            continue
        if not any(n == name and all(lab.get(k) == v for k, v in eq) for n, lab, _ in have):
            out.append(name + ("{" + ",".join(f'{k}="{v}"' for k, v in eq) + "}" if eq else ""))
    return out
