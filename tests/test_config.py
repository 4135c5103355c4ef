"""hf_zero.config: strict DeepSpeed-format parsing, "auto" resolution, batch arithmetic, startup table."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from hf_zero.config import (
    AUTO,
    ConfigError,
    HfZeroConfig,
    OffloadConfig,
    ZeroConfig,
    doc,
    format_config_table,
    known_keys,
    load_config,
)
from hf_zero.config.batch import resolve_batch
from hf_zero.config.optim import OPTIMIZER_TYPES, SCHEDULER_TYPES
from hf_zero.config.status import ConfigKeyIgnored

DATA = Path(__file__).parent / "data"
ZERO1 = DATA / "zero1.json"
ZERO2 = DATA / "zero2.json"


def load(config, world_size: int = 1, **kwargs) -> HfZeroConfig:
    return load_config(config, world_size=world_size, log=False, **kwargs)


def error_of(config, world_size: int = 1, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load(config, world_size, **kwargs)
    return str(info.value)


# --- the shared configs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size, micro", [(1, 2), (2, 1)])
def test_zero1_batch_resolves_per_world_size(world_size, micro):
    cfg = load(ZERO1, world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, micro, 4)
    assert cfg.sources["train_micro_batch_size_per_gpu"] == "derived"
    assert cfg.zero.stage == 1
    assert cfg.zero.reduce_bucket_size == 500_000_000
    assert cfg.zero.use_multi_rank_bucket_allreduce is True
    assert cfg.zero.elastic_checkpoint is False
    assert cfg.zero.overlap_comm is True
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.name == "adam"
    assert dict(cfg.optimizer.params) == {"lr": 0.0001, "weight_decay": 0.01}
    assert cfg.scheduler is None
    assert cfg.fp16.enabled is True and cfg.bf16.enabled is False
    assert cfg.compute_dtype == torch.float16
    assert cfg.not_implemented == ()
    assert cfg.raw["train_micro_batch_size_per_gpu"] == micro
    assert cfg.raw["zero_optimization"]["stage"] == 1


def test_zero1_on_three_ranks_is_a_contradiction():
    assert error_of(ZERO1, 3) == (
        "train_batch_size: train_batch_size 8 is not divisible by gradient_accumulation_steps 4 * world_size 3 = 12, "
        "so train_micro_batch_size_per_gpu cannot be derived; make train_batch_size a multiple of 12, "
        "or change gradient_accumulation_steps")


def test_zero2_loads_with_float_bucket_sizes_and_no_batch_keys():
    cfg = load(str(ZERO2), world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 1, 1)
    assert cfg.sources == {"train_batch_size": "derived", "train_micro_batch_size_per_gpu": "default",
                           "gradient_accumulation_steps": "default"}
    assert cfg.zero.stage == 2
    assert cfg.zero.reduce_bucket_size == 200_000_000 and type(cfg.zero.reduce_bucket_size) is int
    assert cfg.zero.allgather_bucket_size == 200_000_000 and type(cfg.zero.allgather_bucket_size) is int
    assert cfg.zero.offload_optimizer == OffloadConfig(device="cpu", pin_memory=True)
    assert cfg.zero.offload_optimizer.enabled and not cfg.zero.offload_param.enabled
    assert cfg.zero.offload_param.buffer_count == 5 and cfg.zero.offload_optimizer.buffer_count == 4
    assert cfg.optimizer.name == "adamw"
    assert dict(cfg.optimizer.params) == {"lr": 3e-05, "betas": (0.8, 0.999), "eps": 1e-08, "weight_decay": 3e-07}
    assert cfg.scheduler.type == "WarmupLR"
    assert dict(cfg.scheduler.params) == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-05, "warmup_num_steps": 500}
    assert cfg.steps_per_print == 2000 and cfg.wall_clock_breakdown is False
    assert cfg.fp16.loss_scale == 0.0 and cfg.fp16.initial_scale_power == 16 and cfg.fp16.min_loss_scale == 1.0
    assert cfg.raw == {
        "fp16": {"enabled": True, "loss_scale": 0.0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1.0},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-05, "betas": [0.8, 0.999], "eps": 1e-08,
                                                  "weight_decay": 3e-07}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-05,
                                                     "warmup_num_steps": 500}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 200000000, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": 200000000, "contiguous_gradients": True},
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
    }
    json.dumps(cfg.raw)  # what engine.config returns must serialise


def test_the_dict_the_hf_trainer_passes_loads():
    # The final dict observed from Trainer + accelerate (ds_api_surface.md), with JSON's Infinity.
    text = ('{"train_micro_batch_size_per_gpu":2,"train_batch_size":8,"gradient_accumulation_steps":2,'
            '"gradient_clipping":1.0,"zero_optimization":{"stage":3,"stage3_gather_16bit_weights_on_model_save":true,'
            '"reduce_bucket_size":1024,"stage3_prefetch_bucket_size":921,"stage3_param_persistence_threshold":320},'
            '"bf16":{"enabled":false},"fp16":{"enabled":false},"steps_per_print":Infinity,'
            '"zero_allow_untested_optimizer":true}')
    cfg = load(json.loads(text), world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 2, 2)
    assert cfg.zero.stage == 3 and cfg.zero.overlap_comm is True
    assert cfg.zero.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.zero.gather_16bit_weights_on_model_save is True  # DeepSpeed's attribute name, same flag
    assert (cfg.zero.reduce_bucket_size, cfg.zero.stage3_prefetch_bucket_size,
            cfg.zero.stage3_param_persistence_threshold) == (1024, 921, 320)
    assert cfg.steps_per_print is None and cfg.zero_allow_untested_optimizer is True
    assert cfg.compute_dtype == torch.float32
    assert cfg.raw == json.loads(text)


# --- config sources -----------------------------------------------------------------------------------------------

def test_path_str_and_base64_inputs_give_the_same_config():
    as_dict = json.loads(ZERO2.read_text())
    encoded = base64.urlsafe_b64encode(ZERO2.read_bytes()).decode()
    results = [load(source, 2).raw for source in (as_dict, ZERO2, str(ZERO2), encoded)]
    assert all(r == results[0] for r in results)


def test_dict_input_is_not_modified():
    config = {"train_batch_size": "8", "zero_optimization": {"stage": "auto"}}
    load(config, 2, auto_values={"zero_optimization.stage": 3})
    assert config == {"train_batch_size": "8", "zero_optimization": {"stage": "auto"}}


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "ds_config.json"
    assert error_of(missing) == f"config file not found: {missing}"


def test_string_that_is_neither_file_nor_base64_json(tmp_path):
    missing = str(tmp_path / "ds.json")
    assert error_of(missing) == (f"config {missing!r} is neither an existing file (no such file: {missing}) "
                                 "nor base64-encoded JSON")


def test_invalid_json_file_names_the_position(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,\n "fp16": }')
    assert error_of(path) == (f"config file {path} is neither valid JSON (Expecting value at line 2 column 10) "
                              "nor hjson")


def test_hjson_config_as_deepspeed_reads_it(tmp_path):
    """DeepSpeed reads config files (and base64 configs) with hjson: comments, trailing commas, unquoted keys. A key
    given twice in one object is refused, as DeepSpeed refuses it (plain json would keep the last silently)."""
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  // the global batch\n  train_batch_size: 8,\n  "zero_optimization": {"stage": 2,},\n}')
    cfg = load(str(path), world_size=2)
    assert cfg.train_batch_size == 8 and cfg.zero.stage == 2
    encoded = base64.urlsafe_b64encode(b"{train_batch_size: 4, # hjson comment\n}").decode()
    assert load(encoded, world_size=1).train_batch_size == 4
    twice = tmp_path / "twice.json"
    twice.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 3}}')
    assert error_of(twice) == "stage: given twice in the same object of the config; keep one"


def test_config_of_wrong_kind():
    assert error_of(42) == "config must be a dict, a path to a JSON file or base64-encoded JSON, got int"


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        load({}, world_size=0)


# --- strict validation --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     "zero_optimization.overlap_com: unknown key; did you mean 'overlap_comm'?"),
    ({"zero_optimization": {"stag": 2}},
     "zero_optimization.stag: unknown key; did you mean 'stage'?"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy: unknown key; did you mean 'pin_memory'?"),
    ({"zero_optimization": {"overlap_comm": "maybe"}},  # 'yes', 1 are booleans to DeepSpeed's config models too
     "zero_optimization.overlap_comm: expected true or false, got 'maybe' (str)"),
    ({"zero_optimization": {"overlap_comm": 2}},
     "zero_optimization.overlap_comm: expected true or false, got 2 (int)"),
    ({"train_micro_batch_size_per_gpu": 2.5},
     "train_micro_batch_size_per_gpu: expected an integer, got 2.5 (float)"),
    ({"fp16": "yes"},
     "fp16: expected a JSON object (section FP16Config), got 'yes' (str)"),
    ({"zero_optimization": {"stage": 4}},
     "zero_optimization.stage: value 4 (int) is not accepted; use one of 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": True}},
     "zero_optimization.stage: value True (bool) is not accepted; use one of 0, 1, 2, 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device: value 'gpu' (str) is not accepted; use one of 'none', 'cpu', "
     "'nvme'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path: required when device is 'nvme': give a directory on the NVMe "
     "drive"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
     "zero_optimization.offload_optimizer.ratio: value 1.5 is not accepted; use a fraction with 0 < ratio <= 1"),
    ({"zero_optimization": {"offload_param": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_param.ratio: value 0.5 is not accepted here; ratio applies to offload_optimizer"),
    ({"zero_optimization": {"reduce_bucket_size": -1}},
     "zero_optimization.reduce_bucket_size: must be >= 0, got -1"),
    ({"zero_optimization": {"stage3_max_live_parameters": -5}},
     "zero_optimization.stage3_max_live_parameters: must be >= 0, got -5"),
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}},
     "zero_optimization.cpu_offload: true means offload_optimizer.device 'cpu' but offload_optimizer.device is "
     "'nvme'; remove cpu_offload"),
    ({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True,
                            "stage3_gather_fp16_weights_on_model_save": True}},
     "zero_optimization.stage3_gather_fp16_weights_on_model_save: given twice (as "
     "'stage3_gather_16bit_weights_on_model_save' and one of its aliases); keep one"),
    ({"gradient_clipping": -1}, "gradient_clipping: must be >= 0 (0 is off), got -1.0"),
    ({"train_batch_size": 0}, "train_batch_size: must be a positive integer, got 0"),
    ({"fp16": {"enabled": True, "loss_scale": -1}},
     "fp16.loss_scale: must be a finite number >= 0 (0 = dynamic), got -1.0"),
    ({"checkpoint": {"tag_validation": "Sometimes"}},
     "checkpoint.tag_validation: value 'Sometimes' (str) is not accepted; use one of 'ignore', 'warn', 'fail'"),
    ({"steps_per_print": "auto"},
     "steps_per_print: 'auto' is not accepted for this key (nothing fills it in); write a value"),
    ({"compile": {"deepcompile": True}},
     "compile: DeepCompile is a DeepSpeed option hf_zero does not support; remove it from the config (or switch it "
     "off)"),
    ({"zero_optimization": {"zenflow": {"update_interval": 2}}},
     "zero_optimization.zenflow: needs offload_optimizer (device 'cpu'): ZenFlow applies the unselected gradients "
     "with the offloaded optimizer"),
])
def test_bad_values_name_key_value_and_what_is_accepted(config, message):
    assert error_of(config) == message


def test_an_unknown_top_level_key_is_ignored_with_a_warning_naming_it():
    """DeepSpeed ignores top-level keys it does not know (its sections refuse extra keys, as hf_zero's do)."""
    with pytest.warns(ConfigKeyIgnored, match=r"config key 'zero_optimisation' is unknown; did you mean "
                                              r"'zero_optimization'\?; ignored, as DeepSpeed ignores"):
        cfg = load({"zero_optimisation": {"stage": 2}, "train_micro_batch_size_per_gpu": 2})
    assert cfg.zero.stage == 0 and cfg.train_micro_batch_size_per_gpu == 2


@pytest.mark.parametrize("section", [{"compile": {"deepcompile": False}}, {"nebula": {"enabled": False}},
                                     {"compile": None}])
def test_an_unsupported_option_switched_off_is_accepted(section, recwarn):
    cfg = load({**section, "train_micro_batch_size_per_gpu": 2})
    assert cfg.train_micro_batch_size_per_gpu == 2 and not [w for w in recwarn if "compile" in str(w.message)]


def test_fp16_and_bf16_together_is_an_error():
    message = "bf16.enabled: true together with fp16.enabled true; enable at most one of fp16 and bf16"
    assert error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == message
    assert error_of({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}}) == message


