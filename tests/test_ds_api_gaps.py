"""DeepSpeed APIs scripts call around the training loop, checked by the numbers they produce:

* ``engine.load_module_state_dict`` at ZeRO stages 0-3 on 2 ranks (and with ``offload_optimizer``): the model
  *and* the optimizer's masters take the loaded weights, so the next step continues from them (a plain torch
  model + AdamW, loaded the same way, is the reference within 1e-5); strict / ``allowed_missing_keys`` /
  ``custom_load_fn`` as DeepSpeed;
* ``deepspeed.utils.set_z3_leaf_modules_by_name`` / ``_by_suffix``: ``(modules, missing)`` as DeepSpeed;
* ``deepspeed.utils.safe_update_full_grad_vectorized``: the gradients the step uses;
* ``deepspeed.runtime.zero.stage3.unwrap_model_for_generation``: full parameters and no hooks inside, the same
  outputs, partitioned again after, training unaffected.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import hf_zero
from hf_zero.testing import run_distributed

from _shim_util import ds as _ds

LR, BETAS, WD = 0.01, (0.8, 0.9), 0.01


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) + self.offset


def _config(stage: int, offload: bool = False, **extra) -> dict:
    # persistence threshold 10: at ZeRO-3 l2.bias (4 elements) stays gathered, the rest is partitioned
    zero = {"stage": stage, "stage3_param_persistence_threshold": 10}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WD}},
            "zero_optimization": zero, "steps_per_print": 1000, **extra}


def _engine(stage: int, offload: bool = False, **extra):
    torch.manual_seed(0)
    model = _Net()
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(),
                                    config=_config(stage, offload, **extra))
    return engine


def _known_state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Values no initialisation produces: the state dict the tests load."""
    g = torch.Generator().manual_seed(123)
    shapes = {"l1.weight": (16, 8), "l1.bias": (16,), "l2.weight": (4, 16), "l2.bias": (4,), "offset": (4,)}
    return {k: torch.randn(s, generator=g) * 0.3 * scale for k, s in shapes.items()}


def _batch(step: int) -> torch.Tensor:
    """The global batch of ``step`` (4 samples); rank r trains on rows [2r, 2r + 2)."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 + step))


def _engine_step(engine, step: int, rank: int) -> None:
    x = _batch(step)[2 * rank:2 * rank + 2]
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _reference_step(model, opt, step: int) -> None:
    opt.zero_grad()
    model(_batch(step)).pow(2).mean().backward()  # the mean over both ranks' samples: what the engine averages
    opt.step()


def _weights(engine) -> dict[str, torch.Tensor]:
    """The module's full weights (gathered at ZeRO-3) and buffers; every rank calls it."""
    from hf_zero.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        out = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    out.update({n: b.detach().float().clone() for n, b in engine.module.named_buffers()})
    return out


def _masters(engine) -> dict[str, torch.Tensor]:
    from hf_zero.zero.tensor_fragment import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _after_first_step(stage: int, offload: bool = False, *, rank: int):
    """An engine and the torch reference (AdamW, same seed), each one step in."""
    engine = _engine(stage, offload)
    torch.manual_seed(0)
    ref = _Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    _engine_step(engine, 0, rank)
    _reference_step(ref, opt, 0)
    return engine, ref, opt


def _two_more_steps(engine, ref, opt, rank: int) -> float:
    """Steps 1 and 2 on both; the largest difference of the engine's weights from the reference's."""
    for step in (1, 2):
        _engine_step(engine, step, rank)
        _reference_step(ref, opt, step)
    return _max_diff(_weights(engine), dict(ref.named_parameters()) | dict(ref.named_buffers()))


