"""How fast the torch engine hashes CPU pages (vLLM's CPU engine verifies every restore and save
with it): ``checksum.words_host`` (numpy, cache-sized tiles) against ``checksum.words_device``
(the torch int64 ops CUDA pages use), on the same random pages; both must give equal words.

  python bench/host_words.py [--reps 3] [--shapes 480x8192,16384x512,64x1048576,100000x16]

Prints one line per shape ``rows x page bytes``: the best of ``--reps`` times of each and its
rate in GB/s of pages hashed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from xkv.kernels import checksum


def _best(fn, reps: int) -> tuple[float, torch.Tensor]:
    fn()
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", default="480x8192,16384x512,64x1048576,100000x16")
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    print(f"# python bench/host_words.py --reps {a.reps} --shapes {a.shapes}; "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    for shape in a.shapes.split(","):
        m, b = (int(x) for x in shape.split("x"))
        pages = torch.randint(0, 256, (m, b), dtype=torch.uint8, generator=g)
        start = torch.randint(0, 1 << 40, (m,), dtype=torch.int64, generator=g)
        th, host = _best(lambda p=pages, s=start: checksum.words_torch(p, s), a.reps)
        td, dev = _best(lambda p=pages, s=start: checksum.words_device(p, s), a.reps)
        if not torch.equal(host, dev):
            raise SystemExit(f"{shape}: words_host and words_device differ")
        gb = m * b / 1e9
        print(f"{m} x {b} B ({gb * 1e3:.1f} MB): words_host {th * 1e3:.1f} ms "
              f"({gb / th:.2f} GB/s), words_device (torch int64) {td * 1e3:.1f} ms "
              f"({gb / td:.2f} GB/s), {td / th:.0f} x; words equal")


if __name__ == "__main__":
    main()
