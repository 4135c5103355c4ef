"""The shared-memory ring (comm/shm_ring.py, shm_collectives.py): ZeRO's packed all-gathers and reduce-scatters
between ranks of one host.

Every value is an integer in fp32 (exact), so the gathered rows and reduced sums are compared with ``==``. A 1 MiB
ring with buffers of up to 0.75 MiB wraps around many times, has several buffers in flight, given back out of
order, and turns down what does not fit (on every rank alike); private buffers (every reduce-scatter, the gathers
into a private buffer) are bounced through it in chunks, up to 2 MiB of them.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_zero.testing import run_distributed


def _exchange(sub: bool):
    import torch.distributed as dist

    from hf_zero.comm import all_gather_packed, give_packed, reduce_scatter_packed, shm_ring, take_gather_buffer

    rank, world = dist.get_rank(), dist.get_world_size()
    group = None
    members = list(range(world))
    if sub:  # a subgroup of ranks 1 and 3: its own ring, global ranks in its flags' errors
        members = [1, 3]
        group = dist.new_group(members)
        if rank not in members:
            # Stay until the members are done: rank 0 hosts the store their fault channel connects to on first
            # use, and a host that already exited leaves them retrying that connection for comms_timeout_s.
            dist.barrier()
            return None
    r, w = members.index(rank), len(members)
    ring = shm_ring.ring_for(group)
    gen = torch.Generator().manual_seed(7)  # the same sizes on every rank
    bad = []
    in_flight = []  # (kind, buffer, work, expected, out)
    for it in range(60):
        reduce = it % 3 == 2
        span = int(torch.randint(1, 150_000 // (w * w if reduce else w), (1,), generator=gen))
        if it % 17 == 5:
            span = 260_000  # (w, span) fp32 is over three quarters of the 1 MiB ring at w >= 2: turned down
        if reduce:  # a reduce-scatter of the first `used` columns of a bucket
            used = max(1, span - int(torch.randint(0, span, (1,), generator=gen)))
            bucket = torch.empty(w, span)  # private: bounced through the ring in chunks at wait()
            for row in range(w):
                bucket[row, :used] = torch.arange(used, dtype=torch.float32) + 1000 * (r + 1) + 10 * row + it
            out = torch.empty(used)
            work = reduce_scatter_packed(out, bucket[:, :used], group=group, async_op=True)
            # rank r receives sum over j of row r of rank j's bucket
            expected = (torch.arange(used, dtype=torch.float32) * w + 1000 * sum(j + 1 for j in range(w))
                        + w * (10 * r + it))
            in_flight.append(("reduce", bucket, work, expected, out))
        else:
            # in the ring (in place), or private and bounced: every fourth one, and those the ring turns down
            packed = torch.empty(w, span) if it % 4 == 0 else take_gather_buffer((w, span), torch.float32, "cpu", group)
            shard = torch.arange(span, dtype=torch.float32) + 100_000 * r + it
            work = all_gather_packed(packed, shard, group=group, async_op=True)
            expected = torch.stack([torch.arange(span, dtype=torch.float32) + 100_000 * j + it for j in range(w)])
            in_flight.append(("gather", packed, work, expected, packed))
        if len(in_flight) == 3 or it == 59:  # waited in order, given back in reverse order
            for kind, buf, work, expected, out in in_flight:
                work.wait()
                if not torch.equal(out, expected):
                    bad.append((it, kind))
            for kind, buf, *_ in reversed(in_flight):
                give_packed(buf, group)
            in_flight = []
    if sub:
        dist.barrier()  # the world's, with the ranks outside the subgroup (above)
    return {"bad": bad, "taken": ring.taken if ring else 0, "refused": ring.refused if ring else 0,
            "ring": ring is not None, "size": ring.size if ring else 0}


@pytest.mark.parametrize("world, sub", [(2, False), (4, False), (4, True)])
def test_ring_gathers_and_reduce_scatters_exact_values_wrapping_a_small_ring(world, sub):
    results = run_distributed(_exchange, world, args=(sub,), env={"HF_ZERO_SHM_COMM_MIB": "1"})
    members = [1, 3] if sub else list(range(world))
    for rank in members:
        res = results[rank]
        assert res["ring"] and res["size"] < (1 << 20), res
        assert res["bad"] == [], res
        # 60 collectives: the two in-place gathers over three quarters of the ring (it 22 and 39) were turned down
        # and bounced; every bounce takes at least one chunk
        assert res["refused"] >= 2 and res["taken"] >= 60, res
    assert len({(results[r]["taken"], results[r]["refused"]) for r in members}) == 1  # the same answers everywhere
    # the ring's file was unlinked as soon as every rank had mapped it (another job's ring lives a few ms at most)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("hf_zero_comm_")]


def test_switched_off_the_same_collectives_go_through_gloo():
    results = run_distributed(_exchange, 2, args=(False,), env={"HF_ZERO_SHM_COMM": "0"})
    for res in results:
        assert not res["ring"] and res["bad"] == [] and res["taken"] == 0, res


def _stalled_peer():
    import time

    import torch.distributed as dist

    from hf_zero.comm import shm_ring

    rank = dist.get_rank()
    ring = shm_ring.ring_for(None)
    packed = ring.take_gather((2, 1000), torch.float32)
    region = ring.region_of(packed)
    out = {}
    if rank == 0:
        ring.publish(region)
        start = time.monotonic()
        try:
            ring.wait_ready(region, "the test's gather", timeout_s=0.6)
        except TimeoutError as exc:
            out["error"] = str(exc)
        out["seconds"] = time.monotonic() - start
    dist.barrier()  # rank 1 publishes only after rank 0 gave up
    if rank == 1:
        ring.publish(region)
    start = time.monotonic()
    ring.wait_ready(region, "the test's gather", timeout_s=5.0)
    out["then"] = time.monotonic() - start
    return out


def test_a_peer_that_never_writes_its_part_ends_the_wait_naming_it():
    res = run_distributed(_stalled_peer, 2)[0]
    assert "timed out after 0.6s in the test's gather: rank(s) [1] has not written its part" in res["error"], res
    assert 0.6 <= res["seconds"] < 0.6 + 0.5 + 1.0, res  # the liveness period is 0.25 s; slack for a loaded machine
    assert res["then"] < 5.0


def _full_ring_falls_back_to_gloo():
    import torch.distributed as dist

    from hf_zero.comm import all_gather_packed, give_packed, reduce_scatter_packed, shm_ring, take_gather_buffer

    rank = dist.get_rank()
    ring = shm_ring.ring_for(None)
    cols = ring.size // 8  # fp32 (2, cols): half the ring each
    held = []
    for k, frac in enumerate((0.5, 0.45)):  # two gathers in flight fill 95% of the ring
        packed = take_gather_buffer((2, int(cols * frac)), torch.float32, "cpu")
        held.append((all_gather_packed(packed, torch.full((packed.shape[1],), 10.0 * k + rank), async_op=True), packed))
    refused = ring.refused
    span = 50_000
    gathered = torch.empty(2, span)  # private: bounced, but no chunk fits beside what this rank holds
    all_gather_packed(gathered, torch.arange(span, dtype=torch.float32) + 1000 * rank)
    bucket = torch.stack([torch.arange(span, dtype=torch.float32) + 100 * row + rank for row in range(2)])
    out = torch.empty(span)
    reduce_scatter_packed(out, bucket)
    turned_down = ring.refused - refused
    ok_in_flight = []
    for k, (work, packed) in enumerate(held):
        work.wait()
        ok_in_flight.append(bool((packed[:, :3] == torch.tensor([[10.0 * k], [10.0 * k + 1]])).all()))
        give_packed(packed)
    gather_ok = torch.equal(gathered, torch.stack([torch.arange(span, dtype=torch.float32) + 1000 * j
                                                   for j in range(2)]))
    reduce_ok = torch.equal(out, 2 * torch.arange(span, dtype=torch.float32) + 200 * rank + 1)
    return turned_down, gather_ok, reduce_ok, ok_in_flight


def test_collectives_the_ring_turns_down_go_through_gloo_with_the_same_values():
    for turned_down, gather_ok, reduce_ok, ok_in_flight in run_distributed(_full_ring_falls_back_to_gloo, 2,
                                                                           env={"HF_ZERO_SHM_COMM_MIB": "1"}):
        assert turned_down == 2, turned_down  # the first chunk of each bounce: the rest goes through gloo rows
        assert gather_ok and reduce_ok and ok_in_flight == [True, True]


def _hf_zero_shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hf_zero_comm_")}


def _ring_set_up(kill_after_create: bool):
    import signal

    import torch.distributed as dist

    from hf_zero.comm import shm_ring

    if kill_after_create and dist.get_rank() == 0:
        create = shm_ring._create

        def create_then_die(kind, size):
            out = create(kind, size)
            os.kill(os.getpid(), signal.SIGKILL)  # between creating the memory and every rank mapping it
            return out

        shm_ring._create = create_then_die
    ring = shm_ring.ring_for(None)
    maps = open("/proc/self/maps").read()
    return {"ring": ring is not None, "memfd": "memfd:hf_zero_comm" in maps, "files": sorted(_hf_zero_shm_files())}


def test_ring_memory_has_no_name_and_a_kill_during_set_up_leaves_nothing():
    """The ring is an anonymous memfd (issue #25: a kill between creating a named /dev/shm file and unlinking it
    left the file behind): built normally, every rank maps memfd memory and /dev/shm never holds a ring file;
    rank 0 SIGKILLed right after creating it: the job fails naming the dead rank, and nothing is left behind."""
    before = _hf_zero_shm_files()
    outs = run_distributed(_ring_set_up, 2, args=(False,))
    assert all(o["ring"] and o["memfd"] for o in outs), outs
    assert all(set(o["files"]) <= before for o in outs), outs  # no ring file while the ranks were up
    from hf_zero.testing import DistributedFailure

    with pytest.raises(DistributedFailure, match="rank 0 exited with code -9"):
        run_distributed(_ring_set_up, 2, args=(True,), timeout_s=60)
    assert _hf_zero_shm_files() <= before


def _hold_most_of_the_ring(ring, w: int) -> list:
    """Two gathers in flight holding 95% of the ring: the next chunk that needs room is turned down."""
    from hf_zero.comm import all_gather_packed, take_gather_buffer

    held = []
    cols = ring.size // (4 * w)
    for frac in (0.5, 0.45):
        packed = take_gather_buffer((w, int(cols * frac)), torch.float32, "cpu")
        held.append((all_gather_packed(packed, torch.zeros(packed.shape[1]), async_op=True), packed))
    return held


def _let_go(held: list) -> None:
    from hf_zero.comm import give_packed

    for work, packed in held:
        work.wait()
        give_packed(packed)


def _filled(hold_ring: bool):
    """reduce_scatter_filled against reduce_scatter_packed of the same buffer materialized: a bucket of parameters
    of random sizes (some spanning several of the ring's chunks), filled column range by column range and delivered
    into one output per parameter. ``hold_ring``: two gathers hold 95% of the ring, so it turns the first chunk
    down and the rest goes through gloo."""
    import torch.distributed as dist

    from hf_zero.comm import reduce_scatter_filled, reduce_scatter_packed, shm_ring
    from hf_zero.zero.layout import ShardLayout

    rank, w = dist.get_rank(), dist.get_world_size()
    ring = shm_ring.ring_for(None)
    held = _hold_most_of_the_ring(ring, w) if hold_ring else []
    gen = torch.Generator().manual_seed(3)  # the same sizes on every rank
    bad, calls, refused, filled_at_issue = [], [], ring.refused if ring else 0, []
    for it in range(4):
        numels = [int(torch.randint(1, 90_000, (1,), generator=gen)) for _ in range(int(torch.randint(1, 7, (1,),
                                                                                                  generator=gen)))]
        layout = ShardLayout(tuple(numels), w)
        flats = [torch.arange(n, dtype=torch.float32) % 977 + 1000 * rank + it for n in numels]
        reference = torch.empty(w, layout.shard_numel)
        layout.pack(flats, 0, reference, scale=0.5)
        expected = torch.empty(layout.shard_numel)
        reduce_scatter_packed(expected, reference)
        got = torch.full((layout.shard_numel,), float("nan"))
        added = torch.arange(layout.shard_numel, dtype=torch.float64)  # float64: cast on the way, as into fp32
        seen = []

        def deliver(lo, hi, sum_into):
            seen.append((lo, hi))
            mid = (lo + hi) // 2  # two pieces, as a caller writing into two parameters' storages would
            sum_into(got[lo:mid], lo, mid)
            if mid < hi:
                sum_into(got[mid:hi], mid, hi)
            sum_into(added[lo:hi], lo, hi, add=True)

        events = []  # ("fill", lo, hi) and "filled" of the first collective, in order

        def fill(dst, lo, log=False):
            if log:
                events.append(("fill", lo, lo + dst.shape[1]))
            layout.pack_columns(flats, 0, dst, lo, scale=0.5)

        work = reduce_scatter_filled(lambda dst, lo: fill(dst, lo, log=True), (w, layout.shard_numel), torch.float32,
                                     "cpu", deliver=deliver, filled=lambda: events.append("filled"),
                                     what="the test's bucket", defer_check=True)
        whole = torch.full((layout.shard_numel,), float("nan"))  # the same sums into one tensor
        work2 = reduce_scatter_filled(fill, (w, layout.shard_numel), torch.float32, "cpu", out=whole)
        filled_at_issue.append("filled" in events)
        work.wait()
        work2.wait()
        # filled() once, right after the fills have covered every column, and no fill after it
        fills = [e for e in events if e != "filled"]
        if not (events.count("filled") == 1 and events[-1] == "filled" and fills[0][1] == 0
                and fills[-1][2] == layout.shard_numel and all(a[2] == b[1] for a, b in zip(fills, fills[1:]))):
            bad.append((it, "filled", events[:6]))
        contiguous = all(a[1] == b[0] for a, b in zip(seen, seen[1:]))
        sums_added = torch.equal(added, torch.arange(layout.shard_numel, dtype=torch.float64) + expected.double())
        if not (torch.equal(got, expected) and torch.equal(whole, expected) and sums_added and seen[0][0] == 0
                and seen[-1][1] == layout.shard_numel and contiguous):
            bad.append(it)
        calls.append(len(seen))
    _let_go(held)
    return {"bad": bad, "calls": calls, "ring": ring is not None, "filled_at_issue": filled_at_issue,
            "refused": (ring.refused - refused) if ring else 0}


@pytest.mark.parametrize("world, env, hold", [(2, {"HF_ZERO_SHM_COMM_MIB": "1"}, False),
                                              (4, {"HF_ZERO_SHM_COMM_MIB": "1"}, False),
                                              (2, {"HF_ZERO_SHM_COMM_MIB": "1"}, True),
                                              (2, {"HF_ZERO_SHM_COMM": "0"}, False)])
def test_a_bucket_given_as_functions_reduces_to_the_packed_buffers_sums(world, env, hold):
    for res in run_distributed(_filled, world, args=(hold,), env=env):
        assert res["bad"] == [], res
        # off the ring the bucket is packed when issued (here: when the next collective settles the deferred one),
        # so the gradients need not be held while it is in flight; through the ring it is packed at wait()
        assert res["filled_at_issue"] == [env.get("HF_ZERO_SHM_COMM") == "0"] * 4, res
        if env.get("HF_ZERO_SHM_COMM") == "0":  # one delivery of the whole bucket, after gloo's reduces
            assert not res["ring"] and res["calls"] == [1, 1, 1, 1], res
        elif hold:  # the first chunk turned down (the reference's, the two filled ones'): the rest at once, from gloo
            assert res["refused"] == 12 and res["calls"] == [1, 1, 1, 1], res
        else:  # straight through the ring, chunk by chunk (1/8 of a 1 MiB ring: a few thousand columns each)
            assert res["ring"] and res["refused"] == 0 and min(res["calls"]) >= 2, res


def _delivered(hold_ring: bool):
    """all_gather_delivered against all_gather_packed of the same shard: the rows of every chunk unpacked straight
    into parameters of random sizes, as stages 1-2 publish their weights."""
    import torch.distributed as dist

    from hf_zero.comm import all_gather_delivered, shm_ring
    from hf_zero.zero.layout import ShardLayout

    rank, w = dist.get_rank(), dist.get_world_size()
    ring = shm_ring.ring_for(None)
    held = _hold_most_of_the_ring(ring, w) if hold_ring else []
    gen = torch.Generator().manual_seed(5)
    bad, calls = [], []
    for it in range(4):
        numels = [int(torch.randint(1, 90_000, (1,), generator=gen)) for _ in range(int(torch.randint(1, 7, (1,),
                                                                                                  generator=gen)))]
        layout = ShardLayout(tuple(numels), w)
        full = [torch.arange(n, dtype=torch.float32) * 3 + it for n in numels]  # what every rank should end with
        shard = torch.empty(w, layout.shard_numel)
        layout.pack(full, 0, shard)  # this rank publishes its row
        outs = [torch.full((n,), float("nan")) for n in numels]
        seen = []

        def deliver(lo, hi, rows):
            seen.append((lo, hi))
            layout.unpack_columns(rows, 0, outs, lo)

        all_gather_delivered(shard[rank].clone(), deliver, what="the test's gather").wait()
        contiguous = all(a[1] == b[0] for a, b in zip(seen, seen[1:]))
        unpacked = all(torch.equal(o, f) for o, f in zip(outs, full))
        if not (unpacked and contiguous and seen[-1][1] == layout.shard_numel):
            bad.append(it)
        calls.append(len(seen))
    _let_go(held)
    return {"bad": bad, "calls": calls, "ring": ring is not None}


@pytest.mark.parametrize("world, env, hold", [(2, {"HF_ZERO_SHM_COMM_MIB": "1"}, False),
                                              (4, {"HF_ZERO_SHM_COMM_MIB": "1"}, False),
                                              (2, {"HF_ZERO_SHM_COMM_MIB": "1"}, True),
                                              (2, {"HF_ZERO_SHM_COMM": "0"}, False)])
def test_a_gather_delivered_chunk_by_chunk_unpacks_every_rank_s_rows(world, env, hold):
    for res in run_distributed(_delivered, world, args=(hold,), env=env):
        assert res["bad"] == [], res
        if env.get("HF_ZERO_SHM_COMM") == "0" or hold:  # one delivery: gloo's rows (after the first chunk, if any)
            assert res["calls"] == [1, 1, 1, 1], res
        else:
            assert min(res["calls"]) >= 2, res
