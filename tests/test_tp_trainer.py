"""``TrainingArguments(deepspeed=<config with tensor_parallel.autotp_size 2>)`` on 4 CPU processes (DP 2 x TP 2),
no real DeepSpeed: the Trainer calls ``deepspeed.tp_model_init`` and ``deepspeed.initialize`` (hf_zero). The
config also carries ``sequence_parallel: true`` (the tokens are 32 long), so the Trainer's path through
``tp_model_init(config=...)`` is checked with it; without it, the same engine path is test_tp_engine.py's. ZeRO
stage 3 (every parameter partitioned): each rank's TP shards are partitioned over its data-parallel pair and
``save_model`` consolidates them into the unsplit model. (Under zero.Init: tests/test_tp_engine.py; transformers
itself refuses ``from_pretrained`` under ZeRO-3 with ``tensor_parallel`` in a registered config.)

Checked: the two ranks of a TP group train on the same batches and the two data-parallel replicas on different
ones; the global batch counts replicas, not ranks; the saved ``model.safetensors`` is one ordinary file that
``from_pretrained`` loads on one process, equal to a single-process clipped AdamW run over the same batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from _hf_env import EXAMPLES, make_venv, tiny_base_model, torchrun
from _tp_util import rel

SCRIPT = Path(__file__).resolve().parent / "_tp_trainer_script.py"


def _reference(base: Path, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for ids in batches:  # (dp * micro, T): mean token loss over the global batch = the DP-averaged gradient
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.state_dict().items()}


def test_trainer_dp2_tp2(tmp_path):
    python = make_venv(tmp_path / "venv")
    base = tiny_base_model(tmp_path / "base")
    out, record = tmp_path / "out", tmp_path / "record"
    torchrun(python, SCRIPT, [str(base), str(out), str(record), str(EXAMPLES), "sp", "3"], cwd=tmp_path, nproc=4,
             timeout=420)
    runs = [json.loads(Path(f"{record}.{r}.json").read_text()) for r in range(4)]
    assert all(r["tp_size"] == 2 and r["train_batch_size"] == 4 for r in runs)  # 2 replicas x micro-batch 2
    assert all(r["sequence_parallel"] for r in runs)
    assert all(r["stage"] == 3 and r["partitioned"] for r in runs)
    seen = [r["seen"] for r in runs]
    assert seen[0] == seen[1] and seen[2] == seen[3]  # a TP group reads one batch
    assert all(a != b for a, b in zip(seen[0], seen[2]))  # the replicas read different ones
    batches = [torch.tensor(a + b) for a, b in zip(seen[0], seen[2])]
    assert len(batches) == 3

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(str(out / "model.safetensors"))
    reference = _reference(base, batches)
    assert set(saved) == set(reference)
    for name, ref in reference.items():
        assert saved[name].shape == ref.shape, name
        assert rel(saved[name], ref) <= 1e-5, (name, rel(saved[name], ref))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, ref in reference.items():
        assert rel(reloaded.state_dict()[name], ref) <= 1e-5, name
