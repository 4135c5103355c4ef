"""Calls into transformers whose name changed across the versions hf_zero supports (5.17 on the GPU image, 5.24 here).

transformers 5.24 renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` and deprecates the
old name (a FutureWarning; removed in v6). hf_zero calls the new name where the model has it, the old one on older
transformers -- so no hf_zero code triggers the deprecation, and nothing breaks on either side of the rename.
"""

from __future__ import annotations

from typing import Any

__all__ = ["enable_activation_checkpointing"]


def enable_activation_checkpointing(model: Any, use_reentrant: bool | None = None) -> None:
    """Turn on the model's activation (gradient) checkpointing; ``use_reentrant`` as in torch.utils.checkpoint
    (None: transformers' default)."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