def test_legacy_bfloat16_key():
    cfg = load({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled is True and cfg.compute_dtype == torch.bfloat16
    assert error_of({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}) == (
        "bfloat16: given twice (as 'bf16' and one of its aliases); keep one")


def test_fp16_enabled_is_allowed_without_a_gpu():
    assert load({"fp16": {"enabled": True}}).compute_dtype == torch.float16
    assert load({}).compute_dtype == torch.float32


def test_strings_and_integral_floats_convert_to_ints():
    cfg = load({"train_micro_batch_size_per_gpu": "8", "gradient_accumulation_steps": 2.0,
                "zero_optimization": {"stage": "2", "reduce_bucket_size": "2e8", "overlap_comm": "true"}}, 2)
    assert cfg.train_micro_batch_size_per_gpu == 8 and type(cfg.train_micro_batch_size_per_gpu) is int
    assert cfg.train_batch_size == 32
    assert cfg.zero.stage == 2 and cfg.zero.reduce_bucket_size == 200_000_000 and cfg.zero.overlap_comm is True
    assert cfg.raw["train_micro_batch_size_per_gpu"] == 8
    assert cfg.raw["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 200000000, "overlap_comm": True}


def test_deepspeed_defaults():
    cfg = load({})
    zero = cfg.zero
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size, zero.sub_group_size) == (
        0, 500_000_000, 500_000_000, 1_000_000_000)
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (50_000_000, 100_000)
    assert (zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance) == (1_000_000_000, 1_000_000_000)
    assert zero.contiguous_gradients and zero.reduce_scatter and zero.allgather_partitions
    assert zero.overlap_comm is False and load({"zero_optimization": {"stage": 3}}).zero.overlap_comm is True
    assert zero.stage3_gather_16bit_weights_on_model_save is False and zero.memory_efficient_linear is True
    assert (zero.mics_shard_size, zero.zero_hpz_partition_size) == (-1, 1)
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.intra_op_parallelism) == (1_048_576, 8, 1)
    assert cfg.aio.overlap_events is True and cfg.aio.single_submit is False and cfg.aio.use_gds is False
    assert (cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window, cfg.fp16.hysteresis) == (16, 1000, 2)
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10 and cfg.gradient_predivide_factor == 1.0
    assert cfg.zero_force_ds_cpu_optimizer is True and cfg.zero_allow_untested_optimizer is False
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.raw == {"zero_optimization": {"stage": 0}, "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                       "gradient_accumulation_steps": 1}


def test_aliases_and_legacy_forms():
    cfg = load({"aio": {"thread_count": 4},
                "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                                      "cpu_offload": True, "cpu_offload_use_pin_memory": True}})
    assert cfg.aio.intra_op_parallelism == 4
    assert cfg.zero.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.zero.offload_optimizer == OffloadConfig(device="cpu", pin_memory=True)
    assert load({"zero_optimization": True}).zero.stage == 1
    assert load({"zero_optimization": {"cpu_offload_param": True}}).zero.offload_param.device == "cpu"


def test_hf_trainer_steps_per_print_infinity():
    cfg = load({"steps_per_print": float("inf")})
    assert cfg.steps_per_print is None
    assert math.isinf(cfg.raw["steps_per_print"])


def test_nvme_offload_with_path():
    cfg = load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "NVMe", "nvme_path": "/local_nvme",
                                                                          "ratio": 0.3}}})
    assert cfg.zero.offload_optimizer.device == "nvme" and cfg.zero.offload_optimizer.ratio == 0.3
    assert cfg.zero.offload_enabled


