"""More DeepSpeed names scripts import, reached through ``import deepspeed`` (hf_zero's compatibility layer): each
checked by what it computes or returns, against DeepSpeed 0.19.8's behaviour (its source read for each name) or a
torch reference."""

from __future__ import annotations

import argparse
import base64
import collections.abc
import copy
import importlib
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from _shim_util import ds as _ds


# ---- the top-level names and where they lead ----------------------------------------------------------------------
def test_top_level_and_pipe_names_are_hf_zeros_classes():
    import hf_zero.comm.accelerator
    import hf_zero.pipeline.module
    import hf_zero.pipeline.topology
    import hf_zero.runtime.pipe_engine
    from hf_zero.pipeline.data import RepeatingLoader
    from hf_zero.zero.stage3.param import ZeroParamStatus

    ds = _ds("deepspeed")
    assert ds.get_accelerator is hf_zero.comm.accelerator.get_accelerator
    assert ds.PipelineEngine is hf_zero.runtime.pipe_engine.PipelineEngine
    assert _ds("deepspeed.runtime.pipe.engine").PipelineEngine is ds.PipelineEngine
    pipe = _ds("deepspeed.runtime.pipe")
    for name in ("PipelineModule", "LayerSpec", "TiedLayerSpec"):
        assert getattr(pipe, name) is getattr(hf_zero.pipeline.module, name)
        assert getattr(_ds("deepspeed.runtime.pipe.module"), name) is getattr(hf_zero.pipeline.module, name)
    topology = importlib.import_module("deepspeed.runtime.pipe.topology")
    assert topology is hf_zero.pipeline.topology
    topo = topology.PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    assert (topo.world_size(), topo.get_dim("pipe"), topo.get_dim("data")) == (4, 2, 2)
    assert ds.DeepSpeedConfig is _ds("deepspeed.runtime.config").DeepSpeedConfig
    assert _ds("deepspeed.runtime.dataloader").RepeatingLoader is RepeatingLoader
    zero = _ds("deepspeed.runtime.zero")
    assert zero.ZeroParamStatus is ZeroParamStatus
    assert [(s.name, s.value) for s in zero.ZeroParamStatus] == [("NOT_AVAILABLE", 1), ("INFLIGHT", 2),
                                                                  ("AVAILABLE", 3)]  # DeepSpeed's values


# ---- DeepSpeedConfig ----------------------------------------------------------------------------------------------
_CONFIG = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2}, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}


def test_deepspeed_config_attributes_from_dict_path_and_base64(tmp_path):
    DeepSpeedConfig = _ds("deepspeed").DeepSpeedConfig
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_CONFIG))
    encoded = base64.urlsafe_b64encode(json.dumps(_CONFIG).encode()).decode()
    user = copy.deepcopy(_CONFIG)
    for source in (user, str(path), encoded):
        c = DeepSpeedConfig(source)
        # values DeepSpeed 0.19.8 gives for this config at world size 1 (run beside it)
        assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 2)
        assert (c.world_size, c.global_rank) == (1, 0)
        assert (c.zero_optimization_stage, c.zero_enabled, c.zero_config.stage) == (2, True, 2)
        assert c.bfloat16_config.enabled is True and c.float16_config.enabled is False
        assert (c.bfloat16_enabled, c.fp16_enabled) == (True, False)
        assert (c.optimizer_name, c.optimizer_params) == ("adamw", {"lr": 1e-3})
        assert (c.scheduler_name, c.scheduler_params) == ("WarmupLR", {"warmup_num_steps": 10})
        assert c.gradient_clipping == 0.5 and c.prescale_gradients is False and c.gradient_predivide_factor == 1.0
        assert c.wall_clock_breakdown is False and c.memory_breakdown is False
        assert c.comms_config.comms_logger_enabled is False
        assert c.config["train_micro_batch_size_per_gpu"] == 4
    assert user == _CONFIG  # the caller's dict is not modified
    assert DeepSpeedConfig({"train_micro_batch_size_per_gpu": 3}).train_batch_size == 3
    # DeepSpeed 0.19's newer top-level keys, as its config object answers them
    newer = DeepSpeedConfig({"train_batch_size": 2, "gradient_allreduce_op": "SUM", "log_level": "error",
                             "managed_gradient_accumulation": False, "disable_python_gc": True})
    assert (newer.gradient_allreduce_op, newer.log_level) == ("sum", "error")
    assert newer.managed_gradient_accumulation is False and newer.disable_python_gc is True
    assert c.gradient_allreduce_op == "mean" and c.managed_gradient_accumulation is True and c.log_level is None


