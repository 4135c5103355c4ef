"""LoRA fine-tuning with PEFT and the Hugging Face ``Trainer`` under ZeRO-3, run by hf_zero.

An ordinary PEFT + Trainer script; with hf_zero installed (and the real DeepSpeed not) the DeepSpeed config runs on
hf_zero's engine:

    torchrun --nproc_per_node 2 examples/lora_train.py --deepspeed integrations/ds_config_zero3.json

What hf_zero guarantees here (what goes wrong elsewhere, see the README):
- ``trainer.save_model`` writes a complete ``adapter_model.safetensors``: every LoRA tensor with its real shape and
  trained values, gathered from the ZeRO-3 shards;
- resuming from a checkpoint works (the Trainer loads it with ``load_module_strict=False`` for PEFT models);
- ``merge_and_unload()`` works on the ZeRO-3 model inside ``deepspeed.zero.GatheredParameters``;
- the frozen base weights get no gradients and no optimizer state.

``--load_in_4bit`` loads the base model with bitsandbytes 4-bit quantization (QLoRA). The model is the examples'
2-layer Llama (``hf_tiny.py``), saved first as a local "pretrained" model; ``--metrics_out`` writes the losses, the
logits before and after merging, and the optimizer memory, which the tests check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tiny import probe_input_ids, synthetic_lm_dataset, tiny_llama_config  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config; omit for plain DDP")
    p.add_argument("--model_name_or_path", default=None, help="local base model; default: out/lora_base, created "
                                                             "from the tiny Llama config if missing")
    p.add_argument("--output_dir", default="out/lora")
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--save_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--use_cpu", action="store_true")
    p.add_argument("--load_in_4bit", action="store_true", help="QLoRA: bitsandbytes 4-bit base weights")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--metrics_out", default=None)
    return p.parse_args(argv)


def ensure_base_model(path: str) -> str:
    """The 'pretrained' model to adapt: saved once from the tiny config (rank 0 writes, the others wait)."""
    from transformers import LlamaForCausalLM

    rank = int(os.environ.get("RANK", 0))
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    return path


def main(argv=None) -> None:
    args = parse_args(argv)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, use_cpu=args.use_cpu, max_steps=args.max_steps,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=args.learning_rate,
        warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1, save_steps=args.save_steps,
        seed=0, data_seed=0, report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available())  # page-locked batches only where a GPU copies them
    base_path = args.model_name_or_path
    if base_path is None:
        base_path = ensure_base_model("out/lora_base")
        _ = training_args.device  # sets up the process group (a no-op if TrainingArguments already did)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    load_kwargs = {"dtype": torch.float32}
    if args.load_in_4bit:
        from transformers import BitsAndBytesConfig

        load_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
            bnb_4bit_quant_storage=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(base_path, **load_kwargs)
    if args.load_in_4bit:
        from hf_zero.runtime.bnb_compat import keep_4bit_layout

        # bitsandbytes >= 0.50 repacks 4-bit weights in place for a bf16 CPU kernel on the first eval forward, and
        # merge_and_unload then merges into the repacked layout (wrong logits); keep the training layout, as
        # hf_zero does for ZeRO-3 partitioned layers anyway, so every run here computes the same way
        keep_4bit_layout(model)
    torch.manual_seed(0)  # the LoRA initialisation, identical on every rank and in every run
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                             init_lora_weights="gaussian"))
    trainer = Trainer(model=model, args=training_args, train_dataset=synthetic_lm_dataset(256, seed=0))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(os.path.join(args.output_dir, "final"))  # adapter_model.safetensors + adapter_config.json

    metrics = {"losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
               "memory": optimizer_memory(trainer)}
    merged_logits = merge_and_check(trainer, metrics)
    if args.metrics_out and trainer.is_world_process_zero():
        torch.save(merged_logits, args.metrics_out + ".merged_logits.pt")
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


def optimizer_memory(trainer) -> dict:
    """What the optimizer holds on this rank, against the trainable / frozen parameter counts."""
    peft_model = trainer.model
    numel = lambda p: int(getattr(p, "ds_numel", p.numel()))  # noqa: E731 -- ZeRO-3 params report their full size
    trainable = sum(numel(p) for p in peft_model.parameters() if p.requires_grad)
    frozen = sum(numel(p) for p in peft_model.parameters() if not p.requires_grad)
    opt = trainer.optimizer
    inner = getattr(getattr(opt, "optimizer", opt), "inner", getattr(opt, "optimizer", opt))
    master = sum(p.numel() for g in inner.param_groups for p in g["params"])
    state = sum(t.numel() for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    frozen_grads = sum(1 for p in peft_model.parameters() if not p.requires_grad and p.grad is not None)
    return {"trainable": trainable, "frozen": frozen, "optimizer_params": master, "optimizer_state": state,
            "frozen_with_grad": frozen_grads, "world_size": trainer.args.world_size}


def merge_and_check(trainer, metrics: dict):
    """``merge_and_unload`` under ZeRO-3: gather the full weights, merge on every rank, keep rank 0's copy.

    Returns (rank 0) the logits of a plain model loaded with the merged weights; ``metrics["peft_logits"]`` holds
    the adapted model's logits before merging, which they must equal.
    """
    import deepspeed
    from transformers import LlamaForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    model = trainer.model.eval()
    probe = probe_input_ids().to(trainer.args.device)  # where the Trainer put the model (a GPU, or the CPU)
    with torch.no_grad():
        peft_logits = model(input_ids=probe).logits  # every rank: a ZeRO-3 forward is collective
    metrics["peft_logits"] = peft_logits.tolist()
    zero3 = is_deepspeed_zero3_enabled()
    # A 4-bit base stays whole on every rank (transformers loads quantized models without zero.Init) and merging
    # re-quantizes it, so its merged model is run as it is rather than loaded into a plain fp32 model.
    runs_as_is = not zero3 or getattr(model.get_base_model(), "is_loaded_in_4bit", False)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=zero3):
        merged = model.merge_and_unload()
        state = None if runs_as_is else {k: v.detach().clone() for k, v in merged.state_dict().items()}
    if runs_as_is:
        with torch.no_grad():
            merged_logits = merged(input_ids=probe).logits
        return merged_logits if trainer.is_world_process_zero() else None
    if not trainer.is_world_process_zero():
        return None
    plain = LlamaForCausalLM(merged.config)  # the base model's own shapes, whatever its size
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        return plain.eval()(input_ids=probe.cpu()).logits

if __name__ == "__main__":
    main()
