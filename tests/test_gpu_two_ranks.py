"""Two ranks on one GPU (gloo), CUDA tensors at world size 2: ZeRO-2 and ZeRO-3 partitioning, gathers and
gradient reduce-scatters of CUDA shards, against one process training the same model on the same two batches.

Marked ``gpu``: skipped without CUDA (CI). With one GPU, NCCL refuses two ranks on the same device, so the ranks
talk over gloo; gloo has no reduce for CUDA tensors, and hf_zero's bulk collectives copy through host memory there
(comm/collectives.py, ``_gloo_on_gpu``). What this does not test: NCCL between GPUs, pipeline and tensor-parallel
stages on their own GPUs -- they need a machine with several GPUs.

fp32 throughout (TF32 off), so the comparison is tight: the sum of two ranks' mean-gradients, halved, against the
gradient of the mean of the two losses; 1e-5 relative on each loss; the final parameters within 1e-5 except where
Adam amplifies rounding (see the test).
"""

from __future__ import annotations

import pytest
import torch

from hf_zero.testing import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")]

STEPS, LR, CLIP = 4, 1e-3, 1.0


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                        max_position_embeddings=64))


def _batch(rank: int, step: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 512, (2, 32), generator=g).to(device)


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 1000}


def _rank_run(stage: int, compiled: bool = False) -> dict:
    import torch.distributed as dist

    import hf_zero
    from hf_zero.zero.stage3.param import sharded_param_of

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rank = dist.get_rank()
    cfg = _config(stage)
    if stage == 3:
        start = _model().state_dict()
        with hf_zero.zero.Init(config_dict_or_path=cfg):
            model = _model()
        with hf_zero.zero.GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(start[name])
    else:
        model = _model()
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if compiled:  # inductor's CUDA kernels between the ZeRO-3 hooks (docs/compile.md)
        engine.compile()
    shard_devices = sorted({(sp.storage.device.type if (sp := sharded_param_of(p)) is not None else p.device.type)
                            for p in engine.module.parameters()})
    losses = []
    for step in range(STEPS):
        x = _batch(rank, step, engine.device)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    numel = [sp.shard_numel for p in engine.module.parameters() if (sp := sharded_param_of(p)) is not None]
    out = {"losses": losses, "params": params, "shard_devices": shard_devices, "device": str(engine.device),
           "shard_numels": numel[:3]}
    if stage == 3:  # the gathers' divergence trailers were set aside on the GPU and all checked (gather.py)
        g = engine.stage3.gatherer
        out["trailers"] = (g.deferred_trailer_checks, len(g._unchecked), g.gather_count)
    engine.destroy()
    return out


def _reference() -> tuple[list[list[float]], dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        per_rank = [model(input_ids=(x := _batch(r, step, "cuda")), labels=x).loss for r in range(2)]
        (sum(per_rank) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append([t.item() for t in per_rank])
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,compiled", [(2, False), (3, False), (3, True)])
def test_two_ranks_share_one_gpu(stage, compiled):
    ref_losses, ref_params = _reference()
    outs = run_distributed(_rank_run, 2, args=(stage, compiled), fork_server=False, timeout_s=300)
    # inductor's fused kernels sum in another order than eager's: 1e-4 on the losses when compiled
    rel = 1e-4 if compiled else 1e-5
    for rank, out in enumerate(outs):
        assert out["device"] == "cuda:0"
        assert out["shard_devices"] == ["cuda"]
        for step in range(STEPS):
            assert out["losses"][step] == pytest.approx(ref_losses[step][rank], rel=rel), (rank, step)
        for name, ref in ref_params.items():
            diff = (out["params"][name] - ref).abs()
            # Adam normalises each element's step: an element whose gradient is ~0 (an embedding row seen once)
            # moves by up to lr whatever that gradient's rounding, so summation order (one process vs two ranks)
            # may show there (measured on the H100: 1 element of 65536, 7e-5). A partitioning bug moves whole
            # shards. Hence: every element within lr / 2, and at most 0.1% beyond 1e-5.
            assert diff.max() <= LR / 2, (name, diff.max().item())
            assert (diff > rel).float().mean() <= 1e-3, (name, (diff > rel).sum().item())
    if stage == 3:  # partitioned in two: each rank holds half of every (unpadded) parameter
        for out in outs:
            checked, unchecked, gathers = out["trailers"]
            assert unchecked == 0 and 0 < checked <= gathers, out["trailers"]
        full = {n: p.numel() for n, p in ref_params.items()}
        assert outs[0]["shard_numels"] == [-(-n // 2) for n in list(full.values())[:3]]


def _hybrid_rank_run() -> dict:
    """ZeRO-3 with ``hybrid_engine`` on CUDA shards: greedy rollouts between steps (DeepSpeed-Chat's actor)."""
    import torch.distributed as dist

    import hf_zero

    torch.backends.cuda.matmul.allow_tf32 = False
    rank = dist.get_rank()
    model = _model()
    torch.cuda.manual_seed(10 + rank)  # seeded apart: the hybrid engine gives every rank rank 0's CUDA RNG state
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(),
                                    config={**_config(3), "hybrid_engine": {"enabled": True}})
    states = [None, None]
    dist.all_gather_object(states, torch.cuda.get_rng_state(engine.device))
    prompts = _batch(rank, 0, engine.device)[:, :8]
    gatherer = engine.stage3.gatherer
    before = gatherer.gathered_numel
    engine.eval()
    with torch.no_grad():
        tokens = engine.module.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6,
                                        do_sample=False, pad_token_id=0, synced_gpus=True)
    gathered = gatherer.gathered_numel - before
    engine.train()
    x = _batch(rank, 1, engine.device)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    out = {"tokens": tokens.cpu(), "device": str(tokens.device), "rng_synced": bool(torch.equal(*states)),
           "gathered": gathered, "loss": loss.item()}
    engine.destroy()
    return out


def test_hybrid_engine_generates_with_cuda_shards_gathered_once():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model().cuda().eval()
    numel = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        ref = [model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=6, do_sample=False,
                              pad_token_id=0).cpu() for p in (_batch(r, 0, "cuda")[:, :8] for r in range(2))]
    outs = run_distributed(_hybrid_rank_run, 2, fork_server=False, timeout_s=300)
    for rank, out in enumerate(outs):
        assert out["device"] == "cuda:0" and out["rng_synced"]
        torch.testing.assert_close(out["tokens"], ref[rank], rtol=0, atol=0)
        assert 0.9 * numel <= out["gathered"] <= numel, (out["gathered"], numel)  # once, not per decoding step
        assert 4.0 < out["loss"] < 8.0  # a step after the rollout trains (log(512) ~ 6.2 at the start)
