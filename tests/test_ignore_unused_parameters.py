"""``zero_optimization.ignore_unused_parameters: false``: a trainable parameter without a gradient in an accumulation
window is an error at the step, where DeepSpeed checks it -- offload_optimizer at stages 1-2.

DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``, 1 rank, ZeRO-2 + offload_optimizer cpu, a module with an unused
``nn.Linear``): ``engine.step()`` raises ``AssertionError: This assert indicates that your module has parameters
that were not used in producing loss`` (its per-parameter norm of the offloaded gradients). Without offload it
steps: its other paths never read the key.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hf_zero
from hf_zero.config import load_config
from hf_zero.config.status import ConfigKeyIgnored
from hf_zero.testing import run_distributed


class _Branches(nn.Module):
    """``a`` always used; ``b`` on the ranks and micro-steps ``use_b(rank, micro_step)`` says; ``never`` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        y = self.a(x)
        return (self.b(y) if use_b else y).pow(2).mean()


def _config(stage: int, offload: bool, gas: int = 1) -> dict:
    zero = {"stage": stage, "ignore_unused_parameters": False}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}


def _run(stage: int, offload: bool, gas: int, use_b: str, freeze_never: bool) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _Branches()
    if freeze_never:
        model.never.requires_grad_(False)
    engine, *_ = hf_zero.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                    config=_config(stage, offload, gas))
    before = [p.detach().clone() for p in engine.module.parameters()]
    g = torch.Generator().manual_seed(rank)
    out = {"error": None, "steps": 0}
    try:
        for micro in range(2 * gas):
            b = {"all": True, "rank0": rank == 0, "first_micro": micro % gas == 0}[use_b]
            engine.backward(engine(torch.randn(2, 4, generator=g), use_b=b))
            engine.step()
            out["steps"] = engine.global_steps
    except RuntimeError as err:
        out["error"] = str(err)
        out["assertion"] = isinstance(err, AssertionError)  # DeepSpeed raises AssertionError; scripts catch it
    out["moved"] = [not torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters())]
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_unused_parameters_fail_the_step_on_every_rank_naming_them(stage):
    for out in run_distributed(_run, 2, args=(stage, True, 1, "rank0", False)):
        assert out["steps"] == 0 and out["error"] is not None and out["assertion"]
        assert "ignore_unused_parameters is false and 4 trainable parameter(s)" in out["error"]
        assert "b.weight (1 of 2 ranks)" in out["error"] and "never.bias (2 of 2 ranks)" in out["error"]
        assert "a.weight" not in out["error"]
        assert not any(out["moved"])  # nothing was stepped


def test_a_parameter_used_once_per_window_or_frozen_passes():
    # b used in the first micro-step of each window of 2 only; the never-used layer frozen: every trainable
    # parameter had a gradient in each window
    for out in run_distributed(_run, 2, args=(2, True, 2, "first_micro", True)):
        assert out["error"] is None and out["steps"] == 2
        assert out["moved"] == [True, True, True, True, False, False]


def test_without_offload_the_key_changes_nothing_and_says_so():
    for out in run_distributed(_run, 1, args=(2, False, 1, "all", False)):
        assert out["error"] is None and out["steps"] == 2  # DeepSpeed steps too: it reads the key only with offload
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(_config(2, False), world_size=1)
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)]
    assert any("ignore_unused_parameters" in m and "only with offload_optimizer" in m for m in said), said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(_config(2, True), world_size=1)
    assert not [w for w in caught if "ignore_unused_parameters" in str(w.message)]