def test_deepspeed_config_refuses_what_the_engine_refuses():
    from hf_zero.config import ConfigError

    DeepSpeedConfig = _ds("deepspeed").DeepSpeedConfig
    with pytest.raises(ConfigError, match="train_batch_size"):
        DeepSpeedConfig({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match="zero_optimization"):
        DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stgae": 2}})


# ---- logging helpers ----------------------------------------------------------------------------------------------
def test_log_dist_and_print_dist_prefix_the_rank(caplog, capsys):
    utils = _ds("deepspeed.utils")
    logging_mod = _ds("deepspeed.utils.logging")
    assert logging_mod.log_dist is utils.log_dist and logging_mod.logger is utils.logger
    # without a process group every process speaks, as rank -1 (DeepSpeed's get_dist_msg); with one (an earlier
    # test may have left a 1-rank group), only the ranks listed
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
    with caplog.at_level(logging.INFO, logger=utils.logger.name):
        utils.log_dist("hello", ranks=[0])
        utils.log_dist("warned", ranks=[0], level=logging.WARNING)
        utils.log_dist("not me", ranks=[5])
    expected = [(logging.INFO, f"[Rank {rank}] hello"), (logging.WARNING, f"[Rank {rank}] warned")]
    if rank == -1:
        expected.append((logging.INFO, "[Rank -1] not me"))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == expected
    utils.print_dist("printed", ranks=[-1])  # -1: every rank
    assert capsys.readouterr().out == f"[Rank {rank}] printed\n"


def test_on_device_builds_on_meta_in_the_dtype_and_restores():
    OnDevice = _ds("deepspeed.utils").OnDevice
    with OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(4, 3)
        ints = torch.arange(3)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert layer.weight.shape == (3, 4) and ints.device.type == "meta" and ints.dtype == torch.int64
    after = torch.nn.Linear(2, 2)
    assert after.weight.device.type == "cpu" and after.weight.dtype == torch.float32 == torch.get_default_dtype()
    with OnDevice(dtype=torch.bfloat16, device="meta", enabled=False):
        off = torch.nn.Linear(2, 2)
    assert off.weight.device.type == "cpu" and off.weight.dtype == torch.float32
    with pytest.raises(RuntimeError), OnDevice(dtype=torch.bfloat16, device="meta"):
        raise RuntimeError("inside")
    assert torch.get_default_dtype() == torch.float32 and torch.empty(1).device.type == "cpu"


# ---- timers -------------------------------------------------------------------------------------------------------
def test_synchronized_wall_clock_timer_sums_intervals_in_ms(capsys):
    timer_mod = _ds("deepspeed.utils.timer")
    timers = timer_mod.SynchronizedWallClockTimer()
    t = timers("fwd")
    assert timers("fwd") is t and timers.get_timers() == {"fwd": t}
    for _ in range(2):
        t.start()
        time.sleep(0.02)
        t.stop()
    with pytest.raises(AssertionError, match="not started"):
        t.stop()
    kept = t.elapsed(reset=False)
    assert 40.0 <= kept < 400.0 and len(t.elapsed_records) == 2
    assert t.elapsed(reset=True) == pytest.approx(kept)
    assert t.elapsed() == 0.0  # reset above
    t.start()
    time.sleep(0.01)
    running = t.elapsed(reset=False)  # a running timer counts up to now and keeps running
    assert running >= 10.0 and t.started_
    t.stop()
    t.reset()
    timers("bwd").start()
    time.sleep(0.01)
    timers("bwd").stop()
    timers.log(["bwd", "absent"], normalizer=2.0)
    line = capsys.readouterr().out.strip()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1  # printed on rank 0 only
    assert line.startswith(f"[Rank {rank}] time (ms) | bwd: ") and "absent" not in line
    assert 5.0 <= float(line.rsplit(": ", 1)[1]) < 200.0  # halved by the normalizer
    assert timers("bwd").elapsed() == 0.0  # log resets by default


def test_throughput_timer_counts_samples_per_second_after_warmup():
    ThroughputTimer = _ds("deepspeed.utils.timer").ThroughputTimer
    reports = []
    tput = ThroughputTimer(None, batch_size=8, start_step=1, steps_per_output=2, logging_fn=reports.append)
    assert tput.avg_samples_per_sec() == float("-inf")
    for _ in range(3):
        tput.start()
        time.sleep(0.02)
        tput.stop(global_step=True)
    # step 1 is warm-up; steps 2 and 3 are timed: 8 samples per ~20 ms
    assert tput.global_step_count == 3 and tput.micro_step_count == 3
    timed = tput.total_elapsed_time
    assert 0.04 <= timed < 0.4
    assert tput.avg_samples_per_sec() == pytest.approx(8 / (timed / 2))
    assert len(reports) == 1 and reports[0].startswith("epoch=0/micro_step=2/global_step=2, RunningAvgSamplesPerSec=")
    off = ThroughputTimer(type("Cfg", (), {"enabled": False, "synchronized": False})(), batch_size=4)
    off.start()
    off.stop(global_step=True)
    assert off.global_step_count == 0


# ---- runtime.utils ------------------------------------------------------------------------------------------------
def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage = _ds("deepspeed.runtime.utils").see_memory_usage
    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("probe", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "probe" and lines[1].startswith("MA ") and "Max_MA" in lines[1] and "CA" in lines[1]
    assert lines[2].startswith("CPU Virtual Memory:  used = ")


def _grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return params


@pytest.mark.parametrize("norm_type", [2, 1, float("inf")])
def test_clip_grad_norm_matches_torch_on_one_rank(norm_type):
    clip = _ds("deepspeed.runtime.utils").clip_grad_norm_
    ours, ref = _grads(0), _grads(0)
    total = clip(ours, max_norm=1.0, norm_type=norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    assert torch.is_tensor(total) and float(total) == pytest.approx(float(ref_total), rel=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    small = _grads(1)
    before = [p.grad.clone() for p in small]
    clip(small, max_norm=1e6)  # under the bound: gradients unchanged
    assert all(torch.equal(p.grad, b) for p, b in zip(small, before))


def test_get_global_norm():
    get_global_norm = _ds("deepspeed.runtime.utils").get_global_norm
    assert get_global_norm([3.0, 4.0]) == 5.0
    assert get_global_norm([torch.tensor(3.0), 4.0]) == 5.0
    assert get_global_norm([1.0, float("nan")]) == float("inf")
    assert get_global_norm([1.0, -1.0]) == float("inf")  # DeepSpeed's marker of an invalid norm


# ---- optimizers and their builders --------------------------------------------------------------------------------
def _train(make_opt, steps: int = 4):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    opt = make_opt(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_adam_w_mode_is_adamw_or_adam_with_l2(adam_w_mode):
    FusedAdam = _ds("deepspeed.ops.adam").FusedAdam
    ours, opt = _train(lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1, adam_w_mode=adam_w_mode))
    reference = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref, _ = _train(lambda ps: reference(ps, lr=0.01, weight_decay=0.1))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert opt.adam_w_mode == int(adam_w_mode) and opt.param_groups[0]["adamw_mode"] is adam_w_mode
    other, _ = _train(lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1, adam_w_mode=not adam_w_mode))
    assert not torch.allclose(other[0], ours[0])  # the mode changes the result


def test_fused_adam_set_grad_none_and_conflicting_modes():
    FusedAdam = _ds("deepspeed.ops.adam").FusedAdam
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    FusedAdam([p], set_grad_none=False).zero_grad()
    assert torch.equal(p.grad, torch.zeros(2))
    FusedAdam([p]).zero_grad()
    assert p.grad is None
    with pytest.raises(ValueError, match="adam_w_mode=False and adamw_mode=True disagree"):
        FusedAdam([p], adam_w_mode=False, adamw_mode=True)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_op_builders_load_ops_that_step_like_torch(adamw_mode):
    """What DeepSpeed's own optimizers call on the loaded ops: cpu_adam's create_adam/adam_update and fused_adam's
    multi_tensor_adam, with DeepSpeed's argument order."""
    builders = _ds("deepspeed.ops.op_builder")
    cpu_adam, fused_adam = builders.CPUAdamBuilder().load(), builders.FusedAdamBuilder().load()
    assert builders.CPUAdamBuilder().is_compatible() and builders.FusedAdamBuilder.NAME == "fused_adam"
    reference = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref, _ = _train(lambda ps: reference(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1))

    class ViaOp(torch.optim.Optimizer):
        def __init__(self, params, fused: bool):
            super().__init__(params, {})
            self.fused = fused
            if not fused:
                cpu_adam.create_adam(7, 0.01, 0.9, 0.99, 1e-8, 0.1, adamw_mode, False)

        def step(self):
            for p in self.param_groups[0]["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["step"] += 1
                if self.fused:
                    fused_adam.multi_tensor_adam(2048, torch.zeros(1, dtype=torch.int), [[p.grad], [p.data],
                                                 [st["m"]], [st["v"]]], 0.01, 0.9, 0.99, 1e-8, st["step"],
                                                 int(adamw_mode), 1, 0.1)
                else:
                    cpu_adam.adam_update(7, st["step"], 0.01, 0.9, 0.99, 1e-8, 0.1, True, p.data, p.grad,
                                         st["m"], st["v"])

    for fused in (False, True):
        ours, _ = _train(lambda ps: ViaOp(ps, fused))
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    cpu_adam.destroy_adam(7)
    with pytest.raises(ValueError, match="create_adam"):
        cpu_adam.adam_update(7, 1, 0.01, 0.9, 0.99, 1e-8, 0.0, True, torch.zeros(1), torch.zeros(1), torch.zeros(1),
                             torch.zeros(1))


# ---- LR-schedule tuning arguments ---------------------------------------------------------------------------------
def test_lr_schedule_tuning_arguments_as_deepspeed():
    lrs = _ds("deepspeed.runtime.lr_schedules")
    parser = lrs.add_tuning_arguments(argparse.ArgumentParser())
    assert isinstance(parser, argparse.ArgumentParser)
    defaults = parser.parse_args([])
    assert (defaults.lr_schedule, defaults.warmup_max_lr, defaults.warmup_num_steps, defaults.warmup_type,
            defaults.cycle_momentum, defaults.lr_range_test_staircase) == (None, 0.001, 1000, "log", False, False)
    assert lrs.get_config_from_args(defaults) == (None, "--lr_schedule not specified on command line")
    assert lrs.get_config_from_args(parser.parse_args(["--lr_schedule", "Nope"])) == \
        (None, "Nope is not supported LR schedule")
    warm = parser.parse_args(["--lr_schedule", "WarmupDecayLR", "--warmup_max_lr", "0.3"])
    assert lrs.get_config_from_args(warm) == ({"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 0.3, "warmup_num_steps": 1000, "warmup_type": "log"}}, None)
    cosine = parser.parse_args(["--lr_schedule", "WarmupCosineLR", "--cos_min_ratio", "0.5"])
    assert lrs.get_config_from_args(cosine)[0]["params"] == {
        "warmup_num_steps": 1000, "warmup_type": "log", "warmup_min_ratio": 0.01, "cos_min_ratio": 0.5}
    one_cycle, _ = lrs.get_config_from_args(parser.parse_args(["--lr_schedule", "OneCycle", "--cycle_momentum"]))
    assert one_cycle["params"]["cycle_max_lr"] == 0.1 and "cycle_momentum" not in one_cycle["params"]
    range_test, _ = lrs.get_config_from_args(parser.parse_args(["--lr_schedule", "LRRangeTest"]))
    assert range_test["params"] == {"lr_range_test_min_lr": 0.001, "lr_range_test_step_rate": 1.0,
                                    "lr_range_test_step_size": 1000, "lr_range_test_staircase": False}
    # the config built from the flags builds the schedule
    sched = lrs.build_lr_scheduler("WarmupDecayLR", {**warm_params(lrs, warm), "total_num_steps": 2000},
                                   torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
    assert sched.get_last_lr() == [0.0]

    assert lrs.get_lr_from_config({"type": "WarmupLR", "params": {"warmup_max_lr": 0.3}}) == (0.3, "")
    assert lrs.get_lr_from_config({"type": "OneCycle", "params": {"cycle_max_lr": 0.2}}) == (0.2, "")
    assert lrs.get_lr_from_config({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.05}}) == (0.05, "")
    assert lrs.get_lr_from_config({"type": "WarmupCosineLR", "params": {}})[0] is None
    assert lrs.get_lr_from_config({"params": {}}) == (None, "LR schedule type not defined in config")
    assert lrs.get_lr_from_config({"type": "WarmupLR"}) == (None, "LR schedule params not defined in config")
    assert lrs.get_lr_from_config({"type": "X", "params": {}}) == (None, "X is not a valid LR schedule")


def warm_params(lrs, args):
    return lrs.get_config_from_args(args)[0]["params"]


# ---- monitor ------------------------------------------------------------------------------------------------------
def test_monitor_master_is_hf_zeros_and_writes_what_the_script_asks(tmp_path):
    import hf_zero.runtime.monitor

    MonitorMaster = _ds("deepspeed.monitor.monitor").MonitorMaster
    DeepSpeedConfig = _ds("deepspeed").DeepSpeedConfig
    assert MonitorMaster is hf_zero.runtime.monitor.MonitorMaster
    quiet = MonitorMaster(DeepSpeedConfig({"train_batch_size": 1}).monitor_config)
    assert quiet.enabled is False and quiet.csv_monitor is None
    csv_section = {"enabled": True, "output_path": str(tmp_path), "job_name": "script"}
    monitor = MonitorMaster(DeepSpeedConfig({"train_batch_size": 1, "csv_monitor": csv_section}).monitor_config)
    monitor.write_events([("Train/loss", 1.25, 1), ("Train/loss", 0.5, 2)])
    assert monitor.enabled is True
    assert (tmp_path / "script" / "Train_loss.csv").read_bytes() == b"step,loss\r\n1,1.25\r\n2,0.5\r\n"
    # a dict of the sections works too (DeepSpeed's needs its config object), checked key by key
    assert MonitorMaster({"csv_monitor": csv_section}).enabled is True
    with pytest.raises(ValueError, match="^tensorboard.output: unknown key; did you mean 'output_path'"):
        MonitorMaster({"tensorboard": {"enabled": True, "output": "/tmp/x"}})


def test_partition_parameters_names_are_the_zero_packages():
    from deepspeed.runtime.zero import partition_parameters as pp

    import hf_zero.zero as zero
    from hf_zero.zero.stage3.param import ZeroParamStatus

    assert pp.GatheredParameters is zero.GatheredParameters and pp.ZeroParamStatus is ZeroParamStatus
    assert [s.name for s in pp.ZeroParamStatus] == ["NOT_AVAILABLE", "INFLIGHT", "AVAILABLE"]


# ---- what DeepSpeed's own test utilities and ds_report read --------------------------------------------------------
def test_required_torch_version_accelerator_support_and_version_info():
    required = _ds("deepspeed.utils.torch").required_torch_version
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert required(min_version=f"{major}.{minor}") and required(min_version=1.10)
    assert not required(min_version=f"{major}.{minor + 1}")
    assert required(max_version=f"{major}.{minor + 1}") and not required(max_version=f"{major - 1}.0")
    assert required(min_version=f"{major}.{minor}", max_version=f"{major}.{minor}.99")
    with pytest.raises(ValueError, match="min_version or max_version"):
        required()
    accel = _ds("deepspeed.accelerator")
    assert accel.is_current_accelerator_supported() is True
    assert accel.get_accelerator().device_name() in accel.SUPPORTED_ACCELERATOR_LIST
    info = _ds("deepspeed.git_version_info")
    assert info.version == _ds("deepspeed").__version__
    assert info.torch_info["version"] == f"{major}.{minor}"
    assert info.torch_info["cuda_version"] == (torch.version.cuda or "0.0")
    from hf_zero.ops import native_available

    assert info.installed_ops["cpu_adam"] is native_available("cpu")
    assert info.accelerator_name == accel.get_accelerator().device_name()


def test_zero_stage_enum_is_deepspeeds_and_unpickles_from_its_checkpoints():
    """``deepspeed.runtime.zero.config.ZeroStageEnum``: DeepSpeed's values; its optimizer files pickle it."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    assert [int(ZeroStageEnum[n]) for n in ("disabled", "optimizer_states", "gradients", "weights", "max_stage")] \
        == [0, 1, 2, 3, 3]
    assert ZeroStageEnum(2) is ZeroStageEnum.gradients and ZeroStageEnum.weights == 3


def test_modules_scripts_import_optimizers_and_helpers_from():
    """The module paths DeepSpeed defines these in, which scripts import them from, and the type aliases and
    ``empty_cache`` of ``deepspeed.runtime``."""
    from deepspeed.ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
    from deepspeed.ops.adam.fused_adam import FusedAdam
    from deepspeed.ops.lion.cpu_lion import DeepSpeedCPULion
    from deepspeed.runtime.engine import DeepSpeedOptimizerCallable, DeepSpeedSchedulerCallable
    from deepspeed.runtime.utils import empty_cache

    import hf_zero.ops.adagrad
    import hf_zero.ops.adam
    import hf_zero.ops.lion

    assert (DeepSpeedCPUAdam, FusedAdam) == (hf_zero.ops.adam.CPUAdam, hf_zero.ops.adam.FusedAdam)
    assert DeepSpeedCPUAdagrad is hf_zero.ops.adagrad.CPUAdagrad and DeepSpeedCPULion is hf_zero.ops.lion.CPULion
    p = torch.nn.Parameter(torch.ones(3))
    opt = DeepSpeedCPUAdam([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), 0.9), atol=1e-6)  # Adam's first step moves by lr
    assert DeepSpeedOptimizerCallable.__origin__ is collections.abc.Callable
    assert DeepSpeedSchedulerCallable.__args__[0] is torch.optim.Optimizer
    assert empty_cache() is None


def _optimizer_class_checks(stage: int):
    import warnings

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    import hf_zero

    model = torch.nn.Linear(4, 4)
    engine, optimizer, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DeepSpeedZeroOptimizer_Stage3.offload_states = lambda self: None  # a script's monkey-patch: named, no effect
    try:
        DeepSpeedZeroOptimizer()
        constructible = True
    except TypeError:
        constructible = False
    result = (isinstance(optimizer, DeepSpeedZeroOptimizer),
              isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3), isinstance(object(), DeepSpeedZeroOptimizer),
              [str(w.message) for w in caught], constructible)
    engine.destroy()
    return result


@pytest.mark.parametrize("stage,expected", [(0, (False, False)), (1, (True, False)), (2, (True, False)),
                                            (3, (False, True))])
def test_zero_optimizer_classes_answer_isinstance_by_stage(stage, expected):
    """``DeepSpeedZeroOptimizer`` (stages 1-2) and ``DeepSpeedZeroOptimizer_Stage3`` (stage 3), which libraries import
    and test the engine's optimizer against: true for hf_zero's optimizer at the matching stage only."""
    from hf_zero.testing import run_distributed

    zero12, zero3, other, warned, constructible = run_distributed(_optimizer_class_checks, 1, args=(stage,))[0]
    assert (zero12, zero3) == expected and other is False and constructible is False
    assert len(warned) == 1
    assert warned[0].startswith("hf_zero: setting DeepSpeedZeroOptimizer_Stage3.offload_states has no effect")


def _load_deepspeed_files_with_the_scripts_allow_list(optim_file: str):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum, fragment_address])
    sd = torch.load(optim_file, weights_only=True)["optimizer_state_dict"]
    scaler, mapping = sd["loss_scaler"], sd["param_slice_mappings"][0]
    return (sd["zero_stage"] is ZeroStageEnum.gradients, type(scaler) is LossScaler, scaler.cur_scale,
            type(mapping["emb.weight"]) is fragment_address, mapping["emb.weight"].numel)


def test_scripts_allow_deepspeeds_pickled_classes_and_load_its_files():
    """The torch>=2.6 pattern: import LossScaler / ZeroStageEnum / fragment_address from DeepSpeed's modules,
    ``add_safe_globals`` them, ``torch.load(weights_only=True)`` a DeepSpeed optimizer file: the objects come back
    as those classes with DeepSpeed's values (a file DeepSpeed 0.19.8 wrote, tests/data/deepspeed_checkpoints)."""
    from hf_zero.testing import run_distributed

    optim = (Path(__file__).parent / "data" / "deepspeed_checkpoints" / "stage2_fp32_groups2" / "ckpt" /
             "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert run_distributed(_load_deepspeed_files_with_the_scripts_allow_list, 1, args=(str(optim),),
                           init_process_group=False)[0] == (True, True, 1.0, True, 60)


def test_dynamic_loss_scaler_halves_with_hysteresis_and_doubles_after_the_window():
    from deepspeed.runtime.fp16.loss_scaler import (INITIAL_LOSS_SCALE, SCALE_WINDOW, CreateLossScaler,
                                                    DynamicLossScaler, LossScaler)

    s = CreateLossScaler(torch.half, 1.0, True, {INITIAL_LOSS_SCALE: 16.0, SCALE_WINDOW: 2, "min_scale": 1,
                                                 "delayed_shift": 2, "consecutive_hysteresis": False})
    assert type(s) is DynamicLossScaler and s.loss_scale == 16.0
    seen = []
    for overflow in (True, True, False, False, False, True, True, True):
        s.update_scale(overflow)
        seen.append(s.cur_scale)
    # 1st overflow spends the hysteresis, 2nd halves; 2 clean steps after it double; then hysteresis again
    # (DeepSpeed 0.19.8's DynamicLossScaler gives the same sequence)
    assert seen == [16.0, 8.0, 8.0, 8.0, 16.0, 16.0, 8.0, 4.0]
    assert type(CreateLossScaler(torch.bfloat16, 128.0, True, None)) is LossScaler
    static = LossScaler(scale=4.0)
    loss = torch.tensor(2.0, requires_grad=True)
    static.backward(loss)
    assert loss.grad.item() == 4.0 and static.has_overflow([]) is False
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("inf")])
    assert s.has_overflow_serial([p]) is True
    low = DynamicLossScaler(init_scale=1, scale_window=1, min_scale=1, delayed_shift=1, consecutive_hysteresis=False)
    with pytest.raises(RuntimeError, match="minimum"):
        low.update_scale(True)


def test_recursive_getattr_and_setattr_from_both_homes():
    """``deepspeed.compression.helper`` (where DeepSpeed-Chat's LoRA module imports them) and
    ``deepspeed.utils.module_utils`` (their home since DeepSpeed 0.19): dotted-path get and set on a module tree,
    as DeepSpeed's own (a missing part raises AttributeError)."""
    helper, module_utils = _ds("deepspeed.compression.helper"), _ds("deepspeed.utils.module_utils")
    assert helper.recursive_getattr is module_utils.recursive_getattr
    assert helper.recursive_setattr is module_utils.recursive_setattr
    model = torch.nn.Sequential(collections.OrderedDict(
        block=torch.nn.Sequential(collections.OrderedDict(proj=torch.nn.Linear(3, 4), act=torch.nn.ReLU()))))
    assert helper.recursive_getattr(model, "block.proj") is model.block.proj
    assert helper.recursive_getattr(model, "block.proj.weight").shape == (4, 3)
    lora = torch.nn.Linear(3, 4, bias=False)
    helper.recursive_setattr(model, "block.proj", lora)
    assert model.block.proj is lora and list(dict(model.named_modules())) == ["", "block", "block.proj", "block.act"]
    helper.recursive_setattr(model, "head", torch.nn.Identity())  # one part: set on the root
    assert isinstance(model.head, torch.nn.Identity)
    with pytest.raises(AttributeError, match="missing"):
        helper.recursive_getattr(model, "block.missing.weight")
