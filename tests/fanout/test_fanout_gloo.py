"""2 and 4 CPU processes over gloo: split -> exchange -> scatter, bit-exact against every rank
copying the whole layer; the agreement path; skips; refusals with one warning per process."""

import hashlib
import logging

import pytest
import torch
from fanout_helpers import FakeNvml, bridged, cache_bytes, make_case, nvswitch, run_workers

CASES = {
    # name: make_case kwargs. 1.5 MB layers in 1 MiB slots: two rounds per layer, shares cut mid-block
    "bf16_rounds": dict(layers=2, num_blocks=48, block_size=64, chunk_blocks=4, chunks=5, seed=7),
    # fp8_ds_mla rows (656 B), kernel block ratio 2, one-block chunks (no contiguous runs)
    "fp8ds_ratio2": dict(layers=2, num_blocks=30, block_size=16, width=656, dtype=torch.uint8,
                         ratio=2, chunk_blocks=1, chunks=7, seed=3),
}


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.warnings = []

    def emit(self, record):
        if record.levelno >= logging.WARNING:
            self.warnings.append(record.getMessage())


def _worker(rank, world, init_file, q):
    import torch.distributed as dist

    from xkv.fanout import (
        FanoutConfig,
        FanoutRestorer,
        LocalExchanger,
        TorchExchanger,
        eligibility,
        plan_batch,
    )
    from xkv.kernels import restore

    counter = _Count()
    logging.getLogger("xkv.fanout").addHandler(counter)
    eligibility._reset_report_for_tests()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = FanoutConfig(enabled=True, staging_bytes=2 << 20, min_layer_bytes=0)
    ex = TorchExchanger(None, world, rank)

    for name, kw in CASES.items():
        for share_copy in ("kernel", "dma"):
            case = make_case(**kw)
            ref = make_case(**kw, card=case.card)
            for ld in ref.loads:  # the reference: this rank copies the whole layer
                restore(ref.card, ld.src_offsets, ld.dst, ld.block_ids)
            r = FanoutRestorer(cfg, ex, "cpu", share_copy=share_copy)
            assert r.begin(case.card, case.loads)
            for ld in reversed(case.loads[1:]):  # out-of-order hooks: drains in plan order
                r.wait_layer(ld.layer)
            r.wait_layer("not.restored.this.step")
            r.finish()
            ok = all(torch.equal(cache_bytes(c), e) and torch.equal(cache_bytes(c), cache_bytes(rc))
                     for c, e, rc in zip(case.caches, case.expected, ref.caches, strict=True))
            copied = r.stats["bytes_copied"]
            total = sum(ld.block_ids.numel() * ld.dst.block_bytes for ld in case.loads)
            q.put((rank, f"{name}/{share_copy}", ok, copied, total, r.stats["rounds"]))

    # identical plan on every rank
    case = make_case(**CASES["bf16_rounds"])
    plan = plan_batch([(ld.block_ids.numel(), ld.dst.block_bytes) for ld in case.loads], world, cfg.slot_bytes)
    digest = torch.tensor(list(hashlib.sha256(repr(plan).encode()).digest()), dtype=torch.uint8)
    digests = [torch.zeros_like(digest) for _ in range(world)]
    dist.all_gather(digests, digest)
    q.put((rank, "plan_identical", all(torch.equal(d, digest) for d in digests), len(plan), 0, 0))

    # groups smaller than TP: ranks 0-1 fan out over their own group, 2 and 3 are groups of one
    # (inactive); everyone takes part in the agreement, nobody waits for anybody
    if world == 4:
        pg01 = dist.new_group([0, 1])  # every rank creates every group, in the same order
        case = make_case(**CASES["bf16_rounds"])
        if rank < 2:
            r = FanoutRestorer(cfg, TorchExchanger(pg01, 2, rank), "cpu")
        else:
            r = FanoutRestorer(cfg, LocalExchanger(1, agree_with_peers=True), "cpu", active=False)
        started = r.begin(case.card, case.loads)
        if started:
            r.finish()
        else:
            for ld in case.loads:
                restore(case.card, ld.src_offsets, ld.dst, ld.block_ids)
        ok = started == (rank < 2) and all(
            torch.equal(cache_bytes(c), e) for c, e in zip(case.caches, case.expected, strict=True))
        q.put((rank, "subgroups", ok, r.stats["bytes_copied"], 0, 0))

    # a rank-local failure: rank 1's offsets point past the card; nobody exchanges, nobody hangs
    case = make_case(**CASES["bf16_rounds"])
    if rank == 1:
        case.loads[0].src_offsets[-1] = case.card.numel()
    r = FanoutRestorer(cfg, ex, "cpu")
    started = r.begin(case.card, case.loads)
    untouched = all(bool((cache_bytes(c) == 0xA5).all()) for c in case.caches)
    q.put((rank, "agreement", (not started) and untouched and (r.last_error is not None) == (rank == 1),
           r.stats["disagreed"], 0, 0))

    # layers below nvlink_fanout_min_layer_bytes: skipped on every rank without a collective
    small = FanoutRestorer(FanoutConfig(enabled=True, staging_bytes=2 << 20), ex, "cpu")
    case = make_case(**CASES["fp8ds_ratio2"])
    q.put((rank, "small_skipped", not small.begin(case.card, case.loads), small.stats["skipped_small"], 0, 0))
    dist.barrier()
    # no refusal warning; only the rank with bad inputs logged its error
    expected = ["invalid restore"] if rank == 1 else []
    q.put((rank, "warnings", [w[w.find("invalid restore"):][:15] for w in counter.warnings] == expected,
           len(counter.warnings), 0, 0))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_split_exchange_scatter_gloo(world):
    got = run_workers(_worker, world)
    by_name = {}
    for rank, name, ok, a, b, c in got:
        assert ok, f"rank {rank} {name}: {a} {b} {c}"
        by_name.setdefault(name, []).append((rank, a, b, c))
    for name in ("bf16_rounds/kernel", "bf16_rounds/dma", "fp8ds_ratio2/kernel", "fp8ds_ratio2/dma"):
        rows = by_name[name]
        assert sorted(r for r, *_ in rows) == list(range(world))
        # every rank copied about 1/world of the bytes; together exactly all of them
        total = rows[0][2]
        assert sum(a for _, a, _, _ in rows) == total
        assert all(a <= -(-total // world) + 2 * 256 * 4 for _, a, _, _ in rows)
    assert all(c == 2 * 2 for _, _, _, c in by_name["bf16_rounds/kernel"])  # 2 layers x 2 rounds
    assert len(by_name["agreement"]) == world and len(by_name["warnings"]) == world
    if world == 4:
        copied = {rank: a for rank, a, _, _ in by_name["subgroups"]}
        assert copied[2] == copied[3] == 0 and copied[0] + copied[1] == 2 * 20 * 73728


TOPOLOGIES = {  # fake NVML -> (partition TP rank 0 broadcasts, why build_restorer refuses)
    "nvswitch": (((0, 1, 2, 3),), "MEMORY"),  # topology passes; no CUDA here -> refused unanimously
    "bridged": (((0, 1), (2, 3)), "MEMORY"),
    "none": (((0,), (1,), (2,), (3,)), "NO_NVLINK"),
    "error": (((0,), (1,), (2,), (3,)), "TOPOLOGY"),
}


def _refusal_worker(rank, world, init_file, q):
    import torch.distributed as dist

    from xkv.fanout import CacheFacts, FanoutConfig, build_restorer, decide, eligibility, report
    from xkv.fanout.topology import resolve_groups
    from xkv.kernels import restore

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = FanoutConfig(enabled=True)
    facts = CacheFacts(use_mla=True, tp_size=world, spec_kinds=("mla",) * 3)
    for topo in TOPOLOGIES:
        counter = _Count()  # a fresh "process" per topology: new handler, report state reset
        logging.getLogger("xkv.fanout").addHandler(counter)
        eligibility._reset_report_for_tests()
        nv = {"nvswitch": nvswitch(world), "bridged": bridged(world), "none": FakeNvml(world),
              "error": FakeNvml(world, [(0, 1)], fail="p2p")}[topo]
        # every rank learns the same partition, decided by TP rank 0 from the UUIDs (reversed here)
        uuid = nv.uuids[world - 1 - rank]
        a = resolve_groups(cfg, rank, world, uuid, nvml_factory=lambda nv=nv: nv)
        # the UUID is passed, not found from CUDA_VISIBLE_DEVICES: with it set to "" (or changed
        # by an earlier test in the process that started the fork server) every rank's GPU was
        # "unknown", nobody's NVLink peer, and the refusal read NO_NVLINK instead of MEMORY
        restorer, decision = build_restorer(cfg, facts, rank, world, torch.device("cuda", rank),
                                            nvml_factory=lambda nv=nv: nv, gpu_uuid=uuid)
        for _ in range(3):  # later decisions in the same process log nothing more
            report(decide(cfg, CacheFacts(use_mla=False, tp_size=world)))
        # the restore then runs exactly as without fan-out
        case = make_case(layers=2, seed=5)
        for ld in case.loads:
            restore(case.card, ld.src_offsets, ld.dst, ld.block_ids)
        ok = restorer is None and all(torch.equal(cache_bytes(c), e)
                                      for c, e in zip(case.caches, case.expected, strict=True))
        q.put((rank, topo, ok, a.partition, decision.reason.name, counter.warnings))
        logging.getLogger("xkv.fanout").removeHandler(counter)
    dist.destroy_process_group()


def test_refusals_one_warning_per_process():
    got = run_workers(_refusal_worker, 4)
    assert len(got) == 4 * len(TOPOLOGIES)
    for rank, topo, ok, part, decided, warnings in got:
        partition, reason = TOPOLOGIES[topo]
        assert ok, f"rank {rank} {topo}"
        assert (part, decided) == (partition, reason), f"rank {rank} {topo}"
        assert len(warnings) == 1 and "fan-out off" in warnings[0], (topo, warnings)
