"""``bf16.bf16_master_weights_and_grads`` / ``bf16_optimizer_states`` really shrink what each rank holds: the
master shard in bf16 *is* the 16-bit shard (one copy instead of fp32 master + bf16 copy), the Adam moments in bf16
halve again. Bytes asserted per rank on 2 ranks (stages 2 and 3), and the runs still train."""

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.testing import run_distributed

from _parity import base_config, engine_run, make_model


def _held_bytes(engine) -> int:
    """Bytes of the distinct tensors the optimizer side holds: masters, 16-bit shards, gradient shards, moments."""
    seen, total = set(), 0
    tensors = []
    for g in engine.groups:
        tensors += [g.master, g.grad] + ([g.param16] if g.param16 is not None else [])
        tensors += [t for t in engine.optimizer.state[g.master].values() if t.dim() > 0]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _run(stage: int, **bf16):
    cfg = base_config(stage, bf16={"enabled": True, **bf16})
    engine, *_ = hf_zero.initialize(model=make_model(), config=cfg)
    losses = engine_run(engine, dist.get_world_size(), dist.get_rank(), steps=4, dtype=torch.bfloat16)
    shard = sum(g.shard_numel for g in engine.groups)
    held_after_step = _held_bytes(engine)
    # The gradient shard lives from a window's first backward to the step and is freed after it (stages 0-2):
    # make it exist as a backward would, so the count is the peak the optimizer side holds.
    for g in engine.groups:
        g.ensure_grad()
    dtypes = {g.master.dtype for g in engine.groups}, {engine.optimizer.state[g.master]["exp_avg"].dtype
                                                         for g in engine.groups}
    out = (losses, _held_bytes(engine), shard, dtypes, held_after_step)
    engine.destroy()
    return out


def _all():
    out = {}
    for stage in (2, 3):
        out[stage] = {"default": _run(stage), "master": _run(stage, bf16_master_weights_and_grads=True),
                      "both": _run(stage, bf16_master_weights_and_grads=True, bf16_optimizer_states=True)}
    try:
        _run(0, bf16_master_weights_and_grads=True)
    except Exception as e:  # DeepSpeed: stages 1-3 only
        out["stage0"] = str(e)
    return out


def test_bf16_master_weights_and_optimizer_states_bytes():
    for r in run_distributed(_all, 2):
        assert "bf16.bf16_master_weights_and_grads" in r["stage0"] and "stage 1, 2 or 3" in r["stage0"]
        for stage in (2, 3):
            cases = r[stage]
            n = cases["default"][2]
            assert n > 0 and all(c[2] == n for c in cases.values())
            # per shard element: fp32 master 4 + bf16 copy 2 + bf16 grad 2 + fp32 moments 8
            assert cases["default"][1] == 16 * n, (stage, cases["default"][1], n)
            assert cases["default"][3] == ({torch.float32}, {torch.float32})
            if stage == 2:  # freed after the step: 2 bytes (bf16 grad) per element fewer
                assert cases["default"][4] == 14 * n, (stage, cases["default"][4], n)
            # bf16 master (also the 16-bit weights) 2 + bf16 grad 2 + fp32 moments 8
            assert cases["master"][1] == 12 * n, (stage, cases["master"][1], n)
            assert cases["master"][3] == ({torch.bfloat16}, {torch.float32})
            # bf16 master 2 + bf16 grad 2 + bf16 moments 4
            assert cases["both"][1] == 8 * n, (stage, cases["both"][1], n)
            assert cases["both"][3] == ({torch.bfloat16}, {torch.bfloat16})
            for name in ("master", "both"):  # still trains like the fp32-master run, to bf16 precision
                losses, ref = cases[name][0], cases["default"][0]
                assert losses[0] == ref[0]  # same start
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=5e-2, atol=0)
