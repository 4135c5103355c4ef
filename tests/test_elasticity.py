"""The ``elasticity`` section: DeepSpeed's elastic batch plan (hf_zero/config/elasticity.py), applied by
``load_config`` for the world size, and ``deepspeed.elasticity`` through the compatibility layer.

The reference is DeepSpeed 0.19.7, the last release with elasticity (0.19.8 refuses the section); its answers were
recorded once by ``tests/data/elasticity/make_fixture.py`` (CI has no DeepSpeed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.config import ConfigError, format_config_table, load_config
from hf_zero.config.elasticity import (ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
                                       ElasticPlan, elastic_plan, parse_elasticity)
from hf_zero.config.status import STATUS, ConfigKeyIgnored, Status
from hf_zero.integrations.ds_elasticity import compute_elastic_config
from hf_zero.testing import run_distributed

from _parity import IN, OUT, make_model
from _shim_util import ds as _ds

FIXTURE = json.loads((Path(__file__).parent / "data" / "elasticity" / "deepspeed_0.19.7.json").read_text())

# DeepSpeed's class -> the class hf_zero raises. Every hf_zero error is also a ConfigError naming the key. Where
# DeepSpeed raises a plain ValueError (a micro batch above the cap) or NotImplementedError (version 0.15), hf_zero
# raises ElasticityConfigError (a ValueError); where DeepSpeed crashes with a TypeError (no GPU count in
# [min_gpus, max_gpus] fits, and the search kept its starting point) hf_zero says so in an ElasticityError.
_OUR_CLASS = {
    "ElasticityConfigError": ElasticityConfigError,
    "ElasticityIncompatibleWorldSize": ElasticityIncompatibleWorldSize,
    "ElasticityError": ElasticityError,
    "ValueError": ElasticityConfigError,
    "NotImplementedError": ElasticityConfigError,
    "TypeError": ElasticityError,
}


def _compute(record: dict, monkeypatch) -> dict:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if record.get("env_world_size") is not None:
        monkeypatch.setenv("WORLD_SIZE", record["env_world_size"])
    ds_config = record.get("ds_config", {"elasticity": record.get("section")})
    try:
        value = compute_elastic_config(ds_config, record.get("target", "0.19.7"), world_size=record.get("world_size", 0),
                                       return_microbatch=record.get("return_microbatch", False))
    except ConfigError as err:
        return {"error": err}
    return {"value": [list(v) if isinstance(v, list) else v for v in value]}


def test_compute_elastic_config_matches_deepspeed(monkeypatch):
    records = FIXTURE["compute"]
    assert len(records) == 455
    mismatches = []
    for record in records:
        got = _compute(record, monkeypatch)
        if "error" in record:
            wanted = _OUR_CLASS[record["error"]]
            if not isinstance(got.get("error"), wanted):
                mismatches.append((record, got))
            continue
        wanted = record["value"]
        if wanted[1] is None:  # DeepSpeed's "no valid count" as None (search kept its start); hf_zero: []
            wanted = [wanted[0], [], *wanted[2:]]
        if got.get("value") != wanted:
            mismatches.append((record, got))
    assert mismatches == []


def test_fixture_covers_both_versions_preferences_and_every_outcome():
    records = FIXTURE["compute"]
    sections = [r["section"] for r in records if r.get("section")]
    assert {s.get("version", 0.2) for s in sections} >= {0.1, 0.2}
    assert {s.get("prefer_larger_batch", True) for s in sections} == {True, False}
    assert {s.get("num_gpus_per_node", 1) for s in sections} >= {1, 2, 4, 8}
    assert {r.get("world_size", 0) for r in records} >= {0, 1, 2, 3, 4, 6, 8}
    assert {r["error"] for r in records if "error" in r} == set(_OUR_CLASS)
    assert sum("value" in r for r in records) == 221


@pytest.mark.parametrize("index", range(len(FIXTURE["runtime"])))
def test_load_config_resolves_deepspeeds_runtime_batch_sizes(index):
    record = FIXTURE["runtime"][index]
    if "value" in record:
        cfg = load_config(record["config"], world_size=record["world_size"], log=False)
        assert [cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps] == \
            record["value"]
        assert [cfg.raw[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                     "gradient_accumulation_steps")] == record["value"]
        assert {cfg.sources[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps")} == {"elasticity"}
        return
    with pytest.raises(ConfigError) as info:
        load_config(record["config"], world_size=record["world_size"], log=False)
    # DeepSpeed asserts "Train batch size: 0 has to be greater than 0" on a plan that gives no batch at all
    wanted = ElasticityConfigError if record["error"] == "AssertionError" else _OUR_CLASS[record["error"]]
    assert isinstance(info.value, wanted)


# ---- the plan, worked by hand -----------------------------------------------------------------------------------

def _section(**keys) -> dict:
    return {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "version": 0.1, **keys}


def test_plan_by_hand_prefer_larger_and_smaller():
    # bases 2, 4 and lcm 4, scaled by the largest highly composite number within 16: 2*6 = 12, 4*4 = 16.
    # 12 fits counts {1, 2, 3, 6} (12/2 = 6 micro batches of 2, 12/4 = 3 of 4); 16 fits {1, 2, 4, 8}: a tie.
    larger = elastic_plan(parse_elasticity(_section()))
    assert larger == ElasticPlan(16, (1, 2, 4, 8), None, None)
    smaller = elastic_plan(parse_elasticity(_section(prefer_larger_batch=False)))
    assert smaller == ElasticPlan(12, (1, 2, 3, 6), None, None)
    # on 2 GPUs: 16/2 = 8 per GPU -> micro 4, 2 steps; 12/2 = 6 -> micro 2 (4 does not divide 6), 3 steps
    assert elastic_plan(parse_elasticity(_section()), 2) == ElasticPlan(16, (1, 2, 4, 8), 4, 2)
    assert elastic_plan(parse_elasticity(_section(prefer_larger_batch=False)), 2) == ElasticPlan(12, (1, 2, 3, 6), 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        larger.train_batch_size = 8


def test_plan_version_02_per_node():
    # 2 GPUs per node, no model parallelism: the v0.1 search on 100 // 2 = 50 per node: 50 = 2 * 25 -> 2 * 24 = 48
    # (counts 1,2,3,4,6,8,12,24 of micro 2) vs 4 * 12 = 48: one candidate, 48 per node; times 2 ranks per node
    plan = elastic_plan(parse_elasticity(_section(max_train_batch_size=100, version=0.2, num_gpus_per_node=2)), 4)
    assert plan == ElasticPlan(96, (2, 4, 6, 8, 12, 16, 24, 48), 4, 6)


def test_incompatible_world_size_names_it_and_the_valid_counts():
    with pytest.raises(ElasticityIncompatibleWorldSize) as info:
        elastic_plan(parse_elasticity(_section()), 3)
    message = str(info.value)
    assert message.startswith("elasticity: world size 3 cannot train with the elastic batch size 16")
    assert "the valid GPU counts are [1, 2, 4, 8]" in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("section, start", [
    (_section(micro_batch_sizes=[4, 32]),
     "elasticity.micro_batch_sizes: [4, 32] has a micro batch above elasticity.max_train_batch_size 16"),
    (_section(max_train_batchsize=3), "elasticity.max_train_batchsize: unknown key; did you mean "
                                      "'max_train_batch_size'?"),
    ({"enabled": True, "micro_batch_sizes": [2]}, "elasticity.max_train_batch_size: missing"),
    (_section(min_gpus=4, max_gpus=2), "elasticity.max_gpus: 2 is below elasticity.min_gpus 4"),
    (_section(version=0.3), "elasticity.version: 0.3: the latest elasticity version is 0.2"),
    (_section(model_parallel_size=2), "elasticity.model_parallel_size: 2 needs elasticity.version 0.2"),
    (_section(version=0.2, num_gpus_per_node=3, model_parallel_size=2),
     "elasticity.num_gpus_per_node: 3 is not divisible by elasticity.model_parallel_size 2"),
    (_section(prefer_larger_batch="yes"), "elasticity.prefer_larger_batch: 'yes': must be true or false"),
])
def test_errors_name_the_key_and_value(section, start):
    with pytest.raises(ElasticityError) as info:
        elastic_plan(parse_elasticity(section), 2)
    assert str(info.value).startswith(start)


# ---- load_config --------------------------------------------------------------------------------------------------

def test_batch_keys_beside_the_section_are_refused_unless_ignored(caplog):
    config = {"elasticity": _section(), "train_batch_size": 32, "gradient_accumulation_steps": 4}
    with pytest.raises(ElasticityConfigError) as info:
        load_config(config, world_size=2, log=False)
    assert str(info.value).startswith(
        "train_batch_size: 32 is set, but elasticity.enabled is true and the elastic plan sets the batch sizes "
        "(train_batch_size 16, train_micro_batch_size_per_gpu 4, gradient_accumulation_steps 2 on world size 2). "
        "Remove train_batch_size, gradient_accumulation_steps, or set elasticity.ignore_non_elastic_batch_info true")
    config["elasticity"]["ignore_non_elastic_batch_info"] = True
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        cfg = load_config(config, world_size=2, log=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert "elasticity: train_batch_size 32 overridden by the elastic plan: 16" in caplog.text
    assert "elasticity: gradient_accumulation_steps 4 overridden by the elastic plan: 2" in caplog.text


def test_elasticity_is_honoured_and_a_disabled_section_changes_nothing():
    assert STATUS["elasticity"].status is Status.HONOURED
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigKeyIgnored)
        cfg = load_config({"elasticity": _section()}, world_size=4, log=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 1)
    assert cfg.not_implemented == ()
    table = format_config_table(cfg).splitlines()
    assert [line.split() for line in table if line.split()[0] in ("train_batch_size", "gradient_accumulation_steps")] \
        == [["train_batch_size", "16", "(elasticity)"], ["gradient_accumulation_steps", "1", "(elasticity)"]]
    off = load_config({"elasticity": {"enabled": False}, "train_batch_size": 8}, world_size=2, log=False)
    assert (off.train_batch_size, off.train_micro_batch_size_per_gpu, off.gradient_accumulation_steps) == (8, 4, 1)
    with pytest.raises(ElasticityConfigError, match=r"^elasticity.enable: unknown key; did you mean 'enabled'\?"):
        load_config({"elasticity": {"enable": True}}, world_size=2, log=False)


def test_the_schedulers_copy_of_the_section_must_agree(monkeypatch):
    scheduled = _section(micro_batch_sizes=[2])
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(scheduled))
    with pytest.raises(ElasticityConfigError) as info:
        load_config({"elasticity": _section()}, world_size=2, log=False)
    assert str(info.value) == ("elasticity.micro_batch_sizes: [2, 4], but the resource scheduler planned this job with "
                               "[2] (environment variable DEEPSPEED_ELASTICITY_CONFIG)")
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(_section()))
    assert load_config({"elasticity": _section()}, world_size=2, log=False).train_batch_size == 16


# ---- deepspeed.elasticity -------------------------------------------------------------------------------------------

def test_deepspeed_elasticity_names(monkeypatch):
    import hf_zero.config.elasticity as ours
    import hf_zero.integrations.ds_elasticity as ds_side

    elasticity = _ds("deepspeed.elasticity")
    assert elasticity.compute_elastic_config is ds_side.compute_elastic_config
    assert _ds("deepspeed.elasticity.elasticity").compute_elastic_config is ds_side.compute_elastic_config
    for name in ("ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize"):
        assert getattr(elasticity, name) is getattr(ours, name)
        assert getattr(_ds("deepspeed.elasticity.config"), name) is getattr(ours, name)
    assert (elasticity.ELASTICITY, elasticity.ENABLED, elasticity.ENABLED_DEFAULT) == ("elasticity", "enabled", False)
    assert elasticity.is_torch_elastic_compatible() is True
    config = {"elasticity": _section()}
    assert elasticity.elasticity_enabled(config) is True and elasticity.elasticity_enabled({}) is False
    assert elasticity.compute_elastic_config(config, "0.19.7") == (16, [1, 2, 4, 8])
    assert elasticity.compute_elastic_config(config, "0.19.7", world_size=4) == (16, [1, 2, 4, 8], 4)
    monkeypatch.setenv("WORLD_SIZE", "8")  # version 0.1, return_microbatch: the micro batch for WORLD_SIZE
    assert elasticity.compute_elastic_config(config, "0.19.7", return_microbatch=True) == (16, [1, 2, 4, 8], 2)
    # DeepSpeedConfig goes through load_config: without a process group, one rank
    ds_config = _ds("deepspeed").DeepSpeedConfig(config)
    assert (ds_config.train_batch_size, ds_config.train_micro_batch_size_per_gpu,
            ds_config.gradient_accumulation_steps) == (16, 4, 4)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(_section(max_train_batch_size=32)))
    with pytest.raises(elasticity.ElasticityConfigError, match="max_train_batch_size: 16, but the resource scheduler"):
        elasticity.ensure_immutable_elastic_config(config["elasticity"])


# ---- the engine ---------------------------------------------------------------------------------------------------

def _elastic_engine(section: dict) -> dict:
    config = {"elasticity": section, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
    try:
        engine, *_ = hf_zero.initialize(model=make_model(), config=config)
    except ElasticityIncompatibleWorldSize as err:  # raised on every rank, after the mesh (built together)
        return {"error": str(err)}
    out = {"sizes": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                     engine.gradient_accumulation_steps())}
    # the plan's accumulation is what the engine steps on: one optimizer step per gradient_accumulation_steps
    g = torch.Generator().manual_seed(dist.get_rank())
    micro = engine.train_micro_batch_size_per_gpu()
    for _ in range(engine.gradient_accumulation_steps()):
        x, y = torch.randn(micro, IN, generator=g), torch.randn(micro, OUT, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    out["global_steps"] = engine.global_steps
    engine.destroy()
    return out


def test_initialize_on_two_ranks_takes_the_plans_batch_sizes():
    results = run_distributed(_elastic_engine, world_size=2, args=(_section(),))
    assert results == [{"sizes": (16, 4, 2), "global_steps": 1}] * 2
    results = run_distributed(_elastic_engine, world_size=2, args=(_section(prefer_larger_batch=False),))
    assert results == [{"sizes": (12, 2, 3), "global_steps": 1}] * 2


def test_initialize_on_an_incompatible_world_size_names_it():
    # min_gpus 3: 12 fits {3, 6}, 16 fits {4, 8}; a tie, so 16 -- and 2 ranks are not among its counts
    results = run_distributed(_elastic_engine, world_size=2, args=(_section(min_gpus=3),))
    for result in results:
        assert result["error"].startswith("elasticity: world size 2 cannot train with the elastic batch size 16")
        assert "the valid GPU counts are [4, 8]" in result["error"]
