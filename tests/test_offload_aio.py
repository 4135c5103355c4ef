"""The aio op (compiled pread/pwrite pool) against its pure-Python reference, and the swap directory's errors."""

import os
from collections import namedtuple

import pytest
import torch

import hf_zero.offload.swapper as swapper
from hf_zero.offload import AioParams, SwapDir
from hf_zero.ops import aio

NATIVE = aio._native()
IMPLS = {"reference": (aio.aio_write_reference, aio.aio_read_reference_)}
if NATIVE:
    IMPLS["native"] = (aio.aio_write, aio.aio_read_)


@pytest.mark.parametrize("writer", sorted(IMPLS))
@pytest.mark.parametrize("reader", sorted(IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_write_read_roundtrip_matches_reference(writer, reader, dtype, tmp_path):
    path = str(tmp_path / "swap.bin")
    x = (torch.randn(100_003) * 50).to(dtype)  # not a multiple of the block size
    head = torch.full((37,), 7, dtype=torch.uint8)
    IMPLS[writer][0](head, path, 0, block_size=16, queue_depth=2, thread_count=1)
    nbytes = IMPLS[writer][0](x, path, 37, block_size=4096, queue_depth=4, thread_count=2)
    assert nbytes == x.numel() * x.element_size() == os.path.getsize(path) - 37
    y = torch.empty_like(x)
    assert IMPLS[reader][1](y, path, 37, block_size=1000, queue_depth=3, thread_count=3) == nbytes
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
    h = torch.empty_like(head)
    IMPLS[reader][1](h, path, 0, block_size=8, queue_depth=1, thread_count=1)
    assert torch.equal(h, head)
    part = torch.empty(10, dtype=dtype)  # a read in the middle of the file
    IMPLS[reader][1](part, path, 37 + 500 * x.element_size())
    assert torch.equal(part.view(torch.uint8), x[500:510].view(torch.uint8))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_short_read_and_missing_file_name_the_file(impl, tmp_path):
    path = str(tmp_path / "short.bin")
    aio.aio_write_reference(torch.zeros(100, dtype=torch.uint8), path)
    with pytest.raises((OSError, RuntimeError), match="short.bin"):
        IMPLS[impl][1](torch.empty(200, dtype=torch.uint8), path, 0, block_size=64)
    with pytest.raises((OSError, RuntimeError), match="missing.bin"):
        IMPLS[impl][1](torch.empty(10, dtype=torch.uint8), str(tmp_path / "missing.bin"))


def test_compiled_kernel_is_built():
    from hf_zero.ops._native import native_available

    if not native_available("cpu"):
        pytest.skip("compiled extension not loaded (the reference is tested above)")
    assert NATIVE, "hf_zero._C is loaded but has no aio ops: rebuild (pip install --no-build-isolation -e .)"


def test_swap_dir_preallocates_and_cleans_up(tmp_path):
    sizes = {"a": 4096 * 3, "b": 40}
    d = SwapDir(tmp_path, kind="optimizer", rank=3, sizes_nbytes=sizes, aio=AioParams(block_size=512))
    assert d.path.parent == tmp_path and "rank3" in d.path.name
    assert d.file_nbytes() == sizes
    x = torch.arange(10, dtype=torch.float32)
    d.write_async("b", x, 0).result()
    y = torch.empty(10)
    d.read_async("b", y, 0).result()
    z = torch.empty(4)
    d.read_async("a", z, 100).result()  # preallocated, never written: zeros
    assert torch.equal(x, y) and torch.equal(z, torch.zeros(4))
    d.close()
    assert d.closed and not d.path.exists()


def test_full_nvme_path_fails_at_start_with_path_and_bytes(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(swapper.shutil, "disk_usage", lambda p: Usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OSError, match=rf"nvme_path='{tmp_path}' has 1000 bytes free; rank 0 needs 123456 bytes"):
        SwapDir(tmp_path, kind="optimizer", rank=0, sizes_nbytes={"a": 123456}, aio=AioParams(),
                config_key="zero_optimization.offload_optimizer")
    assert not any(tmp_path.iterdir())  # nothing left behind


def test_unwritable_nvme_path_fails_at_start_with_path_and_bytes(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"nvme_path='.*not_a_dir/swap' is not a writable directory.*needs 4096 bytes"):
        SwapDir(blocker / "swap", kind="optimizer", rank=0, sizes_nbytes={"a": 4096}, aio=AioParams(),
                config_key="zero_optimization.offload_optimizer")


def test_engine_rejects_offload_without_adam(tmp_path):
    import hf_zero

    from _parity import base_config, make_model

    cfg = base_config(2, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(ValueError, match="offload_optimizer.device='nvme'.*Adam"):
        hf_zero.initialize(model=make_model(), config=cfg)


@pytest.mark.skipif(not NATIVE, reason="compiled aio op not built")
def test_native_op_releases_the_gil_so_io_overlaps_python(tmp_path):
    import threading
    import time

    x = torch.ones(256 * 2**20, dtype=torch.uint8)
    span = {}

    def io():
        span["t0"] = time.perf_counter()
        aio.aio_write(x, tmp_path / "big.bin", 0, block_size=1 << 20, queue_depth=4, thread_count=1)
        span["t1"] = time.perf_counter()

    thread = threading.Thread(target=io)
    stamps = []
    thread.start()
    while thread.is_alive():
        stamps.append(time.perf_counter())
    thread.join()
    duration = span["t1"] - span["t0"]
    if duration < 0.05:
        pytest.skip(f"the write took {duration:.3f} s: too fast to see the overlap")
    inside = [span["t0"]] + [s for s in stamps if span["t0"] < s < span["t1"]] + [span["t1"]]
    max_gap = max(b - a for a, b in zip(inside, inside[1:]))
    # holding the GIL would stop this thread for the whole write: one gap as long as the write
    assert max_gap < 0.5 * duration, (max_gap, duration)