# --- optimizer and scheduler --------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decy": 0.1}}},
     "optimizer.params.weight_decy: unknown key; did you mean 'weight_decay'? (parameters of AdamW)"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}},
     "optimizer.params.betas: unknown key; accepted keys: dampening, lr, momentum, nesterov, weight_decay "
     "(parameters of SGD)"),
    ({"optimizer": {"type": "Lamb", "params": {"max_coef": 10}}},
     "optimizer.params.max_coef: unknown key; did you mean 'max_coeff'? (parameters of Lamb)"),
    ({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}},
     "optimizer.params.lr: expected a number, got 'fast' (str) (parameters of Adam)"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
     "optimizer.params.betas: expected a list of 2 values, got [0.9] (list) (parameters of Adam)"),
    ({"optimizer": {"type": "Adamm", "params": {}}},
     "optimizer.type: unknown optimizer type 'Adamm'; accepted (any case): Adam, AdamW, SGD, Lamb, Adagrad, Lion, "
     "OneBitAdam, ZeroOneAdam, OneBitLamb"),
    ({"optimizer": {"params": {"lr": 1}}},
     "optimizer.type: required key missing (Optimizer type, any case: Adam, AdamW, SGD, Lamb, Adagrad, Lion, "
     "OneBitAdam, ...)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
     "scheduler.params.warmup_num_step: unknown key; did you mean 'warmup_num_steps'? (parameters of WarmupLR)"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "cos_min_ration": 0.1}}},
     "scheduler.params.cos_min_ration: unknown key; did you mean 'cos_min_ratio'? (parameters of WarmupCosineLR)"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
     "scheduler.params.total_num_steps: required key missing (Total training steps; the rate decays linearly to 0 "
     "at this step.) (parameters of WarmupDecayLR)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
     "scheduler.params.warmup_type: value 'cosine' (str) is not accepted; use one of 'log', 'linear' "
     "(parameters of WarmupLR)"),
    ({"scheduler": {"type": "CosineAnnealing"}},
     "scheduler.type: unknown scheduler type 'CosineAnnealing'; accepted (any case): WarmupLR, WarmupDecayLR, "
     "WarmupCosineLR, OneCycle, LRRangeTest"),
])
def test_optimizer_and_scheduler_errors(config, message):
    assert error_of(config) == message


