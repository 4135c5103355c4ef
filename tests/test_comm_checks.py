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


def _runs_and_deferred(ring: bool):
    import torch.distributed as dist

    from hf_zero.comm import all_gather_packed, all_reduce_, faults, shm_ring
    from hf_zero.comm.faults import DivergenceError

    faults.configure(timeout_s=2.0)  # short grace periods: the divergence below is reported in about a second
    rank = dist.get_rank()
    ch = faults.channel_for(None)
    out = {}
    if ring:  # the headers then go through the ring's header slots (shm_ring.exchange_header), not gloo
        assert shm_ring.ring_for(None) is not None
        for i in range(150):  # more than the ring's 64 slots; each deferred, verified at the next one
            faults.check_deferred("all_gather", 10 + i, torch.float32, f"collective {i}", lambda: None) or \
                faults.check_collective("all_gather", 10 + i, torch.float32, f"collective {i}")
        faults.settle(None)
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


@pytest.mark.parametrize("ring", [False, True])
def test_one_header_per_run_deferred_headers_and_divergent_runs_fail_on_every_rank(ring):
    """``ring``: the ranks share a ring (comm/shm_ring.py), whose header slots carry the checks."""
    for rank, out in enumerate(run_distributed(_runs_and_deferred, 2, args=(ring,), timeout_s=120)):
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
    for _ in range(buffer_pool.cap_bytes() // (8 << 20) + 2):
        buffer_pool.give(torch.empty(2 << 20))  # 8 MiB each
    assert buffer_pool.cached_bytes() <= buffer_pool.cap_bytes()
    tiny = buffer_pool.take(1 << 18, torch.float32, "cpu")  # 1 MiB: less than half of any cached buffer
    assert all(tiny.untyped_storage().data_ptr() != f.untyped_storage().data_ptr() for f in buffer_pool._free)
    buffer_pool.clear()
    assert buffer_pool.cached_bytes() == 0



def test_buffer_pool_moves_storage_bytes_and_recycles_only_unshared_buffers():
    """ZeRO-3's parked parameters: the bytes of a storage go to the pool and come back into the same storage, so
    views made before (autograd's saved weight views) see the refilled values; a buffer with a live view is never
    recycled. And the gradient shard's zeroing by madvise reads back as zeros, with its pages out of the RSS."""
    from hf_zero.comm import buffer_pool
    from hf_zero.comm.host_memory import rss_bytes, zero_and_release

    buffer_pool.clear()
    full = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB
    view = full.view(512, 1024).t()[3:5]  # what autograd saves of a weight
    buffer_pool.release_storage(full)
    assert full.untyped_storage().nbytes() == 0 and buffer_pool.cached_bytes() == 2 << 20
    buffer_pool.refill_storage(full, fit=0.75)  # the same bytes come back, no new buffer
    assert full.untyped_storage().nbytes() == 2 << 20 and buffer_pool.cached_bytes() == 0
    full.copy_(torch.arange(1 << 19, dtype=torch.float32) * 2)
    assert view[1, 0].item() == 8.0  # element [0, 4] of the (512, 1024) matrix, doubled
    assert not buffer_pool.give_if_unshared(full)  # ``view`` still points at it
    del view
    assert buffer_pool.give_if_unshared(full) and buffer_pool.cached_bytes() == 2 << 20
    buffer_pool.clear()

    shard = torch.randn(8 << 20)[5:]  # 32 MiB, not page-aligned at either end
    before = rss_bytes()
    zero_and_release(shard)
    assert shard.count_nonzero().item() == 0
    assert before - rss_bytes() > 24 << 20


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
