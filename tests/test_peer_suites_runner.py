"""The peer-suite runner's own logic (scripts/peer_suites/, docs/peer_suites.md), on a fake peer test module:
the hardware gates are lifted and nothing else, Hub names resolve to the local stand-ins offline, a launched
job gets 2 processes, and the report finds the tests DeepSpeed passes and hf_zero fails. No peer checkout,
no network, no DeepSpeed."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "scripts", "peer_suites")
sys.path.insert(0, RUNNER)

import hub  # noqa: E402
import run  # noqa: E402

pytest.importorskip("accelerate")

FAKE_PEER_TEST = textwrap.dedent(
    """
    import os
    import unittest

    from accelerate.test_utils import require_multi_device
    from accelerate.test_utils.testing import (
        DEFAULT_LAUNCH_COMMAND, require_cuda, require_non_cpu, skip,
    )
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from .testing_utils import require_bitsandbytes, require_torch_gpu


    class HardwareGated(unittest.TestCase):
        @require_non_cpu
        def test_non_cpu(self):
            pass

        @require_cuda
        def test_cuda(self):
            pass

        @require_multi_device
        def test_launch_has_two_processes(self):
            assert "--num_processes=2" in DEFAULT_LAUNCH_COMMAND, DEFAULT_LAUNCH_COMMAND

        @skip
        def test_software_gate_kept(self):
            pass


    class OwnHelperGates(unittest.TestCase):
        # peft-style: gates defined in the peer's own tests/testing_utils.py
        @require_torch_gpu
        def test_helper_gpu_gate(self):
            pass

        @require_bitsandbytes
        def test_helper_software_gate_kept(self):
            pass


    class HubNames(unittest.TestCase):
        def test_tiny_gpt2(self):
            assert os.environ["HF_HUB_OFFLINE"] == "1"
            config = AutoConfig.from_pretrained("sshleifer/tiny-gpt2")
            assert config.model_type == "gpt2"
            model = AutoModel.from_pretrained("sshleifer/tiny-gpt2")
            assert sum(p.numel() for p in model.parameters()) < 100_000
            assert AutoTokenizer.from_pretrained("sshleifer/tiny-gpt2")("hi")["input_ids"].__len__() == 2

        def test_unmapped_name_fails(self):
            AutoConfig.from_pretrained("no-such-org/no-such-model")


    class Bf16Probe(unittest.TestCase):
        # TrainingArguments refuses bf16 without a bf16 GPU; the runner's probe answers for the CPU
        def test_training_arguments_accept_bf16(self):
            from transformers import TrainingArguments

            assert TrainingArguments("out", bf16=True).bf16 is True
    """
)


FAKE_PEER_HELPERS = textwrap.dedent(
    """
    import unittest


    def require_torch_gpu(test_case):
        return unittest.skip("test requires a GPU")(test_case)


    def require_bitsandbytes(test_case):
        return unittest.skip("test requires bitsandbytes")(test_case)
    """
)

# peft-style module-level gate: the whole module skips itself on a CPU
FAKE_PEER_GPU_MODULE = textwrap.dedent(
    """
    import pytest
    import torch
    from accelerate.test_utils.testing import get_backend

    device, _, _ = get_backend()
    if device == "cpu":
        pytest.skip(allow_module_level=True, reason="GPU tests require hardware accelerator, got CPU only")


    def test_module_gate_lifted_device_still_cpu():
        assert torch.zeros(1).to(device).device.type == "cpu"
    """
)


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """Runs the fake peer module under the runner's environment for the hf_zero engine; returns the junit results."""
    tmp = tmp_path_factory.mktemp("peer")
    peer = tmp / "peer"
    (peer / "tests").mkdir(parents=True)
    (peer / "tests" / "__init__.py").write_text("")
    (peer / "tests" / "testing_utils.py").write_text(FAKE_PEER_HELPERS)
    (peer / "tests" / "test_fake_peer.py").write_text(FAKE_PEER_TEST)
    (peer / "tests" / "test_fake_peer_gpu.py").write_text(FAKE_PEER_GPU_MODULE)
    hub_vars = hub.build_hub(str(tmp / "hub"), names=["sshleifer/tiny-gpt2"], with_datasets=False)
    env = run.engine_env("hf_zero", sys.executable, str(tmp), hub_vars, nproc=2, slow=False)
    xml_path = tmp / "out.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-p", "peer_gates", "-p", "no:cacheprovider", "-q",
         f"--junitxml={xml_path}"],
        cwd=peer, env=env, capture_output=True, text=True, timeout=300,
    )
    return run.parse_junit(str(xml_path)), proc.stdout + proc.stderr


