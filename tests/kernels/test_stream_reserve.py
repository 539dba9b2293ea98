"""Device memory held for the copy streams (xkv/kernels/stream_reserve.py): the blocks held per
stream and their sizes, release once; on the GPU, after vLLM-style ``empty_cache`` (its graph
capture) and the release, a step's allocations on the copy stream call no ``cudaMalloc``, where
without the reserve the same allocation does."""

import contextlib
import weakref
from types import SimpleNamespace as NS

import pytest
import torch

from xkv.kernels import stream_reserve
from xkv.kernels.stream_reserve import LARGE_CAP_BYTES, SMALL_BYTES, SMALL_COUNT, StreamReserve


@pytest.fixture
def host_streams(monkeypatch):
    """Streams of the CPU: ``torch.cuda.stream`` a no-op, blocks in host memory (the sizes and
    the bookkeeping only)."""
    monkeypatch.setattr(stream_reserve.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return [NS(device=torch.device("cpu")) for _ in range(2)]


def test_each_stream_holds_a_capped_large_block_and_small_ones_until_release(host_streams):
    r = StreamReserve()
    r.hold(host_streams, 5 << 20)
    assert r.held_bytes == 2 * ((5 << 20) + SMALL_COUNT * SMALL_BYTES)
    r.hold(host_streams[:1], 10**12)  # capped
    assert r.held_bytes == 2 * ((5 << 20) + SMALL_COUNT * SMALL_BYTES) + LARGE_CAP_BYTES + (
        SMALL_COUNT * SMALL_BYTES)
    r.release()
    assert r.held_bytes == 0
    r.release()  # once: later calls do nothing
    r.hold(host_streams[:1], 1 << 20)  # 1 MiB and less: the small blocks serve it
    assert r.held_bytes == SMALL_COUNT * SMALL_BYTES
    r.hold([], 1 << 30)
    assert r.held_bytes == SMALL_COUNT * SMALL_BYTES
    with pytest.raises(ValueError, match="large_bytes must be >= 0, got -1"):
        r.hold(host_streams, -1)


def test_a_held_block_is_freed_at_release(host_streams):
    r = StreamReserve()
    r.hold(host_streams[:1], 3 << 20)
    refs = [weakref.ref(t) for t in r._held]
    assert len(refs) == 1 + SMALL_COUNT and all(ref() is not None for ref in refs)  # held
    r.release()
    assert all(ref() is None for ref in refs)  # freed (on CUDA: into its stream's cache)


def _device_allocs(dev) -> int:
    return int(torch.cuda.memory_stats(dev).get("num_device_alloc", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("reserved", [False, True])
def test_after_capture_and_release_a_copy_stream_allocates_without_cudamalloc(reserved):
    """What the worker does: hold at start, vLLM empties the cache (its graph capture), the
    first copy step releases, then that step's table and words allocations on the copy stream
    (one large, several small) come from the held blocks: no ``cudaMalloc``. Without the
    reserve the same allocations call it (the control: the test could fail)."""
    dev = torch.device("cuda")
    s = torch.cuda.Stream(device=dev)
    r = StreamReserve()
    if reserved:
        r.hold([s], 8 << 20)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # vLLM's capture_model, after the connector started
    r.release()
    before = _device_allocs(dev)
    with torch.cuda.stream(s):
        tables = torch.empty(6 << 20, dtype=torch.uint8, device=dev)
        small = [torch.empty(100_000, dtype=torch.uint8, device=dev) for _ in range(6)]
        tables.zero_()
    torch.cuda.synchronize()
    grew = _device_allocs(dev) - before
    del tables, small
    assert (grew == 0) == reserved, grew


@pytest.mark.gpu
def test_the_cuda_handler_holds_at_start_and_releases_at_the_first_copy_step():
    from xkv.connector.cuda_transfer import CudaTransferHandler

    dev = torch.device("cuda")
    h = CudaTransferHandler(dev)
    h.hold_stream_memory(4 << 20)
    assert h._reserve.held_bytes == 2 * (4 << 20) + 4 * SMALL_COUNT * SMALL_BYTES
    h.begin_loads()
    assert h._reserve.held_bytes == 0
