"""Names the peers' DeepSpeed test modules read from ``deepspeed`` when they are imported, before any test runs.

A missing one fails the whole module at collection (docs/peer_suites.md), so each is checked here against what
DeepSpeed 0.19.8 offers under the same name.
"""

from __future__ import annotations

import torch


def test_compatible_ops_reports_the_aio_op_that_runs(tmp_path):
    """transformers' ``test_trainer_distributed_deepspeed.py`` decorates ``test_stage3_nvme_offload`` with
    ``require_deepspeed_aio``, which at import reads ``deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]``.
    DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``) answers ``{'async_io': False, 'cpu_adam': True, 'cpu_adagrad': True,
    'cpu_lion': True, 'fused_adam': True, ...}`` (its aio op needs libaio, not installed here), so the test skips.
    hf_zero's aio op is POSIX pread/pwrite and runs anywhere: it reports True, and the op it reports round-trips
    bytes through a file."""
    import deepspeed
    from deepspeed.ops.aio import AsyncIOBuilder

    ops = deepspeed.ops.__compatible_ops__
    assert AsyncIOBuilder.NAME == "async_io"
    assert ops["async_io"] is True
    assert {name for name, ok in ops.items() if ok} == {"async_io", "cpu_adam", "cpu_adagrad", "cpu_lion",
                                                          "fused_adam"}

    handle = AsyncIOBuilder().load().aio_handle(1 << 16, 8, False, False, 1)
    path = str(tmp_path / "swap.bin")
    written = torch.arange(1000, dtype=torch.float32)
    assert handle.sync_pwrite(written, path) == 1
    read = torch.zeros(1000, dtype=torch.float32)
    assert handle.sync_pread(read, path) == 1
    assert torch.equal(read, written)
    assert (tmp_path / "swap.bin").stat().st_size == 4000