def _outcome(results, name):
    (match,) = [r for test_id, r in results.items() if test_id.endswith("::" + name)]
    return match.outcome


def test_hardware_gates_lifted_software_gates_kept(fake_run):
    results, log = fake_run
    assert _outcome(results, "test_non_cpu") == "passed", log
    assert _outcome(results, "test_cuda") == "passed", log
    assert _outcome(results, "test_launch_has_two_processes") == "passed", log
    assert _outcome(results, "test_software_gate_kept") == "skipped", log
    assert _outcome(results, "test_helper_gpu_gate") == "passed", log
    assert _outcome(results, "test_helper_software_gate_kept") == "skipped", log
    assert _outcome(results, "test_module_gate_lifted_device_still_cpu") == "passed", log
    assert _outcome(results, "test_training_arguments_accept_bf16") == "passed", log


def test_hub_names_resolve_offline_to_stand_ins(fake_run):
    results, log = fake_run
    assert _outcome(results, "test_tiny_gpt2") == "passed", log
    assert _outcome(results, "test_unmapped_name_fails") == "failed", log


def test_report_lists_deepspeed_only_passes_with_their_cause():
    hf_zero = run.Run("hf_zero", {
        "m.C::a": run.Result("passed"),
        "m.C::b": run.Result("failed", "RuntimeError: 'accelerate launch' failed with returncode 1\n"
                                       "[rank0]: hf_zero.config.ConfigError: offload_optimizer.torch_adam refused"),
        "m.C::c": run.Result("skipped", "test is slow"),
    })
    deepspeed = run.Run("deepspeed", {
        "m.C::a": run.Result("failed", "E   AssertionError: fp16 is not supported on CPU"),
        "m.C::b": run.Result("passed"),
        "m.C::c": run.Result("skipped", "test is slow"),
    })
    ds_only, hf_only = run.compare(hf_zero, deepspeed)
    assert ds_only == ["m.C::b"] and hf_only == ["m.C::a"]
    assert run.root_cause(hf_zero.results["m.C::b"].message).startswith("hf_zero.config.ConfigError: offload")
    assert run.root_cause(deepspeed.results["m.C::a"].message) == "AssertionError: fp16 is not supported on CPU"
    chained = ("[rank0]: json.decoder.JSONDecodeError: Expecting value\n\n"
               "[rank0]: During handling of the above exception, another exception occurred:\n"
               "[rank0]: ValueError: Expected a string path to an existing deepspeed config\n"
               "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert run.root_cause(chained) == "ValueError: Expected a string path to an existing deepspeed config"
    assert run.root_cause("[rank1]:     assert best > first\n[rank1]: AssertionError\n") == "AssertionError"


def test_every_stand_in_builds_from_its_config_class():
    for name, spec in hub.MODELS.items():
        config = spec.config()
        assert config.to_dict(), name


def test_t5_stand_in_tokenizes_with_its_vocabulary(tmp_path):
    """transformers' T5 tests load ``patrickvonplaten/t5-tiny-random`` with ``T5Tokenizer``: the stand-in's
    Unigram vocabulary (3 specials, the words, "▁", 94 characters) plus T5's 100 sentinels fits the model's
    256 embeddings, and a known word is one piece."""
    from transformers import T5Tokenizer

    name = "patrickvonplaten/t5-tiny-random"
    hub._write_tokenizer("t5", str(tmp_path))
    tok = T5Tokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 3 + len(hub._WORDS) + 1 + 94 + 100
    assert len(tok) <= hub.MODELS[name].config().vocab_size == 256
    assert tok("the cat")["input_ids"] == [tok.convert_tokens_to_ids("▁the"),
                                           tok.convert_tokens_to_ids("▁cat"), tok.eos_token_id]
