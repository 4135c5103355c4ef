"""The DeepSpeed-Chat runner's own logic (scripts/deepspeed_chat/run.py, docs/deepspeed_chat.md) without a
DeepSpeedExamples checkout: the OPT stand-ins it resolves DeepSpeed-Chat's Hub names to, the commands it builds
for DeepSpeed-Chat's test matrix, and how it reads the scripts' printed numbers and compares two engines."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "peer_suites"))

import hub  # noqa: E402

_spec = importlib.util.spec_from_file_location("deepspeed_chat_run", os.path.join(ROOT, "scripts", "deepspeed_chat",
                                                                                  "run.py"))
chat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat)

# lines as DeepSpeed-Chat's three steps print them (under the launcher's rank prefixes)
LOG = """\
ppl: 269.30517578125, loss: 5.5958452224731445
[rank0]: ppl: 217.94900512695312, loss: 5.384261131286621
chosen_last_scores (higher is better) : 0.089111328125, rejected_last_scores (lower is better) : 0.02740478515625, acc (higher is better) : 0.6666666865348816
Epoch: 0 | Step: 1 | PPO Epoch: 1 | Actor Loss: 0.015380859375 | Critic Loss: 0.0078125 | Unsupervised Loss: 0.0
Average reward score: 0.142578125 | EMA reward score: 0.1478515625
chosen: -0.25, rejected: tensor(-0.5), loss: 0.6931
Traceback (most recent call last):
[rank1]: AssertionError: Cannot find model checkpoint at /x/pytorch_model.bin
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: main.py FAILED
"""


def test_reads_every_number_the_steps_print_and_the_ranks_error(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    found = chat.read_log(str(log))
    assert found["eval"] == [["269.30517578125", "5.5958452224731445"], ["217.94900512695312", "5.384261131286621"]]
    assert found["rm_eval"] == [["0.089111328125", "0.02740478515625", "0.6666666865348816"]]
    assert found["ppo"] == [["0.015380859375", "0.0078125"]] and found["reward"] == [["0.142578125"]]
    assert found["dpo_eval"] == [["-0.25", "tensor(-0.5)", "0.6931"]]
    assert chat._numbers(found)[-3:] == [-0.25, -0.5, 0.6931]
    # the rank's exception, not the launcher's ChildFailedError
    assert found["error"] == "[rank1]: AssertionError: Cannot find model checkpoint at /x/pytorch_model.bin"


def test_report_gives_the_largest_relative_difference_between_engines():
    rows = [{"case": "step1_z2", "hf_zero": {"rc": 0, "eval": [["100.0", "5.0"]]},
             "deepspeed": {"rc": 0, "eval": [["100.0", "5.005"]]}},
            {"case": "step3_z3", "hf_zero": {"rc": 0, "ppo": [["1.0", "2.0"]]},
             "deepspeed": {"rc": 1, "error": "[rank0]: RuntimeError: expected m1 and m2 to have the same dtype"}}]
    table = chat.report(rows, ["hf_zero", "deepspeed"]).splitlines()
    assert table[0] == "| case | hf_zero | deepspeed | largest relative difference |"
    assert table[2] == "| step1_z2 | rc 0 | rc 0 | 1.0e-03 over 2 numbers |"
    assert table[3] == ("| step3_z3 | rc 0 | rc 1 ([rank0]: RuntimeError: expected m1 and m2 to have the same dtype) "
                        "|  |")


def test_step3_commands_follow_deepspeed_chats_test_matrix(tmp_path):
    cwd, args = chat.step_commands("/app", "/out", 3, "step3", he=True, offload=True, lora=True, inputs="/in")
    assert cwd == "/app/training/step3_rlhf_finetuning"
    assert {"--enable_hybrid_engine", "--offload", "--enable_test_mode", "--deepspeed"} <= set(args)
    flag = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert flag["--actor_zero_stage"] == flag["--critic_zero_stage"] == "3"
    assert flag["--actor_model_name_or_path"] == "/in/actor" and flag["--critic_model_name_or_path"] == "/in/critic"
    assert flag["--actor_lora_dim"] == "8" and flag["--data_path"] == "local/jsonfile"
    _, args = chat.step_commands("/app", "/out", 2, "step3", inputs="/in")
    assert "--enable_hybrid_engine" not in args and "--offload" not in args
    assert args[args.index("--actor_lora_dim") + 1] == "0"
    chat.write_data(str(tmp_path), rows=8)
    rows = json.loads((tmp_path / "data" / "train.json").read_text())
    assert len(rows) == 8 and set(rows[0]) == {"prompt", "chosen", "rejected"}
    assert rows[0]["prompt"].startswith("Human: ") and rows[0]["prompt"].endswith(" Assistant:")


def test_opt_standins_have_opt_350ms_projections_and_a_gpt2_tokenizer(tmp_path):
    """DeepSpeed-Chat's save_hf_format calls tokenizer.save_vocabulary: the stand-in is a GPT2TokenizerFast (OPT's
    class) with vocab.json and merges.txt, not a bare tokenizer.json (whose save_vocabulary raises
    NotImplementedError in transformers 4)."""
    transformers = pytest.importorskip("transformers")
    hub.build_hub(str(tmp_path), names=[chat.ACTOR, chat.CRITIC], with_datasets=False)
    critic_dir = hub.repo_dir(str(tmp_path / "hub"), chat.CRITIC)
    config = transformers.AutoConfig.from_pretrained(critic_dir)
    assert config.model_type == "opt" and config.word_embed_proj_dim < config.hidden_size  # project_in / _out
    tok = transformers.AutoTokenizer.from_pretrained(hub.repo_dir(str(tmp_path / "hub"), chat.ACTOR))
    assert type(tok).__name__ in ("GPT2TokenizerFast", "GPT2Tokenizer") and tok.is_fast  # transformers 5: one class
    assert tok.decode(tok("Human: hi? Assistant:")["input_ids"]) == "Human: hi? Assistant:"
    out = tmp_path / "saved"
    out.mkdir()
    written = tok.save_vocabulary(str(out))  # transformers 4: vocab.json + merges.txt; 5: one tokenizer file
    assert written and all(os.path.getsize(p) > 0 for p in written)
