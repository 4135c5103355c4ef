"""``deepspeed.checkpointing`` (hf_zero/runtime/activation_checkpointing.py): Megatron-DeepSpeed's activation
checkpointing API. Gradients through a checkpointed region must equal those of the same run without checkpointing,
dropout and autocast included; the options change where the kept inputs live, never the numbers."""

from __future__ import annotations

import importlib
import json
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero.runtime.activation_checkpointing as ckpt
from hf_zero.config import ConfigError, load_config
from hf_zero.config.status import ConfigKeyIgnored
from hf_zero.integrations.deepspeed_shim._finder import install
from hf_zero.runtime.rng_tracker import MODEL_PARALLEL_RNG
from hf_zero.testing import run_distributed

install()  # as the start-up .pth line does in an installed hf_zero

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
CHECKPOINTS = {"checkpoint": ckpt.checkpoint, "non_reentrant_checkpoint": ckpt.non_reentrant_checkpoint}


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts unconfigured, with an empty tracker, and leaves it so."""
    def clear():
        ckpt._STATE.__init__()
        ckpt.get_cuda_rng_tracker().reset()
        ckpt._warned.clear()
    clear()
    yield
    clear()


class Block(nn.Module):
    """Linear -> dropout -> GELU -> Linear, plus a dropout drawn from the tracker's model-parallel stream."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        h = nn.functional.gelu(nn.functional.dropout(self.up(x), 0.3))
        with ckpt.get_cuda_rng_tracker().fork():
            h = nn.functional.dropout(h, 0.2)
        return self.down(h)


def _grads(model: nn.Module, x: torch.Tensor, wrap, seed: int = 7):
    """(output, every parameter's and the input's gradient) for a three-block stack, each block through ``wrap``."""
    torch.manual_seed(seed)
    ckpt.get_cuda_rng_tracker().reset()
    ckpt.get_cuda_rng_tracker().add(MODEL_PARALLEL_RNG, seed + 1)
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    h = x
    for block in model:
        h = wrap(block, h)
    h.float().pow(2).sum().backward()
    return h.detach(), [p.grad for p in model.parameters()] + [x.grad]


def _stack(device: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block()).to(device), torch.randn(8, 16, device=device)


# ---- names --------------------------------------------------------------------------------------------------------

def test_deepspeed_names_are_hf_zeros_module():
    import deepspeed

    by_path = importlib.import_module("deepspeed.runtime.activation_checkpointing.checkpointing")
    assert deepspeed.checkpointing is by_path is ckpt
    for name in ("configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint", "CheckpointFunction",
                 "model_parallel_cuda_manual_seed", "get_cuda_rng_tracker", "CudaRNGStatesTracker"):
        assert callable(getattr(deepspeed.checkpointing, name)), name


# ---- gradients ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cpu_checkpointing", [False, True])
@pytest.mark.parametrize("which", sorted(CHECKPOINTS))
def test_gradients_equal_a_run_without_checkpointing(device, cpu_checkpointing, which):
    model, x = _stack(device)
    out_ref, grads_ref = _grads(model, x, lambda block, h: block(h))
    ckpt.configure(None, checkpoint_in_cpu=cpu_checkpointing)
    out, grads = _grads(model, x, lambda block, h: CHECKPOINTS[which](block, h))
    assert torch.equal(out, out_ref)  # same dropout masks in the first run ...
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # ... and in the recomputation


def test_recomputation_restores_the_generators_and_leaves_them_where_backward_found_them():
    model, x = _stack("cpu")
    _grads(model, x, ckpt.checkpoint)
    after_backward = (torch.get_rng_state(), ckpt.get_cuda_rng_tracker().get_states()[MODEL_PARALLEL_RNG])
    # A run without checkpointing draws the same numbers, so the generators end in the same states.
    _grads(model, x, lambda block, h: block(h))
    assert torch.equal(torch.get_rng_state(), after_backward[0])
    assert torch.equal(ckpt.get_cuda_rng_tracker().get_states()[MODEL_PARALLEL_RNG], after_backward[1])


