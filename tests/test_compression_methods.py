"""Each compression method changes a tiny model exactly as configured, and redundancy_clean keeps its outputs."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_zero.compression import (CompressedLinear, CompressionScheduler, init_compression, quantize_weights,
                                 redundancy_clean, weight_sparsity)
from hf_zero.compression.quant import GroupSpec, fake_quant, group_view
from hf_zero.compression.schedule import BitSchedule, DensitySchedule
from hf_zero.config.errors import ConfigError

torch.set_num_threads(1)


def tiny_llama(kv_heads=4, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=False,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def tokens(seed=1):
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))


def section(method, params, modules, shared=None, related=None):
    group = {"params": params, "modules": modules}
    if related:
        group["related_modules"] = [related]
    return {"compression_training": {method: {"shared_parameters": {"enabled": True, **(shared or {})},
                                              "different_groups": {"g1": group}}}}


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def levels_per_group(weight, spec):
    return max(int(torch.unique(row).numel()) for row in group_view(weight, spec))


# ---- quantization ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("qtype", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("granularity", [{}, {"per_channel": True}, {"group_size": 16}])
def test_weight_quantization_grid(bits, qtype, granularity):
    model = tiny_llama()
    ref = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("mlp.up_proj")}
    cfg = section("weight_quantization", {"start_bits": bits, "target_bits": bits}, ["mlp.up_proj"],
                  {"quantization_type": qtype, **granularity})
    init_compression(model, cfg)
    spec = GroupSpec(per_channel=granularity.get("per_channel", False), group_size=granularity.get("group_size"))
    for name, w0 in ref.items():
        module = model.get_submodule(name)
        assert isinstance(module, CompressedLinear)
        assert int(module.weight_transforms["weight_quantization"].bits) == bits
        w, _ = module.folded()
        assert levels_per_group(w, spec) <= 2**bits
        step = (w0.abs().max() * 2) / (2**bits - 2)  # coarsest possible grid step
        assert (w - w0).abs().max() <= step / 2 + 1e-6
        assert not torch.equal(w, w0)
    # other modules untouched
    assert not isinstance(model.model.layers[0].mlp.down_proj, CompressedLinear)


def test_fake_quant_straight_through_gradient():
    w = torch.randn(8, 16, requires_grad=True)
    q = fake_quant(w, 4, True)
    (q * torch.arange(16.0)).sum().backward()
    torch.testing.assert_close(w.grad, torch.arange(16.0).expand(8, 16))


def test_bit_schedule_and_offset():
    model = tiny_llama()
    cfg = section("weight_quantization", {"start_bits": 8, "target_bits": 4, "quantization_period": 10}, ["q_proj"],
                  {"schedule_offset": 5})
    init_compression(model, cfg)
    quantizer = model.model.layers[1].self_attn.q_proj.weight_transforms["weight_quantization"]
    sched = CompressionScheduler(model)
    seen = []
    for step in (0, 4, 5, 14, 15, 25, 35, 45, 100):
        sched.step(step)
        seen.append(int(quantizer.bits))
    assert seen == [0, 0, 8, 8, 7, 6, 5, 4, 4]
    assert BitSchedule(8, 4, 5, 10).at(15) == 7
    sched.step(0)
    ids = tokens()
    w0 = model.model.layers[1].self_attn.q_proj.weight.detach().clone()
    assert torch.equal(model.model.layers[1].self_attn.q_proj.folded()[0], w0)  # off before the offset
    assert torch.isfinite(logits(model, ids)).all()


def test_activation_quantization_levels_and_static_range():
    model = tiny_llama()
    cfg = section("activation_quantization", {"bits": 4}, ["down_proj"], {"range_calibration": "static"})
    init_compression(model, cfg)
    module = model.model.layers[0].mlp.down_proj
    aq = module.input_transforms["activation_quantization"]
    seen = {}

    def grab(mod, args, out):
        seen.setdefault("x", aq(args[0]))

    handle = module.register_forward_hook(grab)
    model.train()
    with torch.no_grad():
        model(tokens())
    handle.remove()
    assert torch.unique(seen["x"]).numel() <= 16
    assert bool(aq.calibrated) and float(aq.range_max) > 0 > float(aq.range_min)
    lo = float(aq.range_min)
    model.train()
    with torch.no_grad():
        model(tokens(seed=2))
    assert float(aq.range_min) != lo  # EMA moved


def test_ptq_weight_only():
    model = tiny_llama()
    done = quantize_weights(model, bits=4, group_size=32, modules=["mlp"])
    assert len(done) == 6 and set(done.values()) == {4}
    w = model.model.layers[0].mlp.gate_proj.weight.detach()
    assert levels_per_group(w, GroupSpec(group_size=32)) <= 16
    with pytest.raises(ValueError, match="matched no"):
        quantize_weights(model, modules=["nope"])


# ---- pruning --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["l1", "topk"])
def test_sparse_pruning_density(method):
    model = tiny_llama()
    init_compression(model, section("sparse_pruning", {"dense_ratio": 0.3}, ["self_attn.(q|k)_proj"],
                                    {"method": method}))
    ids = tokens()
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            w, _ = proj.folded()
            assert abs(float((w != 0).float().mean()) - 0.3) < 1e-3
            if method == "topk":
                assert proj.weight_transforms["sparse_pruning"].scores.grad.abs().sum() > 0
        assert not isinstance(layer.self_attn.v_proj, CompressedLinear)
    # magnitude: the kept weights are the largest ones
    if method == "l1":
        proj = model.model.layers[0].self_attn.q_proj
        w, _ = proj.folded()
        assert proj.weight.detach().abs()[w == 0].max() <= proj.weight.detach().abs()[w != 0].min()


def test_gradual_sparsity_schedule():
    sched = DensitySchedule(0.2, offset=10, end=30, stride=5)
    assert [round(sched.at(s), 4) for s in (0, 10, 14, 15, 20, 30, 50)] == \
        [1.0, 1.0, 1.0, round(0.2 + 0.8 * 0.75**3, 4), round(0.2 + 0.8 * 0.5**3, 4), 0.2, 0.2]
    model = tiny_llama()
    init_compression(model, section("sparse_pruning", {"dense_ratio": 0.2}, ["mlp"],
                                    {"schedule_offset": 10, "schedule_offset_end": 30, "schedule_offset_stride": 5}))
    scheduler = CompressionScheduler(model)
    ids = tokens()
    densities = []
    for step in (0, 15, 20, 30):
        scheduler.step(step)
        logits(model, ids)  # masks update lazily, in the forward, from the weights seen there
        densities.append(round(1 - weight_sparsity(model.model.layers[0].mlp), 3))
    assert densities == pytest.approx([1.0, 0.2 + 0.8 * 0.75**3, 0.2 + 0.8 * 0.5**3, 0.2], abs=2e-3)
    assert scheduler.stats()["compression/sparse_pruning/density"] == pytest.approx(0.2, abs=1e-3)


ROW = section("row_pruning", {"dense_ratio": 0.25}, ["up_proj"], related=["gate_proj", "down_proj"])
HEAD = section("head_pruning", {"dense_ratio": 0.5}, ["o_proj"], related=["q_proj", "k_proj", "v_proj"])


def test_row_pruning_clean_shrinks_and_round_trips(tmp_path):
    model = tiny_llama()
    ids = tokens()
    dense = logits(model, ids)
    init_compression(model, ROW)
    masked = logits(model, ids)
    assert (masked - dense).abs().max() > 1e-3
    kept = model.model.layers[0].mlp.up_proj.weight_transforms["row_pruning"].kept_units()
    assert kept.numel() == 32
    redundancy_clean(model, ROW)
    mlp = model.model.layers[0].mlp
    assert type(mlp.up_proj) is torch.nn.Linear
    assert tuple(mlp.up_proj.weight.shape) == (32, 64) and tuple(mlp.gate_proj.weight.shape) == (32, 64)
    assert tuple(mlp.down_proj.weight.shape) == (64, 32)
    assert model.config.intermediate_size == 32
    cleaned = logits(model, ids)
    torch.testing.assert_close(cleaned, masked, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.intermediate_size == 32
    torch.testing.assert_close(logits(reloaded, ids), cleaned, atol=1e-5, rtol=1e-5)
    n_before = sum(p.numel() for p in tiny_llama().parameters())
    assert sum(p.numel() for p in reloaded.parameters()) == n_before - 2 * 3 * 64 * 96


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_head_pruning_clean_shrinks_and_round_trips(tmp_path, kv_heads):
    model = tiny_llama(kv_heads=kv_heads)
    ids = tokens()
    init_compression(model, HEAD)
    masked = logits(model, ids)
    redundancy_clean(model, HEAD)
    attn = model.model.layers[1].self_attn
    head_dim = 16
    assert model.config.num_attention_heads == 2 and model.config.head_dim == head_dim
    assert model.config.num_key_value_heads == kv_heads // 2
    assert tuple(attn.q_proj.weight.shape) == (2 * head_dim, 64)
    assert tuple(attn.k_proj.weight.shape) == (kv_heads // 2 * head_dim, 64)
    assert tuple(attn.o_proj.weight.shape) == (64, 2 * head_dim)
    cleaned = logits(model, ids)
    torch.testing.assert_close(cleaned, masked, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(reloaded, ids), cleaned, atol=1e-5, rtol=1e-5)


def test_all_methods_together_clean_matches_fake_quant(tmp_path):
    model = tiny_llama(kv_heads=2)
    cfg = {"compression_training": {
        **section("weight_quantization", {"start_bits": 8, "target_bits": 8}, ["self_attn", "mlp"],
                  {"per_channel": True})["compression_training"],
        **section("sparse_pruning", {"dense_ratio": 0.5}, ["v_proj"])["compression_training"],
        **ROW["compression_training"], **HEAD["compression_training"]}}
    ids = tokens()
    init_compression(model, cfg)
    up = model.model.layers[0].mlp.up_proj
    assert list(up.weight_transforms) == ["row_pruning", "weight_quantization"]  # masks before the quantizer
    fake = logits(model, ids)
    redundancy_clean(model, cfg)
    assert not any(isinstance(m, CompressedLinear) for m in model.modules())
    torch.testing.assert_close(logits(model, ids), fake, atol=1e-5, rtol=1e-5)
    v = model.model.layers[0].self_attn.v_proj.weight
    assert tuple(v.shape) == (16, 64)
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(reloaded, ids), fake, atol=1e-5, rtol=1e-5)


# ---- errors found against the model ---------------------------------------------------------------------------

def test_pattern_matching_nothing_is_named():
    with pytest.raises(ConfigError) as info:
        init_compression(tiny_llama(), section("sparse_pruning", {"dense_ratio": 0.5}, ["q_proj", "attention.query"]))
    assert info.value.key_path == "compression_training.sparse_pruning.different_groups.g1.modules[1]"
    assert "matches no torch.nn.Linear" in str(info.value)


def test_related_module_not_found_is_named():
    cfg = section("row_pruning", {"dense_ratio": 0.5}, ["up_proj"], related=["output.dense"])
    with pytest.raises(ConfigError) as info:
        init_compression(tiny_llama(), cfg)
    assert info.value.key_path == "compression_training.row_pruning.different_groups.g1.related_modules"


def test_impossible_ratio_is_named():
    cfg = section("head_pruning", {"dense_ratio": 0.1}, ["o_proj"], related=["q_proj", "k_proj", "v_proj"])
    with pytest.raises(ConfigError) as info:
        init_compression(tiny_llama(), cfg)
    assert info.value.key_path == "compression_training.head_pruning.different_groups.g1.params.dense_ratio"
    assert "keeps none" in str(info.value)


def test_group_size_not_dividing_is_named():
    cfg = section("weight_quantization", {"start_bits": 8, "target_bits": 8}, ["up_proj"], {"group_size": 48})
    with pytest.raises(ConfigError) as info:
        init_compression(tiny_llama(), cfg)
    assert info.value.key_path == "compression_training.weight_quantization.shared_parameters"
    assert "group_size 48" in str(info.value)


CHANNEL = section("channel_pruning", {"dense_ratio": 0.5}, ["o_proj", "down_proj"])


@pytest.mark.parametrize("tie", [False, True])
def test_channel_pruning_shrinks_hidden_size_and_round_trips(tmp_path, tie):
    model = tiny_llama(kv_heads=2)
    if tie:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    ids = tokens()
    dense = logits(model, ids)
    init_compression(model, CHANNEL)
    masked = logits(model, ids)
    assert (masked - dense).abs().max() > 1e-3
    # the residual stream is zero in pruned channels at every layer
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    owner = model.model.layers[0].self_attn.o_proj.weight_transforms["channel_pruning"]
    assert int(owner.mask.sum()) == 32
    for h in hidden[:-1]:
        assert float(h[..., ~owner.mask].abs().max()) == 0.0
    redundancy_clean(model, CHANNEL)
    assert model.config.hidden_size == 32 and model.config.head_dim == 16
    assert tuple(model.model.embed_tokens.weight.shape) == (96, 32)
    assert tuple(model.model.layers[1].self_attn.q_proj.weight.shape) == (64, 32)
    assert tuple(model.model.layers[1].mlp.down_proj.weight.shape) == (32, 128)
    assert tuple(model.lm_head.weight.shape) == (96, 32)
    cleaned = logits(model, ids)
    torch.testing.assert_close(cleaned, masked, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.hidden_size == 32
    torch.testing.assert_close(logits(reloaded, ids), cleaned, atol=1e-5, rtol=1e-5)


def test_channel_pruning_rejects_non_writer():
    cfg = section("channel_pruning", {"dense_ratio": 0.5}, ["k_proj", "down_proj"])
    with pytest.raises(ConfigError) as info:
        init_compression(tiny_llama(kv_heads=2), cfg)
    assert info.value.key_path == "compression_training.channel_pruning.different_groups.g1.modules"
    assert "not the hidden size 64" in str(info.value)


def test_mixed_quantize_ramp_and_stochastic_rounding():
    model = tiny_llama()
    cfg = section("weight_quantization", {"start_bits": 4, "target_bits": 4}, ["up_proj"],
                  {"schedule_offset": 2, "per_channel": True, "rounding": "stochastic",
                   "fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0.25}})
    init_compression(model, cfg)
    up = model.model.layers[0].mlp.up_proj
    wq = up.weight_transforms["weight_quantization"]
    scheduler = CompressionScheduler(model)
    scheduler.step(3)  # two steps into the schedule: half quantized
    assert float(wq.mix) == pytest.approx(0.5)
    w0 = up.weight.detach()
    full = fake_quant(group_view(w0, GroupSpec(per_channel=True)), 4, True).view_as(w0)
    up.eval()
    torch.testing.assert_close(up.folded()[0], w0 + 0.5 * (full - w0))
    scheduler.step(10)
    assert float(wq.mix) == 1.0
    torch.testing.assert_close(up.folded()[0], full)  # eval: nearest rounding
    up.train()
    with torch.enable_grad():
        noisy, _ = up.effective_weight()
    assert levels_per_group(noisy.detach(), GroupSpec(per_channel=True)) <= 16
    assert not torch.equal(noisy.detach(), full)  # stochastic rounding while training


def test_row_pruning_topk_learns_scores_and_cleans_exactly():
    model = tiny_llama()
    cfg = section("row_pruning", {"dense_ratio": 0.5}, ["up_proj"], {"method": "topk"},
                  related=["gate_proj", "down_proj"])
    init_compression(model, cfg)
    model.train()
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    mask = model.model.layers[0].mlp.up_proj.weight_transforms["row_pruning"]
    assert mask.scores.grad is not None and mask.scores.grad.abs().sum() > 0
    with torch.no_grad():
        mask.scores.copy_(torch.arange(128.0))  # learned scores now prefer the last 64 rows
    model.eval()
    masked = logits(model, ids)
    expected_down = model.model.layers[0].mlp.down_proj.weight.detach()[:, 64:].clone()
    redundancy_clean(model, cfg)
    torch.testing.assert_close(logits(model, ids), masked, atol=1e-5, rtol=1e-5)
    assert model.config.intermediate_size == 64
    torch.testing.assert_close(model.model.layers[0].mlp.down_proj.weight, expected_down, atol=0, rtol=0)
