"""Which device a process trains on, and how the engine and zero.Init put the model there -- the logic, on a CPU.

On a GPU machine these decide whether anything trains at all (tests/test_gpu_engine.py runs the real thing there);
here the CUDA queries are stood in for, and the "meta" device plays the GPU for placement: a tensor moved there
keeps its shape and dtype and holds no bytes, so every move is visible and nothing is computed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.comm import device as device_mod


class FakeCuda:
    """torch.cuda's device queries, for a machine with ``count`` GPUs whose current device is ``current``."""

    def __init__(self, monkeypatch, count: int, current: int = 0):
        self.count, self.current, self.set_to = count, current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set)

    def _set(self, index) -> None:
        self.set_to.append(int(index))
        self.current = int(index)


@pytest.fixture
def env(monkeypatch):
    for k in ("LOCAL_RANK", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_no_gpu_means_the_cpu(env):
    FakeCuda(env, 0)
    assert device_mod.local_device() == torch.device("cpu")
    assert device_mod.accelerator_type() == "cpu"


@pytest.mark.parametrize("local_rank,count,current,expected", [
    (None, 1, 0, 0),   # a plain `python train.py` on a GPU machine
    ("1", 2, 0, 1),    # torchrun's second rank on a 2-GPU node: cuda:LOCAL_RANK
    ("3", 1, 0, 0),    # a launcher that hands each rank one GPU through CUDA_VISIBLE_DEVICES
    ("0", 4, 2, 2),    # the script called torch.cuda.set_device(2) before initialize: its choice stands
])
def test_cuda_local_rank_rule(env, local_rank, count, current, expected):
    cuda = FakeCuda(env, count, current)
    if local_rank is not None:
        env.setenv("LOCAL_RANK", local_rank)
    assert device_mod.local_device() == torch.device("cuda", expected)
    assert cuda.set_to == [expected], "the chosen GPU is made current (NCCL and the kernels allocate there)"


def test_a_local_rank_without_a_gpu_is_an_error_naming_both(env):
    FakeCuda(env, 2)
    env.setenv("LOCAL_RANK", "5")
    env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=5 but this process sees 2 GPUs.*CUDA_VISIBLE_DEVICES=0,1"):
        device_mod.local_device()


def test_ds_accelerator_cpu_trains_on_the_cpu_beside_a_gpu(env):
    from hf_zero.comm.process_group import default_backend

    cuda = FakeCuda(env, 8)
    env.setenv("DS_ACCELERATOR", "cpu")
    assert device_mod.local_device() == torch.device("cpu") and cuda.set_to == []
    assert default_backend() == "gloo"
    env.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        device_mod.accelerator_type()


def test_nccl_is_initialized_with_gloo_beside_it(env):
    """hf_zero's bookkeeping collectives are CPU tensors: an NCCL process group must carry gloo for them."""
    from hf_zero.comm import process_group

    assert process_group.NCCL_WITH_GLOO == "cuda:nccl,cpu:gloo"


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 11, bias=False))
    m[2].weight = m[0].weight  # tied: one Parameter registered twice
    m.register_buffer("table", torch.arange(5.0))
    return m


# The moves themselves (CPU -> CUDA keeps each Parameter object, as nn.Module.to does) are checked on the GPU:
# tests/test_gpu_engine.py asserts every parameter, buffer, shard, gradient, master and optimizer state is on the
# GPU after initialize. A CPU has no second device to move to (the meta device refuses `.data` rebinding), so these
# check what must stay put.
def test_place_module_on_the_device_it_is_on_moves_nothing():
    from hf_zero.zero.placement import place_module

    m = _model()
    before = [(id(p), p.data_ptr()) for p in m.parameters()] + [(id(b), b.data_ptr()) for b in m.buffers()]
    assert place_module(m, torch.device("cpu")) == 0
    after = [(id(p), p.data_ptr()) for p in m.parameters()] + [(id(b), b.data_ptr()) for b in m.buffers()]
    assert after == before and m[2].weight is m[0].weight


def test_offloaded_zero3_parameters_stay_in_host_memory():
    """offload_param: the engine leaves zero.Init's host shards where they are, and a parameter not yet partitioned
    on the host, so that its shards are cut there (params_on_host)."""
    from hf_zero.zero.placement import place_module
    from hf_zero.zero.stage3.param import ParamState, ShardedParam, sharded_param_of

    m = nn.Linear(8, 3)
    full = m.weight.detach().clone()
    sp = ShardedParam(m.weight, "weight", rank=1, world_size=2)  # rank 1 of 2: elements 12..23
    assert sp.state is ParamState.PARTITIONED and m.weight.numel() == 0
    storage = sp.storage
    bias = m.bias.data_ptr()
    assert place_module(m, torch.device("cpu"), params_on_host=True) == 0
    assert sharded_param_of(m.weight) is sp and sp.storage is storage and m.bias.data_ptr() == bias
    assert torch.equal(sp.shard_values(), full.reshape(-1)[12:24])


@pytest.mark.parametrize("remote,section,expect_local", [
    (None, None, True), ("none", None, True), (None, {"device": "none"}, True),
    ("cpu", None, False), (None, {"device": "cpu"}, False), (None, {"device": "nvme", "nvme_path": "/x"}, False),
    ("none", {"device": "cpu"}, True),  # remote_device given wins over the config (DeepSpeed's rule)
])
def test_zero_init_puts_shards_on_the_training_device_unless_offloaded(monkeypatch, remote, section, expect_local):
    from hf_zero.zero import init

    monkeypatch.setattr("hf_zero.comm.device.local_device", lambda: torch.device("meta"))
    raw = {"zero_optimization": {"stage": 3, **({"offload_param": section} if section else {})}}
    got = init.shard_device(raw, remote)
    assert got == (torch.device("meta") if expect_local else torch.device("cpu"))


def test_the_loss_is_read_once_per_print_not_per_backward():
    """engine.backward keeps the loss as a tensor: on a GPU a float() per micro-step is a host synchronisation."""
    from hf_zero.runtime.backward import BackwardSessions

    s = BackwardSessions(begin=lambda: None, end=lambda: None, gas=lambda: 1, loss_scale=lambda: None,
                         timers=lambda: None)
    loss = torch.tensor(2.5, requires_grad=True) * 1.0
    s.last_loss = loss
    assert isinstance(s._last_loss, torch.Tensor) and not s._last_loss.requires_grad
    assert s.last_loss == 2.5 and s._last_loss == 2.5  # converted on the first read, kept as a float
    s.last_loss = None
    assert s.last_loss is None
