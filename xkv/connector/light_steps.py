"""Light steps: a step that computes few tokens (a full hit computes one) cannot hide its restore
under the forward, so the CUDA handler restores it in a few large launches (halving layer groups)
instead of one launch and one fence per layer (issue 24: issue time before the forward).

``StepMetadata.scheduled_tokens`` (the tokens the step computes) decides (:func:`is_light`); the
worker tells its handler per step (``TransferHandler.set_light_step``). ``XKV_LOAD_GROUPS``
(:func:`group_mode`): ``auto`` (default) groups light steps, ``layer`` keeps one launch per layer
and does not warm the grouped variants, ``whole`` restores a light step's cache group as one group
of all its layers, ``eighths`` in groups of an eighth of its layers, the last one halved down to
single layers (A/B switches: on the ring, fewer groups mean longer copy-engine ranges and fewer
chunks, at the price of the forward's overlap with the copy; ``eighths`` trades a few more
launches, 10 against 6 for 32 layers, for a forward that starts after an eighth of the copy, not
half of it). :func:`warm_groups` names the layer groups the worker's kernel warmup compiles: a
light step's and the all-layer launch of a partly restored last block (``GroupTransfer.tail``).
No vLLM types, no tensors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from xkv.connector.registry import Registry

LIGHT_STEP_TOKENS = 128  # a step computing at most this many tokens restores in layer groups
GROUP_MODES = ("auto", "layer", "whole", "eighths")


def is_light(scheduled_tokens: int) -> bool:
    """Whether a step computing ``scheduled_tokens`` tokens (-1: unknown, never light) is light."""
    return 0 <= scheduled_tokens <= LIGHT_STEP_TOKENS


def group_mode() -> str:
    """``XKV_LOAD_GROUPS``: ``auto`` (light steps restore in halving layer groups; the default),
    ``layer``, ``whole`` (one group of every layer) or ``eighths`` (groups of an eighth)."""
    mode = os.environ.get("XKV_LOAD_GROUPS", "auto")
    if mode not in GROUP_MODES:
        raise ValueError(f"XKV_LOAD_GROUPS={mode!r}: expected one of {GROUP_MODES}")
    return mode


def load_layer_groups(n: int, mode: str = "auto") -> list[list[int]]:
    """Layer groups of a light step's restore of ``n`` layers (``mode`` ``whole``: one group of all
    of them; else, the default): halves, then halves of the rest, down to single layers (32 layers:
    16, 8, 4, 2, 1, 1): log2(n) + 1 launches instead of n, and the forward's last layers, which run
    after the copy ends, are single-layer groups. The first layer waits for the first half of the
    copy (where the copy of a layer takes longer than its forward, the forward cannot hide it).
    ``eighths``: groups of ``n // 8`` layers (at least one), then the last such group halved as
    above (32 layers: seven groups of 4, then 2, 1, 1): the first layer waits for an eighth of the
    copy, so where a layer's copy takes about as long as its forward (estimated for a 2k
    Llama-shape restore on an H100: 8.4 MB per layer at ~48 GB/s, 0.17 ms, against ~0.15 ms of a
    one-token forward's weight reads per layer; not measured) the forward hides most of it, for a
    few launches more (``bench/layer_groups_model.py`` ranks the groupings)."""
    if mode == "whole":
        return [list(range(n))] if n else []
    if mode == "eighths":
        k = max(1, n // 8)
        body = max(0, n - k)
        out = [list(range(a, min(a + k, body))) for a in range(0, body, k)]
        return out + [[body + i for i in g] for g in load_layer_groups(n - body)]
    out, a = [], 0
    while a < n:
        m = max(1, (n - a) // 2)
        out.append(list(range(a, a + m)))
        a += m
    return out


def group_layers(registry: Registry, pool_names: Sequence[str]) -> list[list[int]]:
    """Each cache group's layers as indices into ``pool_names`` (the registered caches, in the
    warmup's order): the layers one launch over a whole cache group copies (a full hit's tail,
    ``checksum_pass`` "end"'s hash)."""
    at = {name: i for i, name in enumerate(pool_names)}
    out = [[at[n] for n in plan.group.layer_names if n in at] for plan in registry.groups]
    return [idx for idx in out if idx]


def warm_groups(registry: Registry, pool_names: Sequence[str], mode: str,
                tails: bool = True) -> list[list[int]]:
    """The restore layer groups one launch copies together (:func:`group_layers`' indices): per
    cache group its light-step groups (``mode``, :func:`group_mode`: none for ``layer``) and all
    its layers (the tail's launch, when ``tails``: full hits that end inside a block, config
    ``full_hit_restore``; with ``whole`` that is the light step's one group already)."""
    out: list[list[int]] = []
    for idx in group_layers(registry, pool_names):
        if mode != "layer":
            out += [[idx[i] for i in g] for g in load_layer_groups(len(idx), mode)]
        if tails and mode != "whole":
            out.append(idx)
    return out
