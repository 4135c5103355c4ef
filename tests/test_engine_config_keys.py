"""Four DeepSpeed keys the engine honours as DeepSpeed's engine does: ``fp16.auto_cast``, the legacy top-level
``curriculum_learning``, ``memory_breakdown`` and ``dump_state``.

The reference values of the curriculum schedules are DeepSpeed 0.19.8's: its
``deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`` (``DS_ACCELERATOR=cpu``), fed the
configs of :data:`SCHEDULES`, gives the difficulties of :data:`DS_DIFFICULTIES` from ``update_difficulty(1..12)``.
Engines are single-process (gloo, world size 1) unless a test checks that rank 1 stays silent.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.config import ConfigError, load_config
from hf_zero.config.status import STATUS, ConfigKeyIgnored, Status
from hf_zero.runtime.curriculum import CurriculumScheduler
from hf_zero.runtime.input_cast import cast_inputs_half
from hf_zero.testing import run_distributed

KEYS = ("fp16.auto_cast", "curriculum_learning", "memory_breakdown", "dump_state")

SCHEDULES = {
    "fixed_linear": {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
                     "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
    "fixed_root": {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_root",
                   "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8, "root_degree": 2}},
    "fixed_discrete": {"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
                       "schedule_config": {"difficulty": [1, 2, 3], "max_step": [2, 4]}},
    # difficulty_step 16 above min_difficulty 8: rounding down gives 0 at step 1, raised to 16 (the first multiple
    # of the step at or above min_difficulty)
    "floor": {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 16}},
}
DS_DIFFICULTIES = {  # DeepSpeed 0.19.8, update_difficulty(s) for s = 1..12
    "fixed_linear": [8, 16, 24, 24, 32, 40, 40, 48, 56, 64, 64, 64],
    "fixed_root": [24, 32, 32, 40, 40, 48, 48, 56, 56, 64, 64, 64],
    "fixed_discrete": [1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3],
    "floor": [16, 16, 16, 16, 32, 32, 32, 48, 48, 64, 64, 64],
}


def curriculum(schedule: str, **extra) -> dict:
    return {"enabled": True, "curriculum_type": "seqlen", **SCHEDULES[schedule], **extra}


def load(config: dict):
    return load_config(config, world_size=1, log=False)


# ---- status and config ---------------------------------------------------------------------------------------------
def test_the_four_keys_are_honoured_and_warn_about_nothing():
    assert {key: STATUS[key].status for key in KEYS} == dict.fromkeys(KEYS, Status.HONOURED)
    config = {"fp16": {"enabled": True, "auto_cast": True}, "memory_breakdown": True, "dump_state": True,
              "curriculum_learning": curriculum("fixed_linear")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load(config)
    assert [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)] == []
    assert cfg.not_implemented == ()
    assert cfg.curriculum_learning.schedule_config.total_curriculum_step == 10


@pytest.mark.parametrize("section, message", [
    ({"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
     "curriculum_learning.curriculum_type: required when curriculum_learning is enabled"),
    (curriculum("fixed_linear", min_difficulty=None),
     "curriculum_learning.min_difficulty: required when curriculum_learning is enabled"),
    (curriculum("fixed_linear", min_difficulty=80),
     "curriculum_learning.min_difficulty: 80 is above max_difficulty 64; the schedule goes from min to max"),
    (curriculum("fixed_linear", schedule_type="fixed_cosine"),
     "curriculum_learning.schedule_type: value 'fixed_cosine' (str) is not accepted; use one of 'fixed_linear', "
     "'fixed_root', 'fixed_discrete', 'custom'"),
    (curriculum("fixed_linear", schedule_config={"difficulty_step": 8}),
     "curriculum_learning.schedule_config.total_curriculum_step: required by schedule_type 'fixed_linear'"),
    (curriculum("fixed_root", schedule_config={"total_curriculum_step": 10, "difficulty_step": 8}),
     "curriculum_learning.schedule_config.root_degree: required by schedule_type 'fixed_root'"),
    (curriculum("fixed_linear", schedule_config={"total_curriculum_step": 10, "difficulty_step": 0}),
     "curriculum_learning.schedule_config.difficulty_step: must be >= 1, got 0"),
    (curriculum("fixed_linear", schedule_config={"total_curriculum_steps": 10, "difficulty_step": 8}),
     "curriculum_learning.schedule_config.total_curriculum_steps: unknown key; did you mean "
     "'total_curriculum_step'?"),
    (curriculum("fixed_discrete", schedule_config={"difficulty": [1, 2, 3], "max_step": [2]}),
     "curriculum_learning.schedule_config.max_step: needs at least one entry, and one fewer than "
     "schedule_config.difficulty (the last difficulty holds for every later step): got 1 max_step for 3 "
     "difficulty"),
    (curriculum("fixed_discrete", schedule_config={"difficulty": [1, 2, 3], "max_step": [4, 2]}),
     "curriculum_learning.schedule_config.max_step: [4, 2] must be in ascending order"),
    (curriculum("fixed_discrete", schedule_config={"difficulty": [1]}),
     "curriculum_learning.schedule_config.max_step: required by schedule_type 'fixed_discrete'"),
])
def test_bad_curriculum_sections_name_the_key(section, message):
    section = {k: v for k, v in section.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        load({"curriculum_learning": section})
    assert str(info.value) == message


def test_a_disabled_curriculum_needs_nothing_else():
    assert load({"curriculum_learning": {"enabled": False, "schedule_type": "fixed_linear"}}) \
        .curriculum_learning.enabled is False
    with pytest.raises(ValueError, match="needs an enabled curriculum_learning section"):
        CurriculumScheduler(load({}).curriculum_learning)


# ---- the schedules ------------------------------------------------------------------------------------------------
def _scheduler(schedule: str, **extra) -> CurriculumScheduler:
    return CurriculumScheduler(load({"curriculum_learning": curriculum(schedule, **extra)}).curriculum_learning)


def _root_formula(step: int, lo: int, hi: int, total: int, d: int, degree: int) -> int:
    """DeepSpeed's fixed_root / fixed_linear arithmetic, written out."""
    value = math.floor((step / total) ** (1 / degree) * (hi - lo) + lo)
    value -= value % d
    return min(max(value, math.ceil(lo / d) * d), hi)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedules_give_deepspeeds_difficulties(schedule):
    scheduler = _scheduler(schedule)
    assert scheduler.get_current_difficulty() == SCHEDULES[schedule]["min_difficulty"]
    assert [scheduler.update_difficulty(s) for s in range(1, 13)] == DS_DIFFICULTIES[schedule]


