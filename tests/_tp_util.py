"""Shared pieces of the tensor-parallel tests: tiny Llama (grouped-query attention) and GPT-2 from config, their
token data, and the single-process reference run."""

from __future__ import annotations

import torch

VOCAB, SEQ, BATCH = 128, 16, 4


def make_model(kind: str, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":  # 8 query heads share 4 key/value heads: TP 4 leaves one kv head per rank
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg)
    elif kind == "gpt2":  # fused c_attn Conv1D, tied embedding / LM head
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(kind)
    model.train()
    return model


def token_data(steps: int, batch: int = BATCH, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, batch, SEQ), generator=g)


def make_optimizer(kind: str, params):
    """AdamW for the loss curve; SGD with momentum for parameter parity: Adam divides each element's gradient by
    its own magnitude, so an element whose gradient is rounding noise (GPT-2's key bias has an exactly zero true
    gradient) takes an O(lr) step whose sign is that noise, in the reference as in any reordered computation."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def train(model, opt_kind: str, steps: int, data: torch.Tensor | None = None, start: int = 0) -> list[float]:
    opt = make_optimizer(opt_kind, model.parameters())
    data = token_data(start + steps) if data is None else data
    losses = []
    for s in range(start, start + steps):
        loss = model(input_ids=data[s], labels=data[s]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_steps(engine, batches) -> tuple[list[float], list[float]]:
    """One engine step per token-id batch (labels = inputs): this rank's losses and the engine's global grad norms."""
    losses, norms = [], []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def clipped_adamw_reference(kind: str, steps: int, *, lr: float, clip: float) -> list[float]:
    """The checkpoint tests' single-process run: AdamW (weight decay 0.01), the global gradient norm clipped at
    ``clip``, one step per :func:`token_data` batch; the losses."""
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    data, losses = token_data(steps), []
    for s in range(steps):
        loss = model(input_ids=data[s], labels=data[s]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_range(engine, steps: int, start: int, stop: int) -> list[float]:
    """Engine steps ``start`` to ``stop`` over the batches of :func:`token_data` (``steps``): the same data as
    :func:`clipped_adamw_reference`, so a run resumed at ``start`` continues its curve."""
    data, losses = token_data(steps), []
    for s in range(start, stop):
        loss = engine(input_ids=data[s], labels=data[s]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against the reference ``b`` (norm-wise)."""
    denom = b.float().norm().item()
    return (a.float() - b.float()).norm().item() / (denom if denom > 0 else 1.0)
