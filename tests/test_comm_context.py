"""One communication context per process group (comm/context.py), closed with the group; the shared ring's named
fallback file is removed whatever happens during set-up.

- A group's fault channel, ring and gatherer live in one GroupComm, keyed by the group object; hf_zero's
  destroy_process_group closes it first: the monitor thread joined, the ring's mapping gone from /proc/self/maps, no
  reference to the group left -- so torch frees the group (and gloo's threads) right there.
- A group destroyed with torch's own destroy_process_group: its context is found stale and closed at the next
  creation; a world initialized again gets fresh state (a new ring, a channel whose store keys cannot meet the old).
- The fallback /dev/shm file (where the memfd cannot be opened through /proc): a rank SIGKILLed during set-up --
  rank 0 right after creating it, or rank 1 before mapping it -- leaves nothing in /dev/shm.
"""

from __future__ import annotations

import os
import signal

import pytest

from hf_zero.testing import DistributedFailure, run_distributed


def _ring_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("hf_zero_comm" in line for line in f)


def _monitor_threads() -> int:
    import threading

    return sum(t.name == "hf_zero-fault-monitor" and t.is_alive() for t in threading.enumerate())


def _close_with_the_group():
    import gc
    import sys
    import weakref

    import torch
    import torch.distributed as dist

    from hf_zero.comm import context, destroy_process_group, faults, shm_ring
    from hf_zero.zero.stage3.gather import gatherer_for

    out = {}
    world = dist.group.WORLD
    sub = dist.new_group([0, 1])
    for g in (None, sub):
        faults.channel_for(g)
        shm_ring.ring_for(g, 1 << 20)
        gatherer_for(g)
    ctx_world, ctx_sub = context.get(None), context.get(sub)
    out["one_context_per_group"] = (context.get(world) is ctx_world, len(context.contexts()))
    out["slots"] = [(c.channel is not None, c.ring is not None, "gatherer" in c.attachments)
                    for c in (ctx_world, ctx_sub)]
    out["before"] = (_monitor_threads(), _ring_mappings())
    x = torch.ones(3)
    dist.all_reduce(x, group=sub)
    # the deferred check of a collective still waiting to leave is settled at close: its payload is issued
    t = torch.full((2,), float(dist.get_rank() + 1))
    from hf_zero.comm.collectives import BoundedWork

    bw = BoundedWork(None, "a deferred all-reduce", sub)

    def issue(group=sub):
        bw.work = dist.all_reduce(t, group=group, async_op=True)

    faults.check_deferred("all_reduce", 2, t.dtype, "a deferred all-reduce", issue, group=sub, force=True)
    out["deferred_before"] = ctx_sub.channel.deferred is not None
    ref = weakref.ref(sub)
    del sub, issue
    context.close(ctx_sub.pg)  # hf_zero's destroy path for a subgroup closes only that group's context
    bw.work.wait()
    out["deferred_sum"] = t.tolist()
    del bw  # (it names the group)
    out["after_sub"] = (ctx_sub.state.value, ctx_sub.pg is None, _monitor_threads(), _ring_mappings(),
                        len(context.contexts()))
    dist.destroy_process_group(ref())
    gc.collect()
    # nothing of hf_zero's holds it: gone, or only the one reference torch's C++ side keeps (refcount 2 counts the
    # argument of getrefcount); a pin or a context would add one
    out["sub_freed"] = ref() is None or sys.getrefcount(ref()) <= 2
    wref = weakref.ref(world)
    del world
    destroy_process_group()
    gc.collect()
    out["after_world"] = (ctx_world.state.value, _monitor_threads(), _ring_mappings(), len(context.contexts()))
    out["world_freed"] = wref() is None or sys.getrefcount(wref()) <= 2  # as for the subgroup
    return out


