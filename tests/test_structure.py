"""The code's shape, enforced in ``make test``: the import layering (import-linter contracts in
pyproject.toml), a line budget per module, and no block of code repeated inside ``xkv/``."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("xkv", "xkv_vllm_connector")
#: Lines per module (the standard: ~400, hard budget 500).
MAX_LINES = 500
#: A repeated block of this many code lines is a second home of one idea.
BLOCK = 6


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_import_layers_contracts_kept():
    """``lint-imports`` over the contracts in pyproject.toml ([tool.importlinter]): connector ->
    fanout -> kernels -> layout, the connector reaches the gateway through its client only, the
    gateway never imports torch, only compat/vllm_specs/facade/xkv_vllm_connector import vLLM."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                     os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    out = p.stdout + p.stderr
    assert "No module named 'importlinter'" not in out, (
        "import-linter is missing: install the dev extra (pip install -e '.[dev]')")
    assert p.returncode == 0, out[-4000:]
    assert "0 broken" in out, out[-4000:]


def test_modules_within_line_budget():
    over = {}
    for p in _modules():
        rel = p.relative_to(ROOT).as_posix()
        n = len(p.read_text().splitlines())
        if n > MAX_LINES:
            over[rel] = n
    assert not over, f"modules over {MAX_LINES} lines (split them by idea): {over}"


_TRIVIAL = re.compile(r"""^(#.*|[)\]}]+[,:]?|else:|try:|pass|return|\"\"\"|'''|["'][\w. -]*["'],?)$""")


def _code_lines(p: Path) -> list[tuple[int, str]]:
    rows = [(i + 1, ln.strip()) for i, ln in enumerate(p.read_text().splitlines())]
    return [(i, ln) for i, ln in rows if ln and not _TRIVIAL.match(ln)]


def test_no_repeated_blocks():
    seen: dict[tuple[str, ...], list[str]] = collections.defaultdict(list)
    for p in _modules():
        rel = p.relative_to(ROOT).as_posix()
        rows = _code_lines(p)
        for k in range(len(rows) - BLOCK + 1):
            seen[tuple(ln for _, ln in rows[k:k + BLOCK])].append(f"{rel}:{rows[k][0]}")
    dups = [where for where in seen.values() if len(where) > 1]
    assert not dups, f"blocks of {BLOCK} code lines repeated (give the idea one home): {dups[:5]}"


def test_the_checks_can_fail(tmp_path):
    """The duplicate finder and the budget see what they are meant to see."""
    body = "\n".join(f"x{i} = f({i})" for i in range(BLOCK))
    a = tmp_path / "a.py"
    a.write_text(body + "\n\n" + body + "\n")
    rows = _code_lines(a)
    blocks = [tuple(ln for _, ln in rows[k:k + BLOCK]) for k in range(len(rows) - BLOCK + 1)]
    assert len(blocks) != len(set(blocks))
    assert _code_lines(tmp_path / "a.py")[0] == (1, "x0 = f(0)")


def test_every_xkv_environment_variable_is_documented():
    """Every ``XKV_*`` variable the code names (a string literal that is exactly the name, or
    ``$XKV_...`` in a shell script) appears in docs/configuration.md."""
    pat = re.compile(r"""["'](XKV_[A-Z0-9_]+)["']|\$\{?(XKV_[A-Z0-9_]+)""")
    read = set()
    for top in ("xkv", "xkv_vllm_connector", "bench", "scripts", "tests", "examples"):
        for p in (ROOT / top).rglob("*"):
            if p.suffix in (".py", ".sh") and p.is_file():
                read.update(a or b for a, b in pat.findall(p.read_text()))
    assert {"XKV_GATEWAY_HOSTNAME", "XKV_LOAD_ENGINE", "XKV_MAX_PROGRAMS"} <= read
    docs = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(v for v in read if f"`{v}`" not in docs)
    assert not missing, f"XKV_* variables read but not in docs/configuration.md: {missing}"
