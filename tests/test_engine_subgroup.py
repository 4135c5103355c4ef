"""The engine on a data-parallel sub-group that does not contain global rank 0, and a gradient norm spanning a
model-parallel group.

4 ranks: data-parallel groups {0,1} and {2,3}. Group {0,1} trains part A of a model, group {2,3} part B
(the loss is separable, so each part's gradient depends only on its own data); model-parallel groups {0,2} and
{1,3} join the two parts. With SGD and gradient_clipping 0.5 the clipped update depends on the norm of the whole
model's gradient: every part must match the single-process reference that clips A and B together. ZeRO stages 0-3
(stage 3 also from zero.Init on the sub-group); outside zero.Init the models are built with a different seed on
each rank, so the engine's start-up broadcast from the sub-group's first member (global rank 2 for {2,3}) is what
makes them agree.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.testing import run_distributed

IN, HID, OUT = 5, 11, 3
MICRO, STEPS, LR, CLIP = 2, 3, 0.1, 0.5


def _part(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def _data():
    g = torch.Generator().manual_seed(7)
    # (steps, part, dp rank, micro, ...)
    return torch.randn(STEPS, 2, 2, MICRO, IN, generator=g), torch.randn(STEPS, 2, 2, MICRO, OUT, generator=g)


def _reference():
    parts = [_part(100), _part(200)]
    params = [p for m in parts for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    x, y = _data()
    losses, norms = [], []
    for s in range(STEPS):
        loss_parts = [nn.functional.mse_loss(parts[k](x[s, k].reshape(-1, IN)), y[s, k].reshape(-1, OUT))
                      for k in range(2)]
        sum(loss_parts).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append([lp.item() for lp in loss_parts])
    return losses, norms, [{n: p.detach().clone() for n, p in m.state_dict().items()} for m in parts]


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20, "allgather_bucket_size": 30,
                                  "stage3_param_persistence_threshold": 4},
            "steps_per_print": 1000}


def _train(stages):
    import torch.distributed as dist

    from hf_zero import zero
    from hf_zero.config import load_config
    from hf_zero.runtime.engine import HfZeroEngine
    from hf_zero.runtime.optimizers import plan_from_config

    rank = dist.get_rank()
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    part, dp_rank = divmod(rank, 2)
    dp, mp = dp_groups[part], mp_groups[dp_rank]
    x, y = _data()
    out = {}
    for stage, use_init in stages:
        cfg = load_config(_config(stage), world_size=2, rank=dp_rank)
        # the true weights only on the group's first member: the engine must broadcast from global rank 2 in {2,3}.
        # zero.Init cuts each rank's shard from that rank's own values (no broadcast), so it gets the same seed.
        seed = 100 * (part + 1) if dp_rank == 0 or use_init else 999 + rank
        if use_init:
            with zero.Init(data_parallel_group=dp):
                model = _part(seed)
        else:
            model = _part(seed)
        plan = plan_from_config(cfg.optimizer, list(model.parameters()))
        engine = HfZeroEngine(model, cfg, plan, process_group=dp, model_parallel_group=mp)
        losses, norms = [], []
        for s in range(STEPS):
            loss = nn.functional.mse_loss(engine(x[s, part, dp_rank]), y[s, part, dp_rank])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=dp)
            losses.append(mean.item() / 2)
            norms.append(engine.get_global_grad_norm())
        if engine.stage3 is not None:
            from hf_zero.zero import GatheredParameters

            with GatheredParameters(list(engine.module.parameters())):
                params = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
        else:
            params = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
        engine.destroy()
        out[(stage, use_init)] = (part, losses, norms, params)
    return out


def test_engine_on_sub_groups_clips_by_the_norm_across_the_model_parallel_group():
    cases = [(0, False), (1, False), (2, False), (3, False), (3, True)]
    results = run_distributed(_train, world_size=4, args=(cases,), timeout_s=300)
    ref_losses, ref_norms, ref_params = _reference()
    # the clip is active: an unclipped run would be a different test
    assert all(n > CLIP * 1.5 for n in ref_norms), ref_norms
    for rank, per_case in enumerate(results):
        for case, (part, losses, norms, params) in per_case.items():
            where = f"rank {rank} (part {part}), stage/zero.Init {case}"
            assert losses == pytest.approx([l[part] for l in ref_losses], rel=1e-5), where
            assert norms == pytest.approx(ref_norms, rel=1e-5), where
            for name, ref in ref_params[part].items():
                torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=f"{where}: {name}")
