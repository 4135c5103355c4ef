"""DeepSpeed-side copies of #26's pattern-test workers whose hf_zero version reads hf_zero-only state (engine groups,
hf_zero's logger, a global ``forward_funcs``): the same model, data, config and calls, with the results read the
way DeepSpeed exposes them. Run under the real DeepSpeed through scripts/ds_same_test.py, e.g.

    PYTHONPATH=. HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
        --nproc_per_node 2 scripts/ds_same_test.py scripts/ds_pattern_workers.py pipeline_inplace

What each gave is recorded in the matching test's docstring and in docs/deepspeed_scripts.md.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def pipeline_inplace(inplace: bool = True, clip: float | None = None):
    """tests/test_pipeline_inplace.py::_train on DeepSpeed's PipelineEngine (its one schedule, 1F1B-like).
    ``inplace=False`` swaps the in-place ReLU for an out-of-place one, ``clip`` overrides gradient_clipping (both
    only to find where a difference comes from)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import test_pipeline_inplace as t
    from _pipe_util import ds_config

    layers = t._layers()
    if not inplace:
        layers[3] = nn.ReLU()
    net = PipelineModule(layers, num_stages=2, loss_fn=F.mse_loss, seed_layers=True, partition_method="uniform")
    cfg = ds_config(t.MICRO_BATCHES, 0, "1f1b")
    if clip is not None:
        cfg["gradient_clipping"] = clip
    del cfg["pipeline"]  # DeepSpeed has no schedule choice
    engine, *_ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())
    x, y = t.data(t.STEPS, t.MICRO_BATCHES, 1)
    losses = [engine.train_batch(iter([(x[s, j, 0], y[s, j, 0]) for j in range(t.MICRO_BATCHES)])).item()
              for s in range(t.STEPS)]
    eval_loss = engine.eval_batch(iter([(x[0, j, 0], y[0, j, 0]) for j in range(t.MICRO_BATCHES)])).item()
    state = {k: v.clone() for k, v in net.state_dict().items()}  # DeepSpeed names a layer's module by its index
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    merged = {k: v for s in gathered for k, v in s.items()}
    ref_losses, ref_eval, ref_state = t._reference()
    return dict(parts=list(net.parts), losses=losses, ref_losses=ref_losses, eval_loss=eval_loss, ref_eval=ref_eval,
                keys_equal=sorted(merged) == sorted(ref_state),
                max_param_diff=max((merged[k] - v).abs().max().item() for k, v in ref_state.items()))


def layerspec_counting():
    """tests/test_pipeline_module.py::_parameter_counting; DeepSpeed's forward_funcs holds this stage's layers only."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    import test_pipeline_module as t

    world = dist.get_world_size()
    t._CachedWeight.cache.clear()
    net = PipelineModule([LayerSpec(t._CachedWeight), LayerSpec(nn.Linear, 4, 4)] * world, num_stages=world,
                         partition_method="parameters")
    cached = net.forward_funcs[0]  # this stage's first layer: its _CachedWeight
    weights = {}
    for method in ("parameters", "uniform"):
        torch.manual_seed(7)
        built = PipelineModule([LayerSpec(nn.Linear, 4, 4)] * (2 * world), num_stages=world, partition_method=method)
        weights[method] = [p.detach().clone() for p in built.parameters()]
    return dict(type=type(cached).__name__, device=str(cached.weight.device), value=cached.weight.detach().tolist(),
                parts=[int(p) for p in net.parts], same=all(torch.equal(a, b) for a, b in zip(weights["parameters"], weights["uniform"])))


def per_rank_dirs(base: str):
    """tests/test_checkpoint_per_rank_dirs.py::_per_rank: each rank saves under its own directory, loads it back,
    then every rank loads rank 0's directory."""
    import deepspeed

    from _parity import base_config, engine_run, make_model

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = f"{base}/run-{rank}"
    engine, *_ = deepspeed.initialize(model=(m := make_model()), config=base_config(2),
                                      model_parameters=[p for p in m.parameters() if p.requires_grad])
    engine_run(engine, world, rank, steps=2)
    engine.save_checkpoint(mine, tag="t")
    saved = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
    files = sorted(os.listdir(f"{mine}/t"))
    top = sorted(os.listdir(mine))
    loaded, *_ = deepspeed.initialize(model=(m := make_model(seed=3)), config=base_config(2),
                                      model_parameters=[p for p in m.parameters() if p.requires_grad])
    path, _ = loaded.load_checkpoint(mine)
    same = path is not None and all(torch.equal(saved[n], p) for n, p in loaded.module.state_dict().items())
    steps = loaded.global_steps
    alone, *_ = deepspeed.initialize(model=(m := make_model(seed=3)), config=base_config(2),
                                     model_parameters=[p for p in m.parameters() if p.requires_grad])
    try:
        path0, _ = alone.load_checkpoint(f"{base}/run-0")
        error = None if path0 is not None else "load_checkpoint returned None"
    except Exception as exc:  # noqa: BLE001 -- recording which error DeepSpeed raises
        error = f"{type(exc).__name__}: {exc}"[:300]
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(rank=rank, files=files, top=top, same=same, steps=steps,
                                          alone_error=error))
    return gathered


