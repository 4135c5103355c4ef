"""Compression inside transformers.Trainer: schedules stepped by the callback, state kept across resume, cleaning at
the end; distillation and layer reduction."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_zero.compression import (CompressedLinear, CompressionCallback, DistillationTrainer, distillation_loss,
                                 init_compression, make_student, student_initialization)
from hf_zero.config.errors import ConfigError

torch.set_num_threads(1)

CFG = {"compression_training": {
    "weight_quantization": {"shared_parameters": {"enabled": True, "schedule_offset": 2, "per_channel": True},
                            "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 6,
                                                                   "quantization_period": 2},
                                                        "modules": ["mlp"]}}},
    "sparse_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 1, "schedule_offset_end": 5},
                       "different_groups": {"sp": {"params": {"dense_ratio": 0.4}, "modules": ["self_attn"]}}},
    "row_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 3},
                    "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["up_proj"],
                                                "related_modules": [["gate_proj", "down_proj"]]}}},
}}


def tiny_llama(layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


class Patterned(torch.utils.data.Dataset):
    """Learnable sequences: t_{i+1} = (a * t_i + b) mod 64 with (a, b) per sample."""

    def __init__(self, n=32, length=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            a, b, t = (int(v) for v in torch.randint(1, 8, (3,), generator=g))
            seq = []
            for _ in range(length):
                seq.append(t)
                t = (a * t + b) % 64
            self.items.append(torch.tensor(seq))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i], "labels": self.items[i]}


def args(tmp_path, steps, **kw):
    options = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
                   logging_steps=1, save_steps=3, save_strategy="steps", report_to=[], use_cpu=True, seed=0,
                   data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    options.update(kw)
    return TrainingArguments(**options)


def compression_state(model):
    return {k: v.clone() for k, v in model.state_dict().items()
            if "weight_transforms" in k or "input_transforms" in k}


def test_callback_steps_schedules_logs_and_resume_matches(tmp_path):
    # uninterrupted run A (checkpoint at step 3 is kept for run B)
    model_a = init_compression(tiny_llama(), CFG)
    trainer = Trainer(model=model_a, args=args(tmp_path / "a", 6), train_dataset=Patterned(),
                      callbacks=[CompressionCallback(CFG)])
    trainer.train()
    layer = model_a.model.layers[0]
    assert int(layer.mlp.up_proj.weight_transforms["weight_quantization"].bits) == 7  # step 5: 8 - (5-2)//2
    assert float(layer.self_attn.q_proj.weight_transforms["sparse_pruning"].density) == pytest.approx(0.4)
    assert int(layer.mlp.up_proj.weight_transforms["row_pruning"].mask.sum()) == 64
    logged = [h for h in trainer.state.log_history if "loss" in h]
    # the schedule is set before each step to the number of steps done: 0..5
    assert [h["compression/weight_quantization/bits"] for h in logged] == [0, 0, 8, 8, 7, 7]
    assert [round(h["compression/row_pruning/density"], 3) for h in logged] == [1, 1, 1, 0.5, 0.5, 0.5]
    assert logged[-1]["compression/linear_weight_sparsity"] > 0.2

    # run B: fresh model, resumed from A's step-3 checkpoint, must end where A ended
    model_b = init_compression(tiny_llama(seed=123), CFG)
    trainer_b = Trainer(model=model_b, args=args(tmp_path / "a", 6), train_dataset=Patterned(),
                        callbacks=[CompressionCallback(CFG)])
    trainer_b.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    state_a, state_b = compression_state(model_a), compression_state(model_b)
    assert state_a.keys() == state_b.keys() and len(state_a) > 0
    for key in state_a:
        torch.testing.assert_close(state_b[key], state_a[key], atol=1e-5, rtol=1e-4, msg=key)
    for (na, pa), (nb, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        torch.testing.assert_close(pb, pa, atol=1e-5, rtol=1e-4, msg=na)


def test_callback_cleans_at_end(tmp_path):
    model = init_compression(tiny_llama(), CFG)
    trainer = Trainer(model=model, args=args(tmp_path, 4, save_strategy="no"), train_dataset=Patterned(),
                      callbacks=[CompressionCallback(CFG, clean_at_end=True)])
    trainer.train()
    assert not any(isinstance(m, CompressedLinear) for m in model.modules())
    assert model.config.intermediate_size == 64
    assert tuple(model.model.layers[1].mlp.down_proj.weight.shape) == (64, 64)


def test_distillation_loss_values():
    torch.manual_seed(0)
    t = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    # identical logits: the KD term is zero, only CE remains
    ce = torch.nn.functional.cross_entropy(t[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(distillation_loss(t, t, labels, alpha=0.5), 0.5 * ce)
    s = torch.randn(2, 5, 11)
    p_t = torch.softmax(t / 2, -1)
    kl = (p_t * (torch.log_softmax(t / 2, -1) - torch.log_softmax(s / 2, -1))).sum(-1).mean()
    torch.testing.assert_close(distillation_loss(s, t, None, temperature=2.0, alpha=1.0), 4 * kl)
    hs = [torch.zeros(2, 5, 3), torch.ones(2, 5, 3)]
    ht = [torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), torch.full((2, 5, 3), 3.0)]
    loss = distillation_loss(t, t, None, alpha=1.0, student_hidden=hs, teacher_hidden=ht, hidden_weight=1.0,
                             layer_map=[0, 2])
    torch.testing.assert_close(loss, torch.tensor(2.0))  # mean(MSE 0, MSE (1-3)^2=4)


def test_layer_reduction_copies_chosen_layers():
    teacher = tiny_llama(layers=4)
    student = make_student(teacher, 2, teacher_layer=(0, 3))
    assert student.config.num_hidden_layers == 2 and len(student.model.layers) == 2
    torch.testing.assert_close(student.model.layers[1].mlp.up_proj.weight, teacher.model.layers[3].mlp.up_proj.weight)
    torch.testing.assert_close(student.model.layers[0].self_attn.q_proj.weight,
                               teacher.model.layers[0].self_attn.q_proj.weight)
    torch.testing.assert_close(student.lm_head.weight, teacher.lm_head.weight)
    # through init_compression, the DeepSpeed way, with the default (evenly spaced) teacher layers
    fresh = tiny_llama(layers=2, seed=5)
    cfg = {"compression_training": {"layer_reduction": {"enabled": True, "keep_number_layer": 2,
                                                        "module_name_prefix": "model.layers"}}}
    init_compression(fresh, cfg, teacher_model=teacher)
    torch.testing.assert_close(fresh.model.layers[0].mlp.down_proj.weight, teacher.model.layers[1].mlp.down_proj.weight)
    torch.testing.assert_close(fresh.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    with pytest.raises(ConfigError) as info:
        student_initialization(tiny_llama(layers=2), teacher, {"enabled": True, "keep_number_layer": 2,
                                                               "teacher_layer": [1, 7]})
    assert info.value.key_path == "compression_training.layer_reduction.teacher_layer"
    with pytest.raises(ConfigError, match="needs teacher_model"):
        init_compression(tiny_llama(layers=2), cfg)


def test_distilled_student_beats_scratch_student(tmp_path):
    """A 4-layer teacher trained on the patterns; a 2-layer student initialized from it and distilled gets a lower
    held-out loss than the same student trained from scratch for the same steps."""
    data, held = Patterned(64, seed=0), Patterned(16, seed=99)
    teacher = tiny_llama(layers=4)
    Trainer(model=teacher, args=args(tmp_path / "t", 60, save_strategy="no", learning_rate=3e-3),
            train_dataset=data).train()

    def held_loss(model):
        model.eval()
        with torch.no_grad():
            batch = torch.stack([held[i]["input_ids"] for i in range(len(held))])
            return float(model(batch, labels=batch).loss)

    distilled = make_student(teacher, 2)
    DistillationTrainer(model=distilled, teacher_model=teacher, temperature=2.0, alpha=0.7, hidden_weight=0.1,
                        args=args(tmp_path / "d", 15, save_strategy="no", learning_rate=3e-3),
                        train_dataset=data).train()
    scratch = tiny_llama(layers=2, seed=7)
    Trainer(model=scratch, args=args(tmp_path / "s", 15, save_strategy="no", learning_rate=3e-3),
            train_dataset=data).train()
    assert held_loss(distilled) < held_loss(scratch)
