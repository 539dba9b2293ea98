"""The README's commands from any checkout: ``make install`` re-points the shared environment's
editable install at the clone that runs it (two clones and a moved one, one environment).

Uses a throwaway venv (pip and setuptools linked in from the running environment, nothing else),
never the shared one; the shared one's editable finder is checked to be unchanged."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _site(venv: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def _throwaway_venv(d: Path) -> Path:
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    tools = d / "tools"
    tools.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for pattern in ("pip", "pip-*.dist-info", "setuptools", "setuptools-*.dist-info",
                    "_distutils_hack", "pkg_resources"):
        for p in here.glob(pattern):
            (tools / p.name).symlink_to(p)
    (_site(venv) / "xkv-test-tools.pth").write_text(f"{tools}\n")
    return venv


def _imports(venv: Path, cwd: Path) -> tuple[str, str]:
    code = ("import importlib.metadata as m, xkv, xkv_vllm_connector; print(xkv.__file__); "
            "print([e.value for e in m.entry_points(group='vllm.general_plugins') "
            "if e.name == 'xkv'])")
    out = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", code], cwd=cwd,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return out[0], out[1]


def _make_install(clone: Path, venv: Path) -> str:
    r = subprocess.run(["make", "-C", str(clone), "install", f"VENV={venv}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None
                    or not (ROOT / ".git").exists(), reason="needs git, make and a git checkout")
def test_two_clones_one_environment(tmp_path):
    shared_finders = sorted(Path(sysconfig.get_paths()["purelib"]).glob("__editable__*xkv*"))
    before = [p.read_bytes() for p in shared_finders]
    clones = [tmp_path / "one", tmp_path / "two"]
    for c in clones:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(c)], check=True)
    venv = _throwaway_venv(tmp_path)
    (venv / ".xkv-stamp").touch()  # the recipe is "installed" (newer than both clones' files)
    for c in clones:
        out = _make_install(c, venv)
        assert f"pointing {venv} at {c.resolve()}" in out
        where, plugin = _imports(venv, tmp_path)
        assert where == str(c.resolve() / "xkv" / "__init__.py")
        assert plugin == "['xkv_vllm_connector:register']"
    out = _make_install(clones[1], venv)  # already right: nothing to do
    assert "pointing" not in out
    moved = tmp_path / "moved"
    clones[1].rename(moved)  # the clone that built it moves away (or is deleted)
    shutil.rmtree(clones[0])
    out = _make_install(moved, venv)
    assert f"at {moved.resolve()}" in out
    assert _imports(venv, tmp_path)[0] == str(moved.resolve() / "xkv" / "__init__.py")
    # the environment running this test was not touched
    assert [p.read_bytes() for p in shared_finders] == before


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and a git checkout")
def test_relink_when_the_venv_setuptools_cannot_build(tmp_path):
    """The matrix venvs python3.11 creates hold ensurepip's setuptools 65.5 (no bdist_wheel, no
    SPDX license): re-pointing them at another clone must still work (CI, stop 19: the 0.26.0
    matrix venv failed with "invalid command 'bdist_wheel'")."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    old = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import setuptools; print(setuptools.__version__)"],
                         capture_output=True, text=True)
    r = subprocess.run(["bash", str(clone / "scripts" / "relink.sh"), str(venv), str(clone)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"setuptools {old.stdout.strip()}: {r.stdout}{r.stderr}"
    assert _imports(venv, tmp_path)[0] == str(clone.resolve() / "xkv" / "__init__.py")
