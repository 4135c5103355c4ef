"""Tensor parallelism on DTensor against a single-process reference: tiny Llama (grouped-query attention, the
plan its config declares) and tiny GPT-2 (fused Conv1D q|k|v, tied vocabulary-parallel embedding / head, hf_zero's
own plan), TP 2 and TP 4 on CPU/gloo, fp32, plain torch optimizers over the DTensor parameters."""

from __future__ import annotations

import functools

import pytest
import torch

from _tp_spawns import case, register
from _tp_util import VOCAB, make_model, rel, token_data, train

STEPS = 3


@functools.lru_cache(maxsize=None)
def reference(kind: str):
    adam = train(make_model(kind), "adamw", STEPS)
    model = make_model(kind)
    sgd = train(model, "sgd", STEPS)
    return adam, sgd, {n: t.detach().clone() for n, t in model.state_dict().items()}


def _tp_worker(kinds: tuple[str, ...]):
    return {kind: _tp_run(kind) for kind in kinds}


def _tp_run(kind: str):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hf_zero.tensor_parallel import apply_tp, build_mesh, tp_info, vocab_parallel_cross_entropy
    from hf_zero.tensor_parallel.state import full_state_dict

    tp = dist.get_world_size()
    mesh = build_mesh(tp)
    out = {}
    model = apply_tp(make_model(kind), mesh.tp_mesh)
    out["adam"] = train(model, "adamw", STEPS)
    model = apply_tp(make_model(kind), mesh.tp_mesh)
    out["sgd"] = train(model, "sgd", STEPS)
    out["state"] = full_state_dict(model)
    out["plan_source"] = tp_info(model).plan_source
    # the LM head's logits stay sharded over the vocabulary: this rank holds VOCAB / tp columns
    logits = model(input_ids=token_data(1)[0]).logits
    out["logits"] = (isinstance(logits, DTensor), tuple(logits.to_local().shape), tuple(logits.shape))
    # the vocabulary-parallel cross-entropy (with ignored targets) equals F.cross_entropy, value and gradient
    g = torch.Generator().manual_seed(5)
    full = torch.randn(6, VOCAB, generator=g, requires_grad=True)
    target = torch.randint(0, VOCAB, (6,), generator=g)
    target[2] = -100
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(full.detach(), mesh.tp_mesh, [Shard(1)]).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(sharded, target)
    loss.backward()
    out["ce"] = (loss.item(), sharded.grad.full_tensor())
    return out


for _tp in (2, 4):  # in the shared process groups of 2 and 4 ranks (tests/_tp_spawns.py)
    register(_tp, "parity", _tp_worker, (("llama", "gpt2"),))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_process(tp, kind):
    _check(kind, tp, [r[kind] for r in case(tp, "parity")])


def _check(kind: str, tp: int, results: list[dict]):
    adam_ref, sgd_ref, state_ref = reference(kind)
    for rank, out in enumerate(results):
        for step, (a, b) in enumerate(zip(out["adam"], adam_ref)):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, step, a, b)
        for step, (a, b) in enumerate(zip(out["sgd"], sgd_ref)):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, step, a, b)
        assert set(out["state"]) == set(state_ref)
        for name, ref in state_ref.items():
            assert out["state"][name].shape == ref.shape, name
            assert rel(out["state"][name], ref) <= 1e-5, (rank, name, rel(out["state"][name], ref))
        assert out["logits"] == (True, (4, 16, VOCAB // tp), (4, 16, VOCAB))
    expected_source = "LlamaConfig.base_model_tp_plan" if kind == "llama" else "hf_zero's plan for model_type='gpt2'"
    assert results[0]["plan_source"] == expected_source

    full = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(5), requires_grad=True)
    g = torch.Generator().manual_seed(5)
    torch.randn(6, VOCAB, generator=g)
    target = torch.randint(0, VOCAB, (6,), generator=g)
    target[2] = -100
    loss = torch.nn.functional.cross_entropy(full, target, ignore_index=-100)
    loss.backward()
    ce_loss, ce_grad = results[0]["ce"]
    assert abs(ce_loss - loss.item()) <= 1e-6 * loss.item()
    assert rel(ce_grad, full.grad) <= 1e-6
