"""MFU and throughput in the Trainer logs (HfZeroCallback), and total_flos equal at every ZeRO stage."""

import math

import pytest
import torch

from hf_zero.profiling.analytic import analytic_flops
from hf_zero.testing import run_distributed

B, S, STEPS, PAD = 2, 16, 3, 5


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 128, (n, S), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = torch.ones(S, dtype=torch.long)
        mask[S - PAD:] = 0  # PAD padding positions per sequence: not tokens
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.ids[i]}


def _trainer_run(stage: int, out: str, peak, detail: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from hf_zero.integrations.trainer_callback import HfZeroCallback

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    non_embedding = model.num_parameters(exclude_embeddings=True)  # before ZeRO-3 partitions it
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 1000,
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100}}
    args = TrainingArguments(output_dir=f"{out}/z{stage}", per_device_train_batch_size=B, max_steps=STEPS,
                             logging_steps=1, save_strategy="no", report_to=[], deepspeed=ds, learning_rate=1e-3,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_Data(64))
    HfZeroCallback.attach(trainer, write_cards=False, peak_tflops=peak, detail=detail)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return dict(logs=logs, total_flos=trainer.state.total_flos, non_embedding=non_embedding, analytic=analytic_flops(cfg, B, S).training,
                hooks=len(trainer.model_wrapped._forward_pre_hooks))


def _stages(out: str):
    return {0: _trainer_run(0, out, None), 3: _trainer_run(3, out, 100.0)}


def test_callback_logs_throughput_and_mfu_and_total_flos_is_equal_across_stages(tmp_path):
    results = run_distributed(_stages, 2, args=(str(tmp_path),), timeout_s=300)
    by_stage = results[0]
    z0, z3 = by_stage[0], by_stage[3]
    # transformers' formula (6 x tokens x non-embedding params, both ranks) with the true count at both stages
    assert z0["total_flos"] == z3["total_flos"] == 6 * (2 * STEPS * B * S) * z0["non_embedding"]
    for stage, run in by_stage.items():
        assert len(run["logs"]) == STEPS
        for log in run["logs"]:
            tps, per_rank = log["zero/tokens_per_s"], log["zero/tokens_per_s_per_rank"]
            assert tps > 0 and math.isclose(per_rank, tps / 2, rel_tol=1e-3)
            # tokens exclude padding; model FLOPs are per padded shape: their ratio is fixed by the batch
            tflops = log["zero/model_tflops_per_rank"]
            ratio = tflops * 1e12 / per_rank
            assert math.isclose(ratio, run["analytic"] / (B * (S - PAD)), rel_tol=2e-2), (stage, ratio)
        assert run["hooks"] == 0  # the meter's hook on the engine is gone after training
    assert all("zero/mfu" not in log and "zero/peak_tflops" not in log for log in z0["logs"])  # CPU: no peak
    for log in z3["logs"]:
        assert log["zero/peak_tflops"] == 100.0
        assert math.isclose(log["zero/mfu"], log["zero/model_tflops_per_rank"] / 100.0, rel_tol=1e-3)
        assert log["zero/hfu"] >= log["zero/mfu"]


def _default_line(out: str):
    return _trainer_run(2, out, None, detail=False)


def test_default_log_line_is_six_figures(tmp_path):
    """What a user reads at every logging step: the Trainer's four figures and two of hf_zero's -- tokens/s over
    all ranks and the largest rank's peak memory -- and nothing per rank."""
    run = run_distributed(_default_line, 2, args=(str(tmp_path),), timeout_s=300)[0]
    for log in run["logs"]:
        printed = {k for k in log if k != "step"}  # the Trainer prints the entry without its step
        assert printed == {"loss", "grad_norm", "learning_rate", "epoch", "zero/tokens_per_s", "zero/peak_mem_gb"}
        assert log["zero/tokens_per_s"] > 0 and 0.01 < log["zero/peak_mem_gb"] < 100


def test_time_shares_sum_to_one_and_nested_phases_are_apart():
    from hf_zero.integrations.trainer_callback import time_shares

    out = time_shares({"forward": 0.2, "backward": 0.5, "step": 0.1, "communication": 0.3, "offload_io": 0.05}, 1.0)
    assert out == {"zero/time_share/forward": 0.2, "zero/time_share/backward": 0.5, "zero/time_share/step": 0.1,
                   "zero/time_share/other": 0.2, "zero/time_within/communication": 0.3,
                   "zero/time_within/offload_io": 0.05}
    # timer jitter past the window: the top-level shares are scaled into it, "other" is 0, the sum still 1
    over = time_shares({"forward": 0.6, "backward": 0.6}, 1.0)
    assert over["zero/time_share/other"] == 0.0
    assert abs(sum(v for k, v in over.items() if k.startswith("zero/time_share/")) - 1.0) < 1e-3
