"""``"auto"`` values: filling them from the caller, and saying where a value could come from when none was given.

In a DeepSpeed config written for the HF Trainer or accelerate, ``"auto"`` means "take this from
TrainingArguments / the model / the launcher". The HF integration passes those values to
:func:`load_config` as ``auto_values`` (dotted key -> value); anything still ``"auto"`` afterwards is an error
naming the key and the source that would fill it (:data:`AUTO_HINTS`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import ConfigError

__all__ = ["AUTO_HINTS", "auto_paths", "fill_autos", "unresolved_auto_error"]

# dotted key -> (what "auto" needs, where to pass it, what to write instead)
AUTO_HINTS: dict[str, tuple[str, str, str]] = {
    "train_micro_batch_size_per_gpu": (
        "the per-device batch size", "TrainingArguments(per_device_train_batch_size=...) or accelerate's dataloader",
        "an integer, or give train_batch_size and gradient_accumulation_steps so it can be derived"),
    "gradient_accumulation_steps": (
        "the gradient accumulation steps",
        "TrainingArguments(gradient_accumulation_steps=...) or Accelerator(gradient_accumulation_steps=...)",
        "an integer, or give train_batch_size and train_micro_batch_size_per_gpu so it can be derived"),
    "train_batch_size": (
        "the global batch size", "TrainingArguments (per_device_train_batch_size * gradient_accumulation_steps * "
        "world size)", "an integer, or give the other two batch keys so it can be derived"),
    "gradient_clipping": (
        "the gradient clipping norm", "TrainingArguments(max_grad_norm=...)", "a number (0 turns clipping off)"),
    "fp16.enabled": (
        "the mixed-precision choice", "TrainingArguments(fp16=...) or accelerate's mixed_precision", "true or false"),
    "bf16.enabled": (
        "the mixed-precision choice", "TrainingArguments(bf16=...) or accelerate's mixed_precision", "true or false"),
    "optimizer.params.lr": (
        "the learning rate", "TrainingArguments(learning_rate=...)", "a number (e.g. 5e-05)"),
    "optimizer.params.betas": (
        "the Adam betas", "TrainingArguments(adam_beta1=..., adam_beta2=...)", "a list (e.g. [0.9, 0.999])"),
    "optimizer.params.eps": (
        "the Adam epsilon", "TrainingArguments(adam_epsilon=...)", "a number (e.g. 1e-08)"),
    "optimizer.params.weight_decay": (
        "the weight decay", "TrainingArguments(weight_decay=...)", "a number (e.g. 0.0)"),
    "scheduler.params.warmup_min_lr": (
        "the learning rate at the start of warm-up", "the HF Trainer (it uses 0)", "a number (e.g. 0)"),
    "scheduler.params.warmup_max_lr": (
        "the peak learning rate", "TrainingArguments(learning_rate=...)", "a number (e.g. 5e-05)"),
    "scheduler.params.warmup_num_steps": (
        "the warm-up steps", "TrainingArguments(warmup_steps=... or warmup_ratio=...)", "an integer"),
    "scheduler.params.total_num_steps": (
        "the total number of training steps",
        "the HF Trainer (from max_steps, or num_train_epochs and the dataset length)", "an integer"),
    "zero_optimization.stage": (
        "the ZeRO stage", "accelerate's zero_stage (accelerate config or DeepSpeedPlugin)", "0, 1, 2 or 3"),
    "zero_optimization.reduce_bucket_size": (
        "the model's hidden_size", "TrainingArguments/accelerate", "a number (e.g. hidden_size*hidden_size)"),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "the model's hidden_size", "TrainingArguments/accelerate", "a number (e.g. 0.9*hidden_size*hidden_size)"),
    "zero_optimization.stage3_param_persistence_threshold": (
        "the model's hidden_size", "TrainingArguments/accelerate", "a number (e.g. 10*hidden_size)"),
    "zero_optimization.allgather_bucket_size": (
        "a bucket size", "auto_values (the HF integration does not fill this key)",
        "a number (DeepSpeed's default is 500000000)"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "the save choice", "accelerate's zero3_save_16bit_model", "true or false"),
    "zero_optimization.offload_optimizer.device": (
        "the offload device", "accelerate's offload_optimizer_device", "'none', 'cpu' or 'nvme'"),
    "zero_optimization.offload_param.device": (
        "the offload device", "accelerate's offload_param_device", "'none', 'cpu' or 'nvme'"),
    "zero_optimization.offload_optimizer.nvme_path": (
        "the NVMe directory", "accelerate's offload_optimizer_nvme_path", "a directory on the NVMe drive"),
    "zero_optimization.offload_param.nvme_path": (
        "the NVMe directory", "accelerate's offload_param_nvme_path", "a directory on the NVMe drive"),
    "checkpoint.use_node_local_storage": (
        "the checkpoint layout", "TrainingArguments(save_on_each_node=...)", "true or false"),
}

# Legacy spellings whose auto_values are looked up under the current name.
_ALIASES = {
    "bfloat16.": "bf16.",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
}


# Element counts the HF integration computes in floating point (stage3_prefetch_bucket_size = 0.9 * h * h):
# a filled-in float is floored to an integer.
_ELEMENT_COUNTS = frozenset({
    "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
})


def _canonical(path: str) -> str:
    for old, new in _ALIASES.items():
        if path.startswith(old):
            return new + path[len(old):]
    return path


def auto_paths(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of every value that is exactly ``"auto"``, in document order."""
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from auto_paths(value, path)
        elif isinstance(value, str) and value == "auto":
            yield path


def fill_autos(tree: Mapping[str, Any], auto_values: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A copy of ``tree`` with each ``"auto"`` that ``auto_values`` has a value for replaced; and those paths.

    Values the user wrote are never overridden: ``auto_values`` only fills ``"auto"``.
    """
    filled: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                out[key] = walk(value, path)
                continue
            if isinstance(value, str) and value == "auto":
                for candidate in (path, _canonical(path)):
                    if candidate in auto_values:
                        value = auto_values[candidate]
                        if candidate in _ELEMENT_COUNTS and isinstance(value, float) and math.isfinite(value):
                            value = math.floor(value)
                        filled.append(path)
                        break
            out[key] = value
        return out

    return walk(tree, ""), tuple(filled)


def unresolved_auto_error(paths: list[str]) -> ConfigError:
    """The error for ``"auto"`` values nobody filled: the first key with its hint, the others listed."""
    first = paths[0]
    key = _canonical(first)
    if key in AUTO_HINTS:
        needs, via, write = AUTO_HINTS[key]
    else:
        name = key.rsplit(".", 1)[-1]
        needs, via, write = f"a value for {name}", "auto_values (load_config) or the HF integration", "a value"
    message = f"'auto' needs {needs}: pass it via {via}, or write {write}"
    if len(paths) > 1:
        message += f" (also 'auto' with no value: {', '.join(paths[1:])})"
    return ConfigError(first, message)
