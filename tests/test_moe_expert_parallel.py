"""MoE expert parallelism (``MoE(..., ep_size > 1)``) against one process holding every expert.

Every rank gates its own micro-batch over all experts and exchanges tokens with the ranks of its expert-parallel
group; the reference runs each rank's micro-batch through the same model with all experts in one process and
averages the losses. Experts start from weights drawn by *global* expert index, so a rank holding the wrong experts
(or a wrong all-to-all order) shows up in the first loss. Checked at ZeRO stages 0, 1 and 2, world 2 / ep 2,
world 4 / ep 2 and world 4 / ep 4: losses, every parameter after the steps, the clipped global gradient norm, the
experts each rank holds (DeepSpeed's rank layout), and a checkpoint round trip restoring parameters and optimizer
states exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.moe import MoE
from hf_zero.testing import run_distributed

H, E, STEPS, BATCH, LR, CLIP = 6, 4, 3, 5, 0.02, 0.05


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))


class Net(nn.Module):
    def __init__(self, ep_size: int):
        super().__init__()
        self.inp = nn.Linear(3, H)
        # top-2, capacity small enough that tokens are dropped: the per-rank capacity must be reproduced exactly
        self.moe = MoE(H, _expert(), num_experts=E, ep_size=ep_size, k=2, capacity_factor=0.75, min_capacity=1,
                       use_rts=False, top2_2nd_expert_sampling=False)
        self.out = nn.Linear(H, 1)

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h), l_aux


def _build(ep_size: int, ep_rank: int) -> Net:
    """The same dense weights everywhere; expert ``g`` (global index) drawn from its own seed."""
    torch.manual_seed(0)
    model = Net(ep_size)
    local = model.moe.num_local_experts
    with torch.no_grad():
        for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(1000 + ep_rank * local + i)
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _data(world: int):
    g = torch.Generator().manual_seed(4)
    return torch.randn(STEPS, world, BATCH, 3, generator=g), torch.randn(STEPS, world, BATCH, 1, generator=g)


def _loss(model, x, y):
    pred, l_aux = model(x)
    return nn.functional.mse_loss(pred, y) + 0.01 * l_aux


def _reference(world: int):
    model = _build(1, 0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _data(world)
    losses, norms = [], []
    for s in range(STEPS):
        loss = sum(_loss(model, x[s, r], y[s, r]) for r in range(world)) / world
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _global_name(name: str, ep_rank: int, local: int) -> str:
    """A parameter's name in the model holding every expert (local expert i of EP rank e is e * local + i)."""
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    if not name.startswith(prefix):
        return name
    index, rest = name[len(prefix):].split(".", 1)
    return f"{prefix}{ep_rank * local + int(index)}.{rest}"


def _train(ep_size: int, stages, checkpoint_dir: str | None):
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_fp32_param

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    name = f"ep_size_{ep_size}"
    groups._create_expert_and_data_parallel(ep_size)
    ep_rank = groups._get_expert_parallel_rank(name)
    layout = {"ep_rank": ep_rank, "ep_ranks": groups._get_expert_parallel_group_ranks(name),
              "edp_ranks": groups._get_expert_data_parallel_group_ranks(name),
              "edp_world": groups._get_expert_data_parallel_world_size(name)}
    x, y = _data(world)
    out = {"layout": layout}
    for stage in stages:  # 0, 1, 2, or "2+offload" (offload_optimizer to the CPU)
        zero = {"stage": int(str(stage)[0])}
        if "offload" in str(stage):
            zero["offload_optimizer"] = {"device": "cpu"}
        model = _build(ep_size, ep_rank)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": CLIP, "zero_optimization": zero,
            "optimizer": {"type": "Adam", "params": {"lr": LR}}, "steps_per_print": 1000})
        losses, norms = [], []
        for s in range(STEPS):
            loss = _loss(engine, x[s, rank], y[s, rank])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
            norms.append(engine.get_global_grad_norm())
        # the fp32 masters (gathered over each expert's EDP group); offloaded ones are not readable so: the model's
        # fp32 weights, published from them
        params = {_global_name(n, ep_rank, E // ep_size):
                  (p.detach() if "offload" in str(stage) else safe_get_full_fp32_param(p)).clone()
                  for n, p in model.named_parameters()}
        held = len(model.moe.deepspeed_moe.experts.deepspeed_experts)
        result = {"losses": losses, "norms": norms, "params": params, "held": held}
        if checkpoint_dir is not None:
            # the consolidated weights hold every expert under its global index (rank 0 returns them)
            result["full"] = engine._zero3_consolidated_16bit_state_dict()
            engine.save_checkpoint(checkpoint_dir, tag=f"stage{stage}")
            before = {k: v.clone() for k, v in engine.optimizer.shard_state().items()}
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            fresh = _build(ep_size, ep_rank)
            engine2, *_ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config={
                "train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": CLIP, "zero_optimization": zero,
                "optimizer": {"type": "Adam", "params": {"lr": LR}}, "steps_per_print": 1000})
            engine2.load_checkpoint(checkpoint_dir, tag=f"stage{stage}")
            after = engine2.optimizer.shard_state()
            same_state = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
            same_weights = all(torch.equal(weights[n], p.detach()) for n, p in fresh.named_parameters())
            # the next step of both engines is the same step
            nxt = [_loss(e, x[0, rank], y[0, rank]) for e in (engine, engine2)]
            for e, loss in zip((engine, engine2), nxt):
                e.backward(loss)
                e.step()
            same_next = all(torch.equal(a.detach(), b.detach())
                            for a, b in zip(model.parameters(), fresh.parameters()))
            result["checkpoint"] = (same_state, same_weights, same_next, len(before))
            engine2.destroy()
        out[stage] = result
        engine.destroy()
    return out


