"""run_hybrid(): tests/e2e's run_engine (the one engine driver) with the hybrid models.

Block sizes are vLLM's choice and differ by CPU (block_size 32 asked; vLLM raises it so an
attention page holds a state page: with these shapes nemotron_h 96, granitemoehybrid 64 or 96,
qwen3_next 160 or 288, the larger ones where AVX512-BF16 keeps states in fp32). Tests ask
``chunk_size: {"blocks": k}`` and read the chosen size back with ``block_size(res)``.
"""

from __future__ import annotations

import e2e_harness
from e2e_harness import block_size, emulating, native_kind, other_kinds_or_skip  # noqa: F401

KINDS = ("nemotron_h", "granitemoehybrid", "qwen3_next")
assert set(KINDS) <= set(e2e_harness.MODEL_ARGS)

run_hybrid = e2e_harness.run_engine
