"""Move KV pages between a paged cache (:class:`~xkv.layout.PagePool`) and a flat byte buffer.

Public launchers (all offsets and lengths in bytes; index arguments are int64 tensors on any device,
numpy arrays or lists; a device tensor is read back by the validation, so hot paths pass host ones):

* :func:`restore` / :func:`restore_layers` -- flat fragments -> blocks (one launch for all layers);
* :func:`save` / :func:`save_layers` -- blocks -> flat fragments;
* :func:`restore_slice` -- only bytes ``[lo, hi)`` of the concatenated fragments;
* ``pack`` / ``unpack`` live in :mod:`xkv.kernels.staging`; copies validated once and launched
  layer by layer live in :mod:`xkv.kernels.prepared`.

Each validates everything first (:mod:`xkv.kernels.jobs`) and raises ``ValueError`` with nothing
written. Then, by ``engine``:

* ``"auto"``: the torch engine on CPU tensors; on CUDA the Triton kernel, or, once
  :func:`~xkv.kernels.calibrate.calibrate` has run on this GPU, whichever engine it measured
  fastest for this direction and fragment size;
* ``"triton"``: the kernel reads/writes the flat buffer directly (host memory over PCIe), SMs only
  (``_launch.py``, ``_triton.py``);
* ``"copy_engine"``: one ``cuMemcpyBatchAsync`` with every run of every fragment (no SMs; slow for
  small fragments; :mod:`xkv.kernels.copy_engine`);
* ``"staged"``: copy-engine transfers through a GPU staging ring, Triton between the ring and the
  pages (:mod:`xkv.kernels.staged`);
* ``"reference"``: the torch engine (any device; ``_torch.py``).

Every launcher takes ``checks=`` (:class:`~xkv.kernels.verify.Checks`): the copy then computes
the checksum words of what it moves (:mod:`xkv.kernels.checksum`) and returns their
:class:`~xkv.kernels.verify.CheckWords` (saves: the words; restores: residuals against
``checks.expected``, 0 where they match); without it it returns None and runs the unchanged,
hash-free kernel variant. Verified copies run the Triton kernel (CUDA, or interpreted), the staged
engine (its kernel half hashes the staging slot) or the torch engine; the copy engine does not
hash and is replaced by Triton.

``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (the tests use it); ``"copy_engine"`` and
``"staged"`` need CUDA; ``"staged"`` falls back to ``"triton"`` for slices. GPU work is ordered on
the current torch stream (the copy-engine paths hop to side streams and back with events); nothing
synchronizes the host.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from xkv.kernels import _budgets, _launch, _torch, copy_engine, staged
from xkv.kernels.calibrate import auto_engine
from xkv.kernels.jobs import IndexLike, Job, build_job, offsets_arg, pools_arg
from xkv.kernels.verify import Checks, CheckWords
from xkv.layout import PagePool

__all__ = [
    "ENGINES",
    "check_engine",
    "restore",
    "restore_layers",
    "restore_slice",
    "run",
    "save",
    "save_layers",
]

ENGINES = ("auto", "triton", "copy_engine", "staged", "reference")


def restore(src: torch.Tensor, src_offsets: IndexLike, dst: PagePool, block_ids: IndexLike, *,
            max_programs: int | None = None, engine: str = "auto",
            checks: Checks | None = None) -> CheckWords | None:
    """For every i: block ``block_ids[i]`` of ``dst`` <- ``src[src_offsets[i] : src_offsets[i] + dst.block_bytes]``."""
    job = build_job([dst], block_ids, src, offsets_arg(src_offsets, 1, "src_offsets"), save=False,
                    checks=checks)
    return run(job, engine, max_programs)


def restore_layers(src: torch.Tensor, src_offsets: IndexLike, dsts: Sequence[PagePool],
                   block_ids: IndexLike, *, max_programs: int | None = None,
                   engine: str = "auto", checks: Checks | None = None) -> CheckWords | None:
    """:func:`restore` for L layers at once; ``src_offsets`` is ``[L, n]`` (layer l, fragment i).

    Layers that share a geometry (block stride and runs) go in one launch, addressed through a
    table of per-layer base offsets.
    """
    dsts = pools_arg(dsts, "dsts")
    offs = offsets_arg(src_offsets, len(dsts), "src_offsets")
    return run(build_job(dsts, block_ids, src, offs, save=False, checks=checks), engine,
               max_programs)


def save(src: PagePool, block_ids: IndexLike, dst: torch.Tensor, dst_offsets: IndexLike, *,
         max_programs: int | None = None, engine: str = "auto",
         checks: Checks | None = None) -> CheckWords | None:
    """For every i: ``dst[dst_offsets[i] : dst_offsets[i] + src.block_bytes]`` <- block ``block_ids[i]`` of ``src``."""
    job = build_job([src], block_ids, dst, offsets_arg(dst_offsets, 1, "dst_offsets"), save=True,
                    checks=checks)
    return run(job, engine, max_programs)


def save_layers(srcs: Sequence[PagePool], block_ids: IndexLike, dst: torch.Tensor,
                dst_offsets: IndexLike, *, max_programs: int | None = None,
                engine: str = "auto", checks: Checks | None = None) -> CheckWords | None:
    """:func:`save` for L layers at once; ``dst_offsets`` is ``[L, n]``."""
    srcs = pools_arg(srcs, "srcs")
    offs = offsets_arg(dst_offsets, len(srcs), "dst_offsets")
    return run(build_job(srcs, block_ids, dst, offs, save=True, checks=checks), engine,
               max_programs)


def restore_slice(src: torch.Tensor, src_offsets: IndexLike, dst: PagePool, block_ids: IndexLike,
                  lo: int, hi: int, *, max_programs: int | None = None,
                  engine: str = "auto", checks: Checks | None = None) -> None:
    """:func:`restore`, but only bytes ``[lo, hi)`` of the concatenation of the n fragments (in
    order, ``n * dst.block_bytes`` bytes) are written; the range may start and end inside pages.
    Slices are not verified: ``checks`` is refused (``ValueError``)."""
    offs = offsets_arg(src_offsets, 1, "src_offsets")
    run(build_job([dst], block_ids, src, offs, save=False, lo=lo, hi=hi, checks=checks), engine,
        max_programs)


# --------------------------------------------------------------------------------------------------
# dispatch


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_engine(job: Job, engine: str, max_programs: int | None) -> tuple[str, int]:
    """``(engine, SM budget)`` for ``job``: ``"auto"`` resolved, every refusal a ``ValueError``."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if max_programs is not None and (
        not isinstance(max_programs, (int, np.integer)) or max_programs < 1
    ):
        raise ValueError(f"max_programs must be a positive int, got {max_programs!r}")
    budget = _budgets.copy_programs(max_programs, save=job.save, check=job.checks is not None,
                                   run_bytes=_budgets.min_run_bytes(job.pools))
    if not job.pools:
        return ("reference" if engine == "auto" else engine), budget
    dev = job.pools[0].device
    if engine == "auto":
        engine = auto_engine(job)
    if engine == "triton" and dev.type != "cuda" and not _interpreting():
        raise ValueError(
            "engine='triton' on CPU tensors needs TRITON_INTERPRET=1 (use 'reference' or 'auto')"
        )
    if engine in ("copy_engine", "staged") and dev.type != "cuda":
        raise ValueError(f"engine={engine!r} needs CUDA tensors")
    if engine == "staged" and job.sliced:
        engine = "triton"
    if job.checks is not None and engine == "copy_engine":
        engine = "triton"  # the copy engine cannot hash: the kernel copies and hashes at once
    if job.checks is not None and not job.checks.aligned and engine != "reference":
        engine = "reference"  # the kernel hashes 4-byte words: only the torch engine can here
    return engine, budget


def run(job: Job, engine: str, max_programs: int | None) -> CheckWords | None:
    """Execute a validated ``job`` with ``engine`` (see the module docstring); returns the
    job's checksum words (None for an unverified job)."""
    engine, budget = check_engine(job, engine, max_programs)
    words = None
    if job.checks is not None:
        words = job.checks.bind(job.pools[0].device if job.pools else job.flat.device, job.save)
    if not job.pools or job.n == 0 or job.block_bytes == 0 or job.lo == job.hi:
        return words
    if engine == "reference":
        _torch.run(job)
    elif engine == "triton":
        _launch.run(job, budget)
    elif engine == "staged":
        staged.run(job, budget)
    else:
        copy_engine.run(job)
    return words
