"""run_hybrid(): tests/e2e's run_engine (the one engine driver) with the hybrid models."""

from __future__ import annotations

import e2e_harness

#: block_size 32 is what we ask; vLLM raises it for these shapes so an attention page holds a
#: state page: nemotron_h 96, granitemoehybrid 64, qwen3_next 160 (= BLOCK below).
BLOCK = {"nemotron_h": 96, "granitemoehybrid": 64, "qwen3_next": 160}
assert set(BLOCK) <= set(e2e_harness.MODEL_ARGS)

run_hybrid = e2e_harness.run_engine
