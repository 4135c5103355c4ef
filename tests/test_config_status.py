"""Config honesty: every accepted key has a status, and a key set but not honoured warns, errs or is listed."""

from __future__ import annotations

import dataclasses
import inspect
import typing
import warnings

import pytest
import torch
import torch.distributed as dist

import hf_zero
from hf_zero.config import ConfigError, HfZeroConfig, load_config
from hf_zero.config.schema import json_fields, json_key
from hf_zero.config.status import STATUS, ConfigKeyIgnored, Status
from hf_zero.config.table import format_config_table
from hf_zero.testing import run_distributed

from _parity import base_config, engine_run, make_model


def _accepted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a section reads, aliases left out (they share their key's entry); a section whose own path
    has a status is one key."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in json_fields(cls):
        path = prefix + json_key(f)
        section = [a for a in (typing.get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(a)]
        if section and path not in STATUS:
            out += _accepted_keys(section[0], path + ".")
        else:
            out.append(path)
    return out


def load(config: dict, **kwargs) -> HfZeroConfig:
    return load_config(config, world_size=1, log=False, **kwargs)


def ignored_warnings(config: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(config)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)]


def test_every_accepted_key_has_exactly_one_status():
    keys = _accepted_keys(HfZeroConfig)
    assert len(keys) > 100
    missing = [k for k in keys if k not in STATUS]
    assert not missing, f"accepted keys with no status in hf_zero/config/status.py: {missing}"
    stale = [k for k in STATUS if k not in keys]
    assert not stale, f"status entries for keys the schema does not accept: {stale}"
    for key, entry in STATUS.items():
        if entry.status is not Status.HONOURED:
            assert entry.note, f"{key}: a key that is not honoured must say why or what hf_zero does instead"


def test_defaults_warn_about_nothing():
    assert ignored_warnings({}) == []
    assert load({}).not_implemented == ()


def test_not_implemented_key_warns_once_with_what_hf_zero_does_and_is_marked_in_the_table():
    config = {"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}}
    assert ignored_warnings(config) == [
        "hf_zero: config key zero_optimization.stage3_use_all_reduce_for_fetch_params is not implemented in hf_zero: "
        "parameters are fetched with all-gather (same values)"]
    cfg = load(config)
    assert cfg.not_implemented == ("zero_optimization.stage3_use_all_reduce_for_fetch_params",)
    table = format_config_table(cfg).splitlines()
    assert [line.split() for line in table[1:-1] if "all_reduce_for_fetch" in line] == [
        ["zero_optimization.stage3_use_all_reduce_for_fetch_params", "true", "(not", "implemented)"]]
    assert table[-1] == "  accepted, not yet implemented: zero_optimization.stage3_use_all_reduce_for_fetch_params"


@pytest.mark.parametrize("key, value", [("zero_hpz_partition_size", 4), ("mics_shard_size", 4)])
def test_a_secondary_or_shard_group_of_the_whole_world_is_the_partition_itself(key, value):
    """zero_hpz_partition_size / mics_shard_size equal to the data-parallel world (a one-node config): one partition
    over the world, which is hf_zero's; any other size warns that hf_zero partitions over the whole group."""
    def warned(world_size):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, key: value}},
                              world_size=world_size, log=False)
        return [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)], cfg.not_implemented

    assert warned(4) == ([], ())
    messages, listed = warned(8)
    assert listed == (f"zero_optimization.{key}",)
    assert messages[0].startswith(f"hf_zero: config key zero_optimization.{key} is not implemented in hf_zero: "
                                  "parameters are partitioned over the whole data-parallel group")
    assert len(messages) == 1


def test_enable_sanity_checks_keeps_the_per_collective_check_on():
    """DeepSpeed's ZeRO-3 sanity checks compare the ranks' parameter ids before gathers and reductions; hf_zero's
    per-collective divergence check does that for every collective, and enable_sanity_checks keeps it on even when
    comms_divergence_check is switched off."""
    from hf_zero.comm import faults, settings

    before = settings.checks_enabled()
    try:
        got = {}
        for sanity in (False, True):
            faults.configure_from(load({"comms_divergence_check": False,
                                        "zero_optimization": {"stage": 3, "enable_sanity_checks": sanity}}))
            got[sanity] = settings.checks_enabled()
        assert got == {False: False, True: True}
    finally:
        settings.configure(divergence_check=before)


def test_deepspeeds_serial_checkpoint_loading_key_is_accepted_and_says_it_changes_nothing():
    assert ignored_warnings({"zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": True}}) == [
        "hf_zero: config key zero_optimization.pipeline_loading_checkpoint has no effect in hf_zero: the local ranks "
        "load their checkpoint shards at the same time (same values; DeepSpeed serialises them to bound host memory "
        "at load)"]


def test_no_op_key_warns_with_its_reason_and_is_marked_but_not_listed():
    config = {"zero_optimization": {"stage": 2, "contiguous_gradients": False, "elastic_checkpoint": True}}
    assert ignored_warnings(config) == [
        "hf_zero: config key zero_optimization.contiguous_gradients has no effect in hf_zero: gradients are always "
        "reduced from contiguous bucket buffers",
        "hf_zero: config key zero_optimization.elastic_checkpoint has no effect in hf_zero: hf_zero checkpoints "
        "always load at any world size"]
    cfg = load(config)
    assert cfg.not_implemented == ()
    rows = {line.split()[0]: line.split()[-1] for line in format_config_table(cfg).splitlines()[1:]}
    assert rows["zero_optimization.contiguous_gradients"] == "effect)"
    assert "(no effect)" in format_config_table(cfg)


