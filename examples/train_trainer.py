"""Fine-tune a causal LM with the Hugging Face ``Trainer`` and a DeepSpeed config, run by hf_zero.

The script is an ordinary Trainer script: with hf_zero installed (and the real DeepSpeed not),
``TrainingArguments(deepspeed=...)`` runs on hf_zero's engine. The one hf_zero-specific line is optional:
``HfZeroCallback.attach(trainer)`` adds the engine's statistics to the logs and a model card to saved models.

    # 2 processes, ZeRO-3, on CPU or GPU
    torchrun --nproc_per_node 2 examples/train_trainer.py --deepspeed integrations/ds_config_zero3.json

    # resume the loss curve from a checkpoint
    torchrun --nproc_per_node 2 examples/train_trainer.py --deepspeed integrations/ds_config_zero3.json \\
        --resume_from_checkpoint out/trainer/checkpoint-10

    # the same training under plain DDP (no --deepspeed), for comparison
    torchrun --nproc_per_node 2 examples/train_trainer.py --use_cpu

The model is a 2-layer Llama built from its config and the data is generated (``hf_tiny.py``), so this runs on a
CPU in a minute or two. ``--metrics_out`` writes the per-step losses and, from rank 0, the logits of the trained
weights on a fixed input, which the tests compare across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tiny import probe_input_ids, synthetic_lm_dataset, tiny_llama_config  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config (e.g. integrations/ds_config_zero3.json); "
                                                     "omit for plain DDP")
    p.add_argument("--model_name_or_path", default=None, help="a local model directory; default: a tiny Llama built "
                                                             "from its config")
    p.add_argument("--output_dir", default="out/trainer")
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--save_steps", type=int, default=10)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    # 1 by default: with more, accelerate logs "Gradient accumulation steps mismatch: GradientAccumulationPlugin has
    # 1, DeepSpeed config has N" at start-up -- the Trainer hands accelerate num_steps=1 by design and the DeepSpeed
    # config (its "auto") the real value, which is then used. Harmless, and the same with DeepSpeed itself.
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--use_cpu", action="store_true", help="TrainingArguments(use_cpu=True); hf_zero does not need "
                                                          "it on a CPU-only machine, plain DDP does")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--load_best_model_at_end", action="store_true",
                   help="evaluate at every save and reload the best checkpoint (lowest eval loss) at the end")
    p.add_argument("--greater_is_better", action="store_true", help="with --load_best_model_at_end: keep the "
                   "checkpoint with the *highest* eval loss (the tests use it to make the best one an early one)")
    p.add_argument("--torch_compile_backend", default=None, help="TrainingArguments(torch_compile_backend=...): "
                   "torch.compile the model (e.g. inductor; the engine's compile() under DeepSpeed/hf_zero)")
    p.add_argument("--metrics_out", default=None, help="write losses / eval loss / probe logits here (JSON + .pt)")
    p.add_argument("--zero_log_detail", action="store_true", help="HfZeroCallback's full detail in the logs (time "
                   "shares, per-rank memory spread, MFU, loss scale) instead of tokens/s and peak memory")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    # TrainingArguments first: with a ZeRO-3 config it must exist before the model is built, so that the model is
    # partitioned as it is constructed (transformers' rule, not hf_zero's).
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        use_cpu=args.use_cpu,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        weight_decay=0.01,
        logging_steps=1,
        save_steps=args.save_steps,
        save_strategy="steps",
        eval_strategy="steps" if args.load_best_model_at_end else "no",
        eval_steps=args.save_steps,
        load_best_model_at_end=args.load_best_model_at_end,
        metric_for_best_model="eval_loss" if args.load_best_model_at_end else None,
        greater_is_better=args.greater_is_better if args.load_best_model_at_end else None,
        seed=args.seed,
        data_seed=args.seed,
        report_to=[],
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),  # page-locked batches only where a GPU copies them
        disable_tqdm=True,
        torch_compile_backend=args.torch_compile_backend,
    )
    torch.manual_seed(args.seed)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    # under ZeRO-3 each rank holds only its shards from here on (parameters report their full size in ds_numel)
    at_load = {"full_numel": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
               "local_numel": sum(p.numel() for p in model.parameters())}
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=synthetic_lm_dataset(256, seed=0),
                      eval_dataset=synthetic_lm_dataset(32, seed=1))
    # Optional, hf_zero's own addition: per-rank peak memory, grad norm, loss scale, skipped steps and phase time
    # shares in the logs, and a model card describing the ZeRO run next to every saved checkpoint.
    # Without hf_zero installed (real DeepSpeed, or DDP) the script runs as is, without them.
    try:
        from hf_zero.integrations import HfZeroCallback, write_model_card
    except ImportError:
        HfZeroCallback = write_model_card = None
    if HfZeroCallback is not None:
        HfZeroCallback.attach(trainer, detail=args.zero_log_detail or None)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    eval_loss = trainer.evaluate()["eval_loss"]
    final_dir = os.path.join(args.output_dir, "final")
    trainer.save_model(final_dir)
    if trainer.is_world_process_zero() and write_model_card is not None:
        write_model_card(final_dir, trainer)

    if args.metrics_out:
        write_metrics(trainer, eval_loss, args.metrics_out, at_load)
    # The Trainer leaves the process group up; every rank tears it down together, so no rank exits while another
    # still uses it (a gloo rank exiting that way was once aborted by the C++ runtime, "terminate called ...")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def write_metrics(trainer, eval_loss: float, path: str, at_load: dict) -> None:
    """Per-step losses (all ranks agree) and, from rank 0, logits of the trained weights on a fixed input."""
    from torch._dynamo.utils import counters
    from transformers import LlamaForCausalLM

    losses = {int(e["step"]): float(e["loss"]) for e in trainer.state.log_history if "loss" in e}
    zero_logs = {int(e["step"]): {k: v for k, v in e.items() if k.startswith("zero/")}
                 for e in trainer.state.log_history if "loss" in e}
    norms = {int(e["step"]): float(e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e}
    wrapped = trainer.model_wrapped
    if hasattr(wrapped, "_zero3_consolidated_16bit_state_dict"):
        # the engine's own view of the full weights: collective, dict on rank 0, None elsewhere
        state = wrapped._zero3_consolidated_16bit_state_dict()
    else:
        state = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(wrapped).state_dict().items()}
    if trainer.args.process_index != 0:
        return
    reference = LlamaForCausalLM(tiny_llama_config())
    missing, unexpected = reference.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and all(k.endswith("rotary_emb.inv_freq") for k in missing), (missing, unexpected)
    with torch.no_grad():
        logits = reference.eval()(probe_input_ids()).logits
    torch.save(logits, path + ".logits.pt")
    with open(path, "w") as f:
        json.dump({"losses": losses, "grad_norms": norms, "zero_logs": zero_logs, "eval_loss": eval_loss,
                   "global_step": trainer.state.global_step, "world_size": trainer.args.world_size,
                   "best_model_checkpoint": trainer.state.best_model_checkpoint, "params_at_load": at_load,
                   # torch.compile's record: whether the engine compiled the model, and the graphs it captured
                   "compiled": bool(getattr(wrapped, "is_compiled", False)),
                   "dynamo_graphs": int(counters["stats"]["unique_graphs"])},
                  f, indent=1)


if __name__ == "__main__":
    main()
