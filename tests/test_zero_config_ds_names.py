"""``zero_optimization`` keys as DeepSpeed 0.19.8's config model takes them: its field names without ``stage3_``
(it accepts both spellings), ``compute_grad_norm`` and ``parameter_alignment``."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.config import load_config
from hf_zero.config.errors import ConfigError
from hf_zero.testing import run_distributed

from _parity import GAS, STEPS, assert_matches_reference, base_config, clone_state, make_data, make_model

UNPREFIXED = {"prefetch_bucket_size": 1234, "param_persistence_threshold": 40, "model_persistence_threshold": 5000,
              "max_live_parameters": 4321, "max_reuse_distance": 77, "module_granularity_threshold": 3,
              "gather_16bit_weights_on_model_save": True}


def _load(zero: dict, **top):
    return load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, **zero}, **top}, world_size=1)


def test_deepspeeds_unprefixed_stage3_names_mean_the_stage3_keys():
    short = _load(UNPREFIXED)
    long = _load({f"stage3_{k}": v for k, v in UNPREFIXED.items()})
    assert short.zero == long.zero
    assert short.zero.stage3_param_persistence_threshold == 40 and short.zero.stage3_max_reuse_distance == 77
    # the reuse distance given under either name is honoured (left out, hf_zero's default is 0)
    from hf_zero.config import zero_policy

    assert zero_policy(short).stage3.max_reuse_distance == zero_policy(long).stage3.max_reuse_distance == 77
    assert zero_policy(_load({})).stage3.max_reuse_distance == 0
    with pytest.raises(ConfigError, match="given twice"):
        _load({"param_persistence_threshold": 1, "stage3_param_persistence_threshold": 2})


def test_memory_estimate_reads_either_spelling():
    from transformers import LlamaConfig

    from hf_zero.profiling.memory import estimate_memory

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)

    def states(zero):
        ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, **zero}}
        return estimate_memory(cfg, ds, world_size=4, seq_len=8, accelerator="cpu", activations=0).model_states()

    # this model's parameters are all under the default threshold (100k): 0 shards them all, under either name
    short, long = states({"param_persistence_threshold": 0}), states({"stage3_param_persistence_threshold": 0})
    assert short == long < states({})


def _norms(stage: int, compute: bool):
    config = base_config(stage, gradient_clipping=0.0)
    config["zero_optimization"]["compute_grad_norm"] = compute
    engine, *_ = hf_zero.initialize(model=make_model(), config=config)
    import hf_zero.zero.optimizer as opt_module

    calls = [0]
    original = opt_module.all_reduce_

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    opt_module.all_reduce_ = counted
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = make_data(world)
        norms = []
        for s in range(STEPS):
            for m in range(GAS):
                engine.backward(nn.functional.mse_loss(engine(x[s, m, rank]), y[s, m, rank]))
                engine.step()
            norms.append(engine.get_global_grad_norm())
    finally:
        opt_module.all_reduce_ = original
    params = clone_state(engine)
    engine.destroy()
    return norms, calls[0], params


def _both(stages):
    return {stage: (_norms(stage, True), _norms(stage, False)) for stage in stages}


def test_compute_grad_norm_false_skips_the_norm_and_changes_nothing_else():
    results = run_distributed(_both, 2, args=((1, 2, 3),))
    for stage in (1, 2, 3):
        (norms_on, calls_on, params_on), (norms_off, calls_off, params_off) = results[0][stage]
        assert all(isinstance(n, float) and n > 0 for n in norms_on), norms_on
        assert norms_off == [None] * STEPS
        assert calls_on == STEPS and calls_off == 0, (stage, calls_on, calls_off)  # the norm's all-reduce, gone
        for name, p in params_on.items():
            assert torch.equal(params_off[name], p), (stage, name)


def test_compute_grad_norm_false_needs_clipping_off_and_parameter_alignment_is_a_warned_no_op():
    with pytest.raises(ConfigError, match=r"zero_optimization.compute_grad_norm: false needs gradient_clipping 0: "
                                          r"clipping at 1 needs the norm"):
        _load({"compute_grad_norm": False})  # gradient_clipping absent: 1.0, as in DeepSpeed
    assert _load({"compute_grad_norm": False}, gradient_clipping=0).zero.compute_grad_norm is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _load({"parameter_alignment": True})
    assert any("parameter_alignment" in str(w.message) and "the results are the same" in str(w.message)
               for w in caught)
