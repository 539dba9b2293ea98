"""Turning fan-out on for one worker: decide, find the NVLink groups, make the communicator,
allocate staging, probe the exchange — with every TP rank agreeing at each step.

Call ``build_restorer`` on every TP rank after vLLM allocated the KV cache (so the staging buffer
and the communicator live outside ``gpu_memory_utilization``). It returns ``(restorer, decision)``;
``restorer`` is None when fan-out is off (the decision says why, and one warning was logged).
Every step that could fail on one rank only is agreed over the TP CPU group before the next
collective, so a refusal is always unanimous and never leaves a rank waiting.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from xkv.fanout.comm import Exchanger, LocalExchanger, NcclExchanger, PyncclExchanger, agree
from xkv.fanout.config import FanoutConfig
from xkv.fanout.eligibility import CacheFacts, Decision, Mode, Reason, decide, report
from xkv.fanout.engine import FanoutRestorer
from xkv.fanout.topology import local_gpu_uuid, open_nvml, resolve_groups

logger = logging.getLogger("xkv.fanout")

#: free GPU memory to keep beyond staging for the NCCL communicator's buffers (bytes)
COMM_RESERVE_BYTES = 1 << 30
#: the exchange must move bytes at least this many times faster than one PCIe link
MIN_EXCHANGE_RATIO = 2.0


def probe_exchange(exchanger: Exchanger, buf: torch.Tensor, host: torch.Tensor, iters: int = 3) -> tuple[float, float]:
    """(all-gather bus bandwidth, host-to-GPU bandwidth) in bytes/s, both on ``buf`` (GPU).

    Bus bandwidth = bytes each rank receives / time = (N-1)/N * len(buf) / t. The first
    all-gather connects NCCL's channels and is not timed."""
    n = exchanger.size
    share = buf.numel() // n // 256 * 256
    exchanger.all_gather_inplace(buf, share)
    torch.cuda.synchronize(buf.device)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    for _ in range(iters):
        exchanger.all_gather_inplace(buf, share)
    ev[1].record()
    ev[2].record()
    for _ in range(iters):
        buf[: host.numel()].copy_(host, non_blocking=True)
    ev[3].record()
    torch.cuda.synchronize(buf.device)
    t_ag = ev[0].elapsed_time(ev[1]) / 1e3 / iters
    t_h2d = ev[2].elapsed_time(ev[3]) / 1e3 / iters
    return (n - 1) / n * share * n / t_ag, host.numel() / t_h2d


