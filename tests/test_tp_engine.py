"""Data parallel x tensor parallel through hf_zero.initialize: ``tensor_parallel.autotp_size`` in the config,
ZeRO 0/1/2/3 over the data-parallel dimension of a (dp 2, tp 2) mesh, against one process training on the whole
global batch. At stage 3 every parameter is partitioned (persistence threshold 0): each rank's TP shard is cut
again over its data-parallel pair and gathered module by module; once more with the pieces in NVMe swap files
(offload_param) and the optimizer in host memory. Clipping is active (threshold below the norm), so a norm that
counted a replicated parameter once per TP rank, or missed a shard, would change every step."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from _tp_spawns import case, register
from _tp_util import make_model, rel, token_data

STEPS, CLIP, LR = 3, 0.5, 1e-3
# GPT-2 trains with SGD: its key bias has an exactly zero true gradient, and Adam would turn that element's
# rounding noise into O(lr) steps of random sign (see _tp_util.make_optimizer)
RUNS = (("llama", 1), ("gpt2", 2), ("llama", 0), ("llama", 3), ("gpt2", 3))
SP_RUN = ("llama", 2)
SP3_RUN = ("llama", 3)  # with tensor_parallel.sequence_parallel (tests/test_tp_sequence_parallel.py: TP 2 alone)
OPTIMIZER = {"llama": ("AdamW", {"lr": LR, "weight_decay": 0.01}), "gpt2": ("SGD", {"lr": 0.5, "momentum": 0.9})}


def _config(stage: int, kind: str = "llama", **extra) -> dict:
    opt_type, opt_params = OPTIMIZER[kind]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
           "optimizer": {"type": opt_type, "params": dict(opt_params)},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000},
           "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 1000}
    if stage == 3:  # nothing kept whole: every TP shard is partitioned over the data-parallel pair
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg.update(extra)
    return cfg


@functools.lru_cache(maxsize=None)
def reference(kind: str, dp: int):
    """One process, the whole global batch (dp micro-batches of 2), clipped AdamW."""
    return _reference(make_model(kind), kind, dp)


def _reference(model, kind: str, dp: int):
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


def _train(kind: str, stage: int, sequence_parallel: bool = False, model=None, zero_extra=None):
    import hf_zero

    config = _config(stage, kind)
    config["tensor_parallel"]["sequence_parallel"] = sequence_parallel
    config["zero_optimization"].update(zero_extra or {})
    engine, *_ = hf_zero.initialize(model=model if model is not None else make_model(kind), config=config)
    return _steps(engine, stage)


def _steps(engine, stage: int) -> dict:
    import torch.distributed as dist

    from hf_zero.tensor_parallel.state import full_state_dict

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
    out = {"dp": dp, "losses": losses, "norms": norms, "state": full_state_dict(engine.module)}
    if stage == 3:
        from hf_zero.zero.stage3 import ParamState, sharded_param_of

        sps = [sharded_param_of(p) for p in engine.module.parameters()]
        # partitioned between steps, each shard half of this rank's TP piece (the full state above was gathered)
        out["partitioned"] = all(sp is not None and sp.state is ParamState.PARTITIONED
                                 and sp.shard_numel == -(-sp.numel // dp) for sp in sps)
        out["consolidated"] = engine._zero3_consolidated_16bit_state_dict()
    return out


def _zero_init():
    """A model built under zero.Init (partitioned over the 4 ranks) given to a (dp 2, tp 2) ZeRO-3 engine: its
    whole weights are gathered back before the TP cut. Returns them as built, the engine's unsplit weights before
    any step, and its run."""
    import hf_zero
    from hf_zero.tensor_parallel.state import full_state_dict

    config = _config(3, "llama")
    with hf_zero.zero.Init(config_dict_or_path=config):
        model = make_model("llama")
    with hf_zero.zero.GatheredParameters(list(model.parameters())):
        built = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    start = {n: t.clone() for n, t in full_state_dict(engine.module).items() if n in built}
    return {"built": built, "start": start, "run": _steps(engine, 3)}


def _worker():
    import torch.distributed as dist

    import hf_zero

    out = {f"{kind}-{stage}": _train(kind, stage) for kind, stage in RUNS}
    out["sp"] = _train(*SP_RUN, sequence_parallel=True)
    out["sp3"] = _train(*SP3_RUN, sequence_parallel=True)
    out["zero_init"] = _zero_init()
    with tempfile.TemporaryDirectory() as swap:  # the TP shards' data-parallel pieces in swap files
        out["llama-3-offload"] = _train("llama", 3, zero_extra={
            "offload_param": {"device": "nvme", "nvme_path": swap}, "offload_optimizer": {"device": "cpu"}})
    # ranks of one TP group read the same samples; the two DP replicas read different ones
    _, _, loader, _ = hf_zero.initialize(model=make_model("llama"), config=_config(1),
                                         training_data=torch.utils.data.TensorDataset(torch.arange(16)))
    out["samples"] = [int(x) for (batch,) in loader for x in batch]
    out["rank"] = dist.get_rank()
    return out


register(4, "engine", _worker)  # in the shared 4-rank process group (tests/_tp_spawns.py)


@pytest.fixture(scope="module")
def results():
    return case(4, "engine")


@pytest.mark.parametrize("kind,stage,sp,offload", [(*r, False, False) for r in RUNS]
                         + [(*SP_RUN, True, False), (*SP3_RUN, True, False), ("llama", 3, False, True)])
def test_dp2_tp2_matches_single_process(results, kind, stage, sp, offload):
    ref_losses, ref_norms, ref_state = reference(kind, 2)
    for out in results:
        run = out[("sp3" if stage == 3 else "sp") if sp else f"{kind}-{stage}" + ("-offload" if offload else "")]
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


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_stage3_partitions_tp_shards_and_consolidates_the_unsplit_model(results, kind):
    """ZeRO-3 with TP (DeepSpeed 0.19.8 runs it): between steps every parameter is a data-parallel shard of the
    rank's TP piece, and save_16bit_model's consolidated state dict is the unsplit model (the fused q|k|v columns
    in their canonical order) on the first data-parallel replica, None on the other."""
    _, _, ref_state = reference(kind, 2)
    for out in results:
        run = out[f"{kind}-3"]
        assert run["partitioned"], out["rank"]
        sd = run["consolidated"]
        if out["rank"] in (0, 1):  # dp rank 0 of each TP group (ranks are laid out dp x tp)
            assert sorted(sd) == sorted(ref_state), (out["rank"], sorted(set(sd) ^ set(ref_state)))
            for name, ref in ref_state.items():
                assert sd[name].shape == ref.shape and rel(sd[name], ref) <= 1e-5, (out["rank"], name)
        else:
            assert sd is None, out["rank"]


def test_stage3_model_built_under_zero_init(results):
    """zero.Init partitions the weights over every rank; tensor parallelism needs them whole to cut them: the engine
    starts from exactly the weights the model was built with and trains like one process started from them."""
    import copy

    built = results[0]["zero_init"]["built"]
    model = make_model("llama")
    model.load_state_dict(built, strict=False)
    ref_losses, ref_norms, ref_state = _reference(copy.deepcopy(model), "llama", 2)
    for out in results:
        z = out["zero_init"]
        assert sorted(z["start"]) == sorted(built)
        for name, t in built.items():
            assert torch.equal(z["start"][name], t), (out["rank"], name)
        run = z["run"]
        assert run["partitioned"]
        for s in range(STEPS):
            assert abs(run["losses"][s] - ref_losses[s]) <= 1e-5 * ref_losses[s], (out["rank"], s, run["losses"])
            assert abs(run["norms"][s] - ref_norms[s]) <= 1e-5 * ref_norms[s], (out["rank"], s, run["norms"])
        for name, ref in ref_state.items():
            assert rel(run["state"][name], ref) <= 1e-5, (out["rank"], name)
