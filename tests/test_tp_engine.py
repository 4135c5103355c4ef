"""Data parallel x tensor parallel through hf_zero.initialize: ``tensor_parallel.autotp_size`` in the config,
ZeRO 0/1/2 over the data-parallel dimension of a (dp 2, tp 2) mesh, against one process training on the whole
global batch. Clipping is active (threshold below the norm), so a norm that counted a replicated parameter
once per TP rank, or missed a shard, would change every step."""

from __future__ import annotations

import functools

import pytest
import torch

from _tp_spawns import case, register
from _tp_util import make_model, rel, token_data

STEPS, CLIP, LR = 3, 0.5, 1e-3
# GPT-2 trains with SGD: its key bias has an exactly zero true gradient, and Adam would turn that element's
# rounding noise into O(lr) steps of random sign (see _tp_util.make_optimizer)
RUNS = (("llama", 1), ("gpt2", 2), ("llama", 0))
SP_RUN = ("llama", 2)  # with tensor_parallel.sequence_parallel (tests/test_tp_sequence_parallel.py: TP 2 alone)
OPTIMIZER = {"llama": ("AdamW", {"lr": LR, "weight_decay": 0.01}), "gpt2": ("SGD", {"lr": 0.5, "momentum": 0.9})}


def _config(stage: int, kind: str = "llama", **extra) -> dict:
    opt_type, opt_params = OPTIMIZER[kind]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
           "optimizer": {"type": opt_type, "params": dict(opt_params)},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000},
           "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 1000}
    cfg.update(extra)
    return cfg


@functools.lru_cache(maxsize=None)
def reference(kind: str, dp: int):
    """One process, the whole global batch (dp micro-batches of 2), clipped AdamW."""
    model = make_model(kind)
    opt_type, opt_params = OPTIMIZER[kind]
    opt = getattr(torch.optim, opt_type)(model.parameters(), **opt_params)
    data = token_data(STEPS, batch=2 * dp)
    losses, norms = [], []
    for s in range(STEPS):
        loss = sum(model(input_ids=b, labels=b).loss for b in data[s].view(dp, 2, -1)) / dp
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: t.detach().clone() for n, t in model.state_dict().items()}


def _train(kind: str, stage: int, sequence_parallel: bool = False):
    import torch.distributed as dist

    import hf_zero
    from hf_zero.tensor_parallel.state import full_state_dict

    config = _config(stage, kind)
    config["tensor_parallel"]["sequence_parallel"] = sequence_parallel
    engine, *_ = hf_zero.initialize(model=make_model(kind), config=config)
    dp, dp_rank = engine.world_size, engine.global_rank
    data = token_data(STEPS, batch=2 * dp)
    losses, norms = [], []
    for s in range(STEPS):
        ids = data[s].view(dp, 2, -1)[dp_rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        norms.append(engine.get_global_grad_norm())
    return {"dp": dp, "losses": losses, "norms": norms, "state": full_state_dict(engine.module)}


def _worker():
    import torch.distributed as dist

    import hf_zero
    from hf_zero.config.errors import ConfigError

    out = {f"{kind}-{stage}": _train(kind, stage) for kind, stage in RUNS}
    out["sp"] = _train(*SP_RUN, sequence_parallel=True)
    # ranks of one TP group read the same samples; the two DP replicas read different ones
    _, _, loader, _ = hf_zero.initialize(model=make_model("llama"), config=_config(1),
                                         training_data=torch.utils.data.TensorDataset(torch.arange(16)))
    out["samples"] = [int(x) for (batch,) in loader for x in batch]
    try:
        hf_zero.initialize(model=make_model("llama"), config=_config(3))
        out["stage3"] = None
    except ConfigError as e:
        out["stage3"] = str(e)
    out["rank"] = dist.get_rank()
    return out


register(4, "engine", _worker)  # in the shared 4-rank process group (tests/_tp_spawns.py)


@pytest.fixture(scope="module")
def results():
    return case(4, "engine")


@pytest.mark.parametrize("kind,stage,sp", [(*r, False) for r in RUNS] + [(*SP_RUN, True)])
def test_dp2_tp2_matches_single_process(results, kind, stage, sp):
    ref_losses, ref_norms, ref_state = reference(kind, 2)
    for out in results:
        run = out["sp" if sp else f"{kind}-{stage}"]
        assert run["dp"] == 2
        for s in range(STEPS):
            assert abs(run["losses"][s] - ref_losses[s]) <= 1e-5 * ref_losses[s], (out["rank"], s, run["losses"])
            assert abs(run["norms"][s] - ref_norms[s]) <= 1e-5 * ref_norms[s], (out["rank"], s, run["norms"])
        assert max(ref_norms) > CLIP  # clipping was active
        for name, ref in ref_state.items():
            assert rel(run["state"][name], ref) <= 1e-5, (out["rank"], name, rel(run["state"][name], ref))


def test_data_sharded_by_data_parallel_rank(results):
    by_rank = [out["samples"] for out in results]
    assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3]  # TP peers: same batches
    assert len(by_rank[0]) == 8 and sorted(by_rank[0] + by_rank[2]) == list(range(16))  # DP replicas: disjoint


def test_stage3_with_tensor_parallel_is_refused(results):
    for out in results:
        assert out["stage3"] is not None and "zero_optimization.stage" in out["stage3"]
        assert "3 with tensor_parallel is not implemented in hf_zero (DeepSpeed runs it)" in out["stage3"]
