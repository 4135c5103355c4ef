"""A DeepSpeed config without ``gradient_clipping`` clips the global gradient norm at 1.0, as DeepSpeed does.

DeepSpeed changed ``GRADIENT_CLIPPING_DEFAULT`` from 0 (off) to 1.0 in v0.19.3 (deepspeedai/DeepSpeed#8068); a config
written without the key therefore trains clipped there, and must train the same here.

The case: ``Linear(4, 2)`` seeded 0, the batch ``arange(8).reshape(2, 4)``, loss ``(out * 100).sum()`` (gradient
norm 2097.6), SGD lr 0.1, one step, micro batch 2, 1 process. DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``) gives, with
the key absent, at ZeRO stages 0, 1, 2 and 3 in fp32 exactly :data:`CLIPPED` (the torch reference with
``clip_grad_norm_(1.0)``), and exactly :data:`UNCLIPPED` (weight[0] -40.0037, -59.7318, ...) with
``"gradient_clipping": 0.0``; in bf16 the same to bf16 rounding (weight[0][0] -0.0228271484375 clipped, -40.0
unclipped). Its ``get_global_grad_norm()`` is 2097.6177 (None at stage 0 in fp32). DeepSpeed clips on every path:
stage 0 fp32 in the engine (``clip_fp32_gradients``), bf16 and ZeRO 1-3 in their optimizer wrappers (``clip_grad``).
"""

import logging

import pytest
import torch

import hf_zero
from hf_zero.testing import run_distributed

# [weight (2, 4) flattened, bias (2,)] after the step: the torch reference with clip_grad_norm_(1.0), which is also
# DeepSpeed 0.19.8's result with gradient_clipping absent at every ZeRO stage in fp32.
CLIPPED = [[-0.02281266264617443, 0.23961791396141052, -0.4496610760688782, -0.415642648935318,
            -0.2116464376449585, 0.1054747998714447, -0.048045095056295395, 0.3487716019153595],
           [-0.053906649351119995, 0.12277165055274963]]
# The same without clipping (DeepSpeed 0.19.8 with "gradient_clipping": 0.0).
UNCLIPPED = [[-40.00374221801758, -59.731781005859375, -80.4115219116211, -100.36797332763672,
              -40.19257736206055, -59.86592102050781, -80.0099105834961, -99.60355377197266],
             [-20.04437255859375, -19.867694854736328]]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _reference(max_norm: float | None) -> list[list[float]]:
    model = _model()
    (model(torch.arange(8.0).reshape(2, 4)) * 100.0).sum().backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _one_step(stage: int, clipping: float | None) -> tuple[list[list[float]], float]:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if clipping is not None:
        config["gradient_clipping"] = clipping
    engine, *_ = hf_zero.initialize(model=_model(), config=config)
    engine.backward((engine(torch.arange(8.0).reshape(2, 4)) * 100.0).sum())
    engine.step()
    if getattr(engine, "stage3", None) is not None:
        state = engine._zero3_consolidated_16bit_state_dict()
        params = [state["weight"].flatten().tolist(), state["bias"].flatten().tolist()]
    else:
        params = [p.detach().flatten().tolist() for p in engine.module.parameters()]
    norm = float(engine.get_global_grad_norm())
    engine.destroy()
    return params, norm


def _stages(clipping):
    return {stage: _one_step(stage, clipping) for stage in (0, 1, 2, 3)}


def test_reference_values_are_torch_clip_grad_norm():
    assert _reference(1.0) == CLIPPED
    assert _reference(None) == UNCLIPPED


@pytest.mark.parametrize("clipping, expected", [(None, CLIPPED), (0.0, UNCLIPPED)], ids=["absent", "0.0"])
def test_absent_gradient_clipping_clips_at_1_like_deepspeed(clipping, expected):
    [by_stage] = run_distributed(_stages, 1, args=(clipping,))
    for stage, (params, norm) in by_stage.items():
        assert norm == pytest.approx(2097.6177, rel=1e-6), f"stage {stage}"
        for got, want in zip(params, expected):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-6,
                                       msg=lambda m, s=stage: f"stage {s}: {m}")


def test_default_clipping_is_logged_once(caplog):
    from hf_zero.config import load_config, loader

    loader._note_default_clipping.cache_clear()
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        for _ in range(2):
            assert load_config({}, world_size=1).gradient_clipping == 1.0
        load_config({}, world_size=1, rank=1)
        assert load_config({"gradient_clipping": 0.0}, world_size=1).gradient_clipping == 0.0
    notes = [r.getMessage() for r in caplog.records if "gradient_clipping is not set" in r.getMessage()]
    assert notes == ["gradient_clipping is not set: clipping the global gradient norm at 1.0, DeepSpeed's default "
                     "(GRADIENT_CLIPPING_DEFAULT). Set \"gradient_clipping\": 0.0 to train without clipping."]
