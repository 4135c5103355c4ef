"""``initialize`` paths DeepSpeed scripts take, on 2 ranks: a client optimizer beside an ``optimizer`` section (the
client's is used, the section is named in a warning), ``mpu=`` meaning plain data parallelism (accepted) or a split
model (refused, pointing at tensor parallelism), and no optimizer at all (an evaluation engine: ZeRO-3 partitioned
forward with the same loss as the unsharded model; backward and step refused)."""

import warnings

import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.config.status import ConfigKeyIgnored
from hf_zero.testing import run_distributed

from _parity import GAS, base_config, clone_state, make_data, make_model


class _Mpu:
    """Megatron's parallel-state interface, as DeepSpeed reads it."""

    def __init__(self, tp: int):
        self.tp = tp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_data_parallel_group(self):
        return dist.group.WORLD


def _train(engine, steps: int = 2):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_data(world, steps)
    losses = []
    for s in range(steps):
        for m in range(GAS):
            loss = nn.functional.mse_loss(engine(x[s, m, rank]), y[s, m, rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, clone_state(engine)


def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)


def _cases():
    out = {}
    # client optimizer + optimizer section: the client's SGD is used, as with no section at all
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, opt, *_ = hf_zero.initialize(model=model, optimizer=_sgd(model), config=base_config(1))
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)]
    out["inner"] = type(opt.inner).__name__
    out["both"] = _train(engine)
    engine.destroy()
    cfg = base_config(1)
    del cfg["optimizer"]
    model = make_model()
    engine, *_ = hf_zero.initialize(model=model, optimizer=_sgd(model), config=cfg)
    out["client_only"] = _train(engine)
    engine.destroy()
    # mpu: data parallelism only -> same training as without it; a split model -> refused
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(2), mpu=_Mpu(tp=1))
    out["mpu"] = _train(engine)
    engine.destroy()
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(2))
    out["no_mpu"] = _train(engine)
    engine.destroy()
    try:
        hf_zero.initialize(model=make_model(), config=base_config(2), mpu=_Mpu(tp=2))
    except ValueError as e:
        out["mpu_error"] = str(e)
    # torch_autocast: the forward runs under torch.autocast (default dtype: the device's), parameters stay fp32;
    # float16 brings dynamic loss scaling; enabled false changes nothing
    x = make_data(2, 1)[0][0, 0, dist.get_rank()]
    reference = make_model()
    for name, section in {"bf16": {"enabled": True}, "fp16": {"enabled": True, "dtype": "float16"},
                          "off": {"enabled": False, "dtype": "bfloat16"}}.items():
        engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(2, torch_autocast=section))
        with torch.no_grad():
            got = engine(x)
            with torch.autocast("cpu", dtype=torch.float16 if name == "fp16" else torch.bfloat16,
                                enabled=name != "off"):
                want = reference(x)
        out[f"autocast_{name}"] = (got.dtype, torch.equal(got, want), engine.loss_scaler is not None,
                                   {p.dtype for p in engine.module.parameters()}, _train(engine, steps=1)[0])
        engine.destroy()
    return out


def test_client_optimizer_beside_section_and_mpu():
    for rank, r in enumerate(run_distributed(_cases, 2)):
        assert r["inner"] == "SGD"
        if rank == 0:
            assert len(r["warnings"]) == 1 and '"optimizer" section' in r["warnings"][0]
            assert "SGD" in r["warnings"][0]
        assert r["both"][0] == r["client_only"][0]
        for name, t in r["client_only"][1].items():
            assert torch.equal(r["both"][1][name], t), name
        assert r["mpu"][0] == r["no_mpu"][0]
        assert "tensor parallel size 2" in r["mpu_error"] and "apply_tp" in r["mpu_error"]
        assert r["autocast_bf16"][:4] == (torch.bfloat16, True, False, {torch.float32})
        assert r["autocast_fp16"][:4] == (torch.float16, True, True, {torch.float32})
        assert r["autocast_off"][:4] == (torch.float32, True, False, {torch.float32})
        assert r["autocast_bf16"][4] != r["autocast_off"][4]  # the training losses do differ


def _evaluation_engine():
    rank = dist.get_rank()
    reference = make_model()
    cfg = base_config(3)
    del cfg["optimizer"]
    engine, opt, _, sched = hf_zero.initialize(model=make_model(), config=cfg)
    x, _ = make_data(2, 1)
    with torch.no_grad():
        got = engine(x[0, 0, rank])
        want = reference(x[0, 0, rank])
    partitioned = engine.module[0].weight.numel()  # outside forward: this rank's placeholder only
    try:
        engine.backward(engine(x[0, 0, rank]).sum())
    except RuntimeError as e:
        error = str(e)
    return {"optimizer": opt, "scheduler": sched, "max_diff": (got - want).abs().max().item(),
            "partitioned": partitioned, "error": error}


def test_initialize_without_optimizer_builds_a_zero3_evaluation_engine():
    for r in run_distributed(_evaluation_engine, 2):
        assert r["optimizer"] is None and r["scheduler"] is None
        assert r["max_diff"] == 0.0
        assert r["partitioned"] == 0
        assert "no optimizer" in r["error"] and "evaluation" in r["error"]
