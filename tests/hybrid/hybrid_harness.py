"""run_hybrid(): tests/e2e's run_engine with the hybrid driver and the hybrid models' arguments."""

from __future__ import annotations

from pathlib import Path

import e2e_harness

DRIVER = Path(__file__).with_name("hybrid_driver.py")

#: block_size 32 is what we ask; vLLM raises it for these shapes so an attention page holds a
#: state page: nemotron_h 96, granitemoehybrid 64, qwen3_next 160 (= BLOCK below).
ARGS = {k: {"dtype": "bfloat16", "block_size": 32}
        for k in ("nemotron_h", "granitemoehybrid", "qwen3_next")}
BLOCK = {"nemotron_h": 96, "granitemoehybrid": 64, "qwen3_next": 160}


def run_hybrid(models, kind, gateway, steps, **kw):
    """Like e2e_harness.run_engine (child process, real gateway) with hybrid_driver.py."""
    saved = e2e_harness.DRIVER, dict(e2e_harness.MODEL_ARGS)
    e2e_harness.DRIVER = DRIVER
    e2e_harness.MODEL_ARGS.update(ARGS)
    try:
        return e2e_harness.run_engine(models, kind, gateway, steps, **kw)
    finally:
        e2e_harness.DRIVER = saved[0]
        e2e_harness.MODEL_ARGS.clear()
        e2e_harness.MODEL_ARGS.update(saved[1])