# ---- load_module_state_dict ---------------------------------------------------------------------------------------
def _load_then_train(stage: int, offload: bool = False) -> dict:
    """Train 1 step, load a known state dict, train 2 more: engine vs torch AdamW on the same weights and data.
    ``offload``: the masters live in the optimizer offload (safe_get_full_fp32_param reads them back from there)."""
    rank = dist.get_rank()
    engine, ref, opt = _after_first_step(stage, offload, rank=rank)
    state = _known_state()
    engine.load_module_state_dict({"module": state})
    ref.load_state_dict(state)  # torch's AdamW keeps its moments; so do the engine's
    out = {"loaded_weights": _max_diff(_weights(engine), state),
           "loaded_masters": _max_diff(_masters(engine), {k: v for k, v in state.items() if k != "offset"})}
    out["after_steps"] = _two_more_steps(engine, ref, opt, rank)
    # a step from the loaded values moves every weight: the load was not reverted to the masters of step 0
    out["moved_from_loaded"] = min((_weights(engine)[k] - state[k]).abs().max().item() for k in state
                                   if k != "offset")
    engine.destroy()
    return out


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)])
def test_loaded_weights_are_what_the_next_steps_train(stage, offload):
    for result in run_distributed(_load_then_train, 2, args=(stage, offload)):
        assert result["loaded_weights"] == 0.0 and result["loaded_masters"] == 0.0
        assert result["after_steps"] < 1e-5
        assert result["moved_from_loaded"] > 1e-3


def _semantics(stage: int) -> dict:
    """strict / allowed_missing_keys / custom_load_fn / a bf16 engine's masters, every check on every rank."""
    out = {}
    engine = _engine(stage)
    before = _weights(engine)
    state = _known_state()
    partial = {k: v for k, v in state.items() if k != "l2.bias"}
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "l2.bias"'):
        engine.load_module_state_dict({"module": partial})
    if stage == 3:  # checked before anything is written
        out["unchanged_after_refusal"] = _max_diff(_weights(engine), before)
    with pytest.raises(RuntimeError, match="missing=\\['l2.weight'\\], unexpected=\\[\\]"):
        engine.load_module_state_dict({"module": {k: v for k, v in partial.items() if k != "l2.weight"}},
                                      allowed_missing_keys=["l2.bias"])
    with pytest.raises(RuntimeError, match="unexpected=\\['extra'\\]"):
        engine.load_module_state_dict({"module": {**partial, "extra": torch.zeros(1)}},
                                      allowed_missing_keys=["l2.bias"])
    with pytest.raises(RuntimeError, match="size mismatch for l1.bias"):
        engine.load_module_state_dict({"module": {**state, "l1.bias": torch.zeros(3)}}, strict=False)
    engine.load_module_state_dict({"module": state})  # a clean start for the next checks
    shifted = state["l1.bias"] + 1
    engine.load_module_state_dict({"module": partial | {"l1.bias": shifted}}, allowed_missing_keys=["l2.bias"])
    masters, weights = _masters(engine), _weights(engine)
    out["allowed_missing"] = max((masters["l1.bias"] - shifted).abs().max().item(),
                                 (weights["l1.bias"] - shifted).abs().max().item(),
                                 (masters["l2.bias"] - state["l2.bias"]).abs().max().item())
    engine.load_module_state_dict({"module": {**state, "unused": torch.ones(2)}}, strict=False)
    out["non_strict"] = _max_diff(_masters(engine), {k: v for k, v in state.items() if k != "offset"})

    calls = []

    def double_l1(src, dst):
        calls.append(sorted(src))
        with torch.no_grad():
            dst.l1.weight.copy_(src["w"] * 2)

    engine.load_module_state_dict({"module": {"w": state["l1.weight"]}}, custom_load_fn=double_l1,
                                  fetch_z3_params=True)
    out["custom_calls"] = calls
    out["custom_master"] = (_masters(engine)["l1.weight"] - 2 * state["l1.weight"]).abs().max().item()
    out["custom_weight"] = (_weights(engine)["l1.weight"] - 2 * state["l1.weight"]).abs().max().item()
    out["custom_others_kept"] = (_masters(engine)["l2.weight"] - state["l2.weight"]).abs().max().item()
    engine.destroy()

    bf16 = _engine(stage, bf16={"enabled": True})
    bf16.load_module_state_dict({"module": state})
    masters, weights = _masters(bf16), _weights(bf16)
    out["bf16_masters"] = _max_diff(masters, {k: v for k, v in state.items() if k != "offset"})
    out["bf16_weights"] = max((weights[k] - state[k].bfloat16().float()).abs().max().item() for k in masters)
    out["bf16_dtype"] = str(next(bf16.module.parameters()).dtype)
    bf16.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_strict_allowed_missing_and_custom_load_fn_as_deepspeed(stage):
    for result in run_distributed(_semantics, 2, args=(stage,)):
        assert result.get("unchanged_after_refusal", 0.0) == 0.0
        assert result["allowed_missing"] == 0.0 and result["non_strict"] == 0.0
        assert result["custom_calls"] == [["w"]]
        assert result["custom_master"] == 0.0 and result["custom_weight"] == 0.0
        assert result["custom_others_kept"] == 0.0
        # bf16 training: the fp32 masters hold the loaded values exactly, the model their bf16 rounding
        assert result["bf16_masters"] == 0.0 and result["bf16_weights"] == 0.0
        assert result["bf16_dtype"] == "torch.bfloat16"


