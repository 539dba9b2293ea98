"""On GPUs: a group of one (no NCCL communicator), virtual ranks restoring a vLLM-shaped MLA
cache bit-exactly (one GPU), and real NCCL across 2+ GPUs (``multi_gpu``, spawned processes)."""

import os

import pytest
import torch
from fanout_helpers import cache_bytes, make_case, run_workers

# NVLink multicast off in this process and every child (shared GPUs; KINDS.md)
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

# DeepSeek-V3 bf16 pages (block 64 x 1152 B = 72 KiB): many 4-block chunks, or a few 64-block ones
DSV3_SMALL_CHUNKS = dict(layers=3, num_blocks=600, block_size=64, chunk_blocks=4, chunks=64, seed=11)
DSV3_BIG_CHUNKS = dict(layers=3, num_blocks=600, block_size=64, chunk_blocks=64, chunks=8, seed=12)
FP8DS_RATIO2 = dict(layers=2, num_blocks=90, block_size=64, width=656, dtype=torch.uint8, ratio=2,
                    chunk_blocks=1, chunks=37, seed=13)


def _restore_and_check(restorer, case):
    """begin -> wait_layer per layer; a clone taken on the compute stream right after each
    wait_layer (no host sync) must already hold the restored bytes."""
    assert restorer.begin(case.card, case.loads)
    seen = []
    for ld, cache in zip(case.loads, case.caches, strict=True):
        restorer.wait_layer(ld.layer)
        seen.append(cache.view(torch.uint8).clone())  # queued on the current stream
    restorer.finish()
    torch.cuda.synchronize()
    for c, snap, exp in zip(case.caches, seen, case.expected, strict=True):
        assert torch.equal(cache_bytes(c), exp)
        assert torch.equal(snap.reshape(-1).cpu(), exp)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [DSV3_SMALL_CHUNKS, DSV3_BIG_CHUNKS, FP8DS_RATIO2],
                         ids=["dsv3_small_chunks", "dsv3_big_chunks", "fp8ds_ratio2"])
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("share_copy", ["kernel", "dma"])
def test_virtual_ranks_bit_exact(kw, n, share_copy):
    from xkv.fanout import FanoutConfig, FanoutRestorer, LocalExchanger

    dev = torch.device("cuda", 0)
    cfg = FanoutConfig(enabled=True, staging_bytes=32 << 20, min_layer_bytes=0)  # 16 MiB slots: rounds
    case = make_case(**kw, device=dev, pin=True)
    r = FanoutRestorer(cfg, LocalExchanger(n, virtual=n > 1), dev, share_copy=share_copy)
    _restore_and_check(r, case)
    total = sum(ld.block_ids.numel() * ld.dst.block_bytes for ld in case.loads)
    assert r.stats["bytes_copied"] == total and r.stats["bytes_gathered"] == 0
    r.close()


@pytest.mark.gpu
def test_bulk_mode_restores_in_begin():
    from xkv.fanout import FanoutConfig, FanoutRestorer, LocalExchanger, Mode

    dev = torch.device("cuda", 0)
    case = make_case(**DSV3_BIG_CHUNKS, device=dev, pin=True)
    r = FanoutRestorer(FanoutConfig(enabled=True, min_layer_bytes=0), LocalExchanger(4, virtual=True),
                       dev, mode=Mode.BULK)
    assert r.begin(case.card, case.loads)
    snaps = [c.view(torch.uint8).clone() for c in case.caches]  # no wait_layer at all
    torch.cuda.synchronize()
    assert all(torch.equal(s.reshape(-1).cpu(), e) for s, e in zip(snaps, case.expected, strict=True))


def _group_of_one_worker(rank, world, init_file, q):
    import torch.distributed as dist

    import xkv.fanout.comm as comm

    class NoNccl:
        def __init__(self, *a, **k):
            raise AssertionError("a group of one must not touch NCCL")

    comm.NcclLib = NoNccl
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dev = torch.device("cuda", 0)
    made = comm.NcclExchanger.create(((0,),), 0, 1, dev)
    from xkv.fanout import FanoutConfig, FanoutRestorer, LocalExchanger

    r = FanoutRestorer(FanoutConfig(enabled=True, min_layer_bytes=0), LocalExchanger(1), dev)
    case = make_case(**DSV3_SMALL_CHUNKS, device=dev, pin=True)
    _restore_and_check(r, case)
    q.put(("ok", made is None))


