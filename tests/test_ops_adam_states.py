"""CPU Adam's own optimizer-state memory (zeros_state, on transparent huge pages) and its one-thread path."""

from pathlib import Path

import pytest
import torch
from _ops_util import requires_native

from hf_zero.ops.adam import CPUAdam, adam_step_, zeros_state

HUGE_PAGE = 2 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry of the mapping holding `address`: {"range": "lo-hi", field: value, ...}."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            if entry is not None:
                return entry
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            entry = {"range": head[0]} if lo <= address < hi else None
        elif entry is not None and ":" in line:
            key, _, value = line.partition(":")
            entry[key.strip()] = value.strip()
    return entry


@requires_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_state_is_aligned_zeroed_and_advised(dtype):
    shape = (3, 1 << 20)  # 12 MiB in fp32, 6 MiB in bf16: several huge pages
    t = zeros_state(shape, dtype)
    nbytes = 3 * (1 << 20) * t.element_size()
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == nbytes  # no alignment slack in the storage (checkpoints save it)
    assert torch.count_nonzero(t).item() == 0
    t.fill_(3)
    assert t.sum(dtype=torch.float64).item() == 3.0 * t.numel()
    mapping = _mapping_of(t.data_ptr())
    assert mapping is not None
    lo, hi = (int(x, 16) for x in mapping["range"].split("-"))
    assert (lo, hi) == (t.data_ptr(), t.data_ptr() + nbytes)  # exactly the tensor: head and tail slack unmapped
    if Path("/proc/sys").exists() and THP_MODE.exists() and "[never]" not in THP_MODE.read_text():
        assert "hg" in mapping["VmFlags"].split()  # MADV_HUGEPAGE took
        assert mapping["THPeligible"] == "1"
    address = t.data_ptr()
    del t
    # The deleter unmapped it (reading smaps may itself map a buffer there, but not with the same range).
    after = _mapping_of(address)
    assert after is None or after["range"] != mapping["range"]


def test_zeros_state_small_or_not_cpu_is_plain_zeros():
    small = zeros_state((1000,))  # 4 KB: no huge page fits
    assert small.shape == (1000,) and torch.count_nonzero(small).item() == 0
    meta = zeros_state((4, 1 << 20), torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == (4, 1 << 20)


@requires_native
def test_cpu_adam_states_on_hugepages_step_and_reload_bit_equal():
    """CPUAdam's states come from zeros_state; the step is the kernel's, bit for bit, whatever memory the states
    are on; a reloaded state dict is moved back onto zeros_state memory with its values unchanged."""
    torch.manual_seed(0)
    numel = 1 << 20
    p = torch.nn.Parameter(torch.randn(numel))
    opt = CPUAdam([p], lr=1e-3, weight_decay=0.01)
    master, m, v = p.detach().clone(), torch.zeros(numel), torch.zeros(numel)
    for step in range(1, 4):
        grad = torch.randn(numel)
        p.grad = grad
        opt.step()
        adam_step_(master, grad, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                   adamw_mode=True, bias_correction=True)
    state = opt.state[p]
    for key in ("exp_avg", "exp_avg_sq"):
        assert state[key].data_ptr() % HUGE_PAGE == 0
    assert torch.equal(p.detach(), master)
    assert torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v)

    opt2 = CPUAdam([p], lr=1e-3, weight_decay=0.01)
    opt2.load_state_dict(opt.state_dict())
    loaded = opt2.state[p]
    assert loaded["step"] == 3
    for key, want in (("exp_avg", m), ("exp_avg_sq", v)):
        assert loaded[key].data_ptr() % HUGE_PAGE == 0
        assert loaded[key].data_ptr() != state[key].data_ptr()
        assert torch.equal(loaded[key], want)


@requires_native
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_one_thread_whole_tensor_matches_two_thread_blocks(isa):
    """At one thread the kernel runs the whole tensor as one chunk (prefetch streams never restart); at two the
    threads pull 131072-element blocks. Same per-element operations: bit-equal results."""
    best = torch.ops.hf_zero.adam_cpu_isa("auto")
    order = ["scalar", "avx2", "avx512"]
    if order.index(isa) > order.index(best):
        pytest.skip(f"this CPU has no {isa}")
    numel = 2 * 131072 + 4099  # two blocks and a tail longer than both prefetch distances
    gen = torch.Generator().manual_seed(7)
    inputs = (torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 0.1,
              torch.rand(numel, generator=gen) * 0.1)
    grads = [torch.randn(numel, generator=gen).bfloat16() for _ in range(3)]
    threads = torch.get_num_threads()
    results = {}
    try:
        torch.ops.hf_zero.adam_cpu_isa(isa)
        for n in (1, 2):
            torch.set_num_threads(n)
            state = [t.clone() for t in inputs]
            out16 = torch.empty(numel, dtype=torch.bfloat16)
            for step, grad in enumerate(grads, start=1):
                adam_step_(state[0], grad, state[1], state[2], step=step, lr=1e-3, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=0.01, adamw_mode=True, bias_correction=True, out16=out16)
            results[n] = (*state, out16)
    finally:
        torch.set_num_threads(threads)
        torch.ops.hf_zero.adam_cpu_isa("auto")
    for a, b in zip(results[1], results[2]):
        assert torch.equal(a, b)
    assert not torch.equal(results[1][0], inputs[0])  # the step did move the parameter


def _engine_states(tmp: str) -> dict:
    import hf_zero

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1))  # 4 MiB fp32 shard
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "zero_optimization": {"stage": 2}}
        return hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def states(e):
        return [(e.optimizer.state[g.master]["exp_avg"], e.optimizer.state[g.master]["exp_avg_sq"])
                for g in e.optimizer.groups]

    first = engine()
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        first.backward(first(x).square().mean())
        first.step()
    first.save_checkpoint(tmp, tag="t")
    fresh = engine()
    fresh.load_checkpoint(tmp, tag="t")
    return {"aligned": [t.data_ptr() % HUGE_PAGE == 0 for e in (first, fresh) for pair in states(e) for t in pair],
            "equal": all(torch.equal(a, b) for p, q in zip(states(first), states(fresh)) for a, b in zip(p, q)),
            "nonzero": all(torch.count_nonzero(t).item() > 0 for pair in states(first) for t in pair)}


@requires_native
def test_zero_engine_states_on_hugepages_after_steps_and_after_load(tmp_path):
    """The ZeRO engine's fused-Adam states (zero/optimizer_backend.py) come from zeros_state too, and so do the
    states a fresh engine builds from a checkpoint (zero/optimizer.py), with the saved values."""
    from hf_zero.testing import run_distributed

    out = run_distributed(_engine_states, 1, args=(str(tmp_path),))[0]
    assert out["aligned"] == [True] * 4 and out["equal"] and out["nonzero"]
