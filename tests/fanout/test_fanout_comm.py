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


def _nccl_unavailable_worker(rank, world, init_file, q):
    import torch.distributed as dist

    import xkv.fanout.comm as comm

    class FakeLib:
        def unique_id(self):
            return bytes(range(128))

    class Broken:
        def __init__(self):
            raise comm.ExchangeError("libnccl.so.2 not found")

    comm.NcclLib = FakeLib if rank == 0 else Broken
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        comm.NcclExchanger.create(((0, 1),), rank, world, torch.device("cpu"))
        q.put((rank, "created"))
    except comm.ExchangeError as e:
        q.put((rank, str(e)))
    dist.destroy_process_group()


def test_nccl_missing_on_one_rank_fails_every_rank_without_hanging():
    from fanout_helpers import run_workers

    got = dict(run_workers(_nccl_unavailable_worker, 2, timeout=60))
    assert "another TP rank" in got[0] and "libnccl.so.2 not found" in got[1]
