"""Engine methods that exist for the Hugging Face stack: ``engine.compile`` (accelerate's dynamo path) and
``phase_seconds_total`` (``HfZeroCallback``'s time shares); ``write_model_card`` on a directory with a README."""

from __future__ import annotations

import torch

from hf_zero.testing import run_distributed


def _train(compile_backend: str | None, steps: int = 3):
    import hf_zero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    if compile_backend is not None:
        engine.compile(backend=compile_backend)
    assert engine.is_compiled == (compile_backend is not None)
    engine.phase_seconds_total()  # starts phase accounting
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    totals = engine.phase_seconds_total()
    weights = [p.detach().clone() for p in engine.module.parameters()]
    return losses, weights, totals


def _plain_then_compiled():
    return _train(None), _train("eager")


def test_compile_trains_like_eager_and_phase_totals_accumulate():
    for plain, compiled in run_distributed(_plain_then_compiled, world_size=2):
        losses, weights, totals = compiled
        assert losses == plain[0]
        for a, b in zip(weights, plain[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # "communication": time blocked in the stage-2 gradient reduce-scatters (2 ranks), inside backward's time
        assert set(totals) == {"forward", "backward", "step", "communication"}
        assert all(s > 0 for s in totals.values()) and totals["communication"] <= totals["backward"]


def test_model_card_keeps_an_existing_readme(tmp_path):
    from hf_zero.integrations.trainer_callback import CARD_BEGIN, CARD_END, write_model_card

    (tmp_path / "README.md").write_text("# My model\n\nUser text.\n")
    write_model_card(tmp_path, None)
    write_model_card(tmp_path, None)  # written twice: the section is replaced, not duplicated
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# My model\n\nUser text.\n")
    assert text.count(CARD_BEGIN) == text.count(CARD_END) == 1
    assert "| ZeRO stage | none (not trained by the ZeRO engine) |" in text
    assert "| precision | fp32 |" in text and "| hardware | " in text
