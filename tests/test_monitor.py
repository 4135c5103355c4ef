"""DeepSpeed's metric monitors (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``; hf_zero/runtime/monitor.py):
the events DeepSpeed 0.19.8 writes, at the steps it writes them, on global rank 0 only, in its file layout.

DeepSpeed's own run of the script in ``_dense`` (``DS_ACCELERATOR=cpu``, 2 ranks under torch.distributed.run, the
same model, data, config and ``write_events`` calls) wrote ``<output_path>/job1/`` with exactly these files, which
``test_csv_files_are_deepspeeds_byte_for_byte`` compares against:

    Train_Samples_lr.csv   "step,lr\\r\\n12,0.0\\r\\n24,0.025\\r\\n36,0.05\\r\\n"
    Custom_my_metric.csv   "step,my metric\\r\\n7,3.25\\r\\n8,4.5\\r\\n"
    plain.csv              "step,plain\\r\\n2,1\\r\\n"

Its engine writes ``Train/Samples/lr`` (and ``loss_scale`` with fp16, the ``elapsed_time_ms_*`` timings with
``wall_clock_breakdown``) once per optimizer step at the sample count after it, and no loss; its pipeline engine adds
``train_loss``/``eval_loss``. The losses a script sees are written by the script itself (``engine.monitor``).
"""

from __future__ import annotations

import csv
import io
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hf_zero
from hf_zero.config import ConfigError, load_config
from hf_zero.runtime.monitor import MonitorMaster
from hf_zero.testing import run_distributed

from _pipe_util import MICRO, ds_config, data, layer_list, reference_run

WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
                                         "warmup_type": "linear"}}


