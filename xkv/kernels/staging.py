"""Pack pages into / unpack pages from a contiguous staging buffer.

``staging[i * block_bytes : (i + 1) * block_bytes]`` holds block ``block_ids[i]``: the same kernel as
:mod:`xkv.kernels.page_copy` with the flat offsets implied, so no offset table is built or uploaded.
Same validation, engines and CPU behaviour as the other launchers.
"""

from __future__ import annotations

import torch

from xkv.kernels.jobs import IndexLike, build_job
from xkv.kernels.page_copy import run
from xkv.layout import PagePool

__all__ = ["pack", "unpack"]


def pack(src: PagePool, block_ids: IndexLike, staging: torch.Tensor, *,
         max_programs: int | None = None, engine: str = "auto") -> None:
    """``staging[i*block_bytes : (i+1)*block_bytes]`` <- block ``block_ids[i]`` of ``src``."""
    run(build_job([src], block_ids, staging, None, save=True, flat_name="staging"), engine,
        max_programs)


def unpack(staging: torch.Tensor, dst: PagePool, block_ids: IndexLike, *,
           max_programs: int | None = None, engine: str = "auto") -> None:
    """Block ``block_ids[i]`` of ``dst`` <- ``staging[i*block_bytes : (i+1)*block_bytes]``."""
    run(build_job([dst], block_ids, staging, None, save=False, flat_name="staging"), engine,
        max_programs)