def test_load_module_state_dict_needs_the_module_key_and_reads_frozen_fragments():
    torch.manual_seed(0)
    model = _Net()
    model.l2.bias.requires_grad_(False)
    engine, *_ = hf_zero.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                    config=_config(0))
    with pytest.raises(KeyError, match="checkpoint\\['module'\\]"):
        engine.load_module_state_dict({"model": {}})
    state = _known_state()
    frozen = state.pop("l2.bias")
    with pytest.raises(KeyError, match="no entry for the frozen parameter 'l2.bias'"):
        engine.load_module_state_dict({"module": state, "frozen_param_fragments": {}}, strict=False)
    engine.load_module_state_dict({"module": state, "frozen_param_fragments": {"l2.bias": frozen * 2}},
                                  strict=False)
    assert torch.equal(engine.module.l2.bias.detach(), frozen * 2)
    assert torch.equal(engine.module.l1.weight.detach(), state["l1.weight"])


def test_quantize_nontrainable_params_says_it_keeps_the_weights(caplog):
    """DeepSpeed-Chat's --enable_mixed_precision_lora calls engine.optimizer.quantize_nontrainable_params() after
    initialize (an AttributeError here before). Not quantizing is what zero_quantized_nontrainable_weights' status
    says: logged by name, no weight or step changed."""
    engine = _engine(3)
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        engine.optimizer.quantize_nontrainable_params()
    assert "zero_quantized_nontrainable_weights is not implemented" in caplog.text
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        for n, p in engine.module.named_parameters():
            assert torch.equal(p.detach(), before[n]), n
    assert engine.global_steps == 0


# ---- set_z3_leaf_modules_by_name / _by_suffix ---------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(4, 4)
        self.attn = torch.nn.Linear(4, 4)


class _Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.shared_mlp = torch.nn.Linear(4, 4)


def test_set_z3_leaf_modules_by_name_and_suffix_as_deepspeed():
    utils = _ds("deepspeed.utils")
    model = _Tower()
    modules, missing = utils.set_z3_leaf_modules_by_name(model, ["blocks.0", "shared_mlp", "nope"],
                                                         raise_if_not_found=False)
    assert modules == [model.blocks[0], model.shared_mlp] and missing == ["nope"]
    assert utils.get_z3_leaf_modules(model) == [model.blocks[0], model.shared_mlp]
    with pytest.raises(ValueError, match="no module named \\['nope'\\]"):
        utils.set_z3_leaf_modules_by_name(model, ["nope"])
    modules, missing = utils.set_z3_leaf_modules_by_name(model, ["blocks.0"], flag=False)
    assert (modules, missing) == ([model.blocks[0]], [])
    assert utils.get_z3_leaf_modules(model) == [model.shared_mlp]

    utils.set_z3_leaf_module(model.shared_mlp, False)
    # "mlp" ends blocks.0.mlp, blocks.1.mlp and shared_mlp; "1.mlp" repeats one of them: listed once
    modules, missing = utils.set_z3_leaf_modules_by_suffix(model, ["mlp", "1.mlp", "zzz"], raise_if_not_found=False)
    assert modules == [model.blocks[0].mlp, model.blocks[1].mlp, model.shared_mlp] and missing == ["zzz"]
    assert len(utils.get_z3_leaf_modules(model)) == 3 and utils.z3_leaf_module(model.blocks[1].mlp)
    with pytest.raises(ValueError, match="ends with \\['zzz'\\]"):
        utils.set_z3_leaf_modules_by_suffix(model, ["zzz"])
    modules, _ = utils.set_z3_leaf_modules_by_suffix(model, ["mlp"], flag=False)
    assert len(modules) == 3 and utils.get_z3_leaf_modules(model) == []


