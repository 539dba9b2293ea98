"""bench/e2e_kinds.py: a variant kind's connector options and environment variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import e2e_kinds  # noqa: E402


def test_options_and_environment_split():
    k = "xkv@verify_checksums=off+XKV_TAIL_ORDER=last+CUDA_MODULE_LOADING=EAGER+chunk_size=128"
    assert e2e_kinds.base(k) == "xkv"
    assert e2e_kinds.options(k) == {"verify_checksums": False, "chunk_size": 128}
    assert e2e_kinds.env(k) == {"XKV_TAIL_ORDER": "last", "CUDA_MODULE_LOADING": "EAGER"}
    assert e2e_kinds.env("xkv@VLLM_X=1+TORCH_Y=a") == {"VLLM_X": "1", "TORCH_Y": "a"}
    assert e2e_kinds.options("xkv") == {} and e2e_kinds.env("offload") == {}


@pytest.mark.parametrize("bad", ["offload@x=1", "xkv@novalue", "xkv@=1", "nothing"])
def test_bad_kinds_refused_before_any_engine(bad):
    with pytest.raises(SystemExit):
        e2e_kinds.check([bad], ("none", "xkv", "offload"))


def test_a_tree_kind_runs_that_trees_xkv(tmp_path):
    """``xkv@XKV_TREE=DIR``: an engine child (a script outside DIR, as bench/e2e_ttft.py is)
    imports ``xkv`` from DIR ahead of this checkout (installed or on ``PYTHONPATH``); a DIR
    without the package is refused before any engine starts."""
    tree = tmp_path / "base"
    (tree / "xkv").mkdir(parents=True)
    (tree / "xkv" / "__init__.py").write_text("")
    script = tmp_path / "child.py"
    script.write_text("import xkv\nprint(xkv.__file__)\n")
    kind = f"xkv@XKV_TREE={tree}"
    env = dict(os.environ, **e2e_kinds.env(kind))
    assert env["XKV_TREE"] == str(tree)
    got = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert Path(got) == tree / "xkv" / "__init__.py"
    # without the kind the same child gets this checkout's
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True).stdout.strip()
    assert Path(plain) == ROOT / "xkv" / "__init__.py"
    with pytest.raises(SystemExit, match="holds no xkv package"):
        e2e_kinds.check([f"xkv@XKV_TREE={tmp_path / 'nothing'}"], ("xkv",))
