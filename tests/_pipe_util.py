"""Shared pieces of the pipeline tests: a small layer list (tied or not), its data, the one-process reference, and
the padded HF micro-batches of the wrapped-model and 3D tests.

The layers are built with ``seed_layers=True`` semantics (layer ``i`` right after ``manual_seed(1234 + i)``), so
the pipeline (each stage builds only its own layers) and the reference (one process builds all) hold the same
weights. Step ``s`` reads micro-batch ``j`` of data-parallel replica ``d`` as ``x[s, j, d]``; the reference sees
the whole global batch at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

W, MICRO, STEPS, LR, CLIP = 6, 2, 3, 0.2, 0.04
BASE_SEED = 1234


class Scale(nn.Module):
    """A parameter-free layer given as a module instance (no LayerSpec)."""

    def forward(self, x):
        return x * 0.5


def tied_head(module, x):
    return F.linear(x, module.weight)


def layer_list(tied: bool, n_hidden: int = 4):
    """Embedding-like input layer, ``n_hidden`` Linear+Tanh blocks, a callable, a head (tied to the input)."""
    from hf_zero.pipe import LayerSpec, TiedLayerSpec

    layers = [TiedLayerSpec("emb", nn.Linear, W, W, bias=False) if tied else LayerSpec(nn.Linear, W, W, bias=False)]
    for _ in range(n_hidden):
        layers += [LayerSpec(nn.Linear, W, W), nn.Tanh()]
    layers += [Scale(), torch.sin]
    layers.append(TiedLayerSpec("emb", nn.Linear, W, W, bias=False, forward_fn=tied_head) if tied
                  else LayerSpec(nn.Linear, W, W))
    return layers


def reference_params(tied: bool, n_hidden: int = 4) -> dict[str, torch.Tensor]:
    """One process: every layer built in order with its seed; parameter names as PipelineModule.layer_state_dicts
    gives them (``"<layer>.<param>"``; a tied module under its key's first layer)."""
    from hf_zero.pipe import LayerSpec, TiedLayerSpec

    modules, forward, built = {}, [], {}
    for idx, spec in enumerate(layer_list(tied, n_hidden)):
        torch.manual_seed(BASE_SEED + idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in built:
                built[spec.key] = (idx, spec.build())
                modules[idx] = built[spec.key][1]
            m = built[spec.key][1]
            forward.append((lambda mod, fn: (lambda x: fn(mod, x)) if fn else mod)(m, spec.forward_fn))
        elif isinstance(spec, LayerSpec):
            modules[idx] = spec.build()
            forward.append(modules[idx])
        else:
            forward.append(spec)
    return modules, forward


def data(steps: int, micro_batches: int, dp: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(steps, micro_batches, dp, MICRO, W, generator=g),
            torch.randn(steps, micro_batches, dp, MICRO, W, generator=g))


def padded_micro_batch(g: torch.Generator, micro: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """One HF micro-batch: token ids right-padded to ``seq`` with ragged lengths (2..seq), its attention mask and
    labels masked to -100 on the padding (the pipeline/TP tests' data, drawn from ``g`` in a fixed order)."""
    ids = torch.randint(0, vocab, (micro, seq), generator=g)
    lengths = torch.randint(2, seq + 1, (micro,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


ADAM = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}


def reference_run(tied: bool, steps: int, micro_batches: int, dp: int, n_hidden: int = 4, adam: bool = False):
    modules, forward = reference_params(tied, n_hidden)
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0) if adam else torch.optim.SGD(params, lr=LR)
    x, y = data(steps, micro_batches, dp)
    losses, norms = [], []
    for s in range(steps):
        h = x[s].reshape(-1, W)
        for f in forward:
            h = f(h)
        loss = F.mse_loss(h, y[s].reshape(-1, W))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {f"{idx}.{n}": t.detach().clone() for idx, m in modules.items() for n, t in m.state_dict().items()}
    with torch.no_grad():  # what eval_batch on step 0's data should give after training
        h = x[0].reshape(-1, W)
        for f in forward:
            h = f(h)
        eval_loss = F.mse_loss(h, y[0].reshape(-1, W)).item()
    return losses, norms, state, eval_loss


def ds_config(micro_batches: int, stage: int = 0, schedule: str = "1f1b", optimizer: dict | None = None,
              **pipeline) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
            "gradient_clipping": CLIP, "optimizer": optimizer or {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40,
                                  "stage3_param_persistence_threshold": 8},
            "pipeline": {"schedule": schedule, **pipeline}, "steps_per_print": 1000}