def test_schedules_by_hand_and_by_formula():
    # fixed_linear, step 3: 3/10 * (64 - 8) + 8 = 24.8 -> 24 (a multiple of 8); step 4: 30.4 -> 30 -> 24
    linear = _scheduler("fixed_linear")
    assert (linear.get_difficulty(3), linear.get_difficulty(4), linear.get_difficulty(10)) == (24, 24, 64)
    # fixed_root (square root), step 1: sqrt(0.1) * 56 + 8 = 25.7 -> 25 -> 24
    root = _scheduler("fixed_root")
    assert root.get_difficulty(1) == 24
    for step in range(1, 15):
        assert linear.get_difficulty(step) == _root_formula(step, 8, 64, 10, 8, 1), step
        assert root.get_difficulty(step) == _root_formula(step, 8, 64, 10, 8, 2), step
    # fixed_discrete: difficulty[i] while step <= max_step[i], the last one after them
    discrete = _scheduler("fixed_discrete")
    assert [discrete.get_difficulty(s) for s in (0, 2, 3, 4, 5, 1000)] == [1, 1, 2, 2, 3, 3]


def test_the_difficulty_stops_at_max_and_custom_schedules_need_a_function():
    scheduler = _scheduler("fixed_linear")
    assert scheduler.update_difficulty(10) == 64
    assert scheduler.update_difficulty(2) == 64  # max reached: not recomputed (DeepSpeed's update_difficulty)
    custom = _scheduler("fixed_linear", schedule_type="custom", schedule_config={})
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        custom.update_difficulty(1)
    custom.set_custom_get_difficulty(lambda step: 8 * step)
    # a custom schedule is taken as it is (no clamping); once at or past max_difficulty it is no longer called
    assert [custom.update_difficulty(s) for s in (1, 2, 3, 9, 10)] == [8, 16, 24, 72, 72]


