"""``hybrid_engine`` (DeepSpeed's RLHF hybrid engine, hf_zero/runtime/hybrid_engine.py): the training engine
generates between its steps, as DeepSpeed-Chat's step 3 does with the actor.

2 CPU ranks (gloo), a tiny Llama; each rank generates greedily from its own prompts with ``synced_gpus`` (what
DeepSpeed-Chat passes at ZeRO-3). Checked against one process holding the plain model: the tokens; against the same
run without the hybrid engine: the losses of training steps taken between generations (generation changes no
weight), and the elements all-gathered during ``generate`` (ZeRO-3 with ``pin_parameters``: the model once, instead
of every layer at every decoding step)."""

from __future__ import annotations

import logging

import pytest
import torch

from _zero3_util import tiny_llama_config
from hf_zero.testing import run_distributed

NEW_TOKENS = 6


def _config(stage: int, hybrid: dict | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if hybrid is not None:
        cfg["hybrid_engine"] = hybrid
    return cfg


def _prompts(rank: int) -> torch.Tensor:
    return torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(100 + rank))


def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def _rounds(stage: int, hybrid: dict | None):
    """Two RLHF-style rounds: eval, generate, train, one step. Returns (tokens per round, losses, all-gathered
    elements during each generate, the model's parameter count, log lines, rng states equal across ranks?)."""
    import hf_zero
    from hf_zero.zero.stage3.gather import gatherer_for

    rank = torch.distributed.get_rank()
    model = _model()
    torch.manual_seed(1234 + rank)  # differently seeded ranks: the hybrid engine syncs them from rank 0
    numel = sum(p.numel() for p in model.parameters())
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    hf_zero_logger = logging.getLogger("hf_zero")
    hf_zero_logger.addHandler(handler)
    old_level = hf_zero_logger.level
    hf_zero_logger.setLevel(logging.INFO)
    try:
        engine, *_ = hf_zero.initialize(model=model, config=_config(stage, hybrid))
        states = [None] * 2
        torch.distributed.all_gather_object(states, torch.get_rng_state())
        rng_synced = bool(torch.equal(states[0], states[1]))
        g = torch.Generator().manual_seed(7 + rank)
        tokens, losses, gathered = [], [], []
        for _ in range(2):
            engine.eval()
            before = gatherer_for(None).gathered_numel if stage == 3 else 0
            with torch.no_grad():
                out = engine.module.generate(_prompts(rank), attention_mask=torch.ones(2, 5, dtype=torch.long),
                                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                             synced_gpus=stage == 3)
            gathered.append((gatherer_for(None).gathered_numel if stage == 3 else 0) - before)
            tokens.append(out)
            engine.train()
            ids = torch.randint(3, 64, (2, 8), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.eval()  # closes round 2: its breakdown line
        via_engine = engine.generate(_prompts(rank), max_new_tokens=2, do_sample=False, pad_token_id=0,
                                     synced_gpus=stage == 3)
        from hf_zero.zero.gathered import unwrap_model_for_generation

        with unwrap_model_for_generation(engine):  # the script's own block (TRL's pattern): generate inside it
            nested = engine.module.generate(_prompts(rank), max_new_tokens=2, do_sample=False, pad_token_id=0)
        wrapped = "generate" in engine.module.__dict__
        engine.destroy()
        restored = "generate" not in engine.module.__dict__
    finally:
        hf_zero_logger.removeHandler(handler)
        hf_zero_logger.setLevel(old_level)
    lines = [r for r in records if "hybrid engine" in r]
    return dict(tokens=tokens, losses=losses, gathered=gathered, numel=numel, lines=lines, rng_synced=rng_synced,
                via_engine=via_engine, nested=nested, wrapped=wrapped, restored=restored)


def _three_ways(stage: int):
    return {"plain": _rounds(stage, None), "hybrid": _rounds(stage, {"enabled": True, "max_out_tokens": 64}),
            "unpinned": _rounds(stage, {"enabled": True, "pin_parameters": False})}


def _reference_tokens():
    """One process, the plain model: what each rank's round-1 generation must give."""
    model = _model().eval()
    return [model.generate(_prompts(r), attention_mask=torch.ones(2, 5, dtype=torch.long), max_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0) for r in range(2)]


@pytest.mark.parametrize("stage", [2, 3])
def test_generate_between_steps_matches_the_plain_model_and_engine(stage):
    ref = _reference_tokens()
    for rank, runs in enumerate(run_distributed(_three_ways, world_size=2, args=(stage,))):
        plain, hybrid, unpinned = runs["plain"], runs["hybrid"], runs["unpinned"]
        torch.testing.assert_close(hybrid["tokens"][0], ref[rank], rtol=0, atol=0)  # round 1: the initial weights
        for run in (hybrid, unpinned):
            for mine, theirs in zip(run["tokens"], plain["tokens"]):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
            assert run["losses"] == plain["losses"]  # generation changed no weight
            assert run["wrapped"] and run["restored"]  # module.generate wrapped, and given back by destroy()
            assert run["via_engine"].shape == (2, 7)  # engine.generate is the same call
            torch.testing.assert_close(run["nested"], run["via_engine"], rtol=0, atol=0)
        assert not plain["wrapped"]
        # every rank starts from rank 0's random-number state with the hybrid engine (seeded differently here)
        assert hybrid["rng_synced"] and unpinned["rng_synced"] and not plain["rng_synced"]
        if stage == 3:
            numel = plain["numel"]
            for n in hybrid["gathered"]:  # the model once per generate() (the embedding is tied: counted once)
                assert 0.9 * numel <= n <= numel, (n, numel)
            for n in plain["gathered"] + unpinned["gathered"]:  # every layer again at each decoding step
                assert n >= NEW_TOKENS * 0.9 * numel, (n, numel)
        else:
            assert hybrid["gathered"] == [0, 0]
        # DeepSpeed's round breakdown on rank 0 at each eval() after the first
        if rank == 0:
            assert len(hybrid["lines"]) == 2, hybrid["lines"]
            line = hybrid["lines"][-1]
            for field in ("|E2E latency=", "|Gather latency=", "|Generate time=", "|Training time=", "|Others=",
                          "|CurSamplesPerSec=", "|AvgSamplesPerSec="):
                assert field in line, line
            assert float(line.split("|Training time=")[1].split("s")[0]) >= 0.0
        else:
            assert hybrid["lines"] == []
        assert plain["lines"] == []


def test_hybrid_keys_warn_only_with_the_engine_enabled():
    """DeepSpeed-Chat writes the whole section with ``enabled: false`` on its critic: nothing to say then. Enabled,
    the keys that tune DeepSpeed's injected kernels warn by name."""
    import warnings

    from hf_zero.config import load_config
    from hf_zero.config.status import ConfigKeyIgnored

    section = {"max_out_tokens": 80, "inference_tp_size": 2, "release_inference_cache": True,
               "pin_parameters": True, "tp_gather_partition_size": 4, "enable_cuda_graph": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"enabled": False, **section}},
                    world_size=1)
    assert [w for w in caught if issubclass(w.category, ConfigKeyIgnored)] == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"enabled": True, **section}},
                          world_size=1)
    named = sorted(str(w.message).split("config key ")[1].split(" ")[0] for w in caught
                   if issubclass(w.category, ConfigKeyIgnored))
    assert named == ["hybrid_engine.enable_cuda_graph", "hybrid_engine.inference_tp_size",
                     "hybrid_engine.max_out_tokens", "hybrid_engine.release_inference_cache",
                     "hybrid_engine.tp_gather_partition_size"]
    assert cfg.hybrid_engine.pin_parameters is True and cfg.hybrid_engine.max_out_tokens == 80
    from hf_zero.config.errors import ConfigError

    with pytest.raises(ConfigError, match="hybrid_engine.max_out_tokens"):
        load_config({"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"enabled": True, "max_out_tokens": 0}},
                    world_size=1)
