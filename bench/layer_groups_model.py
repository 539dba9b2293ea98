"""A model of a light step's restore (a full hit: one token computed) in layer groups, no GPU:
when the forward's last layer ends for each ``XKV_LOAD_GROUPS`` mode, by the ratio of a layer's
copy time to its forward time.

    python bench/layer_groups_model.py                       # 32 layers (the Llama shape)
    python bench/layer_groups_model.py --layers 36 --launch-ms 0.4   # Qwen shape, ring-like host work

The step, as the CUDA handler runs it: every group's launch is issued on the host before the
forward's first kernel (``--issue-ms`` before the first copy, ``--launch-ms`` per launch); the
copies run back to back on the load stream, one layer in ``ratio * --forward-ms``; layer ``i``'s
forward starts when its group's copy has ended and layer ``i - 1``'s forward has. Launch costs
inside the copy, the copy slowing the forward beside it (1.13 x at 32 programs, stop 43) and the
sampler are left out: the model ranks the groupings; the GPU measures them
(``xkv@XKV_LOAD_GROUPS=eighths`` in ``bench/e2e_ttft.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xkv.connector.light_steps import GROUP_MODES, load_layer_groups  # noqa: E402


def step_end_ms(groups: list[list[int]], copy_ms: float, forward_ms: float, *, issue_ms: float,
                launch_ms: float) -> float:
    """When the last layer's forward ends (ms from the step's first hook): ``groups`` of layer
    indices in copy order, ``copy_ms`` / ``forward_ms`` per layer."""
    start = issue_ms + launch_ms * len(groups)  # the forward's first kernel, after every launch
    copied, done = issue_ms, {}
    for g in groups:
        copied += copy_ms * len(g)
        done.update(dict.fromkeys(g, copied))
    t = start
    for layer in range(sum(len(g) for g in groups)):
        t = max(t, done[layer]) + forward_ms
    return t


def table(layers: int, forward_ms: float, issue_ms: float, launch_ms: float,
          ratios=(0.5, 1.0, 1.15, 1.5, 2.0, 4.0)) -> dict[float, dict[str, float]]:
    """{copy / forward ratio: {mode: step end, ms}} for the grouped modes and ``layer``."""
    out = {}
    for r in ratios:
        row = {}
        for mode in GROUP_MODES:
            groups = ([[i] for i in range(layers)] if mode == "layer"
                      else load_layer_groups(layers, mode))
            row[mode] = step_end_ms(groups, r * forward_ms, forward_ms, issue_ms=issue_ms,
                                    launch_ms=launch_ms)
        out[r] = row
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--forward-ms", type=float, default=0.15,
                    help="one layer of a one-token forward (Llama-3-8B shape on an H100: ~0.15)")
    ap.add_argument("--issue-ms", type=float, default=1.0, help="host time before the first copy")
    ap.add_argument("--launch-ms", type=float, default=0.13,
                    help="host time per launch (Triton path ~0.13; the ring's chunks more)")
    a = ap.parse_args(argv)
    t = table(a.layers, a.forward_ms, a.issue_ms, a.launch_ms)
    print(f"{a.layers} layers, forward {a.forward_ms} ms per layer, issue {a.issue_ms} ms, "
          f"{a.launch_ms} ms per launch; step end, ms (forward alone: "
          f"{a.issue_ms + a.layers * a.forward_ms:.2f})")
    print("| copy / forward per layer | " + " | ".join(GROUP_MODES) + " |")
    print("|---|" + "---|" * len(GROUP_MODES))
    for r, row in t.items():
        print(f"| {r} | " + " | ".join(f"{row[m]:.2f}" for m in GROUP_MODES) + " |")


if __name__ == "__main__":
    main()
