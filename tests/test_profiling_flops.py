"""FLOPs counted at the dispatcher equal the analytic count, at every ZeRO stage; parameter counts are true sizes."""

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import hf_zero
from hf_zero.profiling.analytic import analytic_flops
from hf_zero.profiling.flops import FlopCounter, count_flops
from hf_zero.profiling.params import count_params
from hf_zero.testing import run_distributed
from hf_zero.util.hf_compat import enable_activation_checkpointing

B, S = 2, 16


def llama(attn: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return cfg, LlamaForCausalLM(cfg)


def bert(attn: str = "sdpa", seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return cfg, BertForMaskedLM(cfg)


def _no_global_hooks():
    return not nn.modules.module._global_forward_pre_hooks and not nn.modules.module._global_forward_hooks


def test_cpu_sdpa_forward_and_backward_counted_like_the_math_backend():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))

    def run(backend):
        counter = FlopCounter()
        with sdpa_kernel(backend):
            with counter.window("forward"):
                out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            with counter.window("backward"):
                out.sum().backward()
        return counter.report

    flash, math = run(SDPBackend.FLASH_ATTENTION), run(SDPBackend.MATH)
    assert math.forward == 2 * (2 * 2 * 4 * 32 * 32 * 16) > 0  # QK^T and AV
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in math.by_op
    assert any("flash_attention_for_cpu" in op for op in flash.by_op)  # the default CPU path really ran
    assert flash.forward == math.forward == flash.attention_forward
    # the flash backward rebuilds Q K^T (one more matmul): hardware FLOPs; the model figure is the math one
    assert math.backward == 2 * math.forward and math.recompute == 0
    assert flash.backward == math.backward + math.forward // 2
    assert flash.model == math.model == math.hardware
    assert _no_global_hooks()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_counted_equals_analytic(attn):
    cfg, model = llama(attn)
    ids = torch.randint(0, 128, (B, S))
    report = count_flops(model, input_ids=ids, labels=ids)
    expected = analytic_flops(cfg, B, S)
    assert report.forward == expected.forward
    assert report.model == expected.training
    # sdpa on CPU: the flash backward's recompute is hardware-only (half the attention forward)
    assert report.hardware - report.model == (expected.attention // 2 if attn == "sdpa" else 0)
    assert analytic_flops(cfg, B, S, causal=True).attention == expected.attention // 2
    assert _no_global_hooks()


def test_activation_checkpoint_recompute_is_hardware_flops_only():
    ids = torch.randint(0, 128, (B, S))
    cfg, plain = llama("eager")
    baseline = count_flops(plain, input_ids=ids, labels=ids)
    _, model = llama("eager")
    enable_activation_checkpointing(model)
    model.train()
    report = count_flops(model, input_ids=ids, labels=ids)
    expected = analytic_flops(cfg, B, S)
    assert report.model == baseline.model == expected.training
    # exactly the extra work checkpointing dispatched in backward is called recompute; at most the layers' forward
    lm_head = 2 * B * S * cfg.hidden_size * cfg.vocab_size
    assert report.recompute == report.backward - baseline.backward
    assert 0 < report.recompute <= expected.forward - lm_head


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("masked", [False, True])
def test_bert_counted_equals_analytic(attn, masked):
    cfg, model = bert(attn)
    ids = torch.randint(0, 100, (B, S))
    kwargs = {"input_ids": ids, "labels": ids}
    if masked:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, -5:] = 0
        kwargs["attention_mask"] = mask
    report = count_flops(model, **kwargs)
    expected = analytic_flops(cfg, B, S)
    assert report.forward == expected.forward
    assert report.model == expected.training
    assert report.by_module["BertForMaskedLM"] == report.forward
    assert report.by_module["bert.encoder.layer.0"] == report.by_module["bert.encoder.layer.1"] > 0


def _engine_counts(stage: int, family: str = "llama"):
    import torch.distributed as dist

    cfg, model = llama("sdpa") if family == "llama" else bert("sdpa")
    unsharded = count_params(model)
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100}}
    engine, *_ = hf_zero.initialize(model=model, config=ds)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    counter = FlopCounter(engine.module)
    for _ in range(2):  # the second step: ZeRO-3 runs from its recorded trace, prefetching
        with counter.window("forward"):
            loss = engine(input_ids=ids, labels=ids).loss
        with counter.window("backward"):
            engine.backward(loss)
        engine.step()
    counts = count_params(engine.module)
    plain_numel = sum(p.numel() for p in engine.module.parameters())
    return dict(report=counter.report, analytic=analytic_flops(cfg, B, S), unsharded=unsharded, counts=counts,
                plain_numel=plain_numel, hooks_clean=_no_global_hooks())


def _all_stages():
    return ({stage: _engine_counts(stage) for stage in (0, 2, 3)},
            {stage: _engine_counts(stage, "bert") for stage in (0, 2, 3)})


def test_engine_flops_and_params_at_stages_0_2_3_on_two_ranks():
    results = run_distributed(_all_stages, 2, timeout_s=240)
    for rank, (_, bert_by_stage) in enumerate(results):  # BERT (tied MLM head, CPU SDPA): exact at every stage
        for stage, r in bert_by_stage.items():
            assert r["report"].forward == 2 * r["analytic"].forward, ("bert", rank, stage)
            assert r["report"].model == 2 * r["analytic"].training, ("bert", rank, stage)
            assert r["counts"].total == r["unsharded"].total, ("bert", rank, stage)
    for rank, by_stage in enumerate(llama_by_stage for llama_by_stage, _ in results):
        for stage, r in by_stage.items():
            report, expected = r["report"], r["analytic"]
            assert report.forward == 2 * expected.forward, (rank, stage)
            assert report.model == 2 * expected.training, (rank, stage)
            assert report.hardware == report.model + 2 * (expected.attention // 2), (rank, stage)
            assert r["counts"].total == r["unsharded"].total == r["unsharded"].trainable, (rank, stage)
            assert r["counts"].embedding == r["unsharded"].embedding == 128 * 64  # input embedding; lm_head is a Linear
            assert r["hooks_clean"]
        # what p.numel() would say under ZeRO-3 (persistent norms only), and the bytes a rank really holds
        z3 = by_stage[3]
        assert z3["plain_numel"] < z3["counts"].total // 10
        assert z3["counts"].sharded and not by_stage[2]["counts"].sharded
        assert z3["counts"].resident_bytes < by_stage[0]["counts"].resident_bytes * 0.6
        assert by_stage[0]["counts"].resident_bytes == 4 * by_stage[0]["counts"].total
