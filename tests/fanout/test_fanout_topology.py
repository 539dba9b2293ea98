"""NVLink groups from a fake NVML: NVSwitch, bridged pairs, no NVLink, errors, and
CUDA_VISIBLE_DEVICES reordered or holding UUIDs (NVML ignores it; we key by UUID)."""

import pytest
from fanout_helpers import FakeNvml, bridged, nvswitch

from xkv.fanout.config import FanoutConfig
from xkv.fanout.eligibility import Reason
from xkv.fanout.topology import (
    TopologyError,
    clique_partition,
    local_gpu_uuid,
    nvlink_matrix,
    partition_for,
)

AUTO = FanoutConfig(enabled=True)


def test_nvswitch_one_group():
    nv = nvswitch(8)
    groups, reason, _ = partition_for(AUTO, nv.uuids, lambda: nv)
    assert groups == [tuple(range(8))] and reason is Reason.OK


def test_bridged_pairs_follow_uuids_not_rank_order():
    nv = bridged(4)
    # TP ranks on physical GPUs 2, 0, 3, 1 (reordered CUDA_VISIBLE_DEVICES=2,0,3,1)
    uuids = [nv.uuids[p] for p in (2, 0, 3, 1)]
    groups, reason, _ = partition_for(AUTO, uuids, lambda: nv)
    assert reason is Reason.OK and sorted(groups) == [(0, 2), (1, 3)]


def test_no_nvlink_refuses():
    nv = FakeNvml(4)
    groups, reason, detail = partition_for(AUTO, nv.uuids, lambda: nv)
    assert groups == [(0,), (1,), (2,), (3,)] and reason is Reason.NO_NVLINK and "4 TP ranks" in detail


@pytest.mark.parametrize("fail", ["init", "p2p"])
def test_nvml_errors_refuse(fail):
    nv = FakeNvml(2, [(0, 1)], fail=fail)

    def factory():
        if fail == "init":
            raise TopologyError("libnvidia-ml.so.1 not found")
        return nv

    groups, reason, detail = partition_for(AUTO, nv.uuids, factory)
    assert reason is Reason.TOPOLOGY and groups == [(0,), (1,)] and "NVML" in detail


def test_unknown_uuid_other_host_is_nobodys_peer():
    nv = nvswitch(2)
    m = nvlink_matrix([nv.uuids[0], "GPU-elsewhere", nv.uuids[1]], nv)
    assert m == [[False, False, True], [False, False, False], [True, False, False]]
    assert clique_partition(m) == [(0, 2), (1,)]
    # two ranks on one GPU are not NVLink peers
    assert nvlink_matrix([nv.uuids[0], nv.uuids[0]], nv) == [[False, False], [False, False]]


def test_explicit_groups_checked_and_trusted_without_nvml():
    nv = bridged(4)
    cfg = FanoutConfig(enabled=True, groups=[[0, 1], [2, 3]])
    assert partition_for(cfg, nv.uuids, lambda: nv)[:2] == ([(0, 1), (2, 3)], Reason.OK)
    bad = FanoutConfig(enabled=True, groups=[[0, 2]])
    groups, reason, detail = partition_for(bad, nv.uuids, lambda: nv)
    assert reason is Reason.NO_NVLINK and "ranks 0 and 2" in detail
    # unlisted ranks form groups of one; NVML failing: explicit groups are trusted
    part = FanoutConfig(enabled=True, groups=[[2, 3]])

    def broken():
        raise TopologyError("nvmlInit failed")

    assert partition_for(part, nv.uuids, broken)[:2] == ([(0,), (1,), (2, 3)], Reason.OK)


def test_clique_partition_greedy():
    m = [[False, True, True, False], [True, False, False, False], [True, False, False, True],
         [False, False, True, False]]
    assert clique_partition(m) == [(0, 1), (2, 3)]
    assert clique_partition([]) == []


def test_local_uuid_prefers_torch_and_normalises():
    assert local_gpu_uuid(0, torch_uuid="1234-abcd", env={}) == "GPU-1234-abcd"
    assert local_gpu_uuid(1, torch_uuid="GPU-x", env={"CUDA_VISIBLE_DEVICES": "3,1"}) == "GPU-x"


def test_local_uuid_from_reordered_visible_devices():
    nv = nvswitch(4)
    env = {"CUDA_VISIBLE_DEVICES": "3,1"}
    assert local_gpu_uuid(0, env=env, nvml=nv) == nv.uuids[3]
    assert local_gpu_uuid(1, env=env, nvml=nv) == nv.uuids[1]
    assert local_gpu_uuid(2, env={}, nvml=nv) == nv.uuids[2]  # unset: CUDA order = NVML order
    with pytest.raises(TopologyError, match="no entry for CUDA device 2"):
        local_gpu_uuid(2, env=env, nvml=nv)


def test_local_uuid_from_uuid_valued_visible_devices():
    nv = nvswitch(4)
    env = {"CUDA_VISIBLE_DEVICES": f"{nv.uuids[2]},GPU-0001"}  # full UUID, then a unique prefix
    assert local_gpu_uuid(0, env=env, nvml=nv) == nv.uuids[2]
    assert local_gpu_uuid(1, env=env, nvml=nv) == nv.uuids[1]
    with pytest.raises(TopologyError, match="matches 4 NVML GPUs"):
        local_gpu_uuid(0, env={"CUDA_VISIBLE_DEVICES": "GPU-"}, nvml=nv)
    with pytest.raises(TopologyError, match="MIG instance"):
        local_gpu_uuid(0, env={"CUDA_VISIBLE_DEVICES": "MIG-1234"}, nvml=nv)
    with pytest.raises(TopologyError, match="no NVML"):
        local_gpu_uuid(0, env={"CUDA_VISIBLE_DEVICES": "0"})
