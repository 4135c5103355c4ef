"""``initialize(..., mpu=mpu)`` with ``tensor_parallel.autotp_size`` (#26 item 4), on 2 ranks: DeepSpeed's AutoTP
training example builds its own TP and DP groups, wraps them in a minimal mpu and passes it with autotp_size.

hf_zero shards the model over the mpu's TP group and runs ZeRO over its DP group (the very process groups the
script built), and trains as one process on the whole batch does. DeepSpeed 0.19.8 (``_configure_tensor_parallel_
states``) replaces the mpu by its own ``groups`` module under AutoTP and builds a (dp, tp) mesh of its own: equal to
the example's groups when they are laid out the same, silently different otherwise, and it never compares the
mpu's size with autotp_size. hf_zero refuses that mismatch, naming both values; an mpu that splits the model
without autotp_size stays refused (a model split by hand, whose split parameters the engine cannot know).

DeepSpeed 0.19.8's run of ``_worker`` (scripts/ds_pattern_workers.py::mpu_autotp, 2 CPU ranks, the same mpu, model,
batches and config): losses 4.890985, 4.864984, 4.857522, grad norms 2.455078, 2.502896, 2.716094 -- the one-process
reference's (losses equal, norms within 3e-7), which this test holds hf_zero to within 1e-5. The mismatched mpu (TP
size 1) with autotp_size 2 is accepted and trains as TP 2 (first loss 4.890985): DeepSpeed drops the mpu. hf_zero
refuses it (test_mpu_size_mismatch_is_refused_naming_both): stricter than DeepSpeed, for a contradictory setting.
"""

from __future__ import annotations

import functools

import torch

from _tp_spawns import case, register
from _tp_util import make_model, rel, token_data

STEPS, CLIP, LR = 3, 0.5, 1e-3


def _config(**tp) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000},
            "tensor_parallel": tp, "steps_per_print": 1000}


@functools.lru_cache(maxsize=None)
def _reference():
    """One process, the same batches (micro-batch 2, one data-parallel replica), clipped AdamW."""
    model = make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    data = token_data(STEPS, batch=2)
    losses, norms = [], []
    for s in range(STEPS):
        loss = model(input_ids=data[s], labels=data[s]).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: t.detach().clone() for n, t in model.state_dict().items()}


class ModelParallelUnit:
    """The minimal mpu of DeepSpeed's AutoTP training example."""

    def __init__(self, tp_group, dp_group, tp_size: int):
        import torch.distributed as dist

        self.tp_group, self.dp_group, self.tp_size = tp_group, dp_group, tp_size
        self.tp_rank, self.dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_world_size(self):
        import torch.distributed as dist

        return dist.get_world_size(self.dp_group)

    def get_model_parallel_world_size(self):
        return self.tp_size

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_model_parallel_rank(self):
        return self.tp_rank


