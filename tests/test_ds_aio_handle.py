"""``deepspeed.ops.aio`` / ``deepspeed.ops.op_builder``: ``AsyncIOBuilder().load().aio_handle(...)`` reads and writes
the bytes it is given, byte for byte, with DeepSpeed's return values (#26 item 10).

DeepSpeed 0.19.8 for the same calls (CPU tensors, libaio installed): ``sync_pwrite`` / ``sync_pread`` return 1,
``async_*`` return 0 and ``wait()`` the number of ops it completed; a read past the end of the file returns -1
(printing the reason), where hf_zero raises ``OSError`` naming the file.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hf_zero.integrations.deepspeed_shim._finder import install

install()  # as the start-up .pth line does in an installed hf_zero


def _handle(**kwargs):
    builder = importlib.import_module("deepspeed.ops.aio").AsyncIOBuilder()
    assert builder.is_compatible()
    return builder.load().aio_handle(**kwargs)


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_sync_roundtrip_is_byte_exact(tmp_path):
    h = _handle(block_size=4096, queue_depth=4, single_submit=False, overlap_events=True, intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (4096, 4, False, True, 2)
    path = str(tmp_path / "t.bin")
    x = torch.randn(100_003).to(torch.bfloat16)  # 200006 bytes: not a multiple of the block size
    assert h.sync_pwrite(x, path) == 1
    y = torch.empty_like(x)
    assert h.sync_pread(y, path) == 1
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
    # at an offset, into the middle of the file: bytes 1000.. replaced, the rest kept (no truncation)
    patch = _random_bytes(777, 1)
    assert h.sync_pwrite(patch, path, 1000) == 1
    whole = torch.empty(200_006, dtype=torch.uint8)
    h.sync_pread(whole, path)
    expect = x.view(torch.uint8).clone()
    expect[1000:1777] = patch
    assert torch.equal(whole, expect)
    part = torch.empty(777, dtype=torch.uint8)
    h.sync_pread(part, path, 1000)
    assert torch.equal(part, patch)


def test_async_ops_complete_at_wait_in_order(tmp_path):
    h = importlib.import_module("deepspeed.ops.op_builder").AsyncIOBuilder().load().aio_handle(1024, 8, False,
                                                                                              False, 3)
    data = [_random_bytes(5000 + 17 * i, i) for i in range(4)]
    paths = [str(tmp_path / f"f{i}.bin") for i in range(4)]
    assert [h.async_pwrite(d, p) for d, p in zip(data, paths)] == [0, 0, 0, 0]
    assert h.wait() == 4
    outs = [torch.empty_like(d) for d in data]
    assert [h.async_pread(o, p) for o, p in zip(outs, paths)] == [0, 0, 0, 0]
    assert h.wait() == 4
    assert all(torch.equal(o, d) for o, d in zip(outs, data))
    # a read submitted after a pending write sees the written bytes (one file, ops in submission order)
    new = _random_bytes(5000, 9)
    back = torch.empty_like(new)
    h.async_pwrite(new, paths[0])
    assert h.sync_pread(back, paths[0]) == 2  # DeepSpeed's count: the pending write and this read
    assert torch.equal(back, new)
    # the older names: pread/pwrite(buffer, file, validate, async) and read/write(buffer, file, validate)
    assert h.pwrite(data[1], paths[2], True, False) == 1
    assert h.write(data[2], paths[3], True) == 0
    check = torch.empty_like(data[2])
    assert h.read(check, paths[3], True) == 0 and torch.equal(check, data[2])


def test_failures_name_the_file(tmp_path):
    h = _handle()
    short = str(tmp_path / "short.bin")
    h.sync_pwrite(torch.zeros(100, dtype=torch.uint8), short)
    with pytest.raises(OSError, match=r"short\.bin.*100 bytes.*needs 200"):
        h.sync_pread(torch.empty(200, dtype=torch.uint8), short)
    assert h.async_pread(torch.empty(10, dtype=torch.uint8), str(tmp_path / "missing.bin")) == 0
    with pytest.raises(OSError, match=r"missing\.bin"):
        h.wait()
    assert h.wait() == 0  # the failed op was consumed; the handle keeps working
    with pytest.raises(ValueError, match="queue_depth"):
        _handle(queue_depth=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
def test_buffers_the_op_cannot_use_directly_go_through_host_memory(device, tmp_path):
    """A GPU tensor or a non-contiguous view: staged through a contiguous host copy (DeepSpeed's bounce buffer),
    the file holding the tensor's elements in logical order."""
    h = _handle(block_size=512)
    path = str(tmp_path / "staged.bin")
    x = torch.randn(64, 33, device=device).t()  # (33, 64), not contiguous
    assert not x.is_contiguous() and h.sync_pwrite(x, path) == 1
    flat = torch.empty(33 * 64)
    h.sync_pread(flat, path)
    assert torch.equal(flat.view(33, 64), x.cpu())
    y = torch.zeros(64, 33, device=device).t()
    assert h.sync_pread(y, path) == 1 and torch.equal(y, x)
