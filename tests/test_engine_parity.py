"""Stages 0, 1, 2 and 3 on 1, 2 and 4 ranks match a single-process reference that sees the same global batch."""

import pytest
import torch
import torch.distributed as dist

import hf_zero
from hf_zero.testing import run_distributed

from _parity import STEPS, assert_matches_reference, base_config, clone_state, engine_run, make_model, reference_run


def _train_stages(stages):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(stage))
        losses = engine_run(engine, world, rank)
        out[stage] = (losses, clone_state(engine))
        engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp32_parity_all_stages(world_size):
    ref_losses, ref_params = reference_run(world_size)
    results = run_distributed(_train_stages, world_size, args=((0, 1, 2, 3),))
    for stage in (0, 1, 2, 3):
        losses, params = results[0][stage]
        assert len(losses) == STEPS
        assert_matches_reference(losses, params, ref_losses, ref_params, f"stage {stage}, world {world_size}")
        # every rank ends with the same full weights (stage 3 holds shards; rank 0 consolidated them above)
        for r in range(1, world_size if stage < 3 else 1):
            for name in ref_params:
                torch.testing.assert_close(results[r][stage][1][name], params[name], rtol=0, atol=0)
