"""ZeRO-3 pieces in one process: ShardedParam states, the trace, the divergence trailer, the engine contract at
world size 1 with a 16-bit compute dtype, and the module attributes transformers reads from zero.init."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hf_zero
from hf_zero.zero.stage3 import DivergenceError, ParamState, ShardedParam, Stage3Runtime, sharded_param_of
from hf_zero.zero.stage3.param import HoldReason
from hf_zero.zero.stage3.divergence import TRAILER_NUMEL, check_trailers, params_key, write_trailer
from hf_zero.zero.stage3.prefetch import GatherTrace


def test_sharded_param_states_and_compat_attributes():
    p = nn.Parameter(torch.arange(12.0).view(4, 3))
    sp = ShardedParam(p, "w", rank=1, world_size=2)  # rank 1 of 2: elements 6..11
    assert sharded_param_of(p) is sp
    assert sp.state is ParamState.PARTITIONED and p.shape == (0,)
    assert torch.equal(sp.local_shard, torch.arange(6.0, 12.0))
    assert p.ds_shape == (4, 3) and p.ds_numel == 12 and p.ds_tensor is sp.local_shard and p.ds_id == sp.ds_id
    assert p.ds_status.name == "NOT_AVAILABLE"
    with pytest.raises(AssertionError, match="to_partitioned from PARTITIONED"):
        sp.to_partitioned()
    sp.to_available(torch.arange(12.0))
    assert p.shape == (4, 3) and p.ds_status.name == "AVAILABLE"
    sp.acquire(HoldReason.BLOCK)
    with pytest.raises(AssertionError, match=r"still need it \(GatheredParameters block x1\)"):
        sp.to_partitioned()
    assert sp.release(HoldReason.BLOCK)
    with pytest.raises(AssertionError, match="forward hold released more often than taken"):
        sp.release(HoldReason.FORWARD)
    sp.to_partitioned()
    assert p.shape == (0,)
    with pytest.raises(ValueError, match="already partitioned"):
        ShardedParam(p, "w", rank=0, world_size=2)
    q = nn.Parameter(torch.ones(5))  # uneven: shard 3, rank 1 owns 2 elements + 1 padding
    sq = ShardedParam(q, "q", rank=1, world_size=2)
    assert sq.shard_numel == 3 and torch.equal(sq.local_shard, torch.tensor([1.0, 1.0, 0.0]))


def test_trace_prefetch_resync_and_reuse():
    misses = []
    trace = GatherTrace({0: 10, 1: 20, 2: 30, 3: 40}, on_miss=misses.append)
    trace.begin_iteration(True)
    assert trace.recording
    for gid in (0, 1, 2, 3, 2, 1, 0):
        trace.request(gid)
    trace.begin_iteration(True)  # the second iteration walks the recorded one
    assert not trace.recording
    trace.request(0)
    assert trace.upcoming(55) == [1, 2]     # 20 + 30 <= 55 < 20 + 30 + 40
    # group 2 comes back after 20 elements of group 1
    assert trace.reused_within({2}, 20) is True and trace.reused_within({2}, 19) is False
    assert trace.reused_within({1}, 0) is False and trace.reused_within({1}, 5) is True
    trace.request(3)                         # skipped 1 and 2: resynchronizes after 3
    assert trace.upcoming(1000) == [2, 1, 0]
    trace.request(7)                         # unknown: position unchanged, a miss
    assert trace.upcoming(1000) == [2, 1, 0]
    trace.request(3)                         # behind the position: a miss too
    assert misses == [7, 3]
    trace.begin_iteration(False)             # a no-grad iteration records its own trace
    assert trace.recording


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_divergence_trailer_round_trips_in_payload_dtype(dtype):
    key_a, key_b = params_key([3, 4, 5]), params_key([3, 5, 4])
    assert key_a != key_b and 0 <= key_a < 2 ** 24 and params_key([3, 4, 5]) == key_a
    tails = torch.empty(2, TRAILER_NUMEL, dtype=dtype)
    write_trailer(tails[0], key_a, 300)
    write_trailer(tails[1], key_a, 300)
    check_trailers(tails, 0, lambda k: f"module {k}")
    write_trailer(tails[1], key_b, 300)
    with pytest.raises(DivergenceError, match=rf"ranks \[0\] gathered module {key_a} .*ranks \[1\] gathered module "
                                              rf"{key_b}"):
        check_trailers(tails, 1, lambda k: f"module {k}")


def test_engine_contract_world_1_bf16():
    """The contract the engine drives: fp32 originals exposed, shards cast, engine-owned flat buffers used."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = Stage3Runtime(model, compute_dtype=torch.bfloat16, reduce_bucket_size=50, prefetch_bucket_size=100,
                       max_live_parameters=1000, max_reuse_distance=0, param_persistence_threshold=4,
                       overlap_comm=True)
    sps = rt.sharded_params()
    assert [sp.name for sp in sps] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # 2.bias has 4 elements: decided persistent now (ds_persist, as DeepSpeed marks it), gathered at the first forward
    assert [sp.persist_planned for sp in sps] == [False, False, False, True]
    assert [sp.param.ds_persist for sp in sps] == [False, False, False, True]
    assert [sp.persistent for sp in sps] == [False] * 4 and model[2].bias.shape == (0,)
    for sp in sps:
        assert torch.equal(sp.initial_fp32_shard()[:sp.numel], originals[sp.name].reshape(-1))
        assert sp.local_shard.dtype == torch.bfloat16
    flat = torch.empty(sum(sp.shard_numel for sp in sps), dtype=torch.bfloat16)
    grads = torch.zeros(flat.numel(), dtype=torch.float32)
    offset = 0
    for sp in sps:
        sp.use_shard_storage(flat[offset:offset + sp.shard_numel])
        sp.use_grad_storage(grads[offset:offset + sp.shard_numel])
        assert sp.local_shard.data_ptr() == flat[offset:].data_ptr()
        offset += sp.shard_numel
    assert torch.equal(flat.float(), torch.cat([sp.initial_fp32_shard() for sp in sps]).bfloat16().float())
    x = torch.randn(3, 8)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).bfloat16()
    ref.load_state_dict({n: v.bfloat16() for n, v in originals.items()})
    for _ in range(2):  # two micro-steps accumulate
        model(x.bfloat16()).float().square().mean().backward()
        assert [sp.persistent for sp in sps] == [False, False, False, True]
    rt.finish_backward()
    for _ in range(2):
        ref(x.bfloat16()).float().square().mean().backward()
    expected = torch.cat([dict(ref.named_parameters())[sp.name].grad.float().reshape(-1) for sp in sps])
    assert (grads - expected).abs().max() <= 2e-2 * expected.abs().max()
    assert all(p.grad is None for p in model.parameters())
    flat.add_(-0.1 * grads.bfloat16())  # the "optimizer" writes the engine's buffer
    rt.after_step()
    assert torch.equal(model[2].bias.data, flat[-sps[-1].shard_numel:][:4])  # persistent param re-published
    rt.remove()
    assert model[0].weight.shape == (16, 8) and not hasattr(model[0].weight, "ds_id")
    assert torch.equal(model[0].weight.data.reshape(-1), flat[:128])


