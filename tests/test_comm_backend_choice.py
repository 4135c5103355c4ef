"""Which backend and device a collective meets, decided on the CPU for the GPU's sake (issue #23): hf_zero's NCCL
groups are "cuda:nccl,cpu:gloo", and a decision that reads "gloo" anywhere in that string sends every ZeRO
collective of CUDA tensors through host copies; torch's DeviceMesh, built before CUDA is initialised, calls
set_device(LOCAL_RANK) and moves rank 1 of two ranks sharing one GPU to a device that does not exist.

The group strings are those torch reports (``dist.get_backend_config``), substituted where this CPU build has no
NCCL; a CUDA tensor stands in as an object with a CUDA ``device`` (only the device type is read)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from hf_zero.comm import collectives
from hf_zero.comm.process_group import backend_for, bookkeeping_device
from hf_zero.testing import run_distributed

CUDA = types.SimpleNamespace(device=torch.device("cuda", 0))
CPU = torch.empty(2, 3)


def _gloo_world_one():
    """The real strings of a gloo default group and of a "cpu:gloo,cuda:gloo" group."""
    return {"default": (dist.get_backend(), dist.get_backend_config(), backend_for("cpu"), backend_for("cuda"),
                        str(bookkeeping_device())),
            "by_rows": collectives._by_rows(CPU, None), "gloo_on_gpu": collectives._gloo_on_gpu(CUDA, None)}


def test_a_gloo_group_serves_both_devices_with_gloo():
    (res,) = run_distributed(_gloo_world_one, 1)
    assert res["default"] == ("gloo", "cpu:gloo,cuda:gloo", "gloo", "gloo", "cpu")
    # CPU tensors by rows (gloo's bulk collectives copy), CUDA tensors through host memory (gloo has no CUDA reduce)
    assert res["by_rows"] is True and res["gloo_on_gpu"] is True


@pytest.mark.parametrize("config, cpu, cuda, bookkeeping", [
    ("cuda:nccl,cpu:gloo", "gloo", "nccl", "cpu"),   # hf_zero's own NCCL groups (process_group.NCCL_WITH_GLOO)
    ("cpu:gloo,cuda:nccl", "gloo", "nccl", "cpu"),
    ("cuda:nccl", "", "nccl", "cuda"),               # a plain NCCL group the application created
    ("nccl", "nccl", "nccl", "cuda"),                # a bare name serves every device
])
def test_the_backend_of_each_device_is_read_from_the_group_config(monkeypatch, config, cpu, cuda, bookkeeping):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert (backend_for("cpu"), backend_for("cuda")) == (cpu, cuda)
    assert bookkeeping_device().type == bookkeeping
    # the bulk collectives of CUDA tensors on an NCCL-served group go to NCCL itself, not through host copies
    assert collectives._gloo_on_gpu(CUDA, None) is False
    assert collectives._by_rows(CPU, None) is (cpu == "gloo")


def test_a_group_without_a_registered_config_falls_back_to_its_backend_name(monkeypatch):
    def missing(group=None):
        raise ValueError("no config")

    monkeypatch.setattr(dist, "get_backend_config", missing)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert backend_for("cuda") == "gloo" and backend_for("cpu") == "gloo"


def _mesh_calls():
    from hf_zero.parallel import ParallelDims, dims

    calls = []
    dims.local_device = lambda: calls.append("local_device") or torch.device("cuda", 0)

    class FakeMesh:
        def __init__(self, device_type, *a, **k):
            calls.append(("DeviceMesh", device_type))

        @staticmethod
        def from_group(groups, device_type, **k):
            calls.append(("from_group", device_type))

    dims.DeviceMesh = FakeMesh
    ParallelDims(dp=1).build_mesh(device_type="cuda")
    ParallelDims(dp=1).build_mesh(device_type="cuda", share_world_group=False)
    dims.mesh_from_groups(None, None, device_type="cuda")
    ParallelDims(dp=1).build_mesh(device_type="cpu")  # a CPU mesh touches no GPU
    return calls


def test_the_mesh_is_built_after_this_process_chose_its_gpu():
    """torch's DeviceMesh picks cuda:LOCAL_RANK itself when CUDA is not initialised yet; hf_zero's device rule
    (comm.device.local_device) must have run before, on every path that builds a CUDA mesh."""
    (calls,) = run_distributed(_mesh_calls, 1)
    assert calls == ["local_device", ("DeviceMesh", "cuda"), "local_device", ("DeviceMesh", "cuda"),
                     "local_device", ("from_group", "cuda"), ("DeviceMesh", "cpu")]
