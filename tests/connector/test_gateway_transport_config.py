"""The connector's CURVE settings (issue 14): both keys or none, files must exist, and the client
built from them talks TCP+CURVE to an allow-listed gateway."""

import os

import pytest
import zmq.auth

from xkv.connector.config import ConfigError, ConnectorConfig
from xkv.gateway import GatewayClient
from xkv.gateway.testing import running_gateway

ENV = {"PYTHONHASHSEED": "0"}


def test_curve_keys_go_together_and_must_exist(tmp_path):
    zmq.auth.create_certificates(str(tmp_path), "gateway")
    server = str(tmp_path / "gateway.key")
    with pytest.raises(ConfigError, match="go together"):
        ConnectorConfig.from_extra({"xkv_gateway_curve_server_key": server}, ENV)
    with pytest.raises(ConfigError, match="readable certificate"):
        ConnectorConfig.from_extra({"xkv_gateway_curve_server_key": server,
                                    "xkv_gateway_curve_client_key": str(tmp_path / "nope")}, ENV)
    cfg = ConnectorConfig.from_extra({}, ENV)
    assert cfg.xkv_gateway_curve_server_key is None is cfg.xkv_gateway_curve_client_key


def test_client_from_the_connector_settings_reaches_a_curve_gateway(tmp_path):
    zmq.auth.create_certificates(str(tmp_path), "gateway")
    zmq.auth.create_certificates(str(tmp_path), "vllm")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    os.replace(tmp_path / "vllm.key", allowed / "vllm.key")
    cfg = ConnectorConfig.from_extra({
        "xkv_gateway_curve_server_key": str(tmp_path / "gateway.key"),
        "xkv_gateway_curve_client_key": str(tmp_path / "vllm.key_secret")}, ENV)
    extra = ["--curve-secret-key", str(tmp_path / "gateway.key_secret"),
             "--curve-allowed-clients", str(allowed)]
    with running_gateway("1M", extra_args=extra) as port, GatewayClient(
            "127.0.0.1", port, timeout_s=2.0, curve_server_key=cfg.xkv_gateway_curve_server_key,
            curve_client_keys=cfg.xkv_gateway_curve_client_key) as c:
        assert c.endpoint == f"tcp://127.0.0.1:{port}"
        lid = c.register_layout("ns", "fp", 1, 100).layout_id
        [r] = c.reserve(lid, [b"k"])
        # the worker commits the ChunkRef reserve() returned (it carries the token)
        assert c.commit(lid, 0, [r]) == 1
        assert c.lookup([(lid, [b"k"])], lease=False).num_chunks == 1
