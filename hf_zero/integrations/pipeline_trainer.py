"""``PipelineTrainer``: the Hugging Face ``Trainer`` driving hf_zero's pipeline engine.

    pipe = hf_zero.pipeline.wrap(AutoModelForCausalLM.from_pretrained(path), num_stages=2)
    trainer = PipelineTrainer(model=pipe, args=TrainingArguments(..., per_device_train_batch_size=8,
                              lr_scheduler_type="cosine"), train_dataset=ds, data_collator=collator,
                              hf_zero_config=ds_config)       # with a "pipeline" section; no args.deepspeed
    trainer.train(); trainer.save_model(out)                   # out is an ordinary save_pretrained directory

One Trainer step is one ``engine.train_batch``: the per-device batch (``per_device_train_batch_size`` rows, read by
every stage of a replica) is cut into the config's ``gradient_accumulation_steps`` pipeline micro-batches, so
``TrainingArguments.gradient_accumulation_steps`` must stay 1. Data is sharded by data-parallel replica, not by
global rank. The engine clips (the config's ``gradient_clipping``) with the norm over every stage and steps the
optimizer inside ``train_batch``; the Trainer's scheduler drives the engine optimizer's learning rate; logs carry
the pipeline's loss and global gradient norm; checkpoints are pipeline checkpoints; ``save_model`` is collective.
The accelerate route (``Trainer(args=TrainingArguments(deepspeed=cfg))`` with a ``pipeline`` section, or
``accelerate launch``) is refused at ``initialize`` with a message pointing here.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import Trainer

__all__ = ["PipelineTrainer"]


class _SteppedByEngine(torch.optim.Optimizer):
    """The engine's optimizer as the Trainer sees it: same param_groups (the Trainer's scheduler sets the learning
    rate), but ``step``/``zero_grad`` do nothing -- ``train_batch`` already stepped."""

    def __init__(self, inner: torch.optim.Optimizer):  # no super().__init__: it would copy the groups
        self.inner = inner
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = inner.state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self):
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict) -> None:
        """Hyperparameters only (accelerate round-trips the optimizer through this); the optimizer state itself is
        in the pipeline checkpoint (engine.load_checkpoint)."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)


class PipelineTrainer(Trainer):
    """See the module docstring."""

    def __init__(self, *args, hf_zero_config: dict, **kwargs):
        super().__init__(*args, **kwargs)
        from hf_zero.runtime.parallelize import is_pipeline_model

        if not is_pipeline_model(self.model):  # by type: a pipeline layout, not whatever has a .grid
            raise TypeError("PipelineTrainer: model must be hf_zero.pipeline.wrap(model, num_stages) (or a "
                            "PipelineModule whose micro-batches are dicts)")
        if self.args.deepspeed:
            raise ValueError("PipelineTrainer: leave TrainingArguments.deepspeed unset; pass the config as "
                             "hf_zero_config=")
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError("PipelineTrainer: TrainingArguments.gradient_accumulation_steps must be 1; the "
                             "pipeline's micro-batches are the hf_zero config's gradient_accumulation_steps")
        cfg = dict(hf_zero_config)
        m = int(cfg.get("gradient_accumulation_steps", 1))
        rows = self.args.per_device_train_batch_size
        if rows % m:
            raise ValueError(f"PipelineTrainer: per_device_train_batch_size={rows} must be a multiple of the "
                             f"config's gradient_accumulation_steps={m} (the pipeline micro-batches)")
        cfg.setdefault("train_micro_batch_size_per_gpu", rows // m)
        cfg.setdefault("gradient_clipping", self.args.max_grad_norm)
        if float(cfg["gradient_clipping"]) != float(self.args.max_grad_norm):
            raise ValueError(f"PipelineTrainer: TrainingArguments.max_grad_norm={self.args.max_grad_norm} and the "
                             f"config's gradient_clipping={cfg['gradient_clipping']} differ; make them equal")
        if "optimizer" not in cfg:
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": self.args.learning_rate,
                                                            "weight_decay": self.args.weight_decay}}
        self.hf_zero_config = cfg
        self.pipe_engine = None
        self.args.max_grad_norm = 0.0  # the engine clips, with the norm over every stage

    # ---- engine and optimizer --------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.pipe_engine is None:
            from hf_zero.runtime.initialize import initialize

            self.pipe_engine, *_ = initialize(model=self.model, config=self.hf_zero_config)
            self.optimizer = _SteppedByEngine(self.pipe_engine.optimizer)
        return self.optimizer

    def _wrap_model(self, model, training=True, dataloader=None):
        # the engine, not the model: the Trainer then leaves the model out of accelerator.prepare (no DDP)
        return self.pipe_engine if self.pipe_engine is not None else model

    def get_train_dataloader(self):
        grid = self.model.grid
        sampler = torch.utils.data.DistributedSampler(self.train_dataset, num_replicas=grid.data_parallel_size,
                                                      rank=grid.data_parallel_id, shuffle=True,
                                                      seed=self.args.seed)
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                                           sampler=sampler, collate_fn=self.data_collator, drop_last=True)

    # ---- one step -----------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.pipe_engine
        m = engine.micro_batches
        keys = [k for k in ("input_ids", "attention_mask", "position_ids", "labels") if k in inputs]
        micro = [{k: inputs[k].chunk(m)[j] for k in keys} for j in range(m)]
        loss = engine.train_batch(iter(micro))
        return loss.detach().to(self.args.device)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.pipe_engine.get_global_grad_norm()

    # ---- saving -------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Collective: every stage writes its own weights into one save_pretrained directory."""
        output_dir = output_dir or self.args.output_dir
        engine = self.pipe_engine
        if engine is not None and engine.stage3 is not None:
            from hf_zero.zero import GatheredParameters

            with GatheredParameters(list(self.model.parameters())):
                sd = {k: v.clone() for k, v in self.model.hf_state_dict().items()}
            self.model.save_pretrained(output_dir, state_dict=sd)
        else:
            self.model.save_pretrained(output_dir)
        if self.processing_class is not None and self.args.should_save:
            self.processing_class.save_pretrained(output_dir)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir):
        self.pipe_engine.save_checkpoint(output_dir, tag="pipeline")
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
        if dist.is_initialized():
            dist.barrier()
