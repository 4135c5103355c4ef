"""DeepSpeedExamples' ``training/`` scripts, unedited, on hf_zero and on DeepSpeed (docs/deepspeed_scripts.md).

    python scripts/ds_examples/run.py --examples PATH/DeepSpeedExamples --site DIR --ds-python /path/to/ds/python \
        [--engines hf_zero,deepspeed] [--cases hello_train,...] [--work build/ds_examples] [--report-only]

Each case is one script of the checkout with the arguments its own run script passes, scaled to test size, started
by each engine's ``deepspeed`` command on 2 CPU ranks (the scripts' ``--bind_cores_to_rank`` / ``--no_local_rank``
flags included). What the scripts download resolves to local stand-ins (scripts/peer_suites/hub.py: the
``roberta-base`` tokenizer, WikiText). ``--site``: a directory on ``PYTHONPATH`` with what the scripts import beyond
the engine (HelloDeepSpeed: ``fire``, ``loguru``, ``pytz``, ``sh``); DeepSpeed's ``--bind_cores_to_rank`` needs
``numactl``. Scripts that place tensors on ``cuda`` unconditionally (bf16_master_weight, the AutoTP examples,
SuperOffload) or need torchvision's downloads (cifar, pipeline_parallelism, gan, imagenet) are not run here.

It prints, per case and engine, the exit status (and the exception a rank died of) and the numbers the script
printed; where both engines ran, how far apart they are. Logs and ``summary.json`` are in the work directory.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peer_suites"))
import hub  # noqa: E402

_spec = importlib.util.spec_from_file_location("deepspeed_chat_run", os.path.join(HERE, "..", "deepspeed_chat",
                                                                                  "run.py"))
chat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat)  # its launcher, environment and log reading serve both runners

_TINY_LLAMA = "hf-internal-testing/tiny-random-LlamaForCausalLM"
_HELLO = ["--num_layers", "2", "--h_dim", "64", "--ff_dim", "128", "--num_heads", "2", "--batch_size", "4",
          "--max_seq_length", "64", "--dropout", "0.0", "--log_every", "5", "--checkpoint_every", "10"]


@dataclass(frozen=True)
class Case:
    directory: str                   # under training/
    script: str
    args: tuple[str, ...]
    flags: tuple[str, ...] = ()      # the launcher's, before the script
    ranks: int = 2
    after: str | None = None         # a case whose output this one reads (run first, same work directory)
    note: str = ""
    # config files written into the example's copy before the run: name -> (the example's file, zero_optimization
    # keys changed) -- a user's variant of the shipped config
    configs: tuple[tuple[str, str, tuple[tuple[str, object], ...]], ...] = ()


CASES: dict[str, Case] = {
    # run_ds.sh: deepspeed --bind_cores_to_rank train_bert_ds.py --checkpoint_dir experiment_deepspeed; bf16,
    # ZeRO-1 with the optimizer offloaded to the CPU, a checkpoint every 10 steps
    "hello_train": Case("HelloDeepSpeed", "train_bert_ds.py",
                        ("--checkpoint_dir", "experiment_deepspeed", "--num_iterations", "21", *_HELLO),
                        flags=("--bind_cores_to_rank",)),
    # the README's resume: --load_checkpoint_dir <the experiment directory>, 10 steps more
    "hello_resume": Case("HelloDeepSpeed", "train_bert_ds.py",
                         ("--load_checkpoint_dir", "{experiment}", "--num_iterations", "31"),
                         flags=("--bind_cores_to_rank",), after="hello_train"),
    # run_benchmark.sh at test size: ZeRO-2, optimizer offloaded to the CPU, ZenFlow's selective updates
    "zenflow_benchmark": Case("DeepSpeed-ZenFlow/benchmark", "zf_benchmark.py",
                              ("--hidden_dim", "64", "--nlayers", "2", "--iteration", "3", "--pin_memory_opts", "0",
                               "--topk_ratios", "0.1", "--update_intervals", "2", "--overlap_steps", "0")),
    # finetune_llama.sh at test size: bf16, ZeRO-2, optimizer offloaded, ZenFlow with overlap_step; the Llama and
    # Alpaca it downloads resolve to stand-ins (one epoch of 64 rows: 8 steps of 8 samples)
    "zenflow_finetune": Case("DeepSpeed-ZenFlow/finetuning", "finetune_llama.py",
                             ("--deepspeed_config=zf_config.json", "--model_name", _TINY_LLAMA, "--num_train_epochs",
                              "1", "--lr", "2e-5", "--batch_size", "8", "--weight_decay", "0.01", "--output_dir",
                              "alpaca_output", "--seed", "42")),
    # the same with its config at stage 3
    "zenflow_finetune_stage3": Case("DeepSpeed-ZenFlow/finetuning", "finetune_llama.py",
                                    ("--deepspeed_config=zf_config_stage3.json", "--model_name", _TINY_LLAMA,
                                     "--num_train_epochs", "1", "--lr", "2e-5", "--batch_size", "8",
                                     "--weight_decay", "0.01", "--output_dir", "alpaca_output", "--seed", "42"),
                                    configs=(("zf_config_stage3.json", "zf_config.json", (("stage", 3),)),)),
    # on one rank: the script saves its checkpoint from rank 0 alone, which a second rank does not join
    "zenflow_finetune_1rank": Case("DeepSpeed-ZenFlow/finetuning", "finetune_llama.py",
                                   ("--deepspeed_config=zf_config.json", "--model_name", _TINY_LLAMA,
                                    "--num_train_epochs", "1", "--lr", "2e-5", "--batch_size", "8", "--weight_decay",
                                    "0.01", "--output_dir", "alpaca_output", "--seed", "42"), ranks=1),
    "zenflow_finetune_stage3_1rank": Case("DeepSpeed-ZenFlow/finetuning", "finetune_llama.py",
                                          ("--deepspeed_config=zf_config_stage3.json", "--model_name", _TINY_LLAMA,
                                           "--num_train_epochs", "1", "--lr", "2e-5", "--batch_size", "8",
                                           "--weight_decay", "0.01", "--output_dir", "alpaca_output", "--seed",
                                           "42"),
                                          configs=(("zf_config_stage3.json", "zf_config.json", (("stage", 3),)),),
                                          ranks=1),
    # the README's command (its argparse takes no --local_rank: the launcher is told so)
    "variable_batch_1rank": Case("data_efficiency/variable_batch_size_and_lr",
                                 "variable_batch_size_and_lr_example.py", (), flags=("--no_local_rank",), ranks=1),
    "variable_batch_2ranks": Case("data_efficiency/variable_batch_size_and_lr",
                                  "variable_batch_size_and_lr_example.py", (), flags=("--no_local_rank",)),
    "variable_batch_pipeline": Case("data_efficiency/variable_batch_size_and_lr",
                                    "variable_batch_size_and_lr_example.py", ("--pipeline-num-stages", "2"),
                                    flags=("--no_local_rank",)),
}

# the numbers each script prints, by the line that carries them
_NUMBERS = {
    "loss": re.compile(r"\] Loss: (\S+)"),                                        # HelloDeepSpeed's log_dist
    "zenflow": re.compile(r"\[Summary\] .*avg_accumulation_step=(\S+)ms avg_update_step=(\S+)ms"),
    "epoch_loss": re.compile(r"epoch (\d+), batch (\d+), loss (\S+)"),            # variable batch (logger.info)
    "step_loss": re.compile(r"\bStep (\d+), Loss: (\S+)"),                          # ZenFlow's finetune_llama.py
}


def experiment_dir(cwd: str) -> str:
    """HelloDeepSpeed's experiment directory (``<checkpoint_dir>/bert_pretrain.<time>.<hash>``), the one rank 0
    wrote (each rank names its own by the clock; rank 0's holds ``hparams.json``)."""
    found = sorted(glob.glob(os.path.join(cwd, "experiment_deepspeed", "bert_pretrain.*", "hparams.json")))
    if not found:
        raise FileNotFoundError(f"{cwd}/experiment_deepspeed: no experiment directory (hello_train did not save)")
    return os.path.dirname(found[-1])


def read_log(log: str) -> dict:
    found: dict[str, list] = {k: [] for k in _NUMBERS}
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines:
        for key, pattern in _NUMBERS.items():
            m = pattern.search(line)
            if m:
                found[key].append(list(m.groups()))
    error = chat.read_log(log).get("error")
    return {k: v for k, v in found.items() if v} | ({"error": error} if error else {})


def numbers(run: dict) -> list[float]:
    """The losses two engines' runs should share: HelloDeepSpeed's (it seeds its model and data). The variable-batch
    example builds its model unseeded, so its losses differ between two runs of one engine; they are kept in the
    summary, not compared."""
    return [float(x) for row in run.get("loss", []) for x in row[-1:]]


def report(results: list[dict], engines: list[str]) -> str:
    """The DeepSpeed-Chat runner's table, comparing the losses (ZenFlow's step times are not compared)."""
    return chat.report(results, engines, numbers, "losses")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--examples", help="a DeepSpeedExamples checkout (not needed with --report-only)")
    p.add_argument("--python", default=sys.executable, help="the interpreter with hf_zero")
    p.add_argument("--ds-python", help="an interpreter with DeepSpeed installed")
    p.add_argument("--site", help="a directory put on PYTHONPATH (the scripts' own dependencies)")
    p.add_argument("--engines", default="hf_zero,deepspeed")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--work", default=os.path.join("build", "ds_examples"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    engines = [e for e in a.engines.split(",") if e != "deepspeed" or a.ds_python]
    work = os.path.abspath(a.work)
    summary = os.path.join(work, "summary.json")
    if a.report_only:
        with open(summary) as f:
            results = json.load(f)
        print(report(results, engines))
        return 0
    if not a.examples or not os.path.isdir(os.path.join(a.examples, "training")):
        raise SystemExit(f"{a.examples}: not a DeepSpeedExamples checkout (no training/)")
    os.makedirs(work, exist_ok=True)
    base = hub.build_hub(os.path.join(work, "hub_standins"), names=["roberta-base", _TINY_LLAMA])
    pythons = {"hf_zero": a.python, "deepspeed": a.ds_python}
    wanted = a.cases.split(",")
    results = []
    for name in wanted:
        case = CASES[name]
        row = {"case": name}
        for engine in engines:
            cwd = os.path.join(work, engine, case.directory)
            if case.after is None:  # a fresh copy of the example for each engine
                shutil.rmtree(cwd, ignore_errors=True)
                shutil.copytree(os.path.join(a.examples, "training", case.directory), cwd)
            for written, shipped, changes in case.configs:
                with open(os.path.join(cwd, shipped)) as f:
                    cfg = json.load(f)
                cfg["zero_optimization"].update(dict(changes))
                with open(os.path.join(cwd, written), "w") as f:
                    json.dump(cfg, f, indent=1)
            log = os.path.join(work, f"{name}.{engine}.log")
            try:
                args = [x.format(experiment=experiment_dir(cwd)) if "{" in x else x for x in case.args]
            except FileNotFoundError as e:
                row[engine] = {"rc": "not run", "error": str(e)}
                continue
            env = chat.engine_env(engine, base, "", a.site)
            rc, wall = chat.launch(pythons[engine], engine, cwd, args, env, log, a.timeout, script=case.script,
                                   flags=case.flags, ranks=case.ranks)
            row[engine] = {"rc": rc, "wall_s": round(wall, 1), **read_log(log)}
            print(f"{name} [{engine}]: rc {rc} in {wall:.0f} s", flush=True)
        results.append(row)
    with open(summary, "w") as f:
        json.dump(results, f, indent=1)
    print(report(results, engines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