def tag_validation(save_dir: str):
    """tests/test_checkpoint_integrity.py::_tag_validation: rank r saves tag f"t{r}" under Fail / Warn / Ignore."""
    import deepspeed

    import test_checkpoint_integrity as t

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("DeepSpeed").addHandler(handler)
    out = {}
    for policy in ("fail", "warn", "ignore"):
        root = f"{save_dir}/{policy}"
        cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 2}, "checkpoint": {"tag_validation": policy.capitalize()}}
        model = t._model()
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        t._train(engine, 1)
        records.clear()
        try:
            engine.save_checkpoint(root, tag=f"t{dist.get_rank()}")
            error = None
        except Exception as exc:  # noqa: BLE001 -- recording which error DeepSpeed raises
            error = f"{type(exc).__name__}: {exc}"[:300]
        dist.barrier()
        listing = sorted(os.listdir(root)) if os.path.exists(root) else []
        latest = open(f"{root}/latest").read().strip() if os.path.exists(f"{root}/latest") else None
        out[policy] = dict(error=error, listing=listing, latest=latest,
                           warned=[r[:200] for r in records if "tag" in r.lower()])
    return out


def torch_adam_offload():
    """tests/test_offload_parity.py::_torch_adam_modes: offload_optimizer cpu with torch_adam, stages 2 and 3."""
    import deepspeed

    import test_offload_parity as t
    from _parity import engine_run, make_model, reference_run

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    ref_losses, ref_params = reference_run(world)
    for stage in (2, 3):
        cfg = t._config(stage, "cpu", "/tmp/unused")
        cfg["optimizer"]["params"]["torch_adam"] = True
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        losses = engine_run(engine, world, rank)
        if stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict()
        else:
            state = engine.module.state_dict()
        diff = None
        if state:
            diff = max((state[n].float() - v).abs().max().item() for n, v in ref_params.items())
        out[stage] = dict(optimizer=type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer,
                                                                                       "optimizer") else None,
                          losses=losses, max_loss_rel=max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
                          max_param_diff=diff)
    out["ref_losses"] = ref_losses
    return out


