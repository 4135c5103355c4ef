"""The ``tensor_parallel`` config section, key by key (honoured, aliased, checked or refused by name), and the
refusals of what tensor parallelism does not compose with yet (the sequence-parallel keys:
test_tp_sequence_parallel.py)."""

from __future__ import annotations

import logging

import pytest

from _tp_spawns import case, register
from _tp_util import make_model
from hf_zero.config.errors import ConfigError
from hf_zero.tensor_parallel.config import parse_tp_config


def test_sizes_and_aliases():
    assert parse_tp_config(None).size == 1 and not parse_tp_config(None).enabled
    assert parse_tp_config({"autotp_size": 0}).size == 1
    assert parse_tp_config({"autotp_size": 4}).size == 4
    assert parse_tp_config({"tp": {"tp_size": 2}}).size == 2
    assert parse_tp_config({"autotp_size": 2, "dtype": "bf16"}).dtype == "bf16"
    assert parse_tp_config({"autotp_size": 2, "vocab_parallel_lm_head": False}).vocab_parallel_lm_head is False


@pytest.mark.parametrize("section,key", [
    ({"autotp_size": 2, "tp": {"tp_size": 4}}, "tensor_parallel.tp.tp_size"),
    ({"autotp_size": -1}, "tensor_parallel.autotp_size"),
    ({"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}},
     "tensor_parallel.partition_config.layer_specs[0].partition_type"),
    ({"autotp_size": 2, "preset_model": "lama"}, "tensor_parallel.preset_model"),
    ({"autotp_size": 2, "injection_policy_tuple": None}, "tensor_parallel.injection_policy_tuple"),
    ({"autotp_size": 2, "tp": {"mpu": None}}, "tensor_parallel.tp.mpu"),
    ({"autotp_size": 2, "tp": {"tp_grain_size": 64}}, "tensor_parallel.tp.tp_grain_size"),
    ({"autotp_size": 2, "vocab_parallel_ce_backend": "liger"}, "tensor_parallel.vocab_parallel_ce_backend"),
    ({"autotp_size": 2, "dtype": "int8"}, "tensor_parallel.dtype"),
    ({"autotpsize": 2}, "tensor_parallel.autotpsize"),
])
def test_refused_keys_are_named(section, key):
    with pytest.raises(ConfigError) as err:
        parse_tp_config(section)
    assert str(err.value).startswith(key)


def test_overlap_comm_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        parse_tp_config({"autotp_size": 2, "tp_overlap_comm": True})
    assert "tensor_parallel.tp_overlap_comm" in caplog.text


def _refusals():
    import hf_zero
    from hf_zero.tensor_parallel import tp_model_init

    from peft import LoraConfig, get_peft_model

    out = {}
    # LoRA on the projections is split with them (test_tp_lora.py); on the vocabulary-parallel embedding it is not
    model = get_peft_model(make_model("llama"), LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    try:
        tp_model_init(model, tp_size=2)
    except ValueError as e:
        out["lora"] = str(e)
    # PEFT after sharding: adapters sized for the whole layer are refused by the engine, naming the order to use
    sharded = tp_model_init(make_model("llama"), tp_size=2)
    try:
        hf_zero.initialize(model=get_peft_model(sharded, LoraConfig(r=2, target_modules=["q_proj"])), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "tensor_parallel": {"autotp_size": 2}})
    except ValueError as e:
        out["lora_after"] = str(e)
    try:  # kv heads 4 cannot be split over 8... a world of 2 cannot hold tp 3
        tp_model_init(make_model("llama"), tp_size=3)
    except ValueError as e:
        out["size"] = str(e)
    try:
        hf_zero.initialize(model=make_model("llama"), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "tensor_parallel": {"autotp_size": 2, "dtype": "bf16"}})
    except ConfigError as e:
        out["dtype"] = str(e)
    # DeepSpeed's idiom (#26 item 4): model_parameters=model.parameters(), a generator read after AutoTP replaced the
    # parameters -- accepted; a list taken before the sharding -- accepted too, as in DeepSpeed, whose AutoTP keeps
    # the Parameter objects: it is pointed at their replacements (runtime/tp_setup.py adopt_sharded_params)
    from torch.distributed.tensor import DTensor

    tp_cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "tensor_parallel": {"autotp_size": 2}}
    model = make_model("llama")
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=tp_cfg)
    stepped = [p for g in engine.groups for p in g.params]
    out["generator"] = (len(stepped), len([p for p in model.parameters() if p.requires_grad]),
                        any(isinstance(p, DTensor) for p in stepped))
    engine.destroy()
    model = make_model("llama")
    stale = list(model.parameters())
    engine, *_ = hf_zero.initialize(model=model, model_parameters=stale, config=tp_cfg)
    stepped = [p for g in engine.groups for p in g.params]
    out["stale_list"] = (len(stepped), set(stepped) == set(model.parameters()))
    engine.destroy()
    try:  # parameters of another model stay refused
        hf_zero.initialize(model=make_model("llama"), model_parameters=stale, config=tp_cfg)
    except ValueError as e:
        out["foreign_list"] = str(e)
    return out


register(2, "refusals", _refusals)  # in the shared 2-rank process group (tests/_tp_spawns.py)


def test_refusals_name_the_cause():
    out = case(2, "refusals")[0]
    assert "'model.embed_tokens'" in out["lora"] and "LoRA" in out["lora"] and "vocabulary" in out["lora"]
    assert "'model.layers.0.self_attn.q_proj'" in out["lora_after"] and "get_peft_model" in out["lora_after"]
    assert "tp_model_init(tp_size)=3" in out["size"] and "world size 2" in out["size"]
    assert out["dtype"].startswith("tensor_parallel.dtype") and "fp32" in out["dtype"]
    trained, in_model, sharded = out["generator"]
    assert trained == in_model and sharded, out["generator"]
    assert out["stale_list"] == (trained, True), out["stale_list"]
    assert "not the tensor-parallel model's" in out["foreign_list"], out["foreign_list"]
