"""FLOPs of a training step from a transformers config alone: ``analytic_flops(config, batch, seq)``.

Counts what the kernels compute for a batch of ``batch`` sequences of ``seq`` tokens (padding included: padded
positions are computed too), with a multiply-add as 2 FLOPs:

- parameter matmuls: ``2 * tokens * (weight elements a token multiplies)``, LM head included;
- attention: ``Q K^T`` and ``A V`` per layer, ``4 * batch * seq^2 * heads * head_dim``, the full square unless
  ``causal=True`` halves it;
- backward: twice the forward (gradients for the input and for the weight of every matmul), which holds when
  every parameter trains.

Families: decoder LMs with a gated MLP (Llama, Mistral, Qwen2/3, Gemma, Phi-3: ``*ForCausalLM``), GPT-2
(``GPT2LMHeadModel``) and BERT-style encoders (``BertForMaskedLM``; ``head="none"`` for the bare model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AnalyticFlops", "analytic_flops", "supports"]

_GATED_DECODERS = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite"}
_GPT2 = {"gpt2"}
_ENCODERS = {"bert", "roberta", "xlm-roberta", "electra"}


@dataclass(frozen=True)
class AnalyticFlops:
    """Forward FLOPs split into parameter matmuls and attention; the training step is 3x the forward."""

    matmul: int        # forward, parameter matmuls
    attention: int     # forward, Q K^T and A V
    causal: bool

    @property
    def forward(self) -> int:
        return self.matmul + self.attention

    @property
    def backward(self) -> int:
        return 2 * self.forward

    @property
    def training(self) -> int:
        return 3 * self.forward


def supports(config: Any) -> bool:
    return getattr(config, "model_type", None) in _GATED_DECODERS | _GPT2 | _ENCODERS


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"analytic_flops: config of type {type(config).__name__} has none of {names}")
    return default


def analytic_flops(config: Any, batch: int, seq: int, *, causal: bool = False, head: str = "lm") -> AnalyticFlops:
    """Training FLOPs of one step on ``batch x seq`` tokens for the model ``config`` describes.

    ``head``: ``"lm"`` counts the LM / MLM head over every position (what ``*ForCausalLM`` and
    ``*ForMaskedLM`` compute); ``"none"`` the base model (encoders then add their pooler on the first token).
    """
    model_type = getattr(config, "model_type", None)
    if not supports(config):
        raise ValueError(f"analytic_flops: model_type {model_type!r} is not one of the supported families "
                         f"({', '.join(sorted(_GATED_DECODERS | _GPT2 | _ENCODERS))}); count it with "
                         f"hf_zero.profiling.count_flops instead")
    if head not in ("lm", "none"):
        raise ValueError(f"analytic_flops: head must be 'lm' or 'none', got {head!r}")
    h = int(_get(config, "hidden_size", "n_embd"))
    layers = int(_get(config, "num_hidden_layers", "n_layer"))
    heads = int(_get(config, "num_attention_heads", "n_head"))
    vocab = int(config.vocab_size)
    tokens = batch * seq
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    if model_type in _GATED_DECODERS:
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        inter = int(config.intermediate_size)
        per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 3 * h * inter
        head_weights = h * vocab if head == "lm" else 0
        pooler = 0
    elif model_type in _GPT2:
        inter = int(getattr(config, "n_inner", None) or 4 * h)
        per_layer = 4 * h * h + 2 * h * inter
        head_weights = h * vocab if head == "lm" else 0
        pooler = 0
    else:
        inter = int(config.intermediate_size)
        per_layer = 4 * h * h + 2 * h * inter
        head_weights = h * h + h * vocab if head == "lm" else 0   # MLM transform + decoder
        pooler = 2 * batch * h * h if head == "none" else 0       # pooler dense on the first token
    matmul = 2 * tokens * (layers * per_layer + head_weights) + pooler
    attention = layers * 4 * batch * seq * seq * heads * head_dim
    if causal:
        attention //= 2
    return AnalyticFlops(matmul=matmul, attention=attention, causal=causal)
