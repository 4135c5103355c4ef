"""DeepSpeed-Chat's three training steps, unedited, on hf_zero and on DeepSpeed (docs/deepspeed_chat.md).

Runs ``applications/DeepSpeed-Chat`` from a DeepSpeedExamples checkout: step 1 (SFT), step 2 (reward model and
DPO) and step 3 (PPO) over the matrix DeepSpeed-Chat's own ``tests/test_training.py`` sweeps (actor/critic ZeRO
stage 2 or 3, hybrid engine on/off, CPU offload on/off, LoRA on/off), with the commands its
``training_scripts/.../run_single.sh`` builds, on 2 CPU ranks. What is changed around the scripts, and nothing else:

- the Hub names (``facebook/opt-125m`` actor, ``facebook/opt-350m`` critic) resolve to tiny random OPT models
  written locally (``scripts/peer_suites/hub.py``), in offline mode;
- ``--data_path local/jsonfile`` (DeepSpeed-Chat's own local-data option) reads generated prompt / chosen /
  rejected rows written into the copy's ``data/``;
- ``--dtype bf16`` (the CPU has no fp16 training on DeepSpeed's CPU accelerator), short sequences, few steps.

Each engine runs in its own interpreter: hf_zero's answers ``import deepspeed`` and provides the ``deepspeed``
command; DeepSpeed's runs with ``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu``. The report lists each
case's exit status, the losses the scripts print and the files they save, side by side.

    python scripts/deepspeed_chat/run.py --examples PATH/DeepSpeedExamples [--ds-python PATH] \
        [--engines hf_zero,deepspeed] [--cases step1,step2,dpo,step3] [--stages 2,3] [--work build/deepspeed_chat]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peer_suites"))
import hub  # noqa: E402

ACTOR, CRITIC = "facebook/opt-125m", "facebook/opt-350m"
_WORDS = ("the cat dog sat on mat ran fast slow big small red blue green house car tree river said market year "
          "new old good bad yes no what why how where").split()
# Every loss-like number the three steps print, by the line that carries it.
_LOSS_LINES = {
    "eval": re.compile(r"^ppl: (\S+), loss: (\S+)"),
    "rm_eval": re.compile(r"chosen_last_scores \(higher is better\) : (\S+), rejected_last_scores.*: (\S+), acc "
                          r"\(higher is better\) : (\S+)"),
    "ppo": re.compile(r"Actor Loss: (\S+) \| Critic Loss: (\S+)"),
    "reward": re.compile(r"Average reward score: (\S+)"),
    "dpo_eval": re.compile(r"^chosen: (\S+), rejected: (\S+), loss: (\S+)"),
}


def write_data(app: str, rows: int = 48, seed: int = 0) -> None:
    """DeepSpeed-Chat's ``local/jsonfile`` dataset: ``<app>/data/{train,eval}.json``, prompt/chosen/rejected."""
    rng = random.Random(seed)

    def sentence(n):
        return " ".join(rng.choices(_WORDS, k=n))

    os.makedirs(os.path.join(app, "data"), exist_ok=True)
    for split, n in (("train", rows), ("eval", rows // 4)):
        data = [{"prompt": f"Human: {sentence(6)}? Assistant:", "chosen": f" {sentence(8)}.",
                 "rejected": f" {sentence(3)}"} for _ in range(n)]
        with open(os.path.join(app, "data", f"{split}.json"), "w") as f:
            json.dump(data, f)


def prepare(examples: str, work: str) -> tuple[str, dict[str, str]]:
    src = os.path.join(examples, "applications", "DeepSpeed-Chat")
    if not os.path.isdir(os.path.join(src, "dschat")):
        raise SystemExit(f"{src}: not DeepSpeed-Chat (no dschat/); pass --examples PATH/DeepSpeedExamples")
    app = os.path.join(work, "app")
    if not os.path.isdir(app):
        shutil.copytree(src, app, ignore=shutil.ignore_patterns("assets", "*.log", "*.mp4", "*.gif", "*.png"))
    write_data(app)
    env = hub.build_hub(os.path.join(work, "hub_standins"), names=[ACTOR, CRITIC], with_datasets=False)
    return app, env


def step_commands(app: str, out: str, stage: int, case: str, he: bool = False, offload: bool = False,
                  lora: bool = False, inputs: str = "") -> tuple[str, list[str]]:
    """The working directory and main.py arguments DeepSpeed-Chat's run scripts use for ``case``, at test size."""
    common = ["--data_path", "local/jsonfile", "--data_split", "2,4,4", "--data_output_path", os.path.join(out, "data"),
              "--dtype", "bf16", "--seed", "1234", "--deepspeed", "--output_dir", out]
    if case == "step1":
        return os.path.join(app, "training", "step1_supervised_finetuning"), common + [
            "--model_name_or_path", ACTOR, "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
            "--max_seq_len", "64", "--learning_rate", "1e-3", "--weight_decay", "0.", "--num_train_epochs", "2",
            "--gradient_accumulation_steps", "1", "--lr_scheduler_type", "cosine", "--num_warmup_steps", "0",
            "--zero_stage", str(stage)] + (["--lora_dim", "8", "--lora_module_name", "decoder.layers."] if lora else [])
    if case == "step2":
        return os.path.join(app, "training", "step2_reward_model_finetuning"), common + [
            "--model_name_or_path", CRITIC, "--num_padding_at_beginning", "1", "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "4", "--max_seq_len", "64", "--learning_rate", "1e-3",
            "--weight_decay", "0.1", "--num_train_epochs", "1", "--gradient_accumulation_steps", "1",
            "--lr_scheduler_type", "cosine", "--num_warmup_steps", "0", "--zero_stage", str(stage)]
    if case == "dpo":
        return os.path.join(app, "training", "step2_dpo_finetuning"), common + [
            "--model_name_or_path", ACTOR, "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
            "--max_seq_len", "64", "--learning_rate", "1e-3", "--weight_decay", "0.", "--num_train_epochs", "1",
            "--gradient_accumulation_steps", "1", "--lr_scheduler_type", "cosine", "--num_warmup_steps", "0",
            "--zero_stage", str(stage)]
    if case == "step3":
        args = common + [
            # as in DeepSpeed-Chat's pipeline: the actor is step 1's output, the critic step 2's (its loader reads
            # the reward model's pytorch_model.bin from there)
            "--actor_model_name_or_path", os.path.join(inputs, "actor"),
            "--critic_model_name_or_path", os.path.join(inputs, "critic"),
            "--num_padding_at_beginning", "1", "--per_device_generation_batch_size", "4",
            "--per_device_training_batch_size", "4", "--generation_batches", "1", "--ppo_epochs", "1",
            "--max_answer_seq_len", "16", "--max_prompt_seq_len", "64", "--actor_learning_rate", "9.65e-6",
            "--critic_learning_rate", "5e-6", "--num_train_epochs", "1", "--lr_scheduler_type", "cosine",
            "--gradient_accumulation_steps", "1", "--actor_weight_decay", "0", "--critic_weight_decay", "0",
            "--num_warmup_steps", "100", "--actor_dropout", "0.0", "--actor_zero_stage", str(stage),
            "--critic_zero_stage", str(stage), "--enable_test_mode", "--test_stop_step", "3"]
        args += ["--enable_hybrid_engine"] if he else []
        args += ["--offload"] if offload else []
        args += ["--actor_lora_dim", "8", "--actor_lora_module_name", "decoder.layers."] if lora else \
            ["--actor_lora_dim", "0"]
        return os.path.join(app, "training", "step3_rlhf_finetuning"), args
    raise ValueError(case)


def engine_env(engine: str, base: dict[str, str], app: str, site: str | None) -> dict[str, str]:
    # PYTHONPATH=app stands for DeepSpeed-Chat's own `pip install -e .` (its setup.py installs `dschat`)
    path = os.pathsep.join(filter(None, [app, site]))
    env = dict(os.environ, **base, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    if engine == "deepspeed":
        env.update(HF_ZERO_DISABLE_DEEPSPEED_SHIM="1", DS_ACCELERATOR="cpu")
    return env


def launch(python: str, engine: str, cwd: str, args: list[str], env: dict[str, str], log: str, timeout: float, *,
           script: str = "main.py", flags: tuple[str, ...] = (), ranks: int = 2):
    """``deepspeed --num_gpus 2 [FLAGS] main.py ARGS`` from the engine's interpreter (both provide the command);
    DeepSpeed's CPU launcher counts NUMA nodes, not processes, so the ranks are asked for by name."""
    launcher = [python, "-m", "deepspeed.launcher.runner"] if engine == "deepspeed" else \
        [python, "-m", "hf_zero.integrations.deepspeed_command"]
    cmd = launcher + ["--num_gpus", str(ranks), "--master_port", str(29500 + random.randint(0, 999)), *flags,
                      script] + args
    start = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.time() - start


def read_log(log: str) -> dict:
    found: dict[str, list] = {k: [] for k in _LOSS_LINES}
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines:
        text = re.sub(r"^\[rank\d+\]:\s*|^\d+: ", "", line)
        for key, pattern in _LOSS_LINES.items():
            m = pattern.search(text)
            if m:
                found[key].append([g for g in m.groups()])
    # the exception a rank died of (bare or with a message), not the launcher's, and not a peer's lost connection
    # when the rank that failed first says why
    errors = [line.strip()[:300] for line in reversed(lines)
              if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)(:|$)", line.strip())
              and "ChildFailedError" not in line]
    error = next((e for e in errors if "Connection closed by peer" not in e), errors[0] if errors else None)
    return {k: v for k, v in found.items() if v} | ({"error": error} if error else {})


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf")


def _numbers(run: dict) -> list[float]:
    """Every number printed, in order (a value printed as ``tensor(0.5)`` counts as 0.5)."""
    return [float(_NUMBER.search(x).group()) for key in _LOSS_LINES for row in run.get(key, []) for x in row
            if _NUMBER.search(x)]


def report(results: list[dict], engines: list[str], numbers=None, unit: str = "numbers") -> str:
    """A markdown table: each case's exit status per engine and how far hf_zero's printed numbers are from
    DeepSpeed's (the largest relative difference over every loss, score and accuracy the scripts print;
    ``numbers(run)``: which of a run's printed values to compare, default all of them)."""
    numbers = numbers or _numbers
    head = "| case | " + " | ".join(engines) + (" | largest relative difference |" if len(engines) == 2 else " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in results:
        cells = [f"rc {row[e]['rc']}" + (f" ({row[e]['error'][:100]})" if row[e].get("error") and row[e]["rc"] else "")
                 for e in engines]
        diff = ""
        if len(engines) == 2 and all(row[e]["rc"] == 0 for e in engines):
            a, b = (numbers(row[e]) for e in engines)
            if len(a) == len(b) and a:
                diff = f"{max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)):.1e} over {len(a)} {unit}"
            elif a or b:
                diff = f"{len(a)} vs {len(b)} {unit}"
        lines.append(f"| {row['case']} | " + " | ".join(cells) + (f" | {diff} |" if len(engines) == 2 else " |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--examples", required=True, help="a DeepSpeedExamples checkout")
    p.add_argument("--python", default=sys.executable, help="the interpreter with hf_zero")
    p.add_argument("--ds-python", help="an interpreter with DeepSpeed (and datasets) installed")
    p.add_argument("--engines", default="hf_zero,deepspeed")
    p.add_argument("--cases", default="step1,step2,dpo,step3")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--step3-matrix", default="he,offload,lora",
                   help="which of DeepSpeed-Chat's test_training.py switches to sweep in step 3 (the rest off)")
    p.add_argument("--site", help="a directory put on both engines' PYTHONPATH: DeepSpeed-Chat needs transformers < 5 "
                   "(its model_utils imports transformers.modeling_utils.no_init_weights, which 5.0 moved); e.g. "
                   "`pip install --target DIR --no-deps transformers==4.57.6 'huggingface_hub<1' 'tokenizers<0.23' "
                   "'datasets<5' requests httpx httpcore h11 anyio sniffio`")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--report-only", action="store_true", help="re-read the last run's logs instead of running")
    p.add_argument("--work", default=os.path.join("build", "deepspeed_chat"))
    a = p.parse_args(argv)
    work = os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    if a.site:  # the stand-in models and tokenizers are written by the transformers the scripts will read them with
        sys.path.insert(0, os.path.abspath(a.site))
    app, hub_vars = prepare(os.path.abspath(a.examples), work)
    engines = [e for e in a.engines.split(",") if e != "deepspeed" or a.ds_python]
    pythons = {"hf_zero": a.python, "deepspeed": a.ds_python}
    switches = [s for s in a.step3_matrix.split(",") if s]
    runs = []
    for case in a.cases.split(","):
        for stage in map(int, a.stages.split(",")):
            variants = [{}]
            if case == "step3":
                variants = [dict(zip(switches, bits)) for bits in itertools.product([False, True], repeat=len(switches))]
            for v in variants:
                # DeepSpeed-Chat's own test skips (and main.py refuses) this combination
                if case == "step3" and stage == 2 and v.get("he") and v.get("offload") and not v.get("lora"):
                    continue
                runs.append((case, stage, v))
    previous = {}  # --report-only: the last run's exit codes and timings, re-read once
    if a.report_only and os.path.exists(os.path.join(work, "summary.json")):
        with open(os.path.join(work, "summary.json")) as f:
            previous = {r["case"]: r for r in json.load(f)}
    results = []
    for case, stage, v in runs:
        name = f"{case}_z{stage}" + "".join(f"_{k}" for k, on in v.items() if on)
        row = {"case": name}
        for engine in engines:
            out = os.path.join(work, engine, name)
            if a.report_only:
                if os.path.exists(os.path.join(out, "run.log")):
                    row[engine] = {**previous.get(name, {}).get(engine, {}), **read_log(os.path.join(out, "run.log"))}
                continue
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            cwd, args = step_commands(app, out, stage, case, inputs=os.path.join(work, "inputs"), **v)
            log = os.path.join(out, "run.log")
            rc, secs = launch(pythons[engine], engine, cwd, args, engine_env(engine, hub_vars, app, a.site), log, a.timeout)
            saved = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs
                           if f.endswith((".bin", ".safetensors")))
            row[engine] = {"rc": rc, "seconds": round(secs, 1), "saved": saved, **read_log(log)}
            # step 3's inputs: the first ZeRO-2 step-1 / step-2 model either engine saved; both engines' step 3
            # then start from the same files
            role = {"step1": "actor", "step2": "critic"}.get(case)
            if role and stage == 2 and rc == 0 and not os.path.exists(os.path.join(work, "inputs", role)):
                shutil.copytree(out, os.path.join(work, "inputs", role), ignore=shutil.ignore_patterns("data", "*.log"))
            print(f"{name:32s} {engine:9s} rc={rc} {secs:6.1f}s {json.dumps({k: w for k, w in row[engine].items() if k not in ('rc', 'seconds')})}",
                  flush=True)
        results.append(row)
    if a.report_only:
        results = [r for r in results if all(e in r for e in engines)]
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n" + report(results, engines))
    failed = [r["case"] for r in results if any(r[e]["rc"] != 0 for e in engines if e == "hf_zero")]
    print(f"\nhf_zero failed: {failed or 'none'}; summary: {os.path.join(work, 'summary.json')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