def test_optimizer_type_any_case_and_params_converted():
    cfg = load({"optimizer": {"type": "ADAMW", "params": {"lr": "1e-4", "betas": ["0.9", 0.95], "torch_adam": True}},
                "scheduler": {"type": "onecycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3,
                                                             "cycle_first_step_size": "100"}}})
    assert cfg.optimizer.type == "ADAMW" and cfg.optimizer.name == "adamw"
    assert dict(cfg.optimizer.params) == {"lr": 1e-4, "betas": (0.9, 0.95), "torch_adam": True}
    assert cfg.scheduler.name == "onecycle"
    assert dict(cfg.scheduler.params) == {"cycle_min_lr": 0.0, "cycle_max_lr": 1e-3, "cycle_first_step_size": 100}
    assert cfg.raw["optimizer"] == {"type": "ADAMW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "torch_adam": True}}


def test_every_optimizer_and_scheduler_type_accepts_its_documented_params():
    expected = {
        "adam": {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "amsgrad", "torch_adam",
                 "fused"},
        "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
        "lamb": {"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff", "bias_correction"},
        "warmuplr": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
        "warmupdecaylr": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration",
                          "total_num_steps"},
        "warmupcosinelr": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                           "last_batch_iteration"},
        "onecycle": {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                     "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                     "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate",
                     "last_batch_iteration"},
        "lrrangetest": {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                        "lr_range_test_staircase", "last_batch_iteration"},
    }
    tables = {**OPTIMIZER_TYPES, **SCHEDULER_TYPES}
    for name, keys in expected.items():
        assert set(known_keys(tables[name][1])) == keys, name
    assert OPTIMIZER_TYPES["adamw"][1] is OPTIMIZER_TYPES["adam"][1]


