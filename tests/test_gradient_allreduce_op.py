"""``gradient_allreduce_op`` (DeepSpeed 0.19.8): "mean" (the default) averages the data-parallel gradients, "sum"
adds them, at ZeRO stages 0-2; "sum" is refused at stage 3 and with ZenFlow, an unknown op always -- as DeepSpeed
does. 2 CPU ranks, each with its own batch: after one SGD step (no clipping) the weights moved by lr times the sum of
the two ranks' gradients, or their mean."""

import pytest
import torch
import torch.distributed as dist

import hf_zero
from hf_zero.config.errors import ConfigError
from hf_zero.config.loader import load_config
from hf_zero.testing import run_distributed

LR = 0.1


def _step(stage: int, op: str | None) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "steps_per_print": 1000}
    if op is not None:
        cfg["gradient_allreduce_op"] = op
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.arange(8.0).reshape(2, 4) * (rank + 1)  # rank 1's batch is twice rank 0's
    engine.backward(engine(x).sum())
    engine.step()
    out = [(b - p.detach()) / LR for p, b in zip(model.parameters(), before)]  # the gradient the step applied
    engine.destroy()
    return {"weight": out[0], "bias": out[1]}


def _runs():
    return {(stage, op): _step(stage, op) for stage in (0, 1, 2) for op in (None, "mean", "SUM")}


def test_sum_adds_and_mean_averages_the_ranks_gradients():
    # d/dW of sum(W x + b) over the batch: the column sums of x, for every output row; d/db: the batch size
    x0 = torch.arange(8.0).reshape(2, 4)
    total = x0.sum(0) * (1 + 2)  # rank 0's batch and rank 1's (twice as large)
    for out in run_distributed(_runs, 2):
        for stage in (0, 1, 2):
            for op, factor in ((None, 0.5), ("mean", 0.5), ("SUM", 1.0)):
                got = out[(stage, op)]
                torch.testing.assert_close(got["weight"], (factor * total).expand(3, 4), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got["bias"], torch.full((3,), factor * 4.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg,message", [
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op: 'max' is not supported; use 'mean' or 'sum'"),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
     "gradient_allreduce_op: 'sum' is not supported with ZeRO stage 3"),
])
def test_refused_as_deepspeed_refuses(cfg, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 2, **cfg}, world_size=1)
    assert message in str(err.value)