@pytest.mark.parametrize("which", sorted(CHECKPOINTS))
def test_autocast_region_is_recomputed_under_autocast(which):
    """The recomputation runs under the forward's autocast state, so the gradients are the ones autocast gives
    without checkpointing (DeepSpeed 0.19.8 recomputes in fp32 and differs)."""
    model, x = _stack("cpu")

    def under_autocast(wrap):
        def run(block, h):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return wrap(block, h)
        return run

    out_ref, grads_ref = _grads(model, x, under_autocast(lambda block, h: block(h)))
    out, grads = _grads(model, x, under_autocast(CHECKPOINTS[which]))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, out_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_outputs_keywords_and_non_tensors():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    index = torch.tensor([1, 0])
    out = ckpt.checkpoint(lambda t, idx, scale=1.0: (lin(t) * scale, idx + 1, "tag"), x, index, scale=torch.tensor(2.0))
    assert isinstance(out, tuple) and len(out) == 3
    assert out[2] == "tag" and torch.equal(out[1], index + 1) and not out[1].requires_grad
    out[0].sum().backward()
    torch.testing.assert_close(x.grad, 2 * lin.weight.sum(0).expand(2, 4))
    single = ckpt.checkpoint(lambda t: (lin(t),), x)
    assert torch.is_tensor(single)  # a one-element result comes back as the element, as in DeepSpeed


def test_no_grad_runs_the_function_once_and_keeps_nothing():
    calls = []
    lin = nn.Linear(4, 4)

    def f(t):
        calls.append(1)
        return lin(t)

    with torch.no_grad():
        out = ckpt.checkpoint(f, torch.randn(2, 4))
    assert calls == [1] and out.grad_fn is None


def test_non_reentrant_works_when_no_input_requires_grad():
    lin = nn.Linear(4, 4)
    ckpt.non_reentrant_checkpoint(lin, torch.randn(2, 4)).sum().backward()
    assert lin.weight.grad is not None


# ---- the RNG tracker ----------------------------------------------------------------------------------------------

def test_tracker_fork_draws_from_its_own_stream_and_restores_the_default_one():
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("tp", 123)
    torch.manual_seed(5)
    default_first = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork("tp"):
        forked = torch.rand(3)
    assert torch.equal(torch.rand(3), default_first)  # the default stream did not move
    torch.manual_seed(123)
    assert torch.equal(forked, torch.rand(3))  # the stream started from its own seed
    with tracker.fork("tp"):
        second = torch.rand(3)
    assert torch.equal(second, torch.rand(3))  # and advanced: the second fork continues where the first stopped


def test_tracker_get_and_set_states_replay_a_stream():
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("tp", 11)
    saved = tracker.get_states()
    with tracker.fork("tp"):
        first = torch.rand(4)
    assert not torch.equal(saved["tp"], tracker.get_states()["tp"])  # get_states is a copy, not a live view
    tracker.set_states(saved)
    with tracker.fork("tp"):
        assert torch.equal(torch.rand(4), first)


def test_tracker_refuses_reused_seeds_and_names_and_unknown_streams():
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="no stream named 'c'"):
        with tracker.fork("c"):
            pass
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("a", 1)  # a reset tracker takes the seed again


