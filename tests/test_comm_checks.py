"""The cheaper divergence checks (comm/faults.py) and the buffer pool (comm/buffer_pool.py), on 2 gloo ranks.

One header for a run of collectives (the publishing all-gathers, a stage 0-2 backward's reductions) and deferred
headers (ZeRO-3's prefetch and reduce-scatters) send fewer header collectives -- counted here by the channel's
sequence number -- while the payloads still carry the right values and ranks about to issue different runs still
fail, on every rank, naming what each was about to do.
"""

from __future__ import annotations

import pytest
import torch

from hf_zero.testing import run_distributed


def _runs_and_deferred():
    import torch.distributed as dist

    from hf_zero.comm import all_gather_packed, all_reduce_, faults
    from hf_zero.comm.faults import DivergenceError

    faults.configure(timeout_s=2.0)  # short grace periods: the divergence below is reported in about a second
    rank = dist.get_rank()
    ch = faults.channel_for(None)
    out = {}
    # a run of three all-gathers: one header (sent at once, or deferred to the run's first collective)
    for defer in (False, True):
        seq = ch.seq
        faults.check_run([("all_gather", 2 * n, torch.float32) for n in (3, 5, 7)], "three gathers", defer=defer)
        got = []
        for n in (3, 5, 7):
            packed = torch.empty(2, n)
            all_gather_packed(packed, torch.full((n,), float(rank + n)))
            got.append(packed[:, 0].tolist())
        out[f"run{defer}"] = (ch.seq - seq, got)
    # a deferred check: the payload leaves at the next collective, after its header was verified
    seq = ch.seq
    packed = torch.empty(2, 4)
    work = all_gather_packed(packed, torch.full((4,), 10.0 + rank), async_op=True, defer_check=True)
    issued_before = work.work is not None
    total = torch.tensor([1.0])
    all_reduce_(total)
    issued_after = work.work is not None
    work.wait()
    out["deferred"] = (ch.seq - seq, issued_before, issued_after, packed[:, 0].tolist(), total.item())
    # ranks about to issue runs of different lengths fail before any payload
    n = 2 if rank == 0 else 3
    try:
        faults.check_run([("all_gather", 8, torch.float32)] * n, f"a run of {n} on rank {rank}")
        out["diverged"] = None
    except DivergenceError as exc:
        out["diverged"] = str(exc)
    return out


def test_one_header_per_run_deferred_headers_and_divergent_runs_fail_on_every_rank():
    for rank, out in enumerate(run_distributed(_runs_and_deferred, 2, timeout_s=120)):
        for defer in (False, True):
            headers, got = out[f"run{defer}"]
            assert headers == 1
            assert got == [[3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]
        headers, issued_before, issued_after, gathered, total = out["deferred"]
        assert (headers, issued_before, issued_after) == (2, False, True)
        assert gathered == [10.0, 11.0] and total == 2.0
        text = out["diverged"]
        assert text is not None and "ranks diverged at collective" in text, text
        assert "a run of 2 on rank 0" in text and "a run of 3 on rank 1" in text, text


def test_buffer_pool_reuses_freed_buffers_within_its_cap():
    from hf_zero.comm import buffer_pool

    buffer_pool.clear()
    a = buffer_pool.take((2, 1 << 18), torch.float32, "cpu")  # 2 MiB
    ptr = a.untyped_storage().data_ptr()
    buffer_pool.give(a)
    buffer_pool.give(a)  # twice: kept once
    assert buffer_pool.cached_bytes() == 2 << 20
    b = buffer_pool.take(3 << 17, torch.float32, "cpu")  # 1.5 MiB fits the 2 MiB buffer
    assert b.untyped_storage().data_ptr() == ptr and b.shape == (3 << 17,)
    assert buffer_pool.cached_bytes() == 0
    small = buffer_pool.take(1000, torch.float32, "cpu")
    buffer_pool.give(small)  # below MIN_POOLED_BYTES: left to the heap
    assert buffer_pool.cached_bytes() == 0
    for _ in range(buffer_pool.POOL_CAP_BYTES // (8 << 20) + 2):
        buffer_pool.give(torch.empty(2 << 20))  # 8 MiB each
    assert buffer_pool.cached_bytes() <= buffer_pool.POOL_CAP_BYTES
    tiny = buffer_pool.take(1 << 18, torch.float32, "cpu")  # 1 MiB: less than half of any cached buffer
    assert all(tiny.untyped_storage().data_ptr() != f.untyped_storage().data_ptr() for f in buffer_pool._free)
    buffer_pool.clear()
    assert buffer_pool.cached_bytes() == 0


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