def test_zero_init_module_attributes_transformers_reads():
    import hf_zero.zero.init as pp

    assert pp._orig_torch_arange is torch.arange
    wrapped = pp.zero_wrapper_for_fp_tensor_constructor(torch.zeros, torch.bfloat16, target_device="cpu")
    assert wrapped(3).dtype == torch.bfloat16 and wrapped(3, dtype=torch.int64).dtype == torch.int64
    assert pp.get_accelerator().device_name() in ("cpu", "cuda")
    import hf_zero.zero as zero

    assert zero.Init is pp.Init


def test_shard_state_reshards_frozen_shards_and_buffers(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hf_zero.checkpoint.reshard import ShardFiles

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3))
    model[0].weight.requires_grad_(False)
    full_weight = model[0].weight.detach().clone()
    rt = Stage3Runtime(model, reduce_bucket_size=100, prefetch_bucket_size=0, max_live_parameters=1000,
                       max_reuse_distance=0, param_persistence_threshold=0, overlap_comm=False)
    saved = rt.shard_state()
    assert sorted(saved) == ["stage3.buffer.1.num_batches_tracked", "stage3.buffer.1.running_mean",
                             "stage3.buffer.1.running_var", "stage3.frozen.0.weight"]
    assert "stage3.frozen.0.weight" not in rt.shard_state(exclude_frozen=True)
    # a checkpoint written by 2 ranks (shards of 8 of the 15 elements), loaded on this 1-rank runtime
    flat = torch.cat([full_weight.reshape(-1) * 2, torch.zeros(1)])
    buffers = {k: v.clone() + 1 for k, v in saved.items() if k.startswith("stage3.buffer.")}
    for r, piece in enumerate((flat[:8], flat[8:])):
        save_file({"stage3.frozen.0.weight": piece.contiguous(), **buffers}, str(tmp_path / f"r{r}.safetensors"))
    rt.load_shard_state(ShardFiles([safe_open(str(tmp_path / f"r{r}.safetensors"), "pt") for r in range(2)]))
    assert torch.equal(model[1].running_mean, buffers["stage3.buffer.1.running_mean"])
    rt.remove()
    assert torch.equal(model[0].weight, full_weight * 2)