class FakeMpu:
    """Megatron's parallel-state interface for ``tp_size`` ranks over the default group."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1):
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def get_tensor_model_parallel_rank(self):
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self):
        return self.tp_size

    def get_tensor_model_parallel_group(self):
        return dist.group.WORLD if dist.is_initialized() else None

    def get_data_parallel_rank(self):
        return 0


def test_model_parallel_cuda_manual_seed_seeds_default_and_model_parallel_streams():
    ckpt.configure(FakeMpu(tp_rank=1, tp_size=2))
    ckpt.model_parallel_cuda_manual_seed(1000)
    default = torch.rand(3)
    with ckpt.get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(3)
    torch.manual_seed(1000)
    assert torch.equal(default, torch.rand(3))
    torch.manual_seed(1000 + 2718 + 1)  # DeepSpeed's and Megatron's offset, plus the tensor-parallel rank
    assert torch.equal(model_parallel, torch.rand(3))


# ---- options ------------------------------------------------------------------------------------------------------

def _saved_by_region(which_device: str, cpu_checkpointing: bool) -> list[torch.Tensor]:
    """The tensors autograd keeps for one reentrant region (they go through the saved-tensor hooks)."""
    ckpt.configure(None, checkpoint_in_cpu=cpu_checkpointing)
    lin = nn.Linear(16, 16).to(which_device)
    x = torch.randn(8, 16, device=which_device, requires_grad=True)
    h = x * 2  # a non-leaf activation, as between transformer layers
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        before = len(saved)
        out = ckpt.checkpoint(lambda t: nn.functional.gelu(lin(t)), h)
        region = saved[before:]
    out.sum().backward()
    assert x.grad is not None
    return region


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_checkpointing_keeps_the_region_input_in_cpu_memory(device):
    region = _saved_by_region(device, cpu_checkpointing=True)
    assert [tuple(t.shape) for t in region] == [(8, 16)]  # only the input is kept, no activation inside
    assert region[0].device.type == "cpu"
    if device == "cuda":  # without the option the input stays on the GPU
        assert _saved_by_region(device, cpu_checkpointing=False)[0].device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cpu_checkpointing_frees_the_device_input_of_a_non_reentrant_region():
    ckpt.configure(None, checkpoint_in_cpu=True)
    lin = nn.Linear(1024, 1024).cuda()
    h = torch.randn(4096, 1024, device="cuda", requires_grad=True) * 2
    nbytes = h.numel() * h.element_size()
    out = ckpt.non_reentrant_checkpoint(lambda t: nn.functional.gelu(lin(t)), h)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    del h
    assert before - torch.cuda.memory_allocated() >= nbytes  # nothing on the GPU held it: the copy is on the CPU
    out.sum().backward()


def test_profile_logs_forward_and_backward_times_like_deepspeed(caplog):
    ckpt.configure(None, profile=True)
    lin = nn.Linear(4, 4)
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        ckpt.checkpoint(lin, torch.randn(2, 4, requires_grad=True)).sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time (ms)")]
    assert len(lines) == 2 and lines[0].startswith("time (ms) | fwd: ") and lines[1].startswith(
        "time (ms) | backward: ")
    float(lines[0].rsplit(" ", 1)[1])


@pytest.mark.parametrize("which", sorted(CHECKPOINTS))
def test_synchronize_waits_for_the_device_at_each_boundary(monkeypatch, which):
    ckpt.configure(None, synchronize=True)
    calls = []
    accelerator = ckpt.get_accelerator()
    monkeypatch.setattr(accelerator, "synchronize", lambda *a: calls.append(1))
    lin = nn.Linear(4, 4)
    out = CHECKPOINTS[which](lin, torch.randn(2, 4, requires_grad=True))
    assert len(calls) == 2  # forward: start and end
    out.sum().backward()
    assert len(calls) == 4  # backward: start and end


# ---- configure ----------------------------------------------------------------------------------------------------

SECTION = {"partition_activations": True, "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True,
           "profile": True, "number_checkpoints": 4}
CONFIG = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": SECTION}


def test_configure_reads_the_section_from_a_dict_and_from_a_json_file(tmp_path):
    assert not ckpt.is_configured()
    ckpt.configure(None, deepspeed_config=CONFIG)
    assert ckpt.is_configured()
    assert ckpt.current_options() == ckpt.CheckpointingOptions(**SECTION)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    ckpt.configure(None)  # back to the defaults ...
    assert ckpt.current_options() == ckpt.CheckpointingOptions()
    ckpt.configure(None, deepspeed_config=str(path))  # ... and from the file
    assert ckpt.current_options() == ckpt.CheckpointingOptions(**SECTION)


def test_arguments_override_the_config_and_each_configure_starts_from_the_defaults():
    ckpt.configure(None, deepspeed_config=CONFIG, partition_activations=False, checkpoint_in_cpu=False,
                   num_checkpoints=9, profile=None)
    options = ckpt.current_options()
    assert (options.partition_activations, options.cpu_checkpointing, options.number_checkpoints) == (False, False, 9)
    assert options.profile and options.synchronize_checkpoint_boundary  # None: the config's value stands
    ckpt.configure(None, synchronize=True)
    assert ckpt.current_options() == ckpt.CheckpointingOptions(synchronize_checkpoint_boundary=True)


def test_mpu_is_kept_until_another_is_given():
    mpu = FakeMpu(tp_rank=0, tp_size=1)
    ckpt.configure(mpu)
    ckpt.configure(None)
    assert ckpt._STATE.mpu is mpu


def test_configure_warns_of_a_misspelt_key_and_refuses_deepspeeds_contradictions():
    # DeepSpeed reads this section key by key and ignores a misspelt one; hf_zero too, saying so and what was meant
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)]
    assert messages == ["hf_zero: config key 'activation_checkpointing.cpu_checkpoint' is unknown; did you mean "
                        "'cpu_checkpointing'?; ignored, as DeepSpeed ignores unknown keys in this section"]
    with pytest.raises(ConfigError, match="needs partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="needs activation_checkpointing.number_checkpoints"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)


def test_contiguous_memory_optimization_warns_once_that_it_is_not_applied():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)]
    assert len(messages) == 1 and "contiguous_memory_optimization is not applied" in messages[0]


def test_config_status_tells_what_the_engine_does_with_the_section():
    """The engine's config check: the keys configure() applies do not warn; the contiguous buffer does."""
    def ignored(section):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": section},
                              world_size=1, log=False)
        return cfg.not_implemented, [str(w.message) for w in caught if issubclass(w.category, ConfigKeyIgnored)]

    assert ignored({"partition_activations": True, "cpu_checkpointing": True, "profile": True,
                    "synchronize_checkpoint_boundary": True}) == ((), [])
    not_implemented, messages = ignored({"partition_activations": True, "contiguous_memory_optimization": True,
                                         "number_checkpoints": 2})
    assert "activation_checkpointing.contiguous_memory_optimization" in not_implemented
    assert any("contiguous_memory_optimization" in m for m in messages)


# ---- partition_activations over two ranks -------------------------------------------------------------------------

def _partitioned_worker(which: str):
    model, x = _stack("cpu")
    out_ref, grads_ref = _grads(model, x, lambda block, h: block(h))
    ckpt.configure(FakeMpu(dist.get_rank(), dist.get_world_size()), partition_activations=True)
    kept = []
    stash = ckpt._stash

    def recording_stash(*args):
        tensors, slots = stash(*args)
        kept.extend(zip(tensors, slots))
        return tensors, slots

    ckpt._stash = recording_stash
    try:
        out, grads = _grads(model, x, lambda block, h: CHECKPOINTS[which](block, h))
    finally:
        ckpt._stash = stash
    same = torch.equal(out, out_ref) and all(torch.equal(g, r) for g, r in zip(grads, grads_ref))
    return same, [(slot.kind, tensor.numel()) for tensor, slot in kept]


@pytest.mark.parametrize("which", sorted(CHECKPOINTS))
def test_partition_activations_keeps_one_share_per_model_parallel_rank(which):
    for same, kept in run_distributed(_partitioned_worker, 2, args=(which,)):
        assert same
        assert kept == [("part", 8 * 16 // 2)] * 3  # each rank keeps half of each block's (8, 16) input
