"""Probe: host time of each per-layer launch of an 8 x 16k checked restore (Llama geometry)."""
import time, sys, json
import numpy as np, torch
from xkv import kernels
from xkv.kernels import pinned
from xkv.kernels.verify import Checks
from xkv.layout.describe import describe_cache
dev = torch.device("cuda")
L, NB, K = 32, 9000, 16
caches = [torch.zeros(2, NB, 16, 8, 128, dtype=torch.bfloat16, device=dev) for _ in range(L)]
pools = [describe_cache(c, num_blocks=NB, layout="NHD") for c in caches]
bb = pools[0].block_bytes
res = {}
from xkv.connector import card_pin
CARD = torch.empty(8 * 64 * L * K * bb, dtype=torch.uint8)
t = time.perf_counter(); card_pin.pin(CARD); print("pin s", time.perf_counter() - t, flush=True)
def case(nreq, checked, engine="auto", groups=None, at=0):
    n = nreq * 64 * K; objs = n // K
    obj = L * K * bb
    card = CARD[at:at + objs * obj]
    blk = torch.arange(n, dtype=torch.int64)
    base = (blk // K) * obj + (blk % K) * bb
    offs = base.reshape(1, -1) + (torch.arange(L) * K * bb).reshape(-1, 1)
    chk = Checks(np.asarray(blk // K), np.asarray(blk % K), objs, expected=np.zeros((L, objs), np.uint32)) if checked else None
    s = torch.cuda.Stream()
    out = []
    for rep in range(2):
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter(); e0.record(s)
            prep = kernels.prepare_restore(card, offs, pools, blk, checks=chk, engine=engine, layer_groups=groups)
            t1 = time.perf_counter()
            lt = []
            for k in range(len(prep._calls)):
                a = time.perf_counter(); prep.launch(k); lt.append((time.perf_counter() - a) * 1e3)
            e1.record(s)
            t2 = time.perf_counter()
        torch.cuda.synchronize()
        r = dict(nreq=nreq, checked=checked, engine=engine, engines=sorted(set(prep.engines)) if hasattr(prep, "engines") else None,
                 plan_ms=(t1 - t0) * 1e3, launch_ms=(t2 - t1) * 1e3, max_launch_ms=max(lt), gpu_ms=e0.elapsed_time(e1),
                 GBps=n * L * bb / e0.elapsed_time(e1) / 1e6)
        out.append(r); print(json.dumps(r), flush=True)
    return out
for args in [(1, True), (1, True, "auto", None, 2 * 64 * L * K * bb), (8, True)]:
    try:
        case(*args)
    except Exception as e:
        print("ERR", args, repr(e)[:300], flush=True)
print("pinned allocations", pinned.pool().allocations)