# ---- safe_update_full_grad_vectorized -----------------------------------------------------------------------------
def _update_grads(stage: int) -> dict:
    rank = dist.get_rank()
    update = _ds("deepspeed.utils").safe_update_full_grad_vectorized
    from hf_zero.zero.tensor_fragment import safe_get_full_grad

    engine = _engine(stage)
    torch.manual_seed(0)
    ref = _Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    x = _batch(0)[2 * rank:2 * rank + 2]
    engine.backward(engine(x).pow(2).mean())
    params = list(engine.module.parameters())
    before = [safe_get_full_grad(p) for p in params]
    seen = []

    def update_func(grad, param):
        seen.append((tuple(grad.shape), grad.dtype))
        return grad * 3 + 0.5

    update(params, update_func)
    after = [safe_get_full_grad(p) for p in params]
    engine.step()
    opt.zero_grad()
    ref(_batch(0)).pow(2).mean().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p.grad.mul_(3).add_(0.5)
    opt.step()
    out = {"calls": seen, "grads": max((a - (3 * b + 0.5)).abs().max().item() for a, b in zip(after, before)),
           "step": _max_diff(_weights(engine), dict(ref.named_parameters()) | dict(ref.named_buffers()))}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_safe_update_full_grad_vectorized_sets_the_gradients_the_step_uses(stage):
    for result in run_distributed(_update_grads, 2, args=(stage,)):
        assert result["calls"] == [((16, 8), torch.float32), ((16,), torch.float32), ((4, 16), torch.float32),
                                   ((4,), torch.float32)]
        assert result["grads"] < 1e-6 and result["step"] < 1e-5


def test_safe_update_full_grad_vectorized_skips_parameters_without_gradients():
    update = _ds("deepspeed.utils.tensor_fragment").safe_update_full_grad_vectorized
    engine = _engine(0)
    calls = []
    update(list(engine.module.parameters()), lambda g, p: calls.append(p) or g)  # no backward yet: no gradients
    assert calls == []
    with pytest.raises(ValueError, match="update_func returned \\(3,\\)"):
        engine.backward(engine(torch.ones(2, 8)).sum())
        update([engine.module.l2.bias], lambda g, p: torch.zeros(3))


# ---- unwrap_model_for_generation ----------------------------------------------------------------------------------
def _unwrap(stage: int) -> dict:
    rank = dist.get_rank()
    unwrap = _ds("deepspeed.runtime.zero.stage3").unwrap_model_for_generation
    engine, ref, opt = _after_first_step(stage, rank=rank)
    x = _batch(7)
    with torch.no_grad():
        outside = engine(x)
    l1 = engine.module.l1
    out = {"hooks_outside": len(l1._forward_pre_hooks)}
    with unwrap(engine) as model:
        out["same_object"] = model is engine
        out["shapes_inside"] = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
        out["hooks_inside"] = len(l1._forward_pre_hooks) + len(model.module._forward_pre_hooks)
        with torch.no_grad():
            inside = [model(x) for _ in range(3)]  # a generation loop: several forwards
        out["shapes_still_full"] = all(p.numel() > 0 for p in model.module.parameters())
        try:
            with unwrap(engine):
                out["nested"] = "allowed"
        except RuntimeError as exc:
            out["nested"] = str(exc)
    out["inside_vs_outside"] = max((o - outside).abs().max().item() for o in inside)
    out["vs_reference"] = (outside - ref(x)).abs().max().item()
    out["shapes_after"] = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    out["hooks_after"] = len(l1._forward_pre_hooks)
    out["after_steps"] = _two_more_steps(engine, ref, opt, rank)
    engine.destroy()
    return out


