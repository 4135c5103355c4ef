"""Compression on ZeRO-3 partitioned parameters (2 ranks, gloo): installed on a model built under zero.Init,
masks and quantizers act on the gathered weights in forward and backward, and match one unpartitioned process.

The model is a pure-PyTorch residual MLP LM (embedding, RMSNorm, linear blocks, head) so the spawned ranks do not
pay for importing transformers; compression only sees module names, nn.Linear and ``config.hidden_size``.
"""

import types

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.testing import run_distributed

CFG = {"compression_training": {
    "weight_quantization": {"shared_parameters": {"enabled": True, "per_channel": True},
                            "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 8},
                                                        "modules": ["fc1"]}}},
    "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "topk"},
                       "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["blocks.1.fc1"]}}},
    "row_pruning": {"shared_parameters": {"enabled": True},
                    "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"],
                                                "related_modules": [["fc2"]]}}},
    "channel_pruning": {"shared_parameters": {"enabled": True},
                        "different_groups": {"cp": {"params": {"dense_ratio": 0.75}, "modules": ["fc2"]}}},
}}


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, h):
        return h + self.fc2(torch.relu(self.fc1(self.norm(h))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=hidden, num_attention_heads=1)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # (B, T, vocab)


def _compressed_under_zero3():
    from hf_zero.compression import CompressionScheduler, init_compression, redundancy_clean
    from hf_zero.zero import GatheredParameters, Init
    from hf_zero.zero.stage3 import Stage3Runtime

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref = TinyLM()
    with Init():
        model = TinyLM()
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        if dist.get_rank() == 0:
            model.load_state_dict(ref.state_dict())
    init_compression(ref, CFG)
    init_compression(model, CFG)  # on partitioned parameters: shapes and scores from the full weights
    assert model.blocks[0].fc1.weight.shape == (0,)
    rt = Stage3Runtime(model, compute_dtype=torch.float32, reduce_bucket_size=3000, prefetch_bucket_size=3000,
                       max_live_parameters=100_000, max_reuse_distance=1000, param_persistence_threshold=40,
                       overlap_comm=True)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    out, expected = model(ids), ref(ids)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.square().mean().backward()
    rt.finish_backward()
    expected.square().mean().backward()
    # the learned scores are a partitioned parameter too; this rank's reduced gradient shard matches the reference
    mask = model.blocks[1].fc1.weight_transforms["sparse_pruning"]
    sp = next(s for s in rt.sharded_params() if s.param is mask.scores)
    ref_grad = ref.blocks[1].fc1.weight_transforms["sparse_pruning"].scores.grad.reshape(-1)
    shard = ref_grad[dist.get_rank() * sp.shard_numel:][:sp.shard_numel]
    torch.testing.assert_close(sp.grad_storage[:shard.numel()], shard, atol=1e-6, rtol=1e-4)
    # stats gather what they read; masks (buffers) are replicated and identical to the reference
    stats = CompressionScheduler(model).stats()
    assert abs(stats["compression/channel_pruning/density"] - 0.75) < 1e-6
    assert abs(stats["compression/row_pruning/density"] - 0.5) < 1e-6
    masks = {k: v for k, v in model.state_dict().items() if k.endswith(".mask")}
    ref_masks = {k: v for k, v in ref.state_dict().items() if k.endswith(".mask")}
    assert len(masks) == 4 and masks.keys() == ref_masks.keys()
    assert all(torch.equal(masks[k], ref_masks[k]) for k in masks)
    try:
        redundancy_clean(model, CFG)
    except RuntimeError as err:
        assert "ZeRO-3 partitioned" in str(err)
    else:
        raise AssertionError("redundancy_clean on partitioned parameters must refuse")
    rt.remove()
    return float(out.square().mean())


def test_compression_on_zero3_partitioned_parameters():
    losses = run_distributed(_compressed_under_zero3, 2, timeout_s=180)
    assert losses[0] == losses[1]


ENGINE_CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40}}


def _engine(seed: int):
    import hf_zero
    from hf_zero.compression import init_compression

    torch.manual_seed(seed)
    model = TinyLM()
    init_compression(model, CFG)
    engine, *_ = hf_zero.initialize(model=model, config=ENGINE_CFG)
    return engine


def _compression_state_through_zero3_checkpoint(save_dir):
    from hf_zero.compression import CompressionScheduler

    torch.set_num_threads(1)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine = _engine(seed=0)
    scheduler = CompressionScheduler(engine.module)
    for step in range(3):
        engine.backward(engine(ids).square().mean())
        engine.step()
        scheduler.step(step)
    engine.save_checkpoint(save_dir)
    probe = torch.arange(20).reshape(2, 10) % 64
    with torch.no_grad():
        expected = engine(probe)
    saved_masks = {k: v.clone() for k, v in engine.module.state_dict().items() if k.endswith(".mask")}
    weights = engine._zero3_consolidated_16bit_state_dict()

    fresh = _engine(seed=123)  # other weights and scores: everything must come from the checkpoint
    fresh.load_checkpoint(save_dir)
    with torch.no_grad():
        got = fresh(probe)
    masks = {k: v for k, v in fresh.module.state_dict().items() if k.endswith(".mask")}
    loaded = fresh._zero3_consolidated_16bit_state_dict()
    return expected, got, saved_masks, masks, weights, loaded


def test_compression_state_survives_a_zero3_engine_checkpoint(tmp_path):
    results = run_distributed(_compression_state_through_zero3_checkpoint, 2, args=(str(tmp_path / "ck"),),
                              timeout_s=240)
    for expected, got, saved_masks, masks, _, _ in results:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert len(saved_masks) == 4 and saved_masks.keys() == masks.keys()
        assert all(torch.equal(saved_masks[k], masks[k]) for k in masks)
    weights, loaded = results[0][4], results[0][5]
    assert weights.keys() == loaded.keys() and any(k.endswith("scores") for k in weights)
    for k in weights:
        assert torch.equal(weights[k], loaded[k]), k