def test_root_with_its_own_parameters_still_starts_iterations():
    """The root's own gather hooks must not hide the iteration boundary: the second step walks a recorded trace
    and prefetches (world size 1: the collectives are local copies)."""

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            return self.b(self.a(x * self.scale))

    model = Root()
    rt = Stage3Runtime(model, reduce_bucket_size=100, prefetch_bucket_size=1000, max_live_parameters=10_000,
                       max_reuse_distance=0, param_persistence_threshold=0, overlap_comm=False)
    for _ in range(2):
        model(torch.ones(2, 8)).sum().backward()
        rt.finish_backward()
        rt.after_step()
    assert not rt.trace.recording and rt.prefetched_numel > 0
    assert rt.gatherer.header_checks is False
    rt.remove()


def _init_starts_the_process_group():
    import torch.distributed as dist

    from hf_zero.zero import GatheredParameters, Init

    assert not dist.is_initialized()
    torch.manual_seed(0)
    expected = nn.Linear(6, 5).weight.detach().clone()
    torch.manual_seed(0)
    with Init(dtype=torch.bfloat16):
        lin = nn.Linear(6, 5)
        seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert dist.is_initialized() and dist.get_world_size() == 2
    assert lin.weight.shape == (0,) and lin.weight.ds_tensor.dtype == torch.bfloat16
    assert lin.weight.ds_tensor.numel() == 15 and all(p.shape == (0,) for p in seq.parameters())
    with GatheredParameters(lin.weight):
        assert torch.equal(lin.weight, expected.bfloat16())  # initialized (reset_parameters) before partitioning
    return True


