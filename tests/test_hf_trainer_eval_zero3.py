"""``Trainer.evaluate()`` with no training under ZeRO-3 (transformers builds the engine without an optimizer, as for
DeepSpeed): 2 ranks, the evaluation loss equals the unsharded model's loss on the same data (what DDP returns)."""

import tempfile

import torch

from hf_zero.testing import run_distributed


def _evaluate():
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from _zero3_util import tiny_llama_config

    cfg = tiny_llama_config()
    ids = torch.randint(3, 64, (8, 8), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": r, "labels": r} for r in ids]
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}, "steps_per_print": 1000}
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_eval_batch_size=2, report_to=[],
                             use_cpu=True, deepspeed=ds)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(cfg)
    with torch.no_grad():  # every sequence has 8 tokens: the mean over eval batches is the loss of all at once
        want = reference(input_ids=ids, labels=ids).loss.item()
    torch.manual_seed(0)
    trainer = Trainer(model=LlamaForCausalLM(cfg), args=args, eval_dataset=data)
    metrics = trainer.evaluate()
    engine = trainer.model_wrapped
    partitioned = sum(p.numel() == 0 for p in engine.module.parameters())
    return metrics["eval_loss"], want, type(engine).__name__, engine.optimizer, partitioned


def test_trainer_evaluate_without_training_under_zero3():
    for got, want, engine_type, optimizer, partitioned in run_distributed(_evaluate, 2, timeout_s=300):
        assert engine_type == "HfZeroEngine" and optimizer is None
        assert partitioned > 0  # the weights were sharded, not whole on every rank
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