@pytest.mark.gpu
def test_group_of_one_creates_no_communicator():
    assert run_workers(_group_of_one_worker, 1, method="spawn") == [("ok", True)]


def _nccl_worker(rank, world, init_file, q):
    import torch.distributed as dist

    from xkv.fanout import CacheFacts, FanoutConfig, NcclExchanger, build_restorer
    from xkv.kernels import restore

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # 1. the raw in-place all-gather, odd share sizes
    ex = NcclExchanger.create((tuple(range(world)),), rank, world, dev)
    for share in (256, 3 * 4096 + 256, 1 << 20):
        buf = torch.full((world * share + 512,), 0xEE, dtype=torch.uint8, device=dev)
        pat = [(torch.arange(share, device=dev) * (k + 3) + k).to(torch.uint8) for k in range(world)]
        buf[rank * share:(rank + 1) * share] = pat[rank]
        ex.all_gather_inplace(buf, share)
        ok = torch.equal(buf[: world * share], torch.cat(pat)) and bool((buf[world * share:] == 0xEE).all())
        q.put((rank, f"allgather/{share}", ok, ""))
    ex.close()
    # 2. the whole path on the real NVML topology, with the warm-up probe
    cfg = FanoutConfig(enabled=True, min_layer_bytes=0, staging_bytes=64 << 20)
    facts = CacheFacts(use_mla=True, tp_size=world, spec_kinds=("mla",) * 3)
    restorer, decision = build_restorer(cfg, facts, rank, world, dev)
    q.put((rank, "decision", True, f"{decision.reason.name}: {decision.detail}"))
    if restorer is not None:
        for name, kw in (("dsv3_small", DSV3_SMALL_CHUNKS), ("dsv3_big", DSV3_BIG_CHUNKS), ("fp8ds", FP8DS_RATIO2)):
            for share_copy in ("kernel", "dma"):
                restorer.share_copy = share_copy
                case = make_case(**kw, device=dev, pin=True)
                ref = make_case(**kw, device=dev, card=case.card)
                for ld in ref.loads:  # every rank copies the whole layer
                    restore(ref.card, ld.src_offsets, ld.dst, ld.block_ids)
                try:
                    _restore_and_check(restorer, case)
                    same = all(torch.equal(a, b) for a, b in zip(case.caches, ref.caches, strict=True))
                    q.put((rank, f"restore/{name}/{share_copy}", same, str(restorer.stats)))
                except AssertionError as e:
                    q.put((rank, f"restore/{name}/{share_copy}", False, str(e)[:200]))
        # a rank-local failure: nobody issues a collective, nobody hangs
        case = make_case(**DSV3_BIG_CHUNKS, device=dev, pin=True)
        if rank == 1:
            case.loads[0].block_ids[0] = 10**6
        started = restorer.begin(case.card, case.loads)
        q.put((rank, "agreement", not started, restorer.last_error or ""))
        restorer.close()
    dist.destroy_process_group()


@pytest.mark.multi_gpu
def test_nccl_fanout_bit_exact():
    world = torch.cuda.device_count()
    got = run_workers(_nccl_worker, world, method="spawn", timeout=300)
    decisions = {msg for _, name, _, msg in got if name == "decision"}
    print("fan-out decision on this machine:", decisions)
    assert len(decisions) == 1, decisions  # unanimous
    for rank, name, ok, msg in got:
        assert ok, f"rank {rank} {name}: {msg}"
    (decision,) = decisions
    if decision.startswith("OK"):
        names = {name for _, name, _, _ in got}
        assert {"restore/dsv3_small/kernel", "restore/dsv3_big/dma", "restore/fp8ds/kernel", "agreement"} <= names
    else:  # no NVLink between these GPUs: refused with its reason, the restore stays as it was
        assert decision.split(":")[0] in ("NO_NVLINK", "SLOW_EXCHANGE", "TOPOLOGY"), decision
