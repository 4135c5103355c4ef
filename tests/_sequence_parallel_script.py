"""Ulysses sequence parallelism, 2 ranks, tiny Llama: the script tests/test_sequence_parallel.py runs.

    python -m torch.distributed.run --nproc_per_node 2 tests/_sequence_parallel_script.py OUT.json
    python tests/_sequence_parallel_script.py OUT.json --reference     # one process, the full sequences

Written against ``import deepspeed`` only, so the same file runs on hf_zero's shim and on DeepSpeed itself
(``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu`` with DeepSpeed's interpreter). The SP run follows
accelerate's test_ds_alst_ulysses_sp.py: register_with_transformers -> initialize(mpu=...) -> the data-loader
adapter -> per-shard loss with shift_labels -> token-weighted aggregation over the SP group (differentiable).
Plain SGD, so a gradient scaled by any factor shows in the parameters.
"""

from __future__ import annotations

import json
import sys

import torch

SEQ, SAMPLES, VOCAB, LR = 32, 4, 96, 0.5
MASKED = {0: 10, 2: 20}  # sample -> leading tokens whose labels are -100 (prompt-like): the shards count unequally


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float()


def samples():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    labels = ids.clone()
    for i, n in MASKED.items():
        labels[i, :n] = -100
    return ids, labels


def reference() -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = samples()
    losses, norms = [], []
    for i in range(SAMPLES):
        loss = model(input_ids=ids[i:i + 1], labels=labels[i:i + 1],
                     position_ids=torch.arange(SEQ).unsqueeze(0)).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": _params(model)}


def _params(model) -> dict:
    return {n: p.detach().flatten()[:64].tolist() + [p.detach().double().sum().item()]
            for n, p in model.named_parameters()}


def _sp_train(stage: int, mpu) -> dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
              "gradient_clipping": 0.0}  # absent, both DeepSpeed 0.19.8 and hf_zero clip at 1.0
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=mpu)
    rank = dist.get_rank()
    ids, labels = samples()
    mine = list(range(rank, SAMPLES, 2))  # the data-parallel split accelerate's prepare() does
    rows = [{"input_ids": ids[i:i + 1], "labels": labels[i:i + 1], "position_ids": torch.arange(SEQ).unsqueeze(0)}
            for i in mine]
    dl = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(rows, batch_size=None), sp_rank=rank,
                                    sp_group=mpu.get_sequence_parallel_group(), sp_world_size=2, device="cpu")
    group = mpu.get_sequence_parallel_group()
    losses, norms, shards = [], [], []
    for batch in dl:
        shards.append([batch["input_ids"][0, 0].item(), batch["position_ids"][0, 0].item(),
                       batch["shift_labels"][0].tolist()])
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        shift = batch["shift_labels"]
        loss = model.loss_function(logits=out.logits, labels=None, shift_labels=shift, vocab_size=VOCAB)
        # accelerate's aggregation, written out so DeepSpeed runs the same
        per_rank = torch.distributed.nn.functional.all_gather(loss, group=group)
        counted = torch.distributed.nn.functional.all_gather((shift != -100).sum(), group=group)
        loss = sum(per_rank[r] * counted[r] for r in range(2) if counted[r] > 0) / sum(counted)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            params = _params(model)
    else:
        params = _params(model)
    return {"len": len(dl), "losses": losses, "norms": norms, "params": params, "shards": shards}


def distributed() -> dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model()  # register reads the head counts and the attention implementation from it
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=2, micro_batch_size=1,
                                                          seq_length_is_variable=True)
    out = {"rank": dist.get_rank(), "sp_rank": mpu.get_sequence_parallel_rank(),
           "sp_size": mpu.get_sequence_parallel_world_size()}
    for stage in (2, 3):
        out[f"stage{stage}"] = _sp_train(stage, mpu)
    if "--hf-zero-checks" in sys.argv:
        out.update(_hf_zero_checks(mpu))
    return out


def _hf_zero_checks(mpu) -> dict:
    """The config key and the refusals (hf_zero only)."""
    import deepspeed
    from hf_zero.config.errors import ConfigError

    base = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW",
            "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    out = {}
    # the key alone: the groups exist already (same size: reused), and 1 sample per step counts one replica
    engine, *_ = deepspeed.initialize(model=make_model(), config={**base, "sequence_parallel_size": 2})
    out["config_key"] = [engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                         engine.gradient_accumulation_steps()]
    # DeepSpeed's mesh_param=(data_parallel, sequence_parallel) says the same as the keys
    engine, *_ = deepspeed.initialize(model=make_model(), config=base, mesh_param=(1, 2))
    out["mesh_param"] = [engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                         engine.gradient_accumulation_steps()]
    for name, kwargs in (("mesh_world", {"mesh_param": (2, 2)}), ("mesh_key", {"mesh_param": (1, 2), "config": {
            **base, "sequence_parallel_size": 1}}), ("no_model", {"model": None})):
        try:
            deepspeed.initialize(**{"model": make_model(), "config": base, **kwargs})
            out[name] = None
        except (ConfigError, ValueError) as e:
            out[name] = (str(e), isinstance(e, AssertionError))
    # Ulysses splits the sequence over the data-parallel ranks; a pipeline splits the model over the same ranks
    pipe = deepspeed.pipe.PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2,
                                         loss_fn=torch.nn.MSELoss())
    for name, kwargs in (("mismatch", {"config": {**base, "sequence_parallel_size": 1}, "mpu": mpu}),
                         ("batch", {"config": {**base, "train_batch_size": 2, "gradient_accumulation_steps": 1}, "mpu": mpu}),
                         ("pipeline", {"config": {**base, "sequence_parallel_size": 2}, "model": pipe})):
        try:
            deepspeed.initialize(**{"model": make_model(), **kwargs})
            out[name] = None
        except (ConfigError, ValueError) as e:
            out[name] = str(e)
    return out


def trainer_run(output_dir: str) -> dict:
    """The same 4 samples through transformers' Trainer with ``parallelism_config`` (SP 2, ZeRO 2, SGD): the
    Trainer's own ALST path (accelerate's adapter after prepare, transformers' deepspeed_sp_compute_loss)."""
    import torch.distributed as dist
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=1, max_steps=SAMPLES, learning_rate=LR,
                             optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
                             report_to=[], save_strategy="no", deepspeed=ds, parallelism_config=pc,
                             train_sampling_strategy="sequential")  # samples 0, 1, 2, 3 as the reference
    ids, labels = samples()
    rows = [{"input_ids": ids[i], "labels": labels[i], "position_ids": torch.arange(SEQ)} for i in range(SAMPLES)]
    trainer = Trainer(model=make_model(), args=args, train_dataset=rows)
    trainer.train()
    return {"rank": dist.get_rank(), "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


if __name__ == "__main__":
    if "--trainer" in sys.argv:
        result = trainer_run(f"{sys.argv[1]}.trainer")
    else:
        result = reference() if "--reference" in sys.argv else distributed()
    rank = result.get("rank", 0)
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        json.dump(result, f)
