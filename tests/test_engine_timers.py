"""Time blocked in collectives is attributed to a "communication" phase, for stages 2 and 3, on swapped timers."""

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.profiling.timers import PhaseTimers
from hf_zero.testing import run_distributed

from _parity import base_config, engine_run, make_model


def _phases(stage):
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(stage))
    engine.timers = PhaseTimers(enabled=True)  # what the HF callback does: components must follow the swap
    engine_run(engine, dist.get_world_size(), dist.get_rank(), steps=2)
    return dict(engine.timers.seconds)


def _both():
    return {stage: _phases(stage) for stage in (2, 3)}


def test_communication_phase_is_timed_for_stage_2_and_3():
    for by_stage in run_distributed(_both, 2):
        for stage, phases in by_stage.items():
            assert {"forward", "backward", "step", "communication"} <= set(phases), (stage, phases)
            # waits happen inside backward (reductions) or forward (stage-3 gathers): never more than both
            assert 0 < phases["communication"] <= phases["backward"] + phases["forward"] + phases["step"]
