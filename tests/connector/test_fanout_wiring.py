"""The connector worker wired to xkv.fanout (issue 7).

- An engine with ``nvlink_fanout`` on and an ineligible model (attention-only, or MLA at TP 1)
  restores exactly as without fan-out, and says why once (one warning per process).
- Two gloo processes (TP 2) drive ``WorkerSide``'s MLA restore through a ``FanoutRestorer``
  (layer-wise, bulk, below the size threshold, and one rank unable to read its card): every
  rank's cache equals the plain restore's bit for bit, and each rank copied about half.
- The same with checksum words (``verify_checksums``, on by default): fanned-out restores are
  verified (hashed after the all-gather, ``fanout_loads``): clean bytes raise no alarm and count
  no unverified block (layer-wise and bulk); one flipped card bit fails exactly its object's
  blocks on every rank; layers whose hook never came leave the group unverified and counted.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fanout"))

from fanout_helpers import run_workers  # noqa: E402

POISON = 0xA5
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn",
          "model.layers.2.self_attn.attn")
BLOCK = 16  # tokens per block
WIDTH = 576  # MLA latent, bf16
BB = BLOCK * WIDTH * 2  # bytes of one block of one layer
K = 2  # blocks per stored chunk
NUM_BLOCKS = 96
CHUNKS = 36  # 72 blocks restored: 1.3 MiB per layer, two rounds of a 1 MiB slot
EPOCH = 7


# ---------------------------------------------------------------- one engine, fan-out refused
class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["attention_only", "mla_tp1"])
def test_ineligible_model_restores_as_before_with_one_warning(fake_gateway, llama_dir,
                                                              monkeypatch, case):
    from xkv.connector import vllm_specs
    from xkv.fanout import Reason, eligibility

    pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
    import vllm_harness as H
    real = vllm_specs.fanout_facts

    def facts(*a, **kw):  # a CUDA machine; the tiny llama config plays an MLA model for mla_tp1
        f = real(*a, **{**kw, "cuda": True})
        return dataclasses.replace(f, use_mla=True) if case == "mla_tp1" else f

    monkeypatch.setattr(vllm_specs, "fanout_facts", facts)
    eligibility._reset_report_for_tests()
    warns = _Warnings()
    logging.getLogger("xkv").addHandler(warns)
    try:
        mla = case == "mla_tp1"
        bs, chunk = (16 if mla else 32), 64
        layout = "LBNHC" if mla else "LBHNC"
        engines = []
        for _ in range(2):
            vc = H.make_vllm_config(llama_dir, policy="recompute", block_size=bs,
                                    extra={"chunk_size": chunk, "nvlink_fanout": True,
                                           "nvlink_fanout_min_layer_bytes": 0})
            kc = H.attention_cache_config(block_size=bs, mla=mla)
            kc.kv_cache_layout = layout
            sched = H.make_scheduler(vc, kc)
            wk, caches = H.make_worker_caches(vc, H.attention_cache_config(block_size=bs, mla=mla),
                                       layout=layout)
            assert wk._worker.restorer is None
            engines.append((sched, wk, caches))
        p = [(10 + i) % 1000 + 4 for i in range(200)]
        s1, w1, c1 = engines[0]
        s1.add_request(H.make_request("a", p, block_size=bs))
        while s1.has_unfinished_requests():
            H.step_with_worker(s1, w1, c1, bs)
        s2, w2, c2 = engines[1]
        s2.add_request(H.make_request("b", p, block_size=bs))
        _, meta, _ = H.step_with_worker(s2, w2, c2, bs)
        (gt,) = meta.loads[0].groups
        assert len(gt.block_ids) == (len(p) - 1) // chunk * chunk // bs
        for i, bid in enumerate(gt.block_ids):
            for name, kv in c2.items():
                want = H.pattern(p[: (i + 1) * bs], name, H.page(kv, 0).numel())
                assert torch.equal(H.page(kv, bid), want), (name, i)
    finally:
        logging.getLogger("xkv").removeHandler(warns)
    fan = [w for w in warns.lines if "NVLink fan-out off" in w]
    reason = Reason.TP1 if case == "mla_tp1" else Reason.NOT_MLA
    assert len(fan) == 1 and reason.value in fan[0], warns.lines
    assert len(warns.lines) == 1, warns.lines  # nothing else went wrong either


# ---------------------------------------------------------------- two gloo ranks
class _Gateway:
    """What WorkerSide asks of the gateway client; the card is identical on every rank."""

    def __init__(self, card: bytearray, epoch: int, reports: list | None = None):
        self._card, self.epoch = card, epoch
        self.reports = [] if reports is None else reports  # CORRUPT: the keys reported

    def register_layout(self, namespace, fingerprint, num_shards, shard_bytes, **kw):
        return type("Info", (), {"layout_id": 1, "epoch": self.epoch})()

    def map_card(self):
        return memoryview(self._card)

    def slot_generation(self, offset):
        return 0

    def report_corrupt(self, layout_id, shard, refs):  # CORRUPT (background thread)
        self.reports += [r.key for r in refs]

    def close(self):
        pass


def _card_and_meta(words: bool = False):
    """Card (seeded, the same on every rank) and one load of CHUNKS chunks into random blocks;
    ``words``: each chunk with its object's checksum words (one per layer, of the card as made)."""
    from xkv.connector.metadata import ChunkRef, GroupTransfer, StepMetadata, TransferJob
    from xkv.kernels import checksum

    g = torch.Generator().manual_seed(3)
    slot = len(LAYERS) * K * BB + 4096  # padded slots: chunks are not back to back
    n_slots = CHUNKS + 5
    card = torch.randint(0, 256, (n_slots * slot,), dtype=torch.uint8, generator=g)
    slot_of = (torch.randperm(n_slots, generator=g)[:CHUNKS] * slot).tolist()
    blocks = torch.randperm(NUM_BLOCKS, generator=g)[: CHUNKS * K].tolist()
    chunks = tuple(ChunkRef(bytes([c]) * 8, (s,), (0,)) for c, s in enumerate(slot_of))
    raw = card.numpy().tobytes()
    checks = tuple(b"".join(checksum.words_numpy(raw[s + li * K * BB:s + (li + 1) * K * BB])
                            .to_bytes(4, "little") for li in range(len(LAYERS)))
                   for s in slot_of) if words else ()
    gt = GroupTransfer(0, tuple(blocks), tuple(i // K for i in range(len(blocks))),
                       tuple(i % K for i in range(len(blocks))), chunks, checks=checks)
    meta = StepMetadata(loads=(TransferJob(1, "r", (gt,), len(blocks) * BLOCK),), epoch=EPOCH,
                        layout_ids=(1,))
    return card, meta, slot_of


def _worker_side(card, rank, world, restorer_factory=None, epoch=EPOCH, reports=None):
    from xkv.connector.registry import CacheGroup, build_registry
    from xkv.connector.worker import WorkerSide

    reg = build_registry([CacheGroup(0, "mla", LAYERS, BLOCK, BB, "MLAAttentionSpec")],
                         tp_size=world, pp_size=1, chunk_size=K * BLOCK)
    ws = WorkerSide(reg, ["fp"], namespace="t", tp_rank=rank,
                    gateway_factory=lambda: _Gateway(bytearray(card.numpy().tobytes()), epoch,
                                                     reports),
                    fanout_factory=restorer_factory)
    caches = {n: torch.full((NUM_BLOCKS, BLOCK, WIDTH), 0, dtype=torch.bfloat16) for n in LAYERS}
    for c in caches.values():
        c.view(torch.uint8).fill_(POISON)
    ws.register_kv_caches(caches, num_blocks=NUM_BLOCKS)
    return ws, caches


def _step(ws, meta, order):
    ws.bind(meta)
    ws.start_load_kv()
    for name in order:
        ws.wait_for_layer_load(name)
    ws.get_finished()
    errors = ws.take_load_errors()
    ws.clear()
    return errors


def _gloo_worker(rank, world, init_file, q):
    import torch.distributed as dist

    from xkv.fanout import FanoutConfig, FanoutRestorer, Mode, TorchExchanger

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    card, meta, _ = _card_and_meta()
    plain, ref = _worker_side(card, rank, world)
    assert not _step(plain, meta, LAYERS)
    total = CHUNKS * K * BB * len(LAYERS)

    def factory(mode, min_bytes=0, made=None):
        cfg = FanoutConfig(enabled=True, staging_bytes=2 << 20, min_layer_bytes=min_bytes)

        def make(kv_caches, device):
            assert set(kv_caches) == set(LAYERS)
            r = FanoutRestorer(cfg, TorchExchanger(None, world, rank), device, mode=mode)
            made.append(r)
            return r
        return make

    cases = {  # name -> (mode, min layer bytes, hook order, rank whose card is unusable)
        "layerwise": (Mode.LAYERWISE, 0, LAYERS[::-1], None),  # out-of-order hooks
        "layerwise_no_hooks": (Mode.LAYERWISE, 0, (), None),  # get_finished drains
        "bulk": (Mode.BULK, 0, (), None),
        "small": (Mode.LAYERWISE, 2 * CHUNKS * K * BB, LAYERS, None),  # begin False: handler
        "rank1_card_unusable": (Mode.LAYERWISE, 0, LAYERS, 1),
    }
    for name, (mode, min_bytes, order, bad) in cases.items():
        made: list = []
        ws, caches = _worker_side(card, rank, world, factory(mode, min_bytes, made),
                                  epoch=EPOCH + 1 if rank == bad else EPOCH)
        (r,) = made
        errors = _step(ws, meta, order)
        if rank == bad:  # its gateway changed: every block is a load error, cache untouched
            ok = errors == set(meta.loads[0].block_ids()) and all(
                bool((c.view(torch.uint8) == POISON).all()) for c in caches.values())
        else:
            ok = not errors and all(torch.equal(caches[n].view(torch.uint8), ref[n].view(torch.uint8))
                                    for n in LAYERS)
        ws.shutdown()
        q.put((rank, name, ok, r.stats["bytes_copied"], r.stats["batches"], total))
    _verified_cases(rank, world, factory, ref, q)
    dist.destroy_process_group()


def _verified_cases(rank, world, factory, ref, q):
    """Fanned-out restores with checksum words: clean, and one card bit flipped (chunk 5,
    layer 1) after the words were taken."""
    from xkv.fanout import Mode

    card, meta, slot_of = _card_and_meta(words=True)
    bad_chunk = 5
    gt = meta.loads[0].groups[0]
    bad_blocks = {b for b, c in zip(gt.block_ids, gt.chunk_of, strict=True) if c == bad_chunk}
    flipped = card.clone()
    flipped[slot_of[bad_chunk] + 1 * K * BB + 777] ^= 0x10
    cases = {  # name -> (mode, hook order, card)
        "verified_layerwise": (Mode.LAYERWISE, LAYERS[::-1], card),
        "verified_no_hooks": (Mode.LAYERWISE, (), card),  # exchanged at the end: unverified
        "verified_bulk": (Mode.BULK, LAYERS, card),
        "verified_corrupt": (Mode.LAYERWISE, LAYERS, flipped),
    }
    for name, (mode, order, c) in cases.items():
        made: list = []
        reports: list = []
        ws, caches = _worker_side(c, rank, world, factory(mode, 0, made), reports=reports)
        errors = _step(ws, meta, order)
        ws.outcomes.wait_reports(10.0)
        st = ws.stats.reduce()
        want_err = bad_blocks if name == "verified_corrupt" else set()
        same = all(torch.equal(caches[n].view(torch.uint8)[sorted(set(gt.block_ids) - want_err)],
                               ref[n].view(torch.uint8)[sorted(set(gt.block_ids) - want_err)])
                   for n in LAYERS)
        unverified = len(gt.block_ids) if name == "verified_no_hooks" else 0
        ok = (errors == want_err and same and st.get("blocks_unverified", 0) == unverified
              and st.get("checksum_mismatches", 0) == (1 if want_err else 0)
              and made[0].stats["batches"] == 1
              and reports == ([gt.chunks[bad_chunk].key] if want_err else []))
        ws.shutdown()
        q.put((rank, name, ok, made[0].stats["bytes_copied"], made[0].stats["batches"],
               CHUNKS * K * BB * len(LAYERS)))


def test_worker_mla_restore_through_restorer_gloo():
    got = run_workers(_gloo_worker, 2, timeout=60.0)
    rows: dict[str, list] = {}
    for rank, name, ok, copied, batches, total in got:
        assert ok, f"rank {rank} {name}: restore differs from the plain one"
        rows.setdefault(name, []).append((rank, copied, batches, total))
    assert sorted(rows) == sorted(["layerwise", "layerwise_no_hooks", "bulk", "small",
                                   "rank1_card_unusable", "verified_layerwise",
                                   "verified_no_hooks", "verified_bulk", "verified_corrupt"])
    for name in ("layerwise", "layerwise_no_hooks", "bulk", "verified_layerwise",
                 "verified_no_hooks", "verified_bulk", "verified_corrupt"):
        (r0, c0, b0, total), (r1, c1, b1, _) = sorted(rows[name])
        # fan-out ran: one batch per rank, each copied about half, together every byte
        assert (b0, b1) == (1, 1) and c0 + c1 == total and abs(c0 - c1) <= 2 * 4096, rows[name]
    for name in ("small", "rank1_card_unusable"):  # restored by the handler, nothing fanned out
        assert all(c == 0 and b == 0 for _, c, b, _ in rows[name]), rows[name]
