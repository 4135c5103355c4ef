"""ZeRO-3 on real transformers models, 2 ranks, one spawn: checkpointing, LoRA, eval, generate, from_pretrained,
a module called twice, an external parameter, the consolidated state dict's memory. Each check asserts numbers
against a single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from hf_zero.testing import run_distributed
from hf_zero.util.hf_compat import enable_activation_checkpointing

from _zero3_util import (STEPS, assert_close, batches, enable_transformers_zero3, global_loss, init_model_parity,
                         local_rows, make_runtime, reference_model, reference_train, sgd_step_on_shards,
                         tiny_llama_config)


def _build_partitioned(cfg, ref):
    from transformers import AutoModelForCausalLM

    from hf_zero.zero import GatheredParameters, Init

    with Init():
        model = AutoModelForCausalLM.from_config(cfg)
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        if dist.get_rank() == 0:
            model.load_state_dict(ref.state_dict(), strict=False)
    return model


def _train(model, rt, data, rank, world):
    persistent_numel = sum(sp.numel for sp in rt.sharded_params() if sp.persist_planned)
    losses = []
    for batch in data:
        x = local_rows(batch, rank, world)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        # by the end of backward every gathered copy is freed again (none leaked by early-stopped recomputation)
        assert rt.gatherer.live_numel == persistent_numel, (rt.gatherer.live_numel, persistent_numel)
        rt.finish_backward()
        sgd_step_on_shards(rt)
        losses.append(global_loss(loss))
    return losses


def _assert_losses(losses, ref_losses, rtol=1e-4):
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= rtol * abs(b), (losses, ref_losses)


def _run_plain(cfg, rank, world, steps, **kw):
    """A plain model (no zero.Init) trained ``steps`` steps; returns (runtime, elements gathered per step, header
    counts)."""
    model, ref = reference_model(cfg), reference_model(cfg)
    rt = make_runtime(model, **kw)
    g = rt.gatherer
    g.reset_peak()
    data = batches(steps, world, seed=7)
    counts, headers, losses = [], [], []
    for batch in data:
        before = g.gathered_numel
        losses += _train(model, rt, [batch], rank, world)
        counts.append(g.gathered_numel - before)
        headers.append(g.header_check_count)
    _assert_losses(losses, reference_train(ref, data))
    return rt, counts, headers


def _check_prefetch_reuse_and_limits(cfg, rank, world):
    """A divergence check before every gather, every step (comms_divergence_check); prefetch, reuse and the live
    limit act."""
    persistent = 40
    rt, counts, headers = _run_plain(cfg, rank, world, 3, prefetch_bucket_size=5000, max_reuse_distance=0,
                                     param_persistence_threshold=persistent)
    assert headers[0] > 0 and headers[1] - headers[0] == headers[2] - headers[1] > 0, headers
    assert rt.prefetched_numel > 0
    no_reuse = counts[-1]
    rt.remove()
    # Reuse: a parameter needed again within 10k elements (the tied embedding, each layer's forward -> backward)
    # stays gathered: fewer elements gathered per step.
    rt, counts, _ = _run_plain(cfg, rank, world, 2, prefetch_bucket_size=0, max_reuse_distance=10_000,
                               param_persistence_threshold=persistent)
    assert counts[-1] < no_reuse, (counts, no_reuse)
    rt.remove()
    # Live limit: no prefetch or reuse beyond max_live_parameters (one module's gather may exceed it alone).
    limit = 3000
    rt, _, _ = _run_plain(cfg, rank, world, 2, prefetch_bucket_size=100_000, max_reuse_distance=100_000,
                          max_live_parameters=limit, param_persistence_threshold=persistent)
    largest = max(g.numel for g in rt._groups.values())
    persistent_numel = sum(sp.numel for sp in rt.sharded_params() if sp.persist_planned)
    assert rt.gatherer.peak_live_bytes // 4 <= limit + largest + persistent_numel
    rt.remove()


def _check_checkpointing(cfg, rank, world, use_reentrant):
    ref = reference_model(cfg)
    model = _build_partitioned(cfg, ref)
    enable_activation_checkpointing(model, use_reentrant=use_reentrant)
    enable_activation_checkpointing(ref, use_reentrant=use_reentrant)
    model.train()
    ref.train()
    rt = make_runtime(model)
    data = batches(3, world, seed=11)
    _assert_losses(_train(model, rt, data, rank, world), reference_train(ref, data))
    rt.remove()
    for name, p in ref.named_parameters():
        assert_close(dict(model.named_parameters())[name].data, p.data, 1e-4, f"checkpointing {name}")


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def _check_lora_frozen_base(cfg, rank, world, use_reentrant):
    """Frozen base + LoRA with activation checkpointing: frozen params recomputed under checkpointing must be
    whole when their backward runs (transformers#47254), and frozen shards get no grad storage."""
    ref = _lora(reference_model(cfg))
    model = _lora(_build_partitioned(cfg, reference_model(cfg)))
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(ref_params[name])  # plain parameters: built after zero.Init, identical on every rank
    for m in (model, ref):
        enable_activation_checkpointing(m, use_reentrant=use_reentrant)
        m.enable_input_require_grads()
        m.train()
    rt = make_runtime(model, param_persistence_threshold=0)
    sps = rt.sharded_params()
    frozen = [sp for sp in sps if not sp.requires_grad]
    trainable = [sp for sp in sps if sp.requires_grad]
    assert frozen and trainable and all("lora_" in sp.name for sp in trainable)
    data = batches(3, world, seed=13)
    _assert_losses(_train(model, rt, data, rank, world), reference_train(ref, data))
    assert all(sp.grad_storage is None for sp in frozen)
    assert all(sp.grad_storage is not None for sp in trainable)
    assert any(sp.grad_storage.abs().sum() == 0 for sp in trainable)  # zeroed by the step, still allocated
    rt.remove()
    for name, p in ref.named_parameters():
        assert_close(dict(model.named_parameters())[name].data, p.data, 1e-4, f"lora {name}")


class _TwiceAndExternal(nn.Module):
    """``lin`` runs twice per forward; ``aux.weight`` is used by the parent, outside ``aux``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.aux = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.lin(torch.tanh(self.lin(x)))
        h = torch.tanh(h @ self.aux.weight.t())
        return self.head(h)


def _check_twice_and_external(rank, world):
    from hf_zero.zero import register_external_parameter

    torch.manual_seed(3)
    ref = _TwiceAndExternal()
    model = _TwiceAndExternal()
    model.load_state_dict(ref.state_dict())
    register_external_parameter(model, model.aux.weight)
    rt = make_runtime(model, param_persistence_threshold=0, reduce_bucket_size=40,  # tiny buckets: many flushes
                      overlap_comm=False)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(world * 3, 16, generator=g) for _ in range(3)]
    ys = [torch.randn(world * 3, 4, generator=g) for _ in range(3)]
    for x, y in zip(xs, ys):
        loss = ((model(local_rows(x, rank, world)) - local_rows(y, rank, world)) ** 2).mean()
        loss.backward()
        rt.finish_backward()
        sgd_step_on_shards(rt, lr=0.1)
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(p.grad, alpha=-0.1)
                p.grad = None
        assert abs(global_loss(loss) - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    rt.remove()
    for name, p in ref.named_parameters():
        assert_close(dict(model.named_parameters())[name].data, p.data, 1e-5, f"twice/external {name}")


def _check_eval_generate_and_state_dict(cfg, rank, world, tmp_dir):
    from transformers import AutoModelForCausalLM

    from hf_zero.zero import GatheredParameters, Init
    from hf_zero.zero.stage3.consolidate import consolidated_state_dict

    ref = reference_model(cfg, seed=21)
    if rank == 0:
        ref.save_pretrained(tmp_dir)
    dist.barrier()
    with Init():
        model = AutoModelForCausalLM.from_pretrained(tmp_dir)
    assert all(p.shape == (0,) for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rt = make_runtime(model)
    model.eval()
    ref.eval()
    # no_grad eval: logits equal the reference's
    x = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        assert_close(model(input_ids=x).logits, ref(input_ids=x).logits, 1e-5, "eval logits")
    assert rt.gatherer.live_numel == sum(sp.numel for sp in rt.sharded_params() if sp.persist_planned)
    # generate(synced_gpus=True): prompt lengths and max_new_tokens differ per rank
    prompt = torch.randint(3, 64, (1, 3 + 2 * rank), generator=torch.Generator().manual_seed(50 + rank))
    new = 3 + 4 * rank
    out = model.generate(prompt, max_new_tokens=new, do_sample=False, synced_gpus=True, pad_token_id=0)
    expected = ref.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected), (out, expected)
    # consolidated state dict: streamed, peak ~ one module's parameters
    module_bytes = max(sum(sp.numel * sp.local_shard.element_size() for sp in g.sps) for g in rt._groups.values())
    rt.gatherer.reset_peak()
    base_live = rt.gatherer.live_bytes
    full = consolidated_state_dict(model, dtype=torch.bfloat16)
    peak = rt.gatherer.peak_live_bytes - base_live
    assert 0 < peak <= module_bytes, (peak, module_bytes)
    if rank == 0:
        for name, p in ref.state_dict().items():
            assert full[name].dtype == (torch.bfloat16 if p.is_floating_point() else p.dtype)
            assert_close(full[name], p.to(torch.bfloat16), 1e-2, name)
    else:
        assert full is None
    # GatheredParameters on ordinary tensors is a no-op
    plain = nn.Parameter(torch.full((3,), float(rank)))
    with GatheredParameters(plain, modifier_rank=0):
        plain.data.add_(1)
    assert torch.equal(plain.data, torch.full((3,), float(rank) + 1))
    # modifier_rank edits land everywhere and are re-partitioned
    w = model.model.layers[0].mlp.up_proj.weight
    with GatheredParameters(w, modifier_rank=1):
        if rank == 1:
            w.data.fill_(0.25)
    assert w.shape == (0,)
    with GatheredParameters(w):
        assert torch.all(w == 0.25) and w.shape == (cfg.intermediate_size, cfg.hidden_size)
    rt.remove()


def _check_init_entry_points(rank, world):
    """zero.Init(module=...) partitions a built module; transformers' prevent_arange_dtype_change swaps the
    wrapper in the module Init reads it from (deepspeed.runtime.zero.partition_parameters is hf_zero.zero.init)."""
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    import hf_zero.zero.init as pp
    from hf_zero.zero import GatheredParameters, Init

    torch.manual_seed(0)
    lin = nn.Linear(4, 6)
    expected = lin.weight.detach().clone()
    Init(module=lin)
    assert lin.weight.shape == (0,) and lin.weight.ds_tensor.numel() == 12  # 24 elements / 2 ranks
    with GatheredParameters([lin.weight, lin.bias]):
        assert torch.equal(lin.weight, expected)
    original = pp.zero_wrapper_for_fp_tensor_constructor
    with prevent_arange_dtype_change():
        assert pp.zero_wrapper_for_fp_tensor_constructor is not original
        with Init() as ctx:
            inner = nn.Linear(3, 3)
            assert ctx._fp_constructor_wrapper is pp.zero_wrapper_for_fp_tensor_constructor
        assert inner.weight.shape == (0,)
    assert pp.zero_wrapper_for_fp_tensor_constructor is original


class _Swapping(nn.Module):
    """Two layers whose order the caller picks: the second iteration runs them in the other order."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, swap=False):
        a, b = (self.second, self.first) if swap else (self.first, self.second)
        return b(torch.tanh(a(x)))


def _check_trace_miss_warning(rank):
    """zero_optimization.log_trace_cache_warnings: a module asking out of the recorded order is logged once per
    iteration, naming it; without the key nothing is logged."""
    import logging

    import hf_zero

    logged = {}
    for flag in (True, False):
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("hf_zero").addHandler(handler)
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "log_trace_cache_warnings": flag}}
        engine, *_ = hf_zero.initialize(model=_Swapping(), config=cfg)
        for swap in (False, True, True):
            engine.backward(engine(torch.randn(2, 8), swap=swap).sum())
            engine.step()
        engine.destroy()
        logging.getLogger("hf_zero").removeHandler(handler)
        logged[flag] = [r.getMessage() for r in records if "prefetch trace" in r.getMessage()]
    # the swapped iterations ask for 'first' after 'second': a miss in each (forward; once per iteration)
    assert len(logged[True]) == 2 and all("module first asked" in m for m in logged[True]), logged
    assert logged[False] == []


def _features(tmp_dir):
    enable_transformers_zero3()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = tiny_llama_config()
    init_model_parity(STEPS)  # the parity test, 2 ranks (4 ranks: test_zero3_parity)
    _check_init_entry_points(rank, world)
    _check_prefetch_reuse_and_limits(cfg, rank, world)
    for reentrant in (True, False):
        _check_checkpointing(cfg, rank, world, reentrant)
        _check_lora_frozen_base(cfg, rank, world, reentrant)
    _check_twice_and_external(rank, world)
    _check_eval_generate_and_state_dict(cfg, rank, world, tmp_dir)
    _check_trace_miss_warning(rank)
    return True


def test_zero3_features_on_2_ranks(tmp_path):
    assert run_distributed(_features, 2, args=(str(tmp_path),), timeout_s=200) == [True, True]