def build_restorer(config: FanoutConfig, facts: CacheFacts, tp_rank: int, tp_size: int,
                   device: torch.device | str, *, cpu_group: Any = None, tp_pynccl: Any = None,
                   nvml_factory: Any = open_nvml, share_copy: str = "auto",
                   probe: bool = True, gpu_uuid: str | None = None,
                   ) -> tuple[FanoutRestorer | None, Decision]:
    """Build this TP rank's restorer (collective over ``cpu_group``, the TP gloo group; None =
    default group). ``tp_pynccl``: vLLM's TP ``PyNcclCommunicator``, reused when the fan-out
    group is the whole TP group. ``gpu_uuid``: this rank's GPU UUID when the caller knows it;
    otherwise it comes from torch, else from ``CUDA_VISIBLE_DEVICES`` resolved through NVML
    (which depends on the process environment)."""
    decision = decide(config, facts)
    if not decision.on:
        report(decision)
        return None, decision
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.monotonic()
    my_uuid = gpu_uuid or _gpu_uuid(device, tp_rank, nvml_factory)
    assignment = resolve_groups(config, tp_rank, tp_size, my_uuid, cpu_group=cpu_group,
                                nvml_factory=nvml_factory)
    if assignment.reason is not Reason.OK:
        return _refuse(Decision(False, assignment.reason, assignment.detail))
    group = assignment.group
    active = len(group) > 1

    # local checks first, agreed before any communicator exists
    staging: torch.Tensor | None = None
    problem: Decision | None = None
    if active:
        need = config.slots * config.slot_bytes + COMM_RESERVE_BYTES
        try:
            free, _ = torch.cuda.mem_get_info(device)
            if free < need:
                problem = Decision(False, Reason.MEMORY, f"{free} bytes free on {device}, need {need} "
                                   f"(staging {config.slots * config.slot_bytes} + communicator reserve)")
            else:
                staging = torch.empty(config.slots * config.slot_bytes, dtype=torch.uint8, device=device)
        except Exception as e:  # no CUDA, OOM: refuse on every rank, never leave one waiting
            problem = Decision(False, Reason.MEMORY, f"cannot allocate {need} bytes on {device}: {e}")
    if not agree(cpu_group, problem is None):
        return _refuse(problem or Decision(False, Reason.MEMORY, "another TP rank lacks GPU memory"))

    exchanger: Exchanger
    try:
        whole_tp = len(assignment.partition) == 1
        if whole_tp and tp_pynccl is not None and not getattr(tp_pynccl, "disabled", True):
            exchanger = PyncclExchanger(tp_pynccl, tp_size, tp_rank, cpu_group=cpu_group)
        else:
            made = NcclExchanger.create(assignment.partition, tp_rank, tp_size, device, cpu_group)
            exchanger = made or LocalExchanger(1, cpu_group=cpu_group, agree_with_peers=True)
        ok = True
    except Exception as e:  # NCCL missing / init failure: agree, then refuse everywhere
        logger.debug("fan-out exchanger failed: %s", e)
        exchanger, ok, problem = LocalExchanger(1), False, Decision(False, Reason.NCCL, str(e))
    if not agree(cpu_group, ok):
        exchanger.close()
        return _refuse(problem or Decision(False, Reason.NCCL, "another TP rank could not set up NCCL"))

    ratio_ok, detail = True, ""
    if probe and active:
        with torch.cuda.device(device):
            host = torch.empty(min(config.slot_bytes, 64 << 20), dtype=torch.uint8, pin_memory=True)
            bus, h2d = probe_exchange(exchanger, staging[: config.slot_bytes], host)
        ratio_ok = bus >= MIN_EXCHANGE_RATIO * h2d
        detail = f"all-gather bus bandwidth {bus / 1e9:.1f} GB/s, one PCIe link {h2d / 1e9:.1f} GB/s"
        logger.info("XKV fan-out probe (TP rank %d): %s", tp_rank, detail)
    if not agree(cpu_group, ratio_ok):
        exchanger.close()
        return _refuse(Decision(False, Reason.SLOW_EXCHANGE, detail or "measured on another TP rank"))

    mode = decision.mode or Mode.LAYERWISE
    restorer = FanoutRestorer(config, exchanger, device, mode=mode, active=active,
                              share_copy=share_copy, staging=staging)
    final = Decision(True, Reason.OK, f"groups {list(assignment.partition)}; set up in "
                     f"{time.monotonic() - t0:.2f} s; {detail}", mode)
    report(final)
    return restorer, final


def _gpu_uuid(device: torch.device, tp_rank: int, nvml_factory: Any) -> str:
    """This rank's GPU UUID: torch's, else CUDA_VISIBLE_DEVICES through NVML, else a name no
    other rank has (the rank still joins the collectives; this GPU is nobody's peer)."""
    try:
        props = torch.cuda.get_device_properties(device)
        return local_gpu_uuid(device.index or 0, torch_uuid=str(getattr(props, "uuid", "") or ""),
                              nvml=None)
    except Exception:
        try:
            return local_gpu_uuid(device.index or 0, nvml=nvml_factory())
        except Exception as e:
            logger.debug("fan-out: GPU UUID of %s unknown: %s", device, e)
            return f"unknown-tp-rank-{tp_rank}"


def _refuse(decision: Decision) -> tuple[None, Decision]:
    report(decision)
    return None, decision
