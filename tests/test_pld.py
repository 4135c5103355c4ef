"""``progressive_layer_drop``: the keep probability each training forward receives, step by step, as DeepSpeed's
engine passes it (``progressive_layer_drop=True, pld_theta=...``; updated at every optimizer step with the step count
before the increment), nothing in eval mode, DeepSpeed's getters and class, and the section's checks."""

from __future__ import annotations

import math
import os

import pytest
import torch

import hf_zero
from hf_zero.config import load_config
from hf_zero.config.errors import ConfigError

THETA, GAMMA = 0.5, 0.1


class PLDNet(torch.nn.Module):
    """Records the keyword arguments of each forward; drops its second layer with probability 1 - pld_theta."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        self.seen: list = []

    def forward(self, x, progressive_layer_drop=False, pld_theta=1.0):
        self.seen.append((progressive_layer_drop, pld_theta))
        return self.b(torch.relu(self.a(x))).sum()


def _engine(model, pld: dict | None, gas: int = 2):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
    if pld is not None:
        config["progressive_layer_drop"] = pld
    return hf_zero.initialize(model=model, config=config)[0]


def _f(step: int) -> float:
    return (1 - THETA) * math.exp(-GAMMA * step) + THETA


def test_each_training_forward_gets_the_keep_probability_of_the_last_step():
    model = PLDNet()
    engine = _engine(model, {"enabled": True, "theta": THETA, "gamma": GAMMA})
    thetas = []
    for _ in range(3):  # 3 optimizer steps of 2 micro-steps
        for _ in range(2):
            engine.backward(engine(torch.ones(1, 4)))
            engine.step()
        thetas.append(engine.get_pld_theta())
    engine.eval()
    engine(torch.ones(1, 4))
    engine.destroy()
    # micro-steps 0-1 see 1.0; step 0's update gives f(0) = 1.0; step 1's f(1) for micro-steps 4-5
    assert model.seen[:6] == [(True, 1.0)] * 4 + [(True, pytest.approx(_f(1)))] * 2
    assert thetas == [pytest.approx(_f(0)), pytest.approx(_f(1)), pytest.approx(_f(2))]
    assert model.seen[6] == (False, 1.0)  # eval: the model's defaults
    assert (engine.pld_enabled(), engine.pld_theta(), engine.pld_gamma()) == (True, THETA, GAMMA)
    assert engine.pld_params() == {"theta": THETA, "gamma": GAMMA}


def test_without_the_section_nothing_is_passed():
    model = PLDNet()
    engine = _engine(model, None, gas=1)
    engine.backward(engine(torch.ones(1, 4)))
    engine.step()
    assert model.seen == [(False, 1.0)] and engine.get_pld_theta() is None and engine.pld_params() is False
    engine.destroy()


def test_deepspeeds_class_and_the_sections_checks():
    from deepspeed.runtime.progressive_layer_drop import ProgressiveLayerDrop  # hf_zero's compatibility layer

    pld = ProgressiveLayerDrop(theta=0.1, gamma=0.001)
    assert pld.get_theta() == 1.0
    for i in range(5):
        pld.update_state(i)
        assert pld.get_theta() == (1. - 0.1) * math.exp(-0.001 * i) + 0.1
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": pld.get_theta()}
    for bad, key in (({"enabled": True, "theta": 1.5}, "theta"), ({"enabled": True, "gamma": -1}, "gamma")):
        with pytest.raises(ConfigError) as info:
            load_config({"train_batch_size": 1, "progressive_layer_drop": bad}, world_size=1, log=False)
        assert info.value.key_path == f"progressive_layer_drop.{key}"
