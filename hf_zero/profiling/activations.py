"""Activation and backward-temporary bytes of one micro-batch, traced without memory or compute.

The model is built from its config inside ``FakeTensorMode`` and runs one forward and backward on fake inputs;
torch's ``MemTracker`` (``torch.distributed._tools``, a private API: its absence falls back to the closed form)
records live bytes by kind. Every parameter gradient is dropped as soon as it is accumulated, so the figure
returned is the peak of activations + temporaries (+ anything else that is not a parameter, buffer or gradient)
alone -- usually the start of backward, with the logits and loss path alive. :func:`activation_profile` also
records, as each parameter's gradient is accumulated, the bytes still alive and which parameter it was: the order
in which ZeRO-3 packs gradients into its buckets, and what backward still holds when a bucket is reduced. Where
parameter gradients live, and for how long, is the ZeRO stage's business: :mod:`hf_zero.profiling.memory` adds
them per stage. Exact for the architecture, attention implementation, gradient checkpointing and frozen
parameters as configured; the closed form is the fallback for models that cannot run under fake tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ActivationProfile", "activation_bytes", "activation_profile", "closed_form_activation_bytes"]

logger = logging.getLogger("hf_zero")


def closed_form_activation_bytes(config: Any, batch: int, seq: int, dtype: torch.dtype) -> int:
    """Per layer about 10 h + 4 I saved elements per token (decoder with gated MLP), plus the logits path: the
    logits, their fp32 upcast and log-softmax (3 T V)."""
    c = torch.empty(0, dtype=dtype).element_size()
    tokens = batch * seq
    h = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd"))
    inter = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h)
    layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer"))
    vocab = int(config.vocab_size)
    return tokens * layers * (10 * h + 4 * inter) * c + tokens * vocab * (c + 2 * 4)


@dataclass(frozen=True)
class ActivationProfile:
    """``peak``: bytes of activations + temporaries at their peak. ``at_grads``: ``(parameter index, bytes alive)``
    as each trainable parameter's gradient is accumulated, in backward's order; the index counts distinct
    parameters in ``named_parameters()`` order (:func:`hf_zero.profiling.memory.param_layout`'s). Empty where
    the closed form stood in for the trace."""

    peak: int
    at_grads: tuple[tuple[int, int], ...] = ()

    def scaled(self, factor: float) -> "ActivationProfile":
        """The profile of ``factor`` times the batch (activations are linear in it)."""
        return ActivationProfile(int(self.peak * factor), tuple((i, int(b * factor)) for i, b in self.at_grads))


def activation_bytes(config: Any, batch: int, seq: int, *, dtype: torch.dtype = torch.float32,
                     gradient_checkpointing: bool = False, trainable=None, lora: dict | None = None) -> int:
    """Peak bytes of activations and temporaries of one ``batch x seq`` forward + backward of ``config``'s model
    (with ``lora``: with PEFT LoRA adapters, ``peft.LoraConfig`` keywords)."""
    return activation_profile(config, batch, seq, dtype=dtype, gradient_checkpointing=gradient_checkpointing,
                              trainable=trainable, lora=lora).peak


def activation_profile(config: Any, batch: int, seq: int, *, dtype: torch.dtype = torch.float32,
                       gradient_checkpointing: bool = False, trainable=None, lora: dict | None = None
                       ) -> ActivationProfile:
    """:func:`activation_bytes` and the bytes still alive at each parameter gradient (:class:`ActivationProfile`)."""
    try:
        return _traced(config, batch, seq, dtype, gradient_checkpointing, trainable, lora)
    except Exception as err:  # noqa: BLE001 -- any model the tracer cannot run gets the closed form, said loudly
        logger.warning("hf_zero: activations of %s could not be traced under FakeTensorMode (%s: %s); using the "
                       "closed form (approximate)", type(config).__name__, type(err).__name__, err)
        return ActivationProfile(closed_form_activation_bytes(config, batch, seq, dtype))


def _traced(config, batch, seq, dtype, gradient_checkpointing, trainable, lora) -> ActivationProfile:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForMaskedLM if config.model_type in ("bert", "roberta", "xlm-roberta", "electra") \
        else AutoModelForCausalLM
    with FakeTensorMode():
        model = auto.from_config(config, dtype=dtype)
        if lora:
            from hf_zero.profiling.memory import with_lora

            model = with_lora(model, lora)
        if gradient_checkpointing:
            from hf_zero.util.hf_compat import enable_activation_checkpointing

            enable_activation_checkpointing(model)
        model.train()
        if trainable is not None:
            for name, p in model.named_parameters():
                p.requires_grad_(bool(trainable(name)))
        tracker = MemTracker()
        at_grads: list[tuple[int, int]] = []

        def drop_grad(index: int):
            def hook(param: torch.Tensor) -> None:
                param.grad = None
                at_grads.append((index, _alive(tracker.get_tracker_snapshot("current"))))
            return hook

        drop, seen = [], set()
        for p in model.parameters():  # distinct parameters in order: param_layout's indices
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                drop.append(p.register_post_accumulate_grad_hook(drop_grad(len(seen) - 1)))
        ids = torch.randint(0, int(config.vocab_size), (batch, seq))
        tracker.track_external(model)
        with tracker:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        snapshot = tracker.get_tracker_snapshot("peak")
        for handle in drop:
            handle.remove()
    return ActivationProfile(_alive(snapshot), tuple(at_grads))


def _alive(snapshot: dict) -> int:
    """Activations + temporaries (+ other non-parameter memory) of a MemTracker snapshot, largest device."""
    return int(max((sum(v for k, v in per_kind.items() if str(k).split(".")[-1] in ("ACT", "TEMP", "OTH"))
                    for per_kind in snapshot.values()), default=0))
