"""Bad configuration refuses to start, with a message that says what and why."""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bad_configuration_refused(models, gateway):
    res, _ = run_engine(models, "llama", gateway, [
        {"op": "expect_error", "extra": {"chunk_sise": 64}},
        {"op": "expect_error", "extra": {"xkv_gateway_port": "5557"}},
        {"op": "expect_error", "extra": {"require_cache_salt": "yes"}},
        {"op": "expect_error", "extra": {"chunk_size": 48}},
        {"op": "expect_error", "env": {"PYTHONHASHSEED": None}},
        {"op": "expect_error", "env": {"PYTHONHASHSEED": "42"}},
    ], verify=False)
    unknown, port, salt, chunk, unset, other = res["errors"]
    assert "unknown kv_connector_extra_config key(s) ['chunk_sise']" in unknown
    assert "valid keys: xkv_gateway_port, chunk_size" in unknown
    assert "xkv_gateway_port" in port and "expected int" in port
    assert "require_cache_salt" in salt and "expected bool" in salt
    assert "not a multiple of the KV cache block size 32" in chunk
    assert "PYTHONHASHSEED=0" in unset and "unset" in unset and "restarts" in unset
    assert "PYTHONHASHSEED=0" in other and "'42'" in other