def test_destroy_closes_every_context_and_frees_the_groups():
    for out in run_distributed(_close_with_the_group, 2):
        assert out["one_context_per_group"] == (True, 2)
        assert out["slots"] == [(True, True, True), (True, True, True)]
        assert out["before"] == (2, 2)  # a monitor thread and a ring mapping per group
        assert out["deferred_before"] is True
        assert out["deferred_sum"] == [3.0, 3.0]  # 1 + 2: the payload left at close, on both ranks
        assert out["after_sub"] == ("closed", True, 1, 1, 1)
        assert out["sub_freed"] is True
        assert out["after_world"] == ("closed", 0, 0, 0)
        assert out["world_freed"] is True


def _torch_destroy_then_init_again(port: int):
    import torch.distributed as dist

    from hf_zero.comm import context, faults, shm_ring

    first = context.get(None)
    faults.channel_for(None)
    ring1 = shm_ring.ring_for(None, 1 << 20)
    prefix1 = first.channel.prefix
    dist.destroy_process_group()  # torch's, not hf_zero's: the context is stale now
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
    second = context.get(None)  # a miss (a new group object): the stale context is closed here
    faults.channel_for(None)
    ring2 = shm_ring.ring_for(None, 1 << 20)
    return {"stale_closed": first.state.value, "fresh": second is not first, "incarnations": (first.incarnation,
            second.incarnation), "new_ring": ring2 is not None and ring2 is not ring1,
            "prefixes_differ": prefix1 != second.channel.prefix, "maps": _ring_mappings(),
            "monitors": _monitor_threads()}


def test_a_group_destroyed_by_torch_is_closed_at_the_next_use_and_a_new_world_starts_fresh():
    from hf_zero.comm.process_group import free_port

    for out in run_distributed(_torch_destroy_then_init_again, 2, args=(free_port(),)):
        assert out == {"stale_closed": "closed", "fresh": True, "incarnations": (0, 1), "new_ring": True,
                       "prefixes_differ": True, "maps": 1, "monitors": 1}, out


# ---- the named fallback file ------------------------------------------------------------------------------------

def _hf_zero_shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hf_zero_comm_")}


def _fallback_set_up(kill_rank: int | None):
    import torch.distributed as dist

    from hf_zero.comm import shm_ring

    shm_ring._KINDS = ("file",)  # as where /proc/<pid>/fd of another process cannot be opened
    rank = dist.get_rank()
    if kill_rank == 0 and rank == 0:
        create = shm_ring._create

        def create_then_die(kind, size):
            out = create(kind, size)
            os.kill(os.getpid(), signal.SIGKILL)  # the file exists, no other rank has mapped it
            return out

        shm_ring._create = create_then_die
    if kill_rank == 1 and rank == 1:
        def die_before_mapping(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)  # rank 0 created it and waits for this rank's vote

        shm_ring.torch.from_file = die_before_mapping
    seen = []
    if rank == 0 and kill_rank is None:
        create = shm_ring._create

        def create_and_look(kind, size):
            out = create(kind, size)
            seen.append(os.path.basename(out[1]))
            return out

        shm_ring._create = create_and_look
    ring = shm_ring.ring_for(None, 1 << 20)
    maps = open("/proc/self/maps").read()
    return {"ring": ring is not None, "named": "/dev/shm/hf_zero_comm_" in maps, "seen": seen,
            "files": sorted(_hf_zero_shm_files())}


@pytest.mark.parametrize("kill_rank", [0, 1])
def test_the_named_fallback_leaves_nothing_when_a_rank_is_killed_during_set_up(kill_rank):
    before = _hf_zero_shm_files()
    outs = run_distributed(_fallback_set_up, 2, args=(None,))
    assert all(o["ring"] and o["named"] for o in outs), outs  # the fallback works: a named file, mapped
    assert len(outs[0]["seen"]) == 1 and outs[0]["seen"][0].startswith("hf_zero_comm_")
    assert all(set(o["files"]) <= before for o in outs), outs  # unlinked once mapped
    with pytest.raises(DistributedFailure, match=f"rank {kill_rank} exited with code -9"):
        run_distributed(_fallback_set_up, 2, args=(kill_rank,), timeout_s=60)
    assert _hf_zero_shm_files() <= before