# --- batch arithmetic ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, world, expected", [
    ((8, 2, 4), 1, (8, 2, 4)),
    ((8, 2, None), 2, (8, 2, 2)),
    ((8, None, 4), 2, (8, 1, 4)),
    ((None, 2, 4), 3, (24, 2, 4)),
    ((8, None, None), 4, (8, 2, 1)),
    ((None, 3, None), 2, (6, 3, 1)),
    ((None, None, 5), 2, (10, 1, 5)),
    ((None, None, None), 4, (4, 1, 1)),
])
def test_batch_arithmetic(given, world, expected):
    sizes = resolve_batch(*given, world_size=world)
    assert (sizes.train_batch_size, sizes.train_micro_batch_size_per_gpu,
            sizes.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("config, world, message", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 1,
     "train_batch_size: train_batch_size 10 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 3 * "
     "world_size 1; change one of them (for this world size train_batch_size would be 6), or leave train_batch_size "
     "out so it is derived"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 1,
     "train_batch_size: train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4 * world_size 1 = 4, "
     "so gradient_accumulation_steps cannot be derived; make train_batch_size a multiple of 4, or change "
     "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 9}, 2,
     "train_batch_size: train_batch_size 9 is not divisible by world_size 2, so train_micro_batch_size_per_gpu cannot "
     "be derived; make train_batch_size a multiple of 2, or give train_micro_batch_size_per_gpu and "
     "gradient_accumulation_steps"),
])
def test_batch_errors_show_the_arithmetic(config, world, message):
    assert error_of(config, world) == message


# --- "auto" -------------------------------------------------------------------------------------------------------

HF_CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_VALUES = {
    "fp16.enabled": False, "bf16.enabled": True,
    "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 5e-5,
    "scheduler.params.warmup_num_steps": 10, "scheduler.params.total_num_steps": 1000,
    "zero_optimization.reduce_bucket_size": 64 * 64, "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64,
    "zero_optimization.stage3_param_persistence_threshold": 640,
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
}


