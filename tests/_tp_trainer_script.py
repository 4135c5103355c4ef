"""Run by tests/test_tp_trainer.py under torchrun: the HF Trainer with a DeepSpeed config carrying
``tensor_parallel.autotp_size`` (answered by hf_zero), recording the batches each rank trains on. A fifth argument
"sp" adds ``tensor_parallel.sequence_parallel: true``; a sixth is the ZeRO stage (default 1). The model is loaded
before ``TrainingArguments`` registers the config: transformers refuses ``from_pretrained`` under ZeRO-3 with
``tensor_parallel`` in the config ("Weight conversions ... with DeepSpeed Tensor Parallelism are not yet
implemented"), whatever engine answers ``import deepspeed``."""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_zero.tensor_parallel import tp_info

sys.path.insert(0, sys.argv[4])
from hf_tiny import synthetic_lm_dataset  # noqa: E402

model_dir, out_dir, record = sys.argv[1], sys.argv[2], sys.argv[3]
sequence_parallel = sys.argv[5:6] == ["sp"]
stage = int(sys.argv[6]) if len(sys.argv) > 6 else 1


class RecordingTrainer(Trainer):
    seen: list = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append(inputs["input_ids"].tolist())
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


ds_config = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}},
    "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True,
                          "stage3_param_persistence_threshold": 0},
    "tensor_parallel": {"autotp_size": 2, "sequence_parallel": sequence_parallel},
}
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                         weight_decay=0.0, max_grad_norm=0.5, lr_scheduler_type="constant", logging_steps=1,
                         save_strategy="no", report_to=[], seed=0, deepspeed=ds_config, dataloader_drop_last=True)
trainer = RecordingTrainer(model=model, args=args, train_dataset=synthetic_lm_dataset(32))
trainer.train()
trainer.save_model(out_dir)
rank = torch.distributed.get_rank()
with open(f"{record}.{rank}.json", "w") as f:
    json.dump({"seen": trainer.seen, "tp_size": trainer.get_tp_size(),
               "sequence_parallel": tp_info(trainer.model_wrapped.module).sequence_parallel,
               "train_batch_size": trainer.deepspeed.train_batch_size(), "stage": trainer.deepspeed.zero_optimization_stage(),
               "partitioned": all(hasattr(p, "ds_id") for p in trainer.model_wrapped.module.parameters())}, f)
