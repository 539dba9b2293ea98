"""nvlink_fanout* keys: defaults, valid values, and clear errors for bad ones."""

import pytest

from xkv.fanout.config import DEFAULT_MIN_LAYER_BYTES, FanoutConfig, FanoutConfigError


def test_defaults_and_other_keys_ignored():
    c = FanoutConfig.from_extra_config({"xkv_gateway_port": 5557, "chunk_size": 256})
    assert (c.enabled, c.groups, c.min_layer_bytes, c.slots) == (False, "auto", DEFAULT_MIN_LAYER_BYTES, 2)
    assert DEFAULT_MIN_LAYER_BYTES == 4 << 20
    assert c.slot_bytes * 2 <= c.staging_bytes and c.slot_bytes % 256 == 0
    assert FanoutConfig.from_extra_config(None) == FanoutConfig()


def test_explicit_values():
    c = FanoutConfig.from_extra_config({
        "nvlink_fanout": True, "nvlink_fanout_groups": [[3, 2], [0, 1]],
        "nvlink_fanout_staging_bytes": 64 << 20, "nvlink_fanout_min_layer_bytes": 0})
    assert c.enabled and c.groups == ((0, 1), (2, 3)) and c.staging_bytes == 64 << 20
    assert c.min_layer_bytes == 0 and c.slot_bytes == 32 << 20
    assert c.explicit_groups(4) == ((0, 1), (2, 3))
    assert FanoutConfig(enabled=True).explicit_groups(8) is None


@pytest.mark.parametrize("extra, match", [
    ({"nvlink_fanout": "yes"}, r"nvlink_fanout='yes': expected true or false"),
    ({"nvlink_fanout": 1}, "expected true or false"),
    ({"nvlink_fanout_groups": "all"}, r'nvlink_fanout_groups=\'all\': expected "auto"'),
    ({"nvlink_fanout_groups": []}, "non-empty list"),
    ({"nvlink_fanout_groups": [[0, 1], [1, 2]]}, "TP rank 1 appears more than once"),
    ({"nvlink_fanout_groups": [[0, -1]]}, "-1 in group"),
    ({"nvlink_fanout_groups": [[0, True]]}, "True in group"),
    ({"nvlink_fanout_groups": [[]]}, "not a non-empty list"),
    ({"nvlink_fanout_groups": ["01"]}, "not a non-empty list"),
    ({"nvlink_fanout_staging_bytes": "128MiB"}, "expected an integer number of bytes"),
    ({"nvlink_fanout_staging_bytes": 1024}, r"nvlink_fanout_staging_bytes=1024: expected an integer >= "),
    ({"nvlink_fanout_min_layer_bytes": -1}, "expected an integer >= 0"),
    ({"nvlink_fanout_min_layer_bytes": 2.5}, "integer number of bytes"),
    ({"nvlink_fanout_group": [[0, 1]]}, r"unknown fan-out key\(s\) \['nvlink_fanout_group'\]"),
])
def test_bad_values_are_named(extra, match):
    with pytest.raises(FanoutConfigError, match=match):
        FanoutConfig.from_extra_config(extra)


def test_groups_checked_against_tp_size():
    c = FanoutConfig(enabled=True, groups=[[0, 1], [2, 3]])
    with pytest.raises(FanoutConfigError, match="names TP rank 2, but tensor_parallel_size is 2"):
        c.explicit_groups(2)