def test_unwrap_model_for_generation_gathers_once_and_restores_zero3():
    full = {"l1.weight": (16, 8), "l1.bias": (16,), "l2.weight": (4, 16), "l2.bias": (4,)}
    for result in run_distributed(_unwrap, 2, args=(3,)):
        assert result["same_object"] and result["shapes_inside"] == full and result["shapes_still_full"]
        assert result["hooks_outside"] >= 1 and result["hooks_inside"] == 0
        assert result["inside_vs_outside"] == 0.0 and result["vs_reference"] < 1e-6
        # partitioned again (l2.bias is under the persistence threshold: whole, as before)
        assert result["shapes_after"] == {"l1.weight": (0,), "l1.bias": (0,), "l2.weight": (0,), "l2.bias": (4,)}
        assert result["hooks_after"] == result["hooks_outside"]
        assert result["after_steps"] < 1e-5
        assert "already active" in result["nested"], result["nested"]  # nesting refused, the outer block intact


def _trl_unwrap() -> dict:
    """TRL's own ``unwrap_model_for_generation`` (trl/models/utils.py, GRPO / RLOO / online DPO) under ZeRO-3, as
    its calls reach DeepSpeed's internals: inside ``GatheredParameters(engine.parameters())`` it clears each
    parameter's ``ds_active_sub_modules`` (the parameters of ``parameter_offload.module`` and its
    ``ds_external_parameters()``), removes every handle in ``parameter_offload.forward_hooks`` /
    ``backward_hooks`` and empties both lists; after generating it invalidates ``param_coordinator``'s trace and
    calls ``_register_deepspeed_module(parameter_offload.module)``."""
    import deepspeed

    rank = dist.get_rank()
    engine, ref, opt = _after_first_step(3, rank=rank)
    x = _batch(7)
    with torch.no_grad():
        outside = engine(x)
    l1 = engine.module.l1
    out = {"hooks_outside": len(l1._forward_pre_hooks)}
    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(engine.parameters()):
        root = offload.module
        params = [p for _, p in root.named_parameters(recurse=True)] + [p for _, p in root.ds_external_parameters()]
        for p in params:
            p.ds_active_sub_modules.clear()
        out["handles"] = (len(offload.forward_hooks), len(offload.backward_hooks))
        for hook in offload.forward_hooks:
            hook.remove()
        for hook in offload.backward_hooks:
            hook.remove()
        offload.forward_hooks = []
        offload.backward_hooks = []
        out["hooks_inside"] = len(l1._forward_pre_hooks) + len(engine.module._forward_pre_hooks)
        out["handles_inside"] = (len(offload.forward_hooks), len(offload.backward_hooks))
        with torch.no_grad():
            inside = [engine.module(x) for _ in range(3)]  # a generation loop on the unwrapped model
        coordinator = offload.param_coordinator
        out["trace_before"] = coordinator.is_invalid_trace()
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        out["trace_invalidated"] = coordinator.is_invalid_trace()
        offload._register_deepspeed_module(offload.module)
    out["inside_vs_outside"] = max((o - outside).abs().max().item() for o in inside)
    out["hooks_after"] = len(l1._forward_pre_hooks)
    out["handles_after"] = len(offload.forward_hooks)
    out["shapes_after"] = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    out["after_steps"] = _two_more_steps(engine, ref, opt, rank)
    engine.destroy()
    return out


def test_trls_hook_surgery_for_generation_under_zero3():
    for result in run_distributed(_trl_unwrap, 2):
        assert result["handles"] == (1, 0) and result["handles_inside"] == (0, 0) and result["handles_after"] == 1
        assert result["hooks_outside"] >= 1 and result["hooks_inside"] == 0
        assert result["hooks_after"] == result["hooks_outside"]
        assert result["inside_vs_outside"] == 0.0
        assert result["trace_before"] is False and result["trace_invalidated"] is True  # recorded by the step
        assert result["shapes_after"] == {"l1.weight": (0,), "l1.bias": (0,), "l2.weight": (0,), "l2.bias": (4,)}
        assert result["after_steps"] < 1e-5  # training goes on as the reference's


def test_unwrap_model_for_generation_outside_zero3_yields_the_model():
    unwrap = _ds("deepspeed.runtime.zero.stage3").unwrap_model_for_generation
    assert _ds("deepspeed.runtime.zero").unwrap_model_for_generation is unwrap  # DeepSpeed exports it there too
    engine = _engine(2)
    with unwrap(engine) as model:
        assert model is engine and tuple(model.module.l1.weight.shape) == (16, 8)
    plain = torch.nn.Linear(2, 2)
    with unwrap(plain) as model:
        assert model is plain