def zero_to_fp32(save_root: str):
    """tests/test_zero_to_fp32.py::_train_and_save at stages 0-3, then DeepSpeed's own
    get_fp32_state_dict_from_zero_checkpoint on rank 0 against the engine's full state dict."""
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import test_zero_to_fp32 as t

    rank = dist.get_rank()
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = t.Tiny()
        engine, *_ = deepspeed.initialize(model=model, config=t._config(stage),
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ids = torch.randint(0, t.VOCAB, (t.BATCH,), generator=g)
            engine.backward(nn.functional.cross_entropy(engine(ids), ids))
            engine.step()
        save_dir = f"{save_root}/stage{stage}"
        engine.save_checkpoint(save_dir)
        full = (engine._zero3_consolidated_16bit_state_dict() if stage == 3
                else {k: v.detach().clone() for k, v in engine.module.state_dict().items()})
        dist.barrier()
        if rank != 0:
            continue
        try:
            sd = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        except Exception as exc:  # noqa: BLE001 -- recording what DeepSpeed's converter says
            out[stage] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        out[stage] = dict(keys_equal=sorted(sd) == sorted(full), missing=sorted(set(full) - set(sd)),
                          dtypes={k: str(v.dtype) for k, v in sd.items() if "num_batches" in k},
                          equal=[k for k in sd if k in full and torch.equal(sd[k].to(full[k].dtype), full[k])],
                          differ=[k for k in sd if k in full and not torch.equal(sd[k].to(full[k].dtype), full[k])],
                          tied=sd.get("head.weight") is not None
                          and sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr())
    return out


def mpu_autotp():
    """tests/test_tp_mpu.py::_worker on DeepSpeed: the AutoTP example's mpu (TP over both ranks, DP groups of one)
    with tensor_parallel.autotp_size 2, then the mismatched mpu (TP 1) with autotp_size 2."""
    import deepspeed

    import test_tp_mpu as t
    from _tp_util import make_model, token_data

    rank = dist.get_rank()
    tp_group = dist.new_group([0, 1])
    dp_groups = [dist.new_group([0]), dist.new_group([1])]
    mpu = t.ModelParallelUnit(tp_group, dp_groups[rank], 2)
    model = make_model("llama")
    engine, *_ = deepspeed.initialize(model=model, config=t._config(autotp_size=2), mpu=mpu,
                                      model_parameters=model.parameters())
    data = token_data(t.STEPS, batch=2)
    losses, norms = [], []
    for s in range(t.STEPS):
        loss = engine(input_ids=data[s], labels=data[s]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    ref_losses, ref_norms, _ = t._reference()
    out = dict(losses=losses, norms=norms, ref_losses=ref_losses, ref_norms=ref_norms)
    try:
        model = make_model("llama")
        e2, *_ = deepspeed.initialize(model=model, config=t._config(autotp_size=2),
                                      mpu=t.ModelParallelUnit(dist.group.WORLD, dist.group.WORLD, 1),
                                      model_parameters=model.parameters())
        batch = data[0]
        loss = e2(input_ids=batch, labels=batch).loss
        e2.backward(loss)
        e2.step()
        out["mismatch"] = f"accepted, first loss {loss.item():.6f}"
    except Exception as exc:  # noqa: BLE001 -- recording what DeepSpeed says
        out["mismatch"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def autotp_layer_specs(name: str):
    """tests/test_tp_layer_specs.py's cases on DeepSpeed's AutoTP (``partition_config`` / ``preset_model``); ``name``
    is a key of its CASES, or "neox_shaped" (the DeepSpeedExamples spec with ``shape`` on GPT-NeoX). Returns the
    losses; the test's docstring records them."""
    import deepspeed

    import test_tp_layer_specs as t
    from _tp_util import token_data

    if name == "neox_shaped":
        kind, tp = "neox", {"partition_config": {"use_default_specs": False, "layer_specs": t.NEOX_SHAPED}}
    else:
        kind, tp = t.CASES[name]
    # hf_zero's own key (its default splits the head over the vocabulary); DeepSpeed's AutoTP has no such head and
    # its config refuses the key
    tp = {k: v for k, v in tp.items() if k != "vocab_parallel_lm_head"}
    model = t._model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=t.LR, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=t._config(tp))
    losses = []
    for ids in token_data(t.STEPS, batch=2):
        loss = t._loss(engine, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "reference": t._reference(kind)[0]}


def autotp_zero3(kind: str = "llama"):
    """tests/test_tp_engine.py's stage-3 run on DeepSpeed: DP 2 x TP 2 on 4 ranks (``tensor_parallel.autotp_size``
    2, every parameter partitioned: persistence threshold 0), each data-parallel rank its half of the global batch.
    Returns the losses (averaged over the ranks) and gradient norms beside the one-process reference's. Llama only:
    DeepSpeed's AutoTP refuses GPT-2 ("AutoTP not supported for model")."""
    import deepspeed

    import test_tp_engine as t
    from _tp_util import make_model, token_data

    config = t._config(3, kind)
    model = make_model(kind)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    dp = dist.get_world_size() // 2
    dp_rank = dist.get_rank() // 2  # ranks are laid out dp x tp, TP innermost (as hf_zero's mesh)
    data = token_data(t.STEPS, batch=2 * dp)
    losses, norms = [], []
    for s in range(t.STEPS):
        ids = data[s].view(dp, 2, -1)[dp_rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        norms.append(float(engine.get_global_grad_norm()))
    ref_losses, ref_norms, _ = t.reference(kind, dp)
    return {"losses": losses, "norms": norms, "ref_losses": ref_losses, "ref_norms": ref_norms}