def test_auto_values_fill_every_auto():
    cfg = load(HF_CONFIG, 2, auto_values=HF_VALUES)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.gradient_clipping == 1.0 and cfg.bf16.enabled is True and cfg.compute_dtype == torch.bfloat16
    assert cfg.zero.reduce_bucket_size == 4096 and cfg.zero.stage3_prefetch_bucket_size == 3686
    assert cfg.zero.stage3_param_persistence_threshold == 640
    assert dict(cfg.optimizer.params) == {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert cfg.scheduler.params["total_num_steps"] == 1000
    assert "auto" not in json.dumps(cfg.raw)
    assert cfg.raw["train_batch_size"] == 16 and cfg.raw["zero_optimization"]["stage3_prefetch_bucket_size"] == 3686
    assert cfg.sources["train_batch_size"] == "auto, derived"
    assert cfg.sources["optimizer.params.lr"] == "auto"
    assert AUTO not in cfg.optimizer.params.values()


def test_auto_values_never_override_written_values():
    cfg = load({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, auto_values={"optimizer.params.lr": 5e-5})
    assert cfg.optimizer.params["lr"] == 1e-3 and cfg.sources == {
        "train_batch_size": "derived", "train_micro_batch_size_per_gpu": "default",
        "gradient_accumulation_steps": "default"}


@pytest.mark.parametrize("drop, message", [
    ("zero_optimization.reduce_bucket_size",
     "zero_optimization.reduce_bucket_size: 'auto' needs the model's hidden_size: pass it via "
     "TrainingArguments/accelerate, or write a number (e.g. hidden_size*hidden_size)"),
    ("optimizer.params.lr",
     "optimizer.params.lr: 'auto' needs the learning rate: pass it via TrainingArguments(learning_rate=...), or "
     "write a number (e.g. 5e-05)"),
    ("scheduler.params.total_num_steps",
     "scheduler.params.total_num_steps: 'auto' needs the total number of training steps: pass it via the HF Trainer "
     "(from max_steps, or num_train_epochs and the dataset length), or write an integer"),
    ("gradient_clipping",
     "gradient_clipping: 'auto' needs the gradient clipping norm: pass it via TrainingArguments(max_grad_norm=...), "
     "or write a number (0 turns clipping off)"),
    ("train_micro_batch_size_per_gpu",
     "train_micro_batch_size_per_gpu: 'auto' needs the per-device batch size: pass it via "
     "TrainingArguments(per_device_train_batch_size=...) or accelerate's dataloader, or write an integer, or give "
     "train_batch_size and gradient_accumulation_steps so it can be derived"),
])
def test_unresolved_auto_names_key_and_source(drop, message):
    values = {k: v for k, v in HF_VALUES.items() if k != drop}
    assert error_of(HF_CONFIG, 2, auto_values=values) == message


def test_several_unresolved_autos_are_listed():
    assert error_of({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                           "stage3_prefetch_bucket_size": "auto"}}) == (
        "zero_optimization.reduce_bucket_size: 'auto' needs the model's hidden_size: pass it via "
        "TrainingArguments/accelerate, or write a number (e.g. hidden_size*hidden_size) (also 'auto' with no value: "
        "zero_optimization.stage3_prefetch_bucket_size)")


def test_auto_batch_key_is_derived_from_the_other_two():
    cfg = load({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 3)
    assert cfg.train_batch_size == 12 and cfg.sources["train_batch_size"] == "auto, derived"


def test_bad_auto_value_says_where_it_came_from():
    assert error_of({"gradient_clipping": "auto"}, auto_values={"gradient_clipping": "one"}) == (
        "gradient_clipping: expected a number, got 'one' (str) (this value replaced 'auto'; it came from auto_values)")


def test_contradiction_from_auto_values_is_reported():
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1}
    assert error_of(config, 2, auto_values={"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}) == (
        "train_batch_size: train_batch_size 10 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 1 * "
        "world_size 2; change one of them (for this world size train_batch_size would be 8), or leave "
        "train_batch_size out so it is derived")


def test_unresolved_auto_default_mode_for_zero_init():
    cfg = load(HF_CONFIG, 2, unresolved_auto="default")
    assert cfg.zero.stage == 3 and cfg.zero.reduce_bucket_size == 500_000_000
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 1, 1)
    assert cfg.optimizer.params["lr"] is AUTO
    assert cfg.sources["zero_optimization.reduce_bucket_size"] == "auto, default"
    assert cfg.sources["train_micro_batch_size_per_gpu"] == "auto, default"
    assert cfg.sources["optimizer.params.lr"] == "auto, unresolved"
    assert "reduce_bucket_size" not in cfg.raw["zero_optimization"]


# --- not implemented, table, logging ------------------------------------------------------------------------------

def test_not_implemented_sections_are_accepted_and_listed():
    cfg = load({"flops_profiler": {"enabled": True, "profile_step": 2},
                "pipeline": {"stages": "auto", "partition": "best"},
                "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}},
                "comms_logger": {"enabled": True, "verbose": True},
                "amp": {"enabled": True, "opt_level": "O1"},
                "elasticity": {"enabled": False},
                "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
                "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400}}})
    assert cfg.not_implemented == ("amp", "optimizer.type OneBitAdam", "zero_optimization.zero_quantized_weights",
                                   "compression_training")
    assert cfg.compression_training["weight_quantization"]["shared_parameters"] == {"enabled": True}
    assert cfg.raw["pipeline"] == {"stages": "auto", "partition": "best"}
    assert load({"compression_training": {"layer_reduction": {"enabled": False}}}).not_implemented == ()


def test_config_table_lists_changed_values_with_sources():
    cfg = load(HF_CONFIG, 2, auto_values=HF_VALUES)
    assert format_config_table(cfg) == "\n".join([
        'hf_zero config: world_size 2, ZeRO stage 3, bfloat16 (values that differ from the defaults)',
        '  train_batch_size                                             16              (auto, derived)',
        '  train_micro_batch_size_per_gpu                               4               (auto)',
        '  gradient_accumulation_steps                                  2               (auto)',
        '  gradient_clipping                                            1.0             (auto)',
        '  steps_per_print                                              2000',
        '  fp16.enabled                                                 false           (auto)',
        '  bf16.enabled                                                 true            (auto)',
        '  optimizer.type                                               "AdamW"',
        '  optimizer.params.lr                                          5e-05           (auto)',
        '  optimizer.params.betas                                       [0.9, 0.999]    (auto)',
        '  optimizer.params.eps                                         1e-08           (auto)',
        '  optimizer.params.weight_decay                                0.0             (auto)',
        '  scheduler.type                                               "WarmupDecayLR"',
        '  scheduler.params.warmup_min_lr                               0.0             (auto)',
        '  scheduler.params.warmup_max_lr                               5e-05           (auto)',
        '  scheduler.params.warmup_num_steps                            10              (auto)',
        '  scheduler.params.total_num_steps                             1000            (auto)',
        '  zero_optimization.stage                                      3',
        '  zero_optimization.reduce_bucket_size                         4096            (auto)',
        '  zero_optimization.overlap_comm                               true',
        '  zero_optimization.stage3_prefetch_bucket_size                3686            (auto)',
        '  zero_optimization.stage3_param_persistence_threshold         640             (auto)',
        '  zero_optimization.stage3_gather_16bit_weights_on_model_save  true',
    ])


def test_config_table_for_zero2():
    cfg = load(ZERO2, 2)
    assert format_config_table(cfg) == "\n".join([
        'hf_zero config: world_size 2, ZeRO stage 2, float16 (values that differ from the defaults)',
        '  train_batch_size                                2             (derived)',
        '  train_micro_batch_size_per_gpu                  1             (default)',
        '  gradient_accumulation_steps                     1             (default)',
        '  steps_per_print                                 2000',
        '  fp16.enabled                                    true',
        '  optimizer.type                                  "AdamW"',
        '  optimizer.params.lr                             3e-05',
        '  optimizer.params.betas                          [0.8, 0.999]',
        '  optimizer.params.eps                            1e-08',
        '  optimizer.params.weight_decay                   3e-07',
        '  scheduler.type                                  "WarmupLR"',
        '  scheduler.params.warmup_min_lr                  0.0',
        '  scheduler.params.warmup_max_lr                  3e-05',
        '  scheduler.params.warmup_num_steps               500',
        '  zero_optimization.stage                         2',
        '  zero_optimization.reduce_bucket_size            200000000',
        '  zero_optimization.allgather_bucket_size         200000000',
        '  zero_optimization.overlap_comm                  true',
        '  zero_optimization.offload_optimizer.device      "cpu"',
        '  zero_optimization.offload_optimizer.pin_memory  true',
    ])


def test_config_table_lists_not_implemented():
    table = format_config_table(load({"autotuning": {"enabled": True}, "pipeline": {"stages": 2}}))
    assert table.splitlines()[-1] == "  accepted, not yet implemented: autotuning"


def test_table_is_logged_on_rank_zero_only(caplog):
    # gradient_clipping stated: without it rank 0 also logs, once per process, that DeepSpeed's default 1.0 applies
    config = {**json.loads(ZERO1.read_text()), "gradient_clipping": 1.0}
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        load_config(config, world_size=2, rank=1)
        assert caplog.records == []
        cfg = load_config(config, world_size=2, rank=0)
    assert [r.getMessage() for r in caplog.records] == [format_config_table(cfg)]
    assert caplog.records[0].name == "hf_zero" and caplog.records[0].levelno == logging.INFO


# --- the schema itself --------------------------------------------------------------------------------------------

# Frozen on purpose (torchtitan's test_no_new_cli_options): a new key must be added here, visibly.
TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "log_level",
    "disable_python_gc", "expert_parallel",
    "managed_gradient_accumulation", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "dump_state", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "communication_data_type", "fp16", "bf16", "bfloat16", "amp", "optimizer", "scheduler", "zero_optimization",
    "aio", "activation_checkpointing", "flops_profiler", "tensorboard", "csv_monitor", "wandb", "comet",
    "comms_logger", "checkpoint", "data_types", "pipeline", "compression_training", "tensor_parallel", "elasticity",
    "autotuning", "data_efficiency", "curriculum_learning", "comms_timeout_s", "comms_divergence_check",
    "data_parallel_size", "sequence_parallel_size", "torch_autocast", "dataloader_drop_last",
    "use_data_before_expert_parallelism", "timers", "hybrid_engine", "seq_parallel_communication_data_type",
    "progressive_layer_drop",
})
ZERO_KEYS = frozenset({
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_optimizer", "offload_param", "sub_group_size", "cpu_offload", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_divergence_timeout_s",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "mics_shard_size",
    "mics_hierarchical_params_gather", "memory_efficient_linear", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "zenflow", "leaf_module", "pipeline_loading_checkpoint",
    # DeepSpeed's field names without "stage3_" (aliases), compute_grad_norm, parameter_alignment (DeepSpeed 0.19.8)
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential", "compute_grad_norm", "parameter_alignment",
})
OFFLOAD_KEYS = frozenset({"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
                          "fast_init", "pipeline_read", "pipeline_write", "ratio"})


def test_accepted_key_sets_are_frozen():
    assert set(known_keys(HfZeroConfig)) == TOP_LEVEL_KEYS
    assert set(known_keys(ZeroConfig)) == ZERO_KEYS
    assert set(known_keys(OffloadConfig)) == OFFLOAD_KEYS


def test_every_field_has_help_text():
    from hf_zero.config import hf_zero_config, optim, sections

    classes = [obj for module in (hf_zero_config, optim, sections) for obj in vars(module).values()
               if isinstance(obj, type) and dataclasses.is_dataclass(obj)]
    assert len(classes) >= 30
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
    assert doc(ZeroConfig)["stage3_prefetch_bucket_size"] == "Stage 3: parameter elements fetched ahead of use."


def test_config_is_frozen():
    cfg = load(ZERO1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero.stage = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.optimizer.params["lr"] = 1.0  # type: ignore[index]


def test_config_error_survives_pickling():
    """A worker pool hands exceptions back pickled (multiprocessing); a ConfigError that cannot be rebuilt from its
    pickle kills the pool's result thread and the parent waits forever (DeepSpeed's own test harness hung so)."""
    import pickle

    from hf_zero.config.elasticity import ElasticityConfigError

    for err in (ConfigError("checkpoint.tag_validation", "value 'foo' is not accepted"),
                ElasticityConfigError("elasticity.max_train_batch_size", "must be > 0")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert (back.key_path, back.detail) == (err.key_path, err.detail)


def test_booleans_take_what_deepspeeds_config_models_take():
    """DeepSpeed's pydantic sections (and its top-level getters) accept 0 / 1 and the usual words for a boolean:
    DeepSpeed's own tests write "zero_allow_untested_optimizer": 1."""
    for raw, value in ((1, True), (0, False), (1.0, True), ("yes", True), ("Off", False), ("t", True), ("0", False)):
        cfg = load({"zero_allow_untested_optimizer": raw, "zero_optimization": {"overlap_comm": raw}})
        assert cfg.zero_allow_untested_optimizer is value and cfg.zero.overlap_comm is value, raw
    # the raw sections read without parsing count "enabled": 1 as on, as the parsed ones do
    assert load({"autotuning": {"enabled": 1}}).not_implemented == ("autotuning",)
    assert load({"autotuning": {"enabled": "no"}}).not_implemented == ()
