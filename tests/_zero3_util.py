"""Shared pieces of the ZeRO-3 tests: tiny models from config, data, and a tiny SGD step done on the shards."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_zero.zero.stage3 import Stage3Runtime

STEPS = 6

LR = 0.05


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def reference_model(cfg, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def batches(steps: int, world_size: int, per_rank: int = 2, seq: int = 8, vocab: int = 64, seed: int = 1):
    """``steps`` global batches of shape (world_size * per_rank, seq); rank r takes rows [r*per_rank, ...)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (world_size * per_rank, seq), generator=g) for _ in range(steps)]


def local_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = batch.shape[0] // world_size
    return batch[rank * per:(rank + 1) * per]


def make_runtime(model, **kw) -> Stage3Runtime:
    args = dict(compute_dtype=torch.float32, reduce_bucket_size=3000, prefetch_bucket_size=3000,
                max_live_parameters=100_000, max_reuse_distance=1000, param_persistence_threshold=40,
                overlap_comm=True, divergence_timeout_s=30.0)
    args.update(kw)
    return Stage3Runtime(model, **args)


def sgd_step_on_shards(rt: Stage3Runtime, lr: float = LR) -> None:
    with torch.no_grad():
        for sp in rt.sharded_params():
            if sp.requires_grad and sp.grad_storage is not None:
                sp.local_shard.add_(sp.grad_storage.to(sp.local_shard.dtype), alpha=-lr)
                sp.grad_storage.zero_()
    rt.after_step()


def reference_train(model, data, lr: float = LR) -> list[float]:
    losses = []
    for batch in data:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
                    p.grad = None
        losses.append(loss.item())
    return losses


def global_loss(local_loss: torch.Tensor) -> float:
    t = local_loss.detach().clone().reshape(1)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item() + 1e-12
    assert err <= rtol * scale, f"{what}: max abs error {err:.3e} > {rtol:g} * {scale:.3e}"


_HF_DS_CONFIG = []  # transformers holds a weak reference to its HfDeepSpeedConfig: keep it alive here


def enable_transformers_zero3() -> None:
    """Make transformers take its ZeRO-3 paths (initialize_weights_zero3, zero3 state-dict loading, synced generate)
    through hf_zero's ``deepspeed`` compatibility layer, as an installed hf_zero does at interpreter start-up."""
    from hf_zero.integrations.deepspeed_shim._finder import install

    install()
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    _HF_DS_CONFIG.append(HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
                                            "gradient_accumulation_steps": 1}))
    assert is_deepspeed_zero3_enabled()


def train_and_compare(model, ref, steps: int, rank: int, world: int, **runtime_kw):
    """Train ``model`` (partitioned) through the runtime contract and ``ref`` in one process on the same global
    batches; assert losses and final parameters agree. Returns the runtime (still installed)."""
    from hf_zero.zero.stage3.consolidate import consolidated_state_dict

    rt = make_runtime(model, **runtime_kw)
    sps = rt.sharded_params()
    assert model.model.embed_tokens.weight is model.lm_head.weight
    assert sum(1 for sp in sps if sp.param is model.lm_head.weight) == 1  # tied: one ShardedParam
    assert all(sp.param.shape == (0,) for sp in sps if not sp.persistent)
    data = batches(steps, world)
    losses = []
    for batch in data:
        x = local_rows(batch, rank, world)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        rt.finish_backward()
        sgd_step_on_shards(rt)
        losses.append(global_loss(loss))
    ref_losses = reference_train(ref, data)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, ref_losses)
    assert len(set(round(l, 6) for l in losses)) == steps  # it trained: every step's loss differs
    full = consolidated_state_dict(model)
    if rank == 0:
        expected = ref.state_dict()
        assert sorted(full) == sorted(expected)
        for name, p in expected.items():
            assert_close(full[name], p, 1e-4, name)
        assert full["lm_head.weight"] is full["model.embed_tokens.weight"]  # still tied
    else:
        assert full is None
    assert model.model.embed_tokens.weight is model.lm_head.weight
    return rt, losses


def init_model_parity(steps: int):
    """The issue's test: build under zero.Init, load reference weights via GatheredParameters(modifier_rank=0)."""
    enable_transformers_zero3()
    from transformers import AutoModelForCausalLM

    from hf_zero.zero import GatheredParameters, Init

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = tiny_llama_config()
    ref = reference_model(cfg)
    torch.manual_seed(100 + rank)  # ranks build different random values: the load below must make them agree
    with Init():
        model = AutoModelForCausalLM.from_config(cfg)
    params = list(model.parameters())
    assert all(p.shape == (0,) for p in params)
    full_numel = sum(p.ds_numel for p in params)
    local_numel = sum(p.ds_tensor.numel() for p in params)
    # ~1/N of the elements right after construction (padding: at most world-1 per parameter)
    assert full_numel / world <= local_numel <= full_numel / world + len(params) * (world - 1), \
        (local_numel, full_numel)
    assert sorted(p.ds_id for p in params) == sorted(set(p.ds_id for p in params))
    assert model.lm_head.weight.ds_shape == (cfg.vocab_size, cfg.hidden_size)
    with GatheredParameters(params, modifier_rank=0):
        assert model.lm_head.weight.shape == (cfg.vocab_size, cfg.hidden_size)
        if rank == 0:
            model.load_state_dict(ref.state_dict())
    assert all(p.shape == (0,) for p in params)
    rt, losses = train_and_compare(model, ref, steps, rank, world)
    rt.remove()
    assert model.lm_head.weight.shape == (cfg.vocab_size, cfg.hidden_size)  # remove() gives full params back
    assert not hasattr(model.lm_head.weight, "ds_id")
    assert_close(model.lm_head.weight.data, ref.lm_head.weight.data, 1e-4, "lm_head after remove")
    return losses
