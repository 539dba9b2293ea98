"""Page movers: Triton kernels (and their torch references) between a paged KV cache and flat bytes.

See ``docs/internal-api.md`` for the contract. Importing this package does not import Triton; the
first GPU (or interpreted) launch does.
"""

from xkv.kernels._launch import LaunchConfig, default_programs, launch_config
from xkv.kernels.host import is_host_accessible, register_host, unregister_host
from xkv.kernels.page_copy import (
    ENGINES,
    Calibration,
    calibrate,
    calibration,
    restore,
    restore_layers,
    restore_layers_ref,
    restore_ref,
    restore_slice,
    restore_slice_ref,
    save,
    save_layers,
    save_layers_ref,
    save_ref,
    set_calibration,
)
from xkv.kernels.staging import pack, pack_ref, unpack, unpack_ref

__all__ = [
    "Calibration",
    "ENGINES",
    "LaunchConfig",
    "calibrate",
    "calibration",
    "default_programs",
    "is_host_accessible",
    "launch_config",
    "pack",
    "pack_ref",
    "register_host",
    "restore",
    "restore_layers",
    "restore_layers_ref",
    "restore_ref",
    "restore_slice",
    "restore_slice_ref",
    "save",
    "save_layers",
    "save_layers_ref",
    "save_ref",
    "set_calibration",
    "unpack",
    "unpack_ref",
    "unregister_host",
]