def _worker():
    import torch.distributed as dist

    import hf_zero
    from hf_zero.config.errors import ConfigError
    from hf_zero.tensor_parallel import tp_info
    from hf_zero.tensor_parallel.state import full_state_dict

    rank = dist.get_rank()
    # the example's groups: TP over both ranks, a data-parallel group of one rank each (every rank creates all)
    tp_group = dist.new_group([0, 1])
    dp_groups = [dist.new_group([0]), dist.new_group([1])]
    mpu = ModelParallelUnit(tp_group, dp_groups[rank], 2)
    model = make_model("llama")
    engine, *_ = hf_zero.initialize(model=model, config=_config(autotp_size=2), mpu=mpu)
    layout = tp_info(model).layout
    out = {"groups": (layout.tp_group is tp_group, layout.dp_group is dp_groups[rank], engine.world_size)}
    data = token_data(STEPS, batch=2)
    losses, norms = [], []
    for s in range(STEPS):
        loss = engine(input_ids=data[s], labels=data[s]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    out.update(losses=losses, norms=norms, state=full_state_dict(engine.module))
    engine.destroy()
    # a real mismatch: the mpu says data parallelism over both ranks (TP 1), the config TP 2
    try:
        hf_zero.initialize(model=make_model("llama"), config=_config(autotp_size=2),
                           mpu=ModelParallelUnit(dist.group.WORLD, dist.group.WORLD, 1))
        out["mismatch"] = None
    except ConfigError as e:
        out["mismatch"] = str(e)
    try:  # TP from the mpu without autotp_size: a model split by hand
        hf_zero.initialize(model=make_model("llama"), config=_config(), mpu=mpu)
        out["unset"] = None
    except ValueError as e:
        out["unset"] = str(e)
    return out


register(2, "mpu", _worker)  # in the shared 2-rank process group (tests/_tp_spawns.py)


def _client_optimizer_worker():
    """DeepSpeed's AutoTP training example: ``torch.optim.AdamW(model.parameters())`` built *before*
    ``initialize(model, optimizer=opt, config with tensor_parallel.autotp_size)``.

    DeepSpeed 0.19.8 (2 CPU ranks, the same model, batches and config, no mpu): AutoTP keeps all 21 Parameter objects
    of the tiny Llama and swaps the ``.data`` of 15 for this rank's shard (q_proj (64, 64) -> (32, 64), ...), so the
    optimizer built before holds the trained parameters; losses 4.890985, 4.864984, 4.857522 on both ranks, grad norm
    2.7161 at the last step (the single-process reference below: the same to 1e-5)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import hf_zero
    from hf_zero.tensor_parallel.state import full_state_dict

    cfg = _config(autotp_size=2)
    del cfg["optimizer"]  # the client's optimizer is the only one, as in the example
    model = make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    before_groups = opt.param_groups
    engine, *_ = hf_zero.initialize(model=model, optimizer=opt, config=cfg)
    held = [p for g in before_groups for p in g["params"]]  # the groups as the sharding left them
    current = list(model.parameters())
    out = {"adopted": (len(held), len(current), all(any(p is q for q in current) for p in held),
                       sum(isinstance(p, DTensor) for p in held), sum(isinstance(p, DTensor) for p in current)),
           # then, as DeepSpeed's ZeRO optimizer, the engine's optimizer takes over the client's param_groups (a
           # scheduler built on the client's optimizer sets the trained lr: tests/test_client_scheduler.py)
           "groups_taken_over": opt.param_groups is engine.optimizer.param_groups}
    data = token_data(STEPS, batch=2)
    losses, norms = [], []
    for s in range(STEPS):
        loss = engine(input_ids=data[s], labels=data[s]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    out.update(losses=losses, norms=norms, state=full_state_dict(engine.module))
    engine.destroy()
    # an optimizer that already stepped on the full tensors has state of the unsharded shape: refused, naming it
    model = make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model(input_ids=data[0], labels=data[0]).loss.backward()
    opt.step()
    try:
        hf_zero.initialize(model=model, optimizer=opt, config=cfg)
        out["stepped"] = None
    except ValueError as e:
        out["stepped"] = str(e)
    dist.barrier()
    return out


register(2, "client_optimizer", _client_optimizer_worker)


def test_mpu_tp_groups_with_autotp_train_as_one_process():
    ref_losses, ref_norms, ref_state = _reference()
    assert max(ref_norms) > CLIP  # clipping is active
    for rank, out in enumerate(case(2, "mpu")):
        assert out["groups"] == (True, True, 1), (rank, out["groups"])  # the mpu's own groups; ZeRO over dp 1
        for s in range(STEPS):
            assert abs(out["losses"][s] - ref_losses[s]) <= 1e-5 * ref_losses[s], (rank, s, out["losses"])
            assert abs(out["norms"][s] - ref_norms[s]) <= 1e-5 * ref_norms[s], (rank, s, out["norms"])
        for name, ref in ref_state.items():
            assert rel(out["state"][name], ref) <= 1e-5, (rank, name, rel(out["state"][name], ref))


def test_mpu_size_mismatch_is_refused_naming_both():
    for out in case(2, "mpu"):
        assert out["mismatch"] is not None and out["mismatch"].startswith("tensor_parallel.autotp_size")
        assert "2, but the mpu" in out["mismatch"] and "tensor-parallel size of 1" in out["mismatch"]
        assert out["unset"] is not None and "tensor parallel size 2" in out["unset"]
        assert "tensor_parallel.autotp_size: 2" in out["unset"]


def test_optimizer_built_before_autotp_trains_as_one_process():
    ref_losses, ref_norms, ref_state = _reference()
    for rank, out in enumerate(case(2, "client_optimizer")):
        held, in_model, same, dtensors_held, dtensors_model = out["adopted"]
        # the optimizer holds exactly the model's parameters, the sharded (DTensor) ones included
        assert held == in_model == 21 and same and dtensors_held == dtensors_model > 0, (rank, out["adopted"])
        assert out["groups_taken_over"], rank
        for s in range(STEPS):
            assert abs(out["losses"][s] - ref_losses[s]) <= 1e-5 * ref_losses[s], (rank, s, out["losses"])
            assert abs(out["norms"][s] - ref_norms[s]) <= 1e-5 * ref_norms[s], (rank, s, out["norms"])
        for name, ref in ref_state.items():
            assert rel(out["state"][name], ref) <= 1e-5, (rank, name, rel(out["state"][name], ref))
        assert out["stepped"] is not None and "'model.embed_tokens.weight'" in out["stepped"], out["stepped"]
        assert "state for" in out["stepped"] and "shape (128, 64)" in out["stepped"]


def test_reference_matches_deepspeeds_autotp_run():
    """The numbers DeepSpeed's run of _client_optimizer_worker gave (its docstring)."""
    ref_losses, ref_norms, _ = _reference()
    for got, ds in zip(ref_losses, [4.890985488891602, 4.864983558654785, 4.857522010803223]):
        assert abs(got - ds) <= 1e-5 * ds, (ref_losses, ds)
    assert abs(ref_norms[-1] - 2.7161) <= 1e-4 * 2.7161, ref_norms
