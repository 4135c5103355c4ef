"""Shared pieces of the engine parity tests: a small uneven MLP, its data, and the single-process reference."""

from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, FROZEN, OUT = 13, 37, 29, 7  # primes: every world size pads
MICRO, GAS, STEPS, LR, CLIP = 2, 2, 10, 1e-2, 1.0


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, FROZEN), nn.GELU(),
                          nn.Linear(FROZEN, OUT))
    model[2].requires_grad_(False)  # a frozen layer: no gradient, no optimizer state
    return model


def make_data(world_size: int, steps: int = STEPS, seed: int = 1):
    """(steps, GAS, world_size, MICRO, ...) inputs and targets: rank r's micro-batch m of step s is [s, m, r]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, GAS, world_size, MICRO, IN, generator=g)
    y = torch.randn(steps, GAS, world_size, MICRO, OUT, generator=g)
    return x, y


def base_config(stage: int, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300},
           "steps_per_print": 1000}
    if stage == 3:  # shard every parameter except the biases (a mix of partitioned and persistent parameters)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 40
    cfg.update(extra)
    return cfg


def reference_run(world_size: int, steps: int = STEPS, skip_steps: frozenset = frozenset()):
    """Plain torch on one process seeing the whole global batch: losses per step and final parameters.

    ``skip_steps``: steps whose update is dropped (what an fp16 overflow does).
    """
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    x, y = make_data(world_size, steps)
    losses = []
    for s in range(steps):
        xs, ys = x[s].reshape(-1, IN), y[s].reshape(-1, OUT)
        loss = nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if s not in skip_steps:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def assert_matches_reference(losses, params, ref_losses, ref_params, what: str) -> None:
    """Per-step losses (rtol 1e-5) and final parameters (rtol 1e-5, atol 1e-6) equal the reference's."""
    assert len(losses) == len(ref_losses), (what, len(losses), len(ref_losses))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def engine_run(engine, world_size: int, rank: int, steps: int = STEPS, dtype=torch.float32, start: int = 0,
               poison: tuple[int, int] | None = None, after_backward=None):
    """Drive an engine through optimizer steps ``start..start+steps-1``; returns the global mean loss per step.

    ``poison=(step, rank)``: that rank's first micro-batch of that step gets an infinite loss (an fp16 overflow).
    ``after_backward(step, micro)``: called between each micro-batch's backward and its ``engine.step()``.
    """
    import torch.distributed as dist

    x, y = make_data(world_size, max(STEPS, start + steps))
    losses = []
    for s in range(start, start + steps):
        step_loss = torch.zeros(1)
        for m in range(GAS):
            out = engine(x[s, m, rank].to(dtype))
            loss = nn.functional.mse_loss(out.float(), y[s, m, rank])
            if poison == (s, rank) and m == 0:
                engine.backward(loss * float("inf"))
                engine.step()
                step_loss += loss.detach() / GAS
                continue
            engine.backward(loss)
            if after_backward is not None:
                after_backward(s, m)
            engine.step()
            step_loss += loss.detach() / GAS
        if dist.is_initialized():
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world_size)
    return losses


def clone_state(engine) -> dict:
    """Full fp32 copy of the model's weights: every rank for stages 0-2; rank 0 only for stage 3 (else {})."""
    if getattr(engine, "stage3", None) is not None:
        sd = engine._zero3_consolidated_16bit_state_dict()
        return {n: t.detach().float().clone() for n, t in (sd or {}).items()}
    module = engine.module if hasattr(engine, "module") else engine
    return {n: p.detach().float().clone() for n, p in module.state_dict().items()}


def full_optimizer_state(engine, key: str) -> dict:
    """Every parameter's full optimizer-state tensor (``key`` "master" or e.g. "exp_avg"), gathered from the shards."""
    from hf_zero.comm import all_gather_packed

    out = {}
    for g in engine.groups:
        shard = g.master if key == "master" else engine.optimizer.state[g.master][key]
        packed = torch.empty(g.world_size, g.shard_numel)
        all_gather_packed(packed, shard.float())
        flats = [torch.empty(n) for n in g.layout.numels]
        g.layout.unpack(packed, 0, flats)
        out.update({name: f for name, f in zip(g.names, flats)})
    return out