def _check(world: int, ep_size: int, stages, tmp_path=None):
    ref_losses, ref_norms, ref_params = _reference(world)
    results = run_distributed(_train, world_size=world,
                              args=(ep_size, stages, str(tmp_path) if tmp_path is not None else None),
                              timeout_s=300)
    for rank, res in enumerate(results):
        # DeepSpeed's layout: EP groups of consecutive ranks, EDP groups strided by ep_size
        assert res["layout"] == {"ep_rank": rank % ep_size,
                                 "ep_ranks": list(range(rank - rank % ep_size, rank - rank % ep_size + ep_size)),
                                 "edp_ranks": list(range(rank % ep_size, world, ep_size)),
                                 "edp_world": world // ep_size}
        for stage in stages:
            got = res[stage]
            assert got["held"] == E // ep_size, "each rank holds num_experts / ep_size experts"
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank} stage {stage}"
            assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), f"rank {rank} stage {stage}"
            assert ref_norms[0] > CLIP  # clipping is active: the norm decides the update
            for n, p in got["params"].items():
                torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6, msg=f"rank {rank} stage {stage} {n}")
            if got.get("full") is not None:
                assert rank == 0 and set(got["full"]) == set(ref_params)
                for n, p in got["full"].items():
                    torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6, msg=f"consolidated {n}")
            if "checkpoint" in got:
                same_state, same_weights, same_next, numel = got["checkpoint"]
                assert same_state and same_weights and same_next and numel > 0, (rank, stage, got["checkpoint"])
    # every global expert is held by exactly the ranks of its EP rank
    names = {n for res in results for n in res[stages[0]]["params"]}
    assert names == set(ref_params)


def test_world2_ep2_stages_0_1_2_with_checkpoints(tmp_path):
    _check(2, 2, (0, 1, 2), tmp_path)


def test_world4_ep2_stages_0_1_2(tmp_path):
    _check(4, 2, (0, 1, 2), tmp_path)


def test_world4_ep4_stages_0_2(tmp_path):
    _check(4, 4, (0, 2), tmp_path)


def test_world2_ep2_stage2_with_optimizer_offload(tmp_path):
    _check(2, 2, ("2+offload",), tmp_path)


def _refusals():
    import deepspeed

    errors = {}
    for key, ep_size, stage in (("world", 4, 2), ("stage3", 2, 3)):
        torch.manual_seed(0)
        model = Net(ep_size) if ep_size <= E else None
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
                "train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": stage},
                "optimizer": {"type": "Adam", "params": {"lr": LR}}})
            errors[key] = None
        except Exception as exc:  # noqa: BLE001 -- the message is what is checked
            errors[key] = f"{type(exc).__name__}: {exc}"
    return errors


def test_bad_ep_size_and_stage3_are_refused_by_name():
    with pytest.raises(ValueError, match=r"num_experts=4 .*ep_size=3"):
        MoE(H, _expert(), num_experts=4, ep_size=3)
    errors = run_distributed(_refusals, world_size=2, timeout_s=120)[0]
    assert "ep_size=4 does not divide the world size 2" in errors["world"]
    assert "zero_optimization.stage" in errors["stage3"] and "MoE(ep_size=2)" in errors["stage3"]
