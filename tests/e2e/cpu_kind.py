"""Imported in the engine process (scenario key ``imports``): vLLM sees a CPU with fewer
features than this one, as on another CI machine.

vLLM's CPU platform decides by ``torch.cpu._is_avx512_bf16_supported()`` and
``torch.cpu._is_amx_tile_supported()`` (vllm/platforms/cpu.py: the kernel library it loads, the
Mamba state dtype and so the hybrid block sizes, the MLA backend and its block size; the
kernels ask the same functions). ``XKV_TEST_CPU_KIND`` picks what it sees:

* ``plain``: neither AVX512-BF16 nor AMX (vLLM loads its ``_C_AVX512`` or ``_C_AVX2`` kernels);
* ``avx512bf16``: AVX512-BF16 without AMX (an AMD EPYC; on an AMX Xeon, AMX hidden).

Only features this CPU has can be hidden: a kind that needs a feature it lacks is refused (its
kernels would not run here), so an AMX CPU emulates both other kinds and an AVX512-BF16 one
emulates ``plain``. Must be imported before vLLM loads its kernels (the driver's ``imports``);
without ``XKV_TEST_CPU_KIND`` importing it changes nothing (the tests use its helpers).
"""

from __future__ import annotations

import os

import torch

KINDS = {"plain": {"avx512_bf16": False, "amx": False},
         "avx512bf16": {"avx512_bf16": True, "amx": False}}
_REAL = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported,
         "amx": torch.cpu._is_amx_tile_supported}


def real_features() -> dict[str, bool]:
    return {k: bool(f()) for k, f in _REAL.items()}


def can_emulate(kind: str) -> bool:
    """Whether this CPU has every feature ``kind`` keeps (hiding is possible, adding is not)."""
    real = real_features()
    return all(real[k] or not v for k, v in KINDS[kind].items())


def emulate(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"XKV_TEST_CPU_KIND={kind!r}: expected one of {sorted(KINDS)}")
    if not can_emulate(kind):
        raise RuntimeError(f"cannot emulate {kind!r} on a CPU with {real_features()}: "
                           "only features the CPU has can be hidden")
    want = KINDS[kind]
    torch.cpu._is_avx512_bf16_supported = lambda: want["avx512_bf16"]
    torch.cpu._is_amx_tile_supported = lambda: want["amx"]


if os.environ.get("XKV_TEST_CPU_KIND"):  # the engine process (the driver's ``imports``)
    emulate(os.environ["XKV_TEST_CPU_KIND"])
