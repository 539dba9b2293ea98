"""bench/e2e_kinds.py: a variant kind's connector options and environment variables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

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
