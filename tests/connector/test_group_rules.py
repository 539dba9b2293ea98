"""One rule per kind of cache group (xkv/connector/group_rules.py): every kind the registry
accepts has exactly one rule, and saves are reserved prefix groups first, then window, then
state groups, whatever the groups' order in vLLM's config."""

from __future__ import annotations

from types import SimpleNamespace as NS

from xkv.connector.group_rules import PREFIX, STATE, WINDOW, rule_of
from xkv.connector.registry import CacheGroup, build_registry, state_group
from xkv.connector.reservations import SavePlanner
from xkv.connector.stats import ConnectorStats


def _win(i):
    return CacheGroup(i, "sliding_window", (f"s{i}",), 64, 1024, "SlidingWindowMLASpec",
                      sliding_window=128, replicated=True)


def test_each_kind_has_its_rule_and_saves_go_prefix_window_state():
    mla = CacheGroup(2, "mla_compressed", ("a",), 256, 4096, "MLAAttentionSpec")
    reg = build_registry([_win(0), mla, _win(1)], tp_size=1, pp_size=1, chunk_size=256)
    assert [rule_of(p) for p in reg.groups] == [WINDOW, PREFIX, WINDOW]
    planner = SavePlanner(reg, NS(layout_ids=()), ConnectorStats(), 4)
    assert planner._save_order == [1, 0, 2]
    attn = CacheGroup(1, "attention", ("l0",), 32, 256)
    mamba = state_group(CacheGroup(0, "mamba", ("m0",), 32, 8192, "MambaSpec"), 4096)
    reg = build_registry([mamba, attn], tp_size=1, pp_size=1, chunk_size=64)
    assert [rule_of(p) for p in reg.groups] == [STATE, PREFIX]
    assert SavePlanner(reg, NS(layout_ids=()), ConnectorStats(), 2)._save_order == [1, 0]


def test_prefix_saves_only_candidates_whose_blocks_are_allocated():
    reg = build_registry([CacheGroup(0, "attention", ("l0",), 32, 256)], tp_size=1, pp_size=1,
                         chunk_size=64)
    plan = reg.groups[0]
    ids = [7, 8, 9, 10, 11]  # chunk 2 has one block of its two
    todo, blocks_of, pos = PREFIX.saves(plan, ids, range(0, 3), [0, 2], 0, 96, 96, 3)
    assert todo == [0] and list(blocks_of(0)) == [7, 8] and pos is None
    assert PREFIX.saves(plan, ids, range(0, 3), [], 0, 96, 96, 3)[0] == []
