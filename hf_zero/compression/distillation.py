"""Knowledge distillation that plugs into ``transformers.Trainer``.

``loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)
        + hidden_weight * mean_i MSE(student_hidden[i], teacher_hidden[layer_map[i]])``

averaged over the tokens whose label is not ``ignore_index`` (all tokens when there are no labels). Causal-LM
labels are shifted the way transformers shifts them (position t predicts label t+1).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["distillation_loss", "DistillationTrainer", "default_layer_map"]


def default_layer_map(student_layers: int, teacher_layers: int,
                      teacher_layer: Sequence[int] | None = None) -> list[int]:
    """Hidden-state index pairs: hidden_states[0] are the embeddings on both sides; student layer i output
    (hidden_states[i + 1]) is matched to teacher layer ``teacher_layer[i]``'s output."""
    from .layer_reduction.apply import default_teacher_layers

    chosen = list(teacher_layer) if teacher_layer else list(default_teacher_layers(teacher_layers, student_layers))
    return [0] + [t + 1 for t in chosen]


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      labels: torch.Tensor | None = None, *, temperature: float = 2.0, alpha: float = 0.5,
                      student_hidden: Sequence[torch.Tensor] | None = None,
                      teacher_hidden: Sequence[torch.Tensor] | None = None, hidden_weight: float = 0.0,
                      layer_map: Sequence[int] | None = None, ignore_index: int = -100,
                      causal_lm: bool = True) -> torch.Tensor:
    """Logits (B, T, V). Hidden states: tuples of (B, T, C), as ``output_hidden_states=True`` returns them."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    s, t = student_logits, teacher_logits.detach()
    if labels is not None and causal_lm:
        s, t, labels = s[:, :-1], t[:, :-1], labels[:, 1:]
    vocab = s.shape[-1]
    s2, t2 = s.reshape(-1, vocab).float(), t.reshape(-1, vocab).float()
    keep = None if labels is None else labels.reshape(-1) != ignore_index
    kl = F.kl_div(F.log_softmax(s2 / temperature, -1), F.log_softmax(t2 / temperature, -1), reduction="none",
                  log_target=True).sum(-1)  # (N,)
    kl = kl[keep] if keep is not None else kl
    loss = alpha * temperature**2 * kl.mean()
    if labels is not None and alpha < 1.0:
        loss = loss + (1 - alpha) * F.cross_entropy(s2, labels.reshape(-1), ignore_index=ignore_index)
    if hidden_weight > 0:
        if student_hidden is None or teacher_hidden is None:
            raise ValueError("hidden_weight > 0 needs student_hidden and teacher_hidden")
        layer_map = list(layer_map) if layer_map is not None else default_layer_map(
            len(student_hidden) - 1, len(teacher_hidden) - 1)
        if len(layer_map) != len(student_hidden):
            raise ValueError(f"layer_map has {len(layer_map)} entries for {len(student_hidden)} student hidden "
                             f"states")
        mse = [F.mse_loss(sh.float(), teacher_hidden[j].detach().float()) for sh, j in zip(student_hidden, layer_map)]
        loss = loss + hidden_weight * torch.stack(mse).mean()
    return loss


def _trainer_base():
    from transformers import Trainer

    return Trainer


class DistillationTrainer(_trainer_base()):
    """``Trainer`` whose loss is :func:`distillation_loss` against a frozen ``teacher_model``.

    ``DistillationTrainer(model=student, teacher_model=teacher, temperature=2.0, alpha=0.5, hidden_weight=0.0,
    layer_map=None, args=..., train_dataset=...)``; every other Trainer argument works as usual.
    """

    def __init__(self, *args: Any, teacher_model: nn.Module, temperature: float = 2.0, alpha: float = 0.5,
                 hidden_weight: float = 0.0, layer_map: Sequence[int] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.teacher_model = teacher_model.eval()
        for p in self.teacher_model.parameters():
            p.requires_grad_(False)
        self.temperature = temperature
        self.alpha = alpha
        self.hidden_weight = hidden_weight
        self.layer_map = layer_map

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        want_hidden = self.hidden_weight > 0
        labels = inputs.get("labels")
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        device = next(model.parameters()).device
        if next(self.teacher_model.parameters()).device != device:
            self.teacher_model.to(device)
        with torch.no_grad():
            t_out = self.teacher_model(**model_inputs, output_hidden_states=want_hidden)
        s_out = model(**model_inputs, output_hidden_states=want_hidden)
        loss = distillation_loss(s_out.logits, t_out.logits, labels, temperature=self.temperature, alpha=self.alpha,
                                 student_hidden=s_out.hidden_states if want_hidden else None,
                                 teacher_hidden=t_out.hidden_states if want_hidden else None,
                                 hidden_weight=self.hidden_weight, layer_map=self.layer_map)
        return (loss, s_out) if return_outputs else loss