def _empty_partition_cache() -> dict:
    from hf_zero.zero.stage3 import ParamState, sharded_param_of

    rank = dist.get_rank()
    out = {}
    engine2 = _engine(2)
    engine2.empty_partition_cache()  # nothing partitioned: nothing to do
    engine2.destroy()
    engine, ref, opt = _after_first_step(3, rank=rank)
    sps = {n: sharded_param_of(p) for n, p in engine.module.named_parameters()}
    engine.stage3.gatherer.gather([sps["l1.weight"]], "left gathered by a test")  # as a prefetch might leave it
    out["before"] = {n: sp.state.name for n, sp in sps.items()}
    engine.empty_partition_cache()
    out["after"] = {n: sp.state.name for n, sp in sps.items()}
    out["numel_after"] = sum(p.numel() for p in engine.module.parameters())
    out["after_steps"] = _two_more_steps(engine, ref, opt, rank)
    out["persistent_again"] = sps["l2.bias"].persistent  # the next forward gathered it again, as at start-up
    engine.destroy()
    return out


def test_empty_partition_cache_partitions_what_is_left_gathered():
    """DeepSpeed's ``engine.empty_partition_cache()`` (its checkpoint tests call it before saving): ZeRO-3
    parameters left gathered go back to their shards, the persistent ones (l2.bias, under the threshold) too, as
    DeepSpeed releases all (DeepSpeed's TestZeroPartitionCache: every numel 0 after it); the next forward gathers
    the persistent ones again and training goes on as the reference's; at stage 2 it does nothing."""
    for result in run_distributed(_empty_partition_cache, 2):
        assert result["before"]["l1.weight"] == "AVAILABLE" and result["before"]["l2.bias"] == "AVAILABLE"
        assert result["after"] == {"l1.weight": "PARTITIONED", "l1.bias": "PARTITIONED",
                                   "l2.weight": "PARTITIONED", "l2.bias": "PARTITIONED"}
        assert result["numel_after"] == 0
        assert result["after_steps"] < 1e-5 and result["persistent_again"]


# ---- found by DeepSpeed's test_fp16: the untested-optimizer refusal's type, optimizer keys beside params -----------
class _SignSGD(torch.optim.Optimizer):
    """Not element-wise as far as hf_zero knows (a client class of the script's own)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.sign(), alpha=-group["lr"])


def test_untested_client_optimizer_is_refused_as_deepspeed_asserts_and_runs_when_allowed():
    from hf_zero.config.errors import ConfigError

    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "zero_optimization": {"stage": 2}}
    model = _Net()
    with pytest.raises(AssertionError) as info:  # DeepSpeed's type (its test_fp16 expects it) ...
        hf_zero.initialize(model=model, optimizer=_SignSGD(model.parameters()), config=config)
    assert isinstance(info.value, ConfigError)  # ... and hf_zero's, naming the key
    assert str(info.value).startswith("zero_allow_untested_optimizer: the client optimizer ")
    engine, *_ = hf_zero.initialize(model=model, optimizer=_SignSGD(model.parameters(), lr=0.5),
                                    config={**config, "zero_allow_untested_optimizer": True})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.backward(engine(torch.ones(1, 8)).sum())
    engine.step()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    assert moved["l1.weight"] == pytest.approx(0.5) and moved["l2.bias"] == pytest.approx(0.5)  # a sign step
    engine.destroy()


def test_optimizer_keys_deepspeed_ignores_beside_params_are_accepted_with_a_warning():
    import warnings

    from hf_zero.config import load_config
    from hf_zero.config.status import ConfigKeyIgnored

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "torch_adam": True,
                                                                "params": {"lr": 1e-3}}}, world_size=1, log=False)
    assert dict(cfg.optimizer.params) == {"lr": 1e-3}  # not moved into the params: DeepSpeed ignores it there too
    assert [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)] == [
        "hf_zero: config key optimizer.torch_adam has no effect in hf_zero: DeepSpeed reads torch_adam only inside "
        "optimizer.params and ignores it here"]
