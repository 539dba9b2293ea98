"""Checksum words of pages already in a paged cache, with nothing written (issue 25).

:func:`hash_pages` reads blocks ``block_ids`` of every layer pool and computes exactly the words
a checked :func:`~xkv.kernels.save_layers` of the same pages would return (the definition:
:mod:`xkv.kernels.checksum`; one word per (layer, object), from ``checks.objects`` /
``checks.pages``), but writes no byte anywhere except its own word buffer. The word depends on
the layer, the object and the page index inside the object, never on where a save would put the
bytes: there are no offsets to pass.

With ``checks.expected`` (uint32 ``[L, C]``) it returns residuals instead, like a checked
restore: the buffer starts at ``-expected`` and ``words[l, c] == 0`` exactly where layer ``l``
of object ``c`` matched (:meth:`~xkv.kernels.CheckWords.mismatched`). The use: restore
unchecked at full link speed, then hash the restored pages in HBM (reads at HBM rate) and
compare with the words the save sent.

Engines: ``"triton"`` (the page-copy kernel in its save direction, ``CHECK`` and ``STORE=False``:
no ``tl.store`` at all; CPU tensors need ``TRITON_INTERPRET=1``), ``"reference"`` (the torch
engine), ``"auto"`` (Triton on CUDA, the torch engine elsewhere). Pages whose runs, stride or
address are not 4-byte aligned (their size is) run the torch engine, as verified copies do.
Every bad argument is a ``ValueError`` before anything runs. GPU work is ordered on the current
stream; nothing synchronizes the host.

The kernel's signature has a flat-buffer argument: it gets :func:`null_flat`, 16 bytes on the
pools' device that nothing reads or writes (the tests poison it and check it stays poisoned).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xkv.kernels import _launch, _torch
from xkv.kernels.jobs import IndexLike, Job, _check_pools, as_index, pools_arg
from xkv.kernels.page_copy import check_engine
from xkv.kernels.verify import Checks, CheckWords, validate_checks
from xkv.layout import PagePool

__all__ = ["HASH_ENGINES", "build_hash_job", "hash_engine", "hash_pages", "null_flat"]

HASH_ENGINES = ("auto", "triton", "reference")


def hash_engine(engine: str, device: torch.device) -> str:
    """The engine a hash runs (``HASH_ENGINES``; ``"auto"``: Triton on CUDA, the torch engine
    elsewhere); ``ValueError`` for another name."""
    if engine not in HASH_ENGINES:
        raise ValueError(f"engine must be one of {HASH_ENGINES}, got {engine!r}")
    if engine == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return engine


def null_flat(device: torch.device) -> torch.Tensor:
    """The flat buffer a hash job hands the kernel: 16 bytes, never read, never written."""
    return torch.zeros(16, dtype=torch.uint8, device=device)


def build_hash_job(pools: Sequence[PagePool], block_ids: IndexLike, checks: Checks) -> Job:
    """A validated job that reads blocks ``block_ids`` of ``pools`` and hashes them (saves'
    direction, ``store=False``), its word buffer already bound (words, or residuals with
    ``checks.expected``): ready for ``_launch.launches`` / ``_torch.run``. ``ValueError``
    naming the argument otherwise."""
    pools = pools_arg(pools, "pools")
    if not pools:
        raise ValueError("pools must hold at least one PagePool")
    ids = as_index(block_ids, "block_ids")
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {ids.shape}")
    if not isinstance(checks, Checks):
        raise ValueError(f"checks must be a xkv.kernels.Checks, got {type(checks).__name__}")
    if checks.hash_only is not None:
        raise ValueError("hash_pages writes nothing: checks.hash_only has no meaning here")
    flat = null_flat(pools[0].device)
    _check_pools(pools, ids, flat, "flat", True)
    n, L = int(ids.size), len(pools)
    words = checks.expected is None  # else residuals against checks.expected (restores' rule)
    jc = validate_checks(checks, L=L, n=n, save=words, pools=pools, flat=flat, flat_off=None,
                         sliced=False)
    jc.bind(pools[0].device, words)  # words or residuals, whichever engine runs the job
    return Job(pools, ids, flat, None, 0, True, 0, L * n * pools[0].block_bytes, False, jc,
               store=False)


def hash_pages(pools: Sequence[PagePool], block_ids: IndexLike, checks: Checks, *,
               max_programs: int | None = None, engine: str = "auto") -> CheckWords:
    """The checksum words (``[L, C]``) of blocks ``block_ids`` of ``pools``, fragment ``i`` being
    page ``checks.pages[i]`` of object ``checks.objects[i]``; residuals against
    ``checks.expected`` when it is given (module docstring). Writes nothing but the words.

    ``max_programs``: the SM budget (default: a checked save's, ``DEFAULT_PROGRAMS`` or
    ``XKV_MAX_PROGRAMS``)."""
    if engine not in HASH_ENGINES:
        raise ValueError(f"engine must be one of {HASH_ENGINES}, got {engine!r}")
    job = build_hash_job(pools, block_ids, checks)
    engine, budget = check_engine(job, hash_engine(engine, job.pools[0].device), max_programs)
    words = job.checks.buf
    if job.n == 0 or job.block_bytes == 0:
        return words
    if engine == "reference":
        _torch.run(job)
    else:
        _launch.run(job, budget)
    return words
