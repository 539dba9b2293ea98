"""Exchange backends without GPUs: NCCL unique-id bytes, buffer checks, the local exchanger."""

import ctypes

import pytest
import torch

from xkv.fanout.comm import (
    ExchangeError,
    LocalExchanger,
    PyncclExchanger,
    uid_from_bytes,
    uid_to_bytes,
)


def test_unique_id_bytes_roundtrip_all_byte_values():
    raw = bytes((i * 37 + 200) % 256 for i in range(128))
    assert any(b > 127 for b in raw)  # signed c_byte must not break values above 127
    uid = uid_from_bytes(raw)
    assert uid_to_bytes(uid) == raw and ctypes.sizeof(uid) == 128
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        uid_from_bytes(b"abc")


def test_local_exchanger_checks_and_agrees_alone():
    ex = LocalExchanger(4, virtual=True)
    assert ex.copies_all_shares and ex.agree(True) and not ex.agree(False)
    ex.all_gather_inplace(torch.zeros(1024, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="cannot hold 4 shares of 512 bytes"):
        ex.all_gather_inplace(torch.zeros(1024, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        ex.all_gather_inplace(torch.zeros(256, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="needs virtual=True"):
        LocalExchanger(2)


def test_pynccl_adapter_calls_all_gather_in_place(monkeypatch):
    class FakeComm:
        disabled = False

        def all_gather(self, out, inp, stream=None):
            self.args = (out.data_ptr(), out.numel(), inp.data_ptr(), inp.numel())

    comm = FakeComm()
    ex = PyncclExchanger(comm, 2, 1)
    buf = torch.zeros(1024, dtype=torch.uint8)
    # no CUDA here; the adapter only passes the stream on
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    ex.all_gather_inplace(buf, 256)
    assert comm.args == (buf.data_ptr(), 512, buf.data_ptr() + 256, 256)
    comm.disabled = True
    with pytest.raises(ExchangeError, match="disabled"):
        PyncclExchanger(comm, 2, 1)