def test_warnings_only_on_rank_zero():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({"zero_optimization": {"zero_quantized_weights": True}}, world_size=1, rank=1, log=False)
    assert [w for w in caught if issubclass(w.category, ConfigKeyIgnored)] == []


@pytest.mark.parametrize("config, key", [
    ({"communication_data_type": "fp16"}, "communication_data_type"),
    ({"bf16": {"enabled": True}, "communication_data_type": "fp32"}, "communication_data_type"),
    ({"bf16": {"enabled": True}, "sequence_parallel_size": 2, "data_parallel_size": 1,
      "seq_parallel_communication_data_type": "fp32"}, "seq_parallel_communication_data_type"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"zero_optimization": {"load_from_fp32_weights": False}}, "zero_optimization.load_from_fp32_weights"),
])
def test_keys_that_would_change_results_silently_are_refused(config, key):
    with pytest.raises(ConfigError) as info:
        load(config)
    assert str(info.value).startswith(f"{key}: ")
    assert "not supported" in str(info.value)


def test_communication_dtype_equal_to_the_reduction_dtype_is_honoured():
    assert ignored_warnings({"bf16": {"enabled": True}, "communication_data_type": "bf16"}) == []
    # DeepSpeed reads seq_parallel_communication_data_type only with sequence parallelism
    assert ignored_warnings({"bf16": {"enabled": True}, "seq_parallel_communication_data_type": "fp32"}) == []
    assert ignored_warnings({"bf16": {"enabled": True}, "sequence_parallel_size": 2, "data_parallel_size": 1,
                             "data_types": {"grad_accum_dtype": "fp32"},
                             "seq_parallel_communication_data_type": "fp32"}) == []
    assert ignored_warnings({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                             "communication_data_type": "fp32"}) == []


def test_sections_count_as_set_when_enabled():
    assert load({"autotuning": {"enabled": False, "fast": True}}).not_implemented == ()
    assert load({"autotuning": {"enabled": True}}).not_implemented == ("autotuning",)
    # DeepSpeed 0.19's AutoEP: a warning saying what happens instead, not "unknown key" (nor "did you mean
    # tensor_parallel?", which the typo guess offered before the key was known)
    assert load({"expert_parallel": {"enabled": False, "autoep_size": 2}}).not_implemented == ()
    assert load({"expert_parallel": {"enabled": True, "autoep_size": 2}}).not_implemented == ("expert_parallel",)
    assert [w for w in ignored_warnings({"expert_parallel": {"enabled": True}}) if "every rank holds every expert" in w]
    assert load({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}).not_implemented == (
        "optimizer.type OneBitAdam",)
    assert load({"tensor_parallel": {"autotp_size": 1}}).not_implemented == ()


def test_initialize_has_deepspeeds_signature_and_rejects_unknown_keywords():
    assert list(inspect.signature(hf_zero.initialize).parameters) == [
        "args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "distributed_port", "mpu",
        "dist_init_required", "collate_fn", "config", "mesh_param", "config_params"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'confg'"):
        hf_zero.initialize(model=torch.nn.Linear(2, 2), confg={})


def _bf16_poisoned(check: bool):
    extra = {"bf16": {"enabled": True, "check_grad_overflow": check}}
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(1, **extra))
    engine_run(engine, dist.get_world_size(), dist.get_rank(), steps=4, dtype=torch.bfloat16, poison=(2, 0))
    finite = all(torch.isfinite(g.master).all().item() for g in engine.groups)
    out = (engine.skipped_steps, engine.global_steps, finite)
    engine.destroy()
    return out


def test_bf16_check_grad_overflow_skips_the_step():
    # The infinite gradient of step 2 is skipped with the flag (weights stay finite) and applied without it.
    assert run_distributed(_bf16_poisoned, 1, args=(True,)) == [(1, 4, True)]
    assert run_distributed(_bf16_poisoned, 1, args=(False,)) == [(0, 4, False)]


def test_unknown_keys_warn_where_deepspeed_ignores_them_and_fail_where_it_refuses_them():
    """DeepSpeed reads flops_profiler and activation_checkpointing key by key (its own test_flops_profiler writes
    ``"step": 1``, no such key) and refuses extra keys in its pydantic sections (zero_optimization, ...)."""
    assert ignored_warnings({"flops_profiler": {"enabled": True, "step": 1}}) == [
        "hf_zero: config key 'flops_profiler.step' is unknown; accepted keys: detailed, enabled, module_depth, "
        "output_file, profile_step, recompute_fwd_factor, top_modules; ignored, as DeepSpeed ignores unknown keys in "
        "this section"]
    with pytest.raises(ConfigError, match=r"zero_optimization.stagee: unknown key; did you mean 'stage'\?"):
        load({"zero_optimization": {"stagee": 2}})