def _rows(path: Path) -> list[tuple[int, float]]:
    header, *rows = list(csv.reader(io.StringIO(path.read_text())))
    return [(int(step), float(value)) for step, value in rows]


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ---- a DeepSpeed script on 2 ranks: csv + tensorboard, gradient accumulation 3 ------------------------------------
def _dense(out: str):
    """DeepSpeed's reference script (module docstring), plus the loss the script saw written through the monitor."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": WARMUP, "steps_per_print": 1000,
              "csv_monitor": {"enabled": True, "output_path": out, "job_name": "job1"},
              "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"}}
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)  # each rank its own data, so its own losses
    seen, micro_losses = [], []
    for _ in range(9):
        loss = engine(torch.randn(2, 4, generator=g)).pow(2).mean()
        engine.backward(loss)
        micro_losses.append(loss.item())
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:  # what a script logs: the mean loss of the step's micro-batches, at the step's sample count
            mean = sum(micro_losses) / len(micro_losses)
            micro_losses = []
            engine.monitor.write_events([("Train/Samples/script_loss", mean, engine.global_samples)])
            seen.append((engine.global_samples, engine.get_lr()[0], mean))
    engine.monitor.write_events([("Custom/my metric", 3.25, 7), ("plain", 1, 2)])
    engine.monitor.write_events([("Custom/my metric", 4.5, 8)])
    writers = [engine.monitor.csv_monitor is not None, engine.monitor.tb_monitor is not None]
    engine.destroy()
    return {"rank": rank, "seen": seen, "enabled": engine.monitor.enabled, "writers": writers}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor_dense")
    return out, run_distributed(_dense, 2, args=(str(out),), timeout_s=180)


def test_csv_files_are_deepspeeds_byte_for_byte(dense):
    out, ranks = dense
    job = out / "job1"
    assert sorted(p.name for p in job.iterdir()) == ["Custom_my_metric.csv", "Train_Samples_lr.csv",
                                                     "Train_Samples_script_loss.csv", "plain.csv"]
    assert (job / "Train_Samples_lr.csv").read_bytes() == b"step,lr\r\n12,0.0\r\n24,0.025\r\n36,0.05\r\n"
    assert (job / "Custom_my_metric.csv").read_bytes() == b"step,my metric\r\n7,3.25\r\n8,4.5\r\n"
    assert (job / "plain.csv").read_bytes() == b"step,plain\r\n2,1\r\n"


def test_lr_and_the_scripts_losses_are_rank_0s_at_each_boundary(dense):
    out, ranks = dense
    seen = ranks[0]["seen"]
    assert [s for s, _, _ in seen] == [12, 24, 36]  # 2 per micro-batch x 3 accumulation steps x 2 ranks
    assert _rows(out / "job1" / "Train_Samples_lr.csv") == [(s, lr) for s, lr, _ in seen]
    # written once (rank 1 wrote nothing), the exact floats rank 0's script saw -- not rank 1's
    assert _rows(out / "job1" / "Train_Samples_script_loss.csv") == [(s, loss) for s, _, loss in seen]
    assert [loss for _, _, loss in ranks[1]["seen"]] != [loss for _, _, loss in seen]
    assert [r["enabled"] for r in ranks] == [True, True]
    assert [r["writers"] for r in ranks] == [[True, True], [False, False]]


def test_tensorboard_events_are_rank_0s_in_one_file(dense):
    out, ranks = dense
    seen = ranks[0]["seen"]
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    scalars = _scalars(out / "tb")
    assert sorted(scalars) == ["Custom/my metric", "Train/Samples/lr", "Train/Samples/script_loss", "plain"]
    assert scalars["Train/Samples/lr"] == [(s, pytest.approx(lr, rel=1e-6)) for s, lr, _ in seen]
    assert scalars["Train/Samples/script_loss"] == [(s, pytest.approx(loss, rel=1e-6)) for s, _, loss in seen]
    assert scalars["Custom/my metric"] == [(7, 3.25), (8, 4.5)] and scalars["plain"] == [(2, 1.0)]


# ---- one process: fp16 loss scale, wall-clock timings, close ------------------------------------------------------
def _train(config: dict, micro_steps: int, half: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(micro_steps):
        x = torch.randn(2, 4, generator=g)
        loss = engine(x.half() if half else x).float().pow(2).mean()
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            seen.append((engine.global_samples, engine.get_lr()[0], engine.get_loss_scale()))
    return engine, seen


def _base(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": WARMUP, **extra}


def test_fp16_loss_scale_and_wall_clock_timings(tmp_path):
    fp16 = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}
    engine, seen = _train(_base(fp16=fp16, wall_clock_breakdown=True,
                                tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "fp16"}),
                          micro_steps=10, half=True)
    assert [scale for _, _, scale in seen] == [16.0, 16.0, 32.0, 32.0, 64.0]  # grows every 2 clean steps
    engine.destroy()
    scalars = _scalars(tmp_path / "fp16")
    assert scalars["Train/Samples/loss_scale"] == [(s, scale) for s, _, scale in seen]
    assert scalars["Train/Samples/lr"] == [(s, pytest.approx(lr, rel=1e-6)) for s, lr, _ in seen]
    timings = ["forward", "backward", "backward_inner", "backward_allreduce", "step"]
    assert sorted(scalars) == sorted(["Train/Samples/lr", "Train/Samples/loss_scale"] +
                                     [f"Train/Samples/elapsed_time_ms_{t}" for t in timings])
    for t in timings:
        events = scalars[f"Train/Samples/elapsed_time_ms_{t}"]
        assert [s for s, _ in events] == [4, 8, 12, 16, 20] and all(ms >= 0 for _, ms in events)
    assert all(ms > 0 for _, ms in scalars["Train/Samples/elapsed_time_ms_forward"])
    forward, backward = (scalars[f"Train/Samples/elapsed_time_ms_{t}"] for t in ("forward", "backward"))
    inner, waiting = (scalars[f"Train/Samples/elapsed_time_ms_{t}"] for t in ("backward_inner", "backward_allreduce"))
    for (_, b), (_, i), (_, w) in zip(backward, inner, waiting):
        assert i + w == pytest.approx(b, rel=1e-5, abs=1e-6)
    with pytest.raises(RuntimeError, match="after engine.destroy"):
        engine.monitor.write_events([("x", 1.0, 1)])


def test_a_disabled_section_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, seen = _train(_base(csv_monitor={"enabled": False, "job_name": "off"}), micro_steps=2)
    assert engine.monitor.enabled is False and list(tmp_path.iterdir()) == []
    engine.monitor.write_events([("x", 1.0, 1)])  # DeepSpeed's MonitorMaster accepts it too, and writes nowhere
    assert list(tmp_path.iterdir()) == []


def test_empty_output_path_writes_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, seen = _train(_base(csv_monitor={"enabled": True}), micro_steps=4)
    assert _rows(tmp_path / "DeepSpeedJobName" / "Train_Samples_lr.csv") == [(s, lr) for s, lr, _ in seen]


# ---- missing libraries: the key and the fix, before anything is written --------------------------------------------
@pytest.mark.parametrize("section, module, fix", [
    ("tensorboard", "tensorboard", "pip install tensorboard"),
    ("wandb", "wandb", "pip install wandb"),
    ('comet', "comet_ml", 'pip install "comet_ml>=3.41.0"'),
])
def test_a_missing_library_is_an_error_naming_the_key(tmp_path, monkeypatch, section, module, fix):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    config = _base(**{section: {"enabled": True, "output_path": str(tmp_path / "m")} if section == "tensorboard"
                      else {"enabled": True}})
    with pytest.raises(ConfigError) as info:
        _train(config, micro_steps=0)
    assert str(info.value).startswith(f"{section}.enabled: true needs the {module!r} module, which cannot be imported")
    assert f"install it (`{fix}`), or set {section}.enabled to false" in str(info.value)
    assert not (tmp_path / "m").exists()


def test_an_old_comet_ml_is_an_error_naming_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "comet_ml", types.SimpleNamespace(__version__="3.40.2"))
    with pytest.raises(ConfigError, match=r"comet.enabled: true needs comet_ml >= 3.41.0 .*found 3.40.2"):
        MonitorMaster({"comet": {"enabled": True}})


# ---- wandb and comet through fake modules: DeepSpeed's arguments and values ---------------------------------------
class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):  # any method: recorded, returns the recorder (wandb.init's run, comet's experiment)
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs)) or self


def test_wandb_gets_deepspeeds_init_arguments_and_one_log_per_event(monkeypatch):
    wandb = _Recorder()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    engine, seen = _train(_base(wandb={"enabled": True, "project": "proj", "team": "lab", "group": "sweep"}),
                          micro_steps=6)
    engine.monitor.write_events([("Custom/a", 1.5, 3)])
    assert wandb.calls == [("init", (), {"project": "proj", "group": "sweep", "entity": "lab"})] + [
        ("log", ({"Train/Samples/lr": lr},), {"step": s, "commit": None}) for s, lr, _ in seen] + [
        ("log", ({"Custom/a": 1.5},), {"step": 3, "commit": None})]
    assert [s for s, _, _ in seen] == [4, 8, 12]


def test_wandb_defaults_are_deepspeeds(monkeypatch):
    wandb = _Recorder()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    MonitorMaster({"wandb": {"enabled": True}})
    assert wandb.calls == [("init", (), {"project": "deepspeed", "group": None, "entity": None})]


def test_comet_starts_an_experiment_and_sends_each_tag_once_per_interval(monkeypatch):
    experiment = _Recorder()
    comet_ml = types.SimpleNamespace(__version__="3.49.1", started=[])
    comet_ml.start = lambda **kwargs: comet_ml.started.append(kwargs) or experiment
    monkeypatch.setitem(sys.modules, "comet_ml", comet_ml)
    engine, seen = _train(_base(comet={"enabled": True, "samples_log_interval": 8, "project": "p", "workspace": "w",
                                       "experiment_name": "run1", "online": False, "mode": "create"}),
                          micro_steps=12)
    assert comet_ml.started == [{"api_key": None, "project": "p", "workspace": "w", "experiment_key": None,
                                 "mode": "create", "online": False}]
    assert [s for s, _, _ in seen] == [4, 8, 12, 16, 20, 24]
    lr = {s: value for s, value, _ in seen}
    assert experiment.calls == [("set_name", ("run1",), {})] + [
        ("log_metric", ("Train/Samples/lr", lr[s]), {"step": s}) for s in (4, 12, 20)]  # first, then >= 8 later


# ---- the pipeline engine: train_loss / eval_loss, 2 stages ---------------------------------------------------------
def _pipeline(out: str):
    from hf_zero.pipe import PipelineModule

    steps, micro_batches = 3, 2
    net = PipelineModule(layer_list(False), num_stages=2, loss_fn=F.mse_loss, seed_layers=True)
    config = {**ds_config(micro_batches), "wall_clock_breakdown": True,
              "csv_monitor": {"enabled": True, "output_path": out, "job_name": "pipe"}}
    engine, *_ = hf_zero.initialize(model=net, config=config)
    x, y = data(steps, micro_batches, 1)
    losses = [engine.train_batch(iter([(x[s, j, 0], y[s, j, 0]) for j in range(micro_batches)])).item()
              for s in range(steps)]
    # bcast_loss=False: the first stage (global rank 0, the writer) still gets the loss, as under DeepSpeed
    eval_loss = engine.eval_batch(iter([(x[0, j, 0], y[0, j, 0]) for j in range(micro_batches)]),
                                  bcast_loss=False).item()
    engine.destroy()
    return {"losses": losses, "eval_loss": eval_loss, "samples": engine.global_samples}


def test_pipeline_writes_train_and_eval_loss_as_deepspeed(tmp_path):
    ranks = run_distributed(_pipeline, 2, args=(str(tmp_path),), timeout_s=180)
    ref_losses, _, _, ref_eval = reference_run(False, 3, 2, 1)
    job = tmp_path / "pipe"
    # no elapsed_time files although wall_clock_breakdown is on: DeepSpeed's pipeline engine writes none
    assert sorted(p.name for p in job.iterdir()) == ["Train_Samples_eval_loss.csv", "Train_Samples_lr.csv",
                                                     "Train_Samples_train_loss.csv"]
    samples = [MICRO * 2 * (s + 1) for s in range(3)]
    assert _rows(job / "Train_Samples_train_loss.csv") == [(s, loss) for s, loss in zip(samples, ranks[0]["losses"])]
    assert ranks[0]["losses"] == ranks[1]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert _rows(job / "Train_Samples_eval_loss.csv") == [(samples[-1], ranks[0]["eval_loss"])]
    assert ranks[0]["eval_loss"] == pytest.approx(ref_eval, rel=1e-5)
    assert _rows(job / "Train_Samples_lr.csv") == [(s, 0.2) for s in samples]
    assert (job / "Train_Samples_train_loss.csv").read_bytes().startswith(b"step,train_loss\r\n")


# ---- the HF Trainer with csv_monitor in its DeepSpeed config -------------------------------------------------------
class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        x = (torch.arange(8) + i) % 64
        return {"input_ids": x, "labels": x}


def _trainer(out: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "zero_optimization": {"stage": 2},
          "csv_monitor": {"enabled": True, "output_path": out, "job_name": "trainer"}}
    args = TrainingArguments(output_dir=f"{out}/run", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, learning_rate=1e-3, lr_scheduler_type="linear", logging_steps=1,
                             report_to=[], deepspeed=ds, save_strategy="no", disable_tqdm=True,
                             dataloader_pin_memory=False)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    trainer = Trainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=_Data())
    trainer.train()
    return [(h["step"], h["learning_rate"]) for h in trainer.state.log_history if "learning_rate" in h]


def test_trainer_run_with_csv_monitor_writes_one_row_per_optimizer_step(tmp_path):
    logged = run_distributed(_trainer, 1, args=(str(tmp_path),), timeout_s=180)[0]
    assert [step for step, _ in logged] == [1, 2, 3]
    rows = _rows(tmp_path / "trainer" / "Train_Samples_lr.csv")
    # 2 per micro-batch x 2 accumulation steps x 1 rank; the lr the Trainer logged after each step
    assert rows == [(4 * step, pytest.approx(lr, rel=1e-12)) for step, lr in logged]
    assert sorted(p.name for p in (tmp_path / "trainer").iterdir()) == ["Train_Samples_lr.csv"]


# ---- the config: honoured, typed, checked ---------------------------------------------------------------------------
def test_monitor_sections_are_honoured_and_checked_key_by_key():
    cfg = load_config({"tensorboard": {"enabled": True}, "csv_monitor": {"enabled": True}, "wandb": {"enabled": True},
                       "comet": {"enabled": True, "samples_log_interval": 10}}, world_size=1, log=False)
    assert cfg.not_implemented == ()
    assert (cfg.comet.samples_log_interval, cfg.comet.mode, cfg.tensorboard.job_name) == (10, None, "DeepSpeedJobName")
    with pytest.raises(ConfigError, match=r"^comet.projekt: unknown key; did you mean 'project'\?"):
        load_config({"comet": {"projekt": "x"}}, world_size=1, log=False)
    with pytest.raises(ConfigError, match=r"^comet.mode: value 'sometimes'"):
        MonitorMaster({"comet": {"enabled": True, "mode": "sometimes"}})
    with pytest.raises(ConfigError, match=r"^csv_monitor.job: unknown key"):
        MonitorMaster({"csv_monitor": {"enabled": True, "job": "x"}})
