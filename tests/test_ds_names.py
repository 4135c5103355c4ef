"""DeepSpeed names scripts import, reached through ``import deepspeed`` (hf_zero's compatibility layer), one test
per name: each must do what DeepSpeed's does, not merely exist."""

from __future__ import annotations

import os
import random

import numpy

import pytest
import torch

from _shim_util import ds as _ds


def test_set_random_seed_seeds_python_numpy_and_torch():
    set_random_seed = _ds("deepspeed.runtime.utils").set_random_seed
    set_random_seed(1234)
    first = (random.random(), numpy.random.rand(), torch.rand(1).item())
    random.random(), numpy.random.rand(), torch.rand(1)  # move every generator on
    set_random_seed(1234)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == first
    set_random_seed(1235)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) != first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU accelerator's answers")
def test_accelerator_interface_on_cpu(monkeypatch):
    acc = _ds("deepspeed.accelerator").get_accelerator()
    monkeypatch.setenv("LOCAL_RANK", "1")
    acc.set_device(1)  # nothing to select on CPU, and no error (scripts call it unconditionally)
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name(), acc.current_device()) == \
        ("cpu", "cpu", "cpu", 1)
    assert acc.device(0) == torch.device("cpu") and acc.is_available()
    # DeepSpeed's CPU accelerator counts LOCAL_SIZE devices when the launcher sets it, else NUMA nodes with cores
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    nodes = acc.device_count()
    sysfs = "/sys/devices/system/node"
    assert 1 <= nodes <= (len([n for n in os.listdir(sysfs) if n.startswith("node")]) if os.path.isdir(sysfs) else 1)
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert acc.device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "0")
    assert acc.device_count() == nodes
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    assert torch.bfloat16 in acc.supported_dtypes()
    assert acc.is_synchronized_device() and acc.use_host_timers()
    assert acc.on_accelerator(torch.zeros(1)) and acc.pin_memory(t := torch.zeros(2)) is t
    assert acc.Stream is None and acc.Event is None and acc.current_stream() is None
    with acc.stream(None):
        pass
    acc.range_push("x")
    acc.range_pop()
    acc.synchronize()
    acc.empty_cache()
    called = []
    acc.lazy_call(lambda: called.append(1))
    assert called == [1]

    acc.manual_seed_all(7)
    state = acc.get_rng_state()
    a = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), a) and acc.initial_seed() == 7

    total, available = acc.total_memory(), acc.available_memory()
    assert 0 < available <= total


@pytest.fixture
def no_host_cache():
    """The host cache (hf_zero/ops/host_cache.py), which an engine built earlier in this process may have turned
    on, keeps freed large blocks mapped; this test is about what torch hands back without it."""
    from hf_zero.ops import host_cache

    before = host_cache.stats()
    host_cache.disable()
    yield
    if before.caching:
        host_cache.enable(before.min_bytes, before.cap_bytes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU accelerator's answers")
def test_accelerator_memory_counts_host_bytes(no_host_cache):
    """On CPU the memory queries are this process's resident bytes, and the peak sees a freed allocation."""
    acc = _ds("deepspeed.accelerator").get_accelerator()
    nbytes = 128 * 2**20
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    assert acc.max_memory_allocated() - before < nbytes // 4  # the reset started a new peak near the current RSS
    block = torch.ones(nbytes // 4, dtype=torch.float32)  # written: the pages are resident
    during = acc.memory_allocated()
    assert during - before >= 0.9 * nbytes
    assert acc.memory_reserved() >= during - nbytes // 8
    del block
    after = acc.memory_allocated()
    assert during - after >= 0.9 * nbytes  # torch hands large blocks back to the OS
    # the peak still holds the freed block until reset_peak_memory_stats
    assert acc.max_memory_allocated() - before >= 0.9 * nbytes
    assert acc.memory_stats()["allocated_bytes.all.peak"] == acc.max_memory_allocated()
    acc.reset_max_memory_allocated()
    assert acc.max_memory_allocated() - after < nbytes // 4


def test_repeating_loader_restarts_and_reshuffles_per_pass():
    RepeatingLoader = _ds("deepspeed.utils").RepeatingLoader
    data = torch.arange(5.0)
    loader = RepeatingLoader(torch.utils.data.DataLoader(data, batch_size=2))
    batches = [next(loader).tolist() for _ in range(7)]
    assert batches == [[0.0, 1.0], [2.0, 3.0], [4.0], [0.0, 1.0], [2.0, 3.0], [4.0], [0.0, 1.0]]
    assert iter(loader) is loader
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = RepeatingLoader(torch.utils.data.DataLoader(data, batch_size=5, sampler=sampler))
    first, second = next(loader), next(loader)
    assert sampler.epoch == 1  # each pass is a new epoch: a distributed sampler reshuffles
    assert sorted(first.tolist()) == sorted(second.tolist()) == data.tolist()
    assert first.tolist() != second.tolist()


def test_move_to_device_moves_nested_tensors_like_deepspeed():
    """deepspeed.runtime.utils.move_to_device (accelerate's Ulysses path imports it): containers rebuilt, a tensor
    meeting the criterion moved in place (the same object, its .data rebound), every other tensor returned as .to()
    -- DeepSpeed 0.19.8's behaviour, run beside it on these inputs."""
    from deepspeed.runtime.utils import move_to_device

    a, b = torch.ones(2), torch.zeros(3, dtype=torch.float64)
    out = move_to_device({"x": [a, (b,)], "y": a}, "cpu")
    assert isinstance(out["x"], list) and isinstance(out["x"][1], tuple)
    assert torch.equal(out["x"][0], a) and out["x"][1][0].dtype == torch.float64
    kept = move_to_device([a, b], "cpu", criterion_func=lambda t: torch.is_tensor(t) and t.numel() == 2)
    assert kept[0] is a and torch.equal(kept[1], b)  # moved in place: the caller's own tensor comes back
    meta = move_to_device((a, {"b": b}), torch.device("meta"))  # no criterion: copies on the target
    assert meta[0] is not a and meta[0].device.type == "meta" and meta[1]["b"].device.type == "meta"
    assert a.device.type == "cpu" and b.device.type == "cpu"
