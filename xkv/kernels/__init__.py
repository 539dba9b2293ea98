"""Page movers: Triton kernels (and a torch engine) between a paged KV cache and flat bytes.

Public API (see each module's docstring for shapes and units):

* :mod:`~xkv.kernels.page_copy`: ``restore``, ``restore_layers``, ``save``, ``save_layers``,
  ``restore_slice`` and the engines (``ENGINES``); :mod:`~xkv.kernels.staging`: ``pack``, ``unpack``;
* :mod:`~xkv.kernels.prepared`: ``prepare_restore`` / ``prepare_save`` -> ``PreparedCopy`` (a step's
  copies validated and uploaded once, then launched per layer with no host work);
* :mod:`~xkv.kernels.checksum` (the definition) and :mod:`~xkv.kernels.verify` (``Checks``,
  ``CheckWords``, ``mismatch_flags``): checksums computed inside the copies (``checks=`` on
  every launcher);
* :mod:`~xkv.kernels.hashing`: ``hash_pages`` (the words of pages already in the cache, or
  residuals against expected words, with nothing written: verify after an unchecked restore);
  :mod:`~xkv.kernels.hashed_restore`: ``prepare_hashed_restore`` (a verified restore in two
  passes: the unchecked copy, then the hash in HBM), ``prepare_page_hash`` (the hash alone, for
  pages another path wrote: the NVLink fan-out);
* :mod:`~xkv.kernels.warmup`: ``warmup`` (compile every variant before the first copy);
* :mod:`~xkv.kernels.calibrate`: ``calibrate``, ``calibration``, ``set_calibration``;
* :mod:`~xkv.kernels.host`: ``register_host``, ``unregister_host``, ``is_host_accessible``;
* :mod:`~xkv.kernels.ring`: the GPU staging ring of restores through the copy engine
  (:mod:`~xkv.kernels.staged_restore`); ``reserve_staging`` allocates it at start-up;
* :mod:`~xkv.kernels.ring_choice`: ``probe_ring`` (at start-up: does the ring beat the Triton
  kernel on this host by enough to take it, ``auto``'s choice from then on, for restores of at
  least its ``ring_from_bytes``);
* :mod:`~xkv.kernels.pinned`: the page-locked staging pool every copy step takes its tables,
  words and readbacks from (``pinned.reserve_for`` at start: no allocation inside a step);
* ``launch_config`` / ``default_programs`` (launch sizes, ``XKV_MAX_PROGRAMS``),
  ``WHOLE_HASH_PROGRAMS`` (the budget of one hash over every restored layer),
  ``light_restore_programs`` (a light step's verified restore, ``XKV_LIGHT_PROGRAMS``).

Inside: ``jobs`` validates, ``_launch`` + ``_triton`` are the Triton engine, ``_torch`` the torch
engine, ``copy_engine`` and ``staged`` the DMA engines. Importing this package does not import
Triton; the first GPU (or interpreted) launch does.
"""

from xkv.kernels import pinned
from xkv.kernels._budgets import WHOLE_HASH_PROGRAMS, default_programs, light_restore_programs
from xkv.kernels._launch import LaunchConfig, launch_config
from xkv.kernels.calibrate import Calibration, calibrate, calibration, set_calibration
from xkv.kernels.hashed_restore import (
    HashedRestore,
    PageHash,
    prepare_hashed_restore,
    prepare_page_hash,
)
from xkv.kernels.hashing import hash_pages
from xkv.kernels.host import is_host_accessible, register_host, unregister_host
from xkv.kernels.page_copy import (
    ENGINES,
    restore,
    restore_layers,
    restore_slice,
    save,
    save_layers,
)
from xkv.kernels.prepared import PreparedCopy, prepare_restore, prepare_save
from xkv.kernels.ring import reserve as reserve_staging
from xkv.kernels.ring_choice import MIN_GAIN as RING_MIN_GAIN
from xkv.kernels.ring_choice import RING_EXTRA_S
from xkv.kernels.ring_choice import probe as probe_ring
from xkv.kernels.staged_restore import MAX_PAGE_BYTES as RING_PAGE_BYTES
from xkv.kernels.staging import pack, unpack
from xkv.kernels.verify import Checks, CheckWords, mismatch_flags
from xkv.kernels.warmup import warmup

__all__ = [
    "RING_EXTRA_S",
    "RING_MIN_GAIN",
    "RING_PAGE_BYTES",
    "CheckWords",
    "Checks",
    "Calibration",
    "HashedRestore",
    "PageHash",
    "ENGINES",
    "LaunchConfig",
    "WHOLE_HASH_PROGRAMS",
    "PreparedCopy",
    "calibrate",
    "calibration",
    "default_programs",
    "light_restore_programs",
    "hash_pages",
    "is_host_accessible",
    "launch_config",
    "mismatch_flags",
    "pack",
    "pinned",
    "prepare_hashed_restore",
    "prepare_page_hash",
    "prepare_restore",
    "prepare_save",
    "probe_ring",
    "register_host",
    "reserve_staging",
    "restore",
    "restore_layers",
    "restore_slice",
    "save",
    "save_layers",
    "set_calibration",
    "unpack",
    "unregister_host",
    "warmup",
]