def test_zero_init_starts_the_process_group_and_casts():
    from hf_zero.testing import run_distributed

    assert run_distributed(_init_starts_the_process_group, 2, init_process_group=False, timeout_s=60) == [True, True]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_training_states_of_a_checkpointed_forward_and_backward(use_reentrant):
    """Each module call is a unit with a training state: calls made during the backward (activation-checkpoint
    recomputation, either kind) start as RECOMPUTE, the others as FORWARD; every unit whose backward ran ends in
    POST_BACKWARD; the recognition uses the runtime's own knowledge of the pass, no private autograd call."""
    from torch.utils.checkpoint import checkpoint

    from hf_zero.zero.stage3.states import TrainingState

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            x = checkpoint(lambda h: self.b(h).relu(), x, use_reentrant=use_reentrant)
            return self.c(x)

    torch.manual_seed(0)
    model = Net()
    rt = Stage3Runtime(model, reduce_bucket_size=100, prefetch_bucket_size=0, max_live_parameters=1000,
                       max_reuse_distance=0, param_persistence_threshold=0, overlap_comm=False)
    started = []
    start_forward = rt.states.start_forward

    def record(module, group):
        call = start_forward(module, group)
        started.append((group.fqn, call.state, call))
        return call

    rt.states.start_forward = record
    model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert [(fqn, state) for fqn, state, _ in started] == [
        ("a", TrainingState.FORWARD), ("b", TrainingState.FORWARD), ("c", TrainingState.FORWARD),
        ("b", TrainingState.RECOMPUTE)]
    assert rt.states.in_backward and not rt.states.any_open()
    states = [call.state for _, _, call in started]
    # a and c: their own backward ran; b: the backward ran through the recomputed call (reentrant) or through the
    # original one (non-reentrant: recomputation only refills saved tensors)
    b_ran = 3 if use_reentrant else 1
    b_idle = 1 if use_reentrant else 3
    assert states[0] is states[2] is states[b_ran] is TrainingState.POST_BACKWARD, states
    assert states[b_idle] is TrainingState.IDLE, states
    rt.finish_backward()
    assert not rt.states.in_backward
    rt.remove()
    source = (Path(hf_zero.__file__).parent / "zero").rglob("*.py")
    assert not [p.name for p in source if "_current_graph_task_id" in p.read_text()]


def test_world_1_gathers_are_views_of_the_shards():
    """A world of one: a gathered parameter *is* its shard (no buffer, no copy), a release frees nothing, and the
    gradient goes straight into the grad storage; GatheredParameters without a modifier rank still works on a copy
    whose edits are discarded, and with one the edits land in the shard."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    rt = Stage3Runtime(model, compute_dtype=torch.float32, max_reuse_distance=0, param_persistence_threshold=0)
    sps = rt.sharded_params()
    grads = [torch.zeros(sp.shard_numel) for sp in sps]
    for sp, g in zip(sps, grads):
        sp.use_grad_storage(g)
    seen = {}

    def record(module, args):
        for name, p in module.named_parameters(recurse=False):
            seen[name + str(id(module))] = p.data_ptr() == sharded_param_of(p).local_shard.data_ptr()

    handles = [m.register_forward_pre_hook(record) for m in (model[0], model[2])]
    x = torch.randn(3, 8)
    model(x).square().mean().backward()
    rt.finish_backward()
    for h in handles:
        h.remove()
    assert seen and all(seen.values())  # every parameter computed with was its shard's own memory
    assert all(sp.state is ParamState.PARTITIONED for sp in sps)
    assert all(sp.local_shard.numel() == sp.numel for sp in sps)  # nothing freed
    assert rt.reducer.reduced_numel == sum(sp.numel for sp in sps)
    ref(x).square().mean().backward()
    for sp, g in zip(sps, grads):
        torch.testing.assert_close(g, dict(ref.named_parameters())[sp.name].grad.reshape(-1))
    w = model[0].weight
    before = sharded_param_of(w).local_shard.clone()
    with hf_zero.zero.GatheredParameters([w]):
        assert w.data_ptr() != sharded_param_of(w).local_shard.data_ptr()  # a copy
        with torch.no_grad():
            w.fill_(7.0)
    assert torch.equal(sharded_param_of(w).local_shard, before)  # discarded
    with hf_zero.zero.GatheredParameters([w], modifier_rank=0):
        with torch.no_grad():
            w.fill_(3.0)
    assert torch.equal(sharded_param_of(w).local_shard, torch.full((128,), 3.0))  # kept
    rt.remove()


def test_remove_before_the_first_forward_leaves_no_publishing_hook():
    """engine.destroy() before any forward: the persistent parameters' publishing pre-hooks go with the others, and
    the model computes as an ordinary module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    rt = Stage3Runtime(model, param_persistence_threshold=4)
    assert model[2].bias.shape == (0,)
    rt.remove()
    assert all(not m._forward_pre_hooks for m in model.modules())
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))