def test_state_dict_round_trip():
    scheduler = _scheduler("fixed_linear")
    scheduler.update_difficulty(5)
    fresh = _scheduler("fixed_linear")
    fresh.load_state_dict(scheduler.state_dict())
    assert scheduler.state_dict() == {"current_difficulty": 32} and fresh.get_current_difficulty() == 32


def test_cast_inputs_half_walks_containers_and_keeps_integers():
    x32, ids = torch.ones(2, dtype=torch.float32), torch.arange(3)
    out = cast_inputs_half((x32, [x32, ids], {"a": x32, "b": (ids, 1.5)}, "text", torch.ones(1, dtype=torch.float64)))
    assert out[0].dtype == torch.float16 and out[1][0].dtype == torch.float16 and out[1][1].dtype == torch.int64
    assert out[2]["a"].dtype == torch.float16 and out[2]["b"][0].dtype == torch.int64 and out[2]["b"][1] == 1.5
    assert out[3] == "text" and out[4].dtype == torch.float16 and isinstance(out[1], list)
    assert x32.dtype == torch.float32  # the caller's tensors are not changed


# ---- the engine ---------------------------------------------------------------------------------------------------
class Recorder(nn.Module):
    """Records the dtypes of what forward receives and the curriculum_seqlen it is given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.seen: list[dict] = []

    def forward(self, x, nested=None, scale=None, curriculum_seqlen=None):
        self.seen.append({"x": x.dtype, "nested": None if nested is None else
                          [nested[0].dtype, nested[1]["ids"].dtype, nested[1]["mask"].dtype],
                          "scale": None if scale is None else scale.dtype, "seqlen": curriculum_seqlen})
        out = self.lin(x.to(self.lin.weight.dtype))
        return out.float().pow(2).mean()


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1}, **extra}


def _received_dtypes(fp16: bool, auto_cast: bool) -> dict:
    config = _config(fp16={"enabled": fp16, "auto_cast": auto_cast, "initial_scale_power": 4})
    engine, *_ = hf_zero.initialize(model=Recorder(), config=config)
    x = torch.randn(2, 4)
    nested = [torch.randn(2), {"ids": torch.arange(2), "mask": torch.ones(2, dtype=torch.bool)}]
    loss = engine(x, nested, scale=torch.ones(1))
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return {"seen": engine.module.seen[0], "weight": engine.module.lin.weight.dtype, "input": x.dtype,
            "fp16_auto_cast": engine.fp16_auto_cast()}


def _auto_cast_cases():
    return {case: _received_dtypes(*case) for case in ((True, True), (True, False), (False, True))}


def test_fp16_auto_cast_casts_floating_positional_inputs():
    [cases] = run_distributed(_auto_cast_cases, 1)
    f16, f32, i64, b = torch.float16, torch.float32, torch.int64, torch.bool
    on = cases[(True, True)]
    assert on["seen"] == {"x": f16, "nested": [f16, i64, b], "scale": f32, "seqlen": None}
    assert on["weight"] == f16 and on["input"] == f32 and on["fp16_auto_cast"] is True
    # without auto_cast the inputs arrive as given (the model casts them itself)
    assert cases[(True, False)]["seen"] == {"x": f32, "nested": [f32, i64, b], "scale": f32, "seqlen": None}
    # DeepSpeed reads auto_cast without looking at fp16.enabled: fp32 training casts too
    assert cases[(False, True)]["seen"]["x"] == f16 and cases[(False, True)]["weight"] == f32


def _curriculum_run(schedule: str, steps: int) -> dict:
    engine, *_ = hf_zero.initialize(model=Recorder(), config=_config(
        gradient_accumulation_steps=2, curriculum_learning=curriculum(schedule)))
    for _ in range(steps * 2):
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
    engine.eval()
    with torch.no_grad():
        engine(torch.randn(2, 4))  # not training: no curriculum_seqlen, difficulty unchanged
    out = {"seqlens": [seen["seqlen"] for seen in engine.module.seen], "current":
           engine.curriculum_scheduler_legacy.get_current_difficulty(), "enabled": engine.curriculum_enabled_legacy(),
           "params": engine.curriculum_params_legacy(), "global_steps": engine.global_steps}
    engine.destroy()
    return out


def _curricula():
    runs = {schedule: _curriculum_run(schedule, 6) for schedule in ("fixed_linear", "fixed_root", "fixed_discrete")}
    engine, *_ = hf_zero.initialize(model=Recorder(), config=_config())
    runs["off"] = (engine.curriculum_enabled_legacy(), engine.curriculum_scheduler_legacy)
    engine.destroy()
    return runs


def test_curriculum_seqlen_is_passed_for_step_global_steps_plus_1():
    [runs] = run_distributed(_curricula, 1)
    for schedule in ("fixed_linear", "fixed_root", "fixed_discrete"):
        run = runs[schedule]
        # two micro-steps per optimizer step, both at the difficulty of step global_steps + 1
        per_step = DS_DIFFICULTIES[schedule][:6]
        assert run["seqlens"] == [d for d in per_step for _ in range(2)] + [None], schedule
        assert run["current"] == per_step[-1] and run["global_steps"] == 6 and run["enabled"] is True
        assert run["params"] == {"curriculum_type": "seqlen", **SCHEDULES[schedule]}
    assert runs["fixed_linear"]["seqlens"][:12] == [8, 8, 16, 16, 24, 24, 24, 24, 32, 32, 40, 40]
    assert runs["off"] == (False, None)


def _checkpoint_round_trip(tmp: str) -> dict:
    config = _config(curriculum_learning=curriculum("fixed_linear"))
    engine, *_ = hf_zero.initialize(model=Recorder(), config=config)
    for _ in range(10):  # steps 1..10: the difficulty reaches max_difficulty 64
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
    saved = engine.curriculum_scheduler_legacy.get_current_difficulty()
    engine.save_checkpoint(tmp, tag="t")
    engine.destroy()
    on_disk = torch.load(Path(tmp) / "t" / "engine_state.pt", weights_only=True)["curriculum_scheduler"]
    resumed, *_ = hf_zero.initialize(model=Recorder(), config=config)
    before = resumed.curriculum_scheduler_legacy.get_current_difficulty()
    resumed.load_checkpoint(tmp, tag="t")
    after = resumed.curriculum_scheduler_legacy.get_current_difficulty()
    resumed.backward(resumed(torch.randn(2, 4)))
    resumed.step()
    out = {"saved": saved, "on_disk": on_disk, "before": before, "after": after,
           "global_steps": resumed.global_steps, "next_seqlen": resumed.module.seen[-1]["seqlen"]}
    resumed.destroy()
    return out


def test_curriculum_state_survives_save_and_load(tmp_path):
    [out] = run_distributed(_checkpoint_round_trip, 1, args=(str(tmp_path),))
    assert out == {"saved": 64, "on_disk": {"current_difficulty": 64}, "before": 8, "after": 64,
                   "global_steps": 11, "next_seqlen": 64}


def _one_step_output(extra: dict) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("hf_zero")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            engine, *_ = hf_zero.initialize(model=Recorder(), config=_config(**extra))
            engine.backward(engine(torch.randn(2, 4)))
            engine.step()
            engine.destroy()
    finally:
        log.removeHandler(handler)
    return {"rank": dist.get_rank(), "stdout": stdout.getvalue().splitlines(), "log": records}


def _outputs():
    return {"memory": _one_step_output({"memory_breakdown": True}), "dump": _one_step_output({"dump_state": True}),
            "neither": _one_step_output({})}


MEMORY_POINTS = ["Engine before configure distributed model", "Engine after configure distributed model",
                 "Engine before forward", "Engine after forward", "Engine before backward", "Engine after backward",
                 "Engine before step", "Engine after step"]


@pytest.fixture(scope="module")
def two_rank_outputs():
    return run_distributed(_outputs, 2)


def test_memory_breakdown_reports_at_each_stage_of_a_step_on_rank_0(two_rank_outputs):
    rank0, rank1 = two_rank_outputs
    lines = [line for line in rank0["memory"]["stdout"] if not line.startswith("[")]
    assert lines[0::3] == MEMORY_POINTS
    for accelerator, host in zip(lines[1::3], lines[2::3]):
        assert accelerator.startswith("MA ") and "Max_MA" in accelerator and "Max_CA" in accelerator
        assert host.startswith("CPU Virtual Memory:  used = ") and host.endswith("%")
    assert not any(line in MEMORY_POINTS for line in rank1["memory"]["stdout"])
    assert not any(line in MEMORY_POINTS for line in rank0["neither"]["stdout"])


def test_dump_state_logs_engine_state_and_config_on_rank_0(two_rank_outputs):
    rank0, rank1 = two_rank_outputs
    [dump] = [m for m in rank0["dump"]["log"] if m.startswith("HfZeroEngine state:")]
    lines = dump.splitlines()
    split = lines.index("HfZeroEngine configuration:")
    state, config = lines[1:split], lines[split + 1:]
    assert state == sorted(state) and config == sorted(config)
    # one "  name ..... value" line each, the values in one column per block
    for block in (state, config):
        assert all(re.fullmatch(r"  \S+ \.+ .*", line) for line in block), block
        assert len({line.index(" ", line.index(". ")) for line in block}) == 1
    state = dict(re.fullmatch(r"  (\S+) \.+ (.*)", line).groups() for line in state)
    config = dict(re.fullmatch(r"  (\S+) \.+ (.*)", line).groups() for line in config)
    assert {k: state[k] for k in ("global_steps", "stage", "world_size", "compute_dtype", "module", "optimizer")} \
        == {"global_steps": "0", "stage": "1", "world_size": "2", "compute_dtype": "torch.float32",
            "module": "<Recorder>", "optimizer": "<ZeroOptimizer>"}
    assert {k: config[k] for k in ("train_micro_batch_size_per_gpu", "train_batch_size", "dump_state",
                                   "zero_optimization.stage", "optimizer.type", "optimizer.params.lr",
                                   "fp16.loss_scale", "curriculum_learning.enabled")} \
        == {"train_micro_batch_size_per_gpu": "2", "train_batch_size": "4", "dump_state": "True",
            "zero_optimization.stage": "1", "optimizer.type": "'SGD'", "optimizer.params.lr": "0.01",
            "fp16.loss_scale": "0.0", "curriculum_learning.enabled": "False"}
    assert not any("HfZeroEngine state:" in m for m in rank1["dump"]["log"] + rank0["neither"]["log"])


def _pipeline_curriculum() -> dict:
    from hf_zero.pipe import PipelineModule

    from _pipe_util import data, ds_config, layer_list

    net = PipelineModule(layer_list(False), num_stages=1, loss_fn=torch.nn.functional.mse_loss, seed_layers=True)
    config = {**ds_config(2), "curriculum_learning": curriculum("fixed_linear")}
    engine, *_ = hf_zero.initialize(model=net, config=config)
    resets = []
    reset = engine.reset_activation_shape
    engine.reset_activation_shape = lambda: (resets.append(engine.global_steps), reset())
    x, y = data(5, 2, 1)
    difficulties = []
    for s in range(5):
        engine.train_batch(iter([(x[s, j, 0], y[s, j, 0]) for j in range(2)]))
        difficulties.append(engine.curriculum_scheduler_legacy.get_current_difficulty())
    engine.destroy()
    return {"difficulties": difficulties, "resets": resets}


def test_pipeline_train_batch_moves_the_curriculum_and_reinfers_shapes_when_it_changes():
    [out] = run_distributed(_pipeline_curriculum, 1)
    # steps 1..5 of fixed_linear: 8, 16, 24, 24, 32; new shapes before steps 2, 3 and 5 (global_steps 1, 2, 4)
    assert out == {"difficulties": [8, 16, 24, 24, 32], "resets": [1, 2, 4]}
