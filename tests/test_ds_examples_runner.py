"""The DeepSpeedExamples ``training/`` runner's own logic (scripts/ds_examples/run.py, docs/deepspeed_scripts.md)
without a checkout: the stand-ins the scripts load (RoBERTa's tokenizer, WikiText), the commands it builds, how it
finds HelloDeepSpeed's experiment directory, and how it reads the printed numbers and compares two engines."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "peer_suites"))

import hub  # noqa: E402

_spec = importlib.util.spec_from_file_location("ds_examples_run", os.path.join(ROOT, "scripts", "ds_examples",
                                                                               "run.py"))
ex = importlib.util.module_from_spec(_spec)
sys.modules["ds_examples_run"] = ex  # its dataclass looks its module up while the module executes
_spec.loader.exec_module(ex)

LOG = """\
2026-11-29 00:09:36.911 | INFO     | __main__:log_dist:54 - [Rank 0] Loss: 10.8750
[hf_zero] hf_zero: step=10 loss=10.6875 lr=0.0001 grad_norm=4.992 loss_scale=1 skipped=0
2026-11-29 00:09:40.996 | INFO     | __main__:log_dist:54 - [Rank 0] Loss: 10.8250
[Summary] pin_memory=False topk_ratio=0.1 update_interval=2 overlap_step=False avg_accumulation_step=10.32ms avg_update_step=17.29ms
[rank0]: hf_zero.config.errors.ConfigError: zero_optimization.zenflow: ZenFlow is a DeepSpeed option hf_zero does not support
"""


def test_reads_losses_step_times_and_the_ranks_error(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    run = ex.read_log(str(log))
    assert run["loss"] == [["10.8750"], ["10.8250"]]
    assert run["zenflow"] == [["10.32", "17.29"]]
    assert run["error"].startswith("[rank0]: hf_zero.config.errors.ConfigError: zero_optimization.zenflow")
    assert ex.numbers(run) == [10.875, 10.825]


def test_report_compares_losses_where_both_ran():
    rows = [{"case": "hello_train", "hf_zero": {"rc": 0, "loss": [["10.8750"], ["10.7875"]]},
             "deepspeed": {"rc": 0, "loss": [["10.8750"], ["10.7833"]]}},
            {"case": "zenflow_benchmark", "hf_zero": {"rc": 1, "error": "ConfigError: zenflow"},
             "deepspeed": {"rc": 0, "zenflow": [["10.32", "17.29"]]}}]
    table = ex.report(rows, ["hf_zero", "deepspeed"]).splitlines()
    assert table[2] == "| hello_train | rc 0 | rc 0 | 3.9e-04 over 2 losses |"
    assert table[3] == "| zenflow_benchmark | rc 1 (ConfigError: zenflow) | rc 0 |  |"


def test_experiment_directory_is_rank_0s(tmp_path):
    # each rank names its directory by the clock: when they straddle a second, two exist; rank 0's holds hparams.json
    base = tmp_path / "experiment_deepspeed"
    (base / "bert_pretrain.2026.11.28.16.9.31.x").mkdir(parents=True)
    (base / "bert_pretrain.2026.11.28.16.9.31.x" / "hparams.json").write_text("{}")
    (base / "bert_pretrain.2026.11.28.16.9.32.x").mkdir()
    assert ex.experiment_dir(str(tmp_path)) == str(base / "bert_pretrain.2026.11.28.16.9.31.x")
    case = ex.CASES["hello_resume"]
    args = [x.format(experiment=ex.experiment_dir(str(tmp_path))) if "{" in x else x for x in case.args]
    assert args[:2] == ["--load_checkpoint_dir", str(base / "bert_pretrain.2026.11.28.16.9.31.x")]
    assert case.after == "hello_train" and case.flags == ("--bind_cores_to_rank",)


def test_launch_puts_launcher_flags_before_the_script(tmp_path):
    script = tmp_path / "fake_python"
    script.write_text("#!/bin/sh\necho \"$@\"\n")
    script.chmod(0o755)
    log = tmp_path / "launch.log"
    rc, _ = ex.chat.launch(str(script), "hf_zero", str(tmp_path), ["--x", "1"], dict(os.environ), str(log), 30,
                           script="example.py", flags=("--no_local_rank",), ranks=1)
    words = log.read_text().splitlines()[-1].split()
    assert rc == 0
    assert words[:4] == ["-m", "hf_zero.integrations.deepspeed_command", "--num_gpus", "1"]
    assert words[6:] == ["--no_local_rank", "example.py", "--x", "1"]


_PROBE = """
import json, datasets
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("roberta-base")
wiki = datasets.load_dataset("wikitext", "wikitext-2-v1", split="train")
big = datasets.load_dataset("wikitext", "wikitext-103-raw-v1", split="train[:5%]")
print(json.dumps({"ids": [tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.mask_token_id],
                  "round_trip": tok.decode(tok.encode("the cat sat", add_special_tokens=False)),
                  "columns": wiki.column_names, "rows": len(wiki), "empty": sum(t == "" for t in wiki["text"]),
                  "line": wiki[1]["text"], "big": len(big)}))
"""


def test_stand_ins_serve_hello_deepspeed(tmp_path):
    """Resolved as the scripts resolve them: a fresh process with the runner's offline environment."""
    env = dict(os.environ, **hub.build_hub(str(tmp_path), names=["roberta-base"]))
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ids"] == [0, 1, 2, 260]  # HelloDeepSpeed's model hard-codes bos 0, pad 1, eos 2; it masks with 260
    assert got["round_trip"] == "the cat sat"
    assert got["columns"] == ["text"] and got["rows"] == 256 and got["empty"] == 64
    assert got["line"].endswith(" . \n") and got["big"] == 102  # 5% of 2048 rows, as datasets rounds it


def test_the_failing_ranks_cause_wins_over_its_peers_lost_connection(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[rank0]: TypeError: empty(): argument 'dtype' must be torch.dtype, not type\n"
                   "[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:19146.\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: x FAILED\n")
    assert ex.read_log(str(log))["error"].startswith("[rank0]: TypeError: empty()")
    log.write_text("[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:19146.\n")
    assert "Connection closed by peer" in ex.read_log(str(log))["error"]  # the only error there is
