"""Local stand-ins for the Hub names the peers' DeepSpeed tests load.

The peers' tests call ``from_pretrained("gpt2")``, ``load_dataset("nyu-mll/glue", "mrpc")`` and the like.
Nothing here can reach the Hub, so this module writes a Hub cache the ordinary offline code paths read:
``HF_HUB_CACHE/models--<org>--<name>/snapshots/<commit>/`` holding a tiny config built from a transformers
config class, random weights and a tokenizer built locally, and a prepared ``datasets`` cache entry for each
dataset. With ``HF_HUB_OFFLINE=1`` every process, including the ones the tests launch with
``accelerate launch``, resolves the names there; no code in the peer or in transformers is patched.

The weights are random: a test that asserts an accuracy only pretrained weights reach fails on both engines.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
from dataclasses import dataclass
from typing import Callable

__all__ = ["MODELS", "DATASETS", "build_hub", "hub_env", "repo_dir"]

# One commit id for every stand-in: the cache needs one, and nothing compares it.
_COMMIT = "0" * 40
_WORDS = (
    "the a an cat dog sat on mat ran fast slow big small red blue green house car tree river said "
    "company shares market year new percent million stock would its it was he she they"
).split()


@dataclass(frozen=True)
class ModelSpec:
    """How one Hub name is stood in for: ``config`` builds the transformers config, ``auto_class`` names the
    ``transformers`` Auto class whose ``from_config`` builds the random weights (None: config only), and
    ``tokenizer`` is "bert-cased", "bert-uncased", "bytes", "gpt2" (the bytes vocabulary as a GPT2TokenizerFast),
    "roberta" (the same with RoBERTa's special tokens), "t5" (Unigram over words and characters, T5's
    100 sentinels) or None."""

    config: Callable[[], object]
    auto_class: str | None
    tokenizer: str | None


def _gpt2(n_embd: int, n_layer: int = 2):
    def make():
        from transformers import GPT2Config

        # token 256 is the byte tokenizer's <|endoftext|>
        return GPT2Config(
            n_embd=n_embd, n_layer=n_layer, n_head=2, n_positions=256, vocab_size=1024, bos_token_id=256,
            eos_token_id=256,
        )

    return make


def _bert(vocab_size: int):
    def make():
        from transformers import BertConfig

        return BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
            vocab_size=vocab_size, max_position_embeddings=512, num_labels=2,
        )

    return make


def _distilbert(vocab_size: int):
    def make():
        from transformers import DistilBertConfig

        return DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=37, vocab_size=vocab_size, num_labels=2)

    return make


def _gptj():
    from transformers import GPTJConfig

    # rotary_dim < head size (8): the partial-rotary path transformers' GPT-J tests exercise
    return GPTJConfig(
        n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=512, vocab_size=1024, bos_token_id=256,
        eos_token_id=256,
    )


def _opt(word_embed_proj_dim: int):
    def make():
        from transformers import OPTConfig

        # word_embed_proj_dim < hidden_size: the project_in/project_out layers opt-350m has and opt-125m lacks
        return OPTConfig(
            hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2, vocab_size=1024,
            max_position_embeddings=512, word_embed_proj_dim=word_embed_proj_dim, bos_token_id=256,
            eos_token_id=256, pad_token_id=256, dropout=0.0,
        )

    return make


def _t5():
    from transformers import T5Config

    # vocab: the "t5" tokenizer's pieces plus its 100 sentinels fit in 256
    return T5Config(
        d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=256,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=1024, max_position_embeddings=2048, bos_token_id=256, eos_token_id=256, pad_token_id=256,
    )


def _qwen_moe():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024, max_position_embeddings=512, bos_token_id=256, eos_token_id=256, pad_token_id=256,
    )


def _roberta():
    from transformers import RobertaConfig

    # the "roberta" tokenizer's ids: <s> 0, <pad> 1, </s> 2, <unk> 3, the 256 bytes, <mask> 260
    return RobertaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=261, max_position_embeddings=130, bos_token_id=0, pad_token_id=1, eos_token_id=2)


def _mobilevit():
    from transformers import MobileViTConfig

    # the xx-small layout's widths (the tests read hidden_sizes only)
    return MobileViTConfig(hidden_sizes=[64, 80, 96], neck_hidden_sizes=[16, 16, 24, 48, 64, 80, 320])


def _bert_vocab() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = [chr(c) for c in range(33, 127)]
    return specials + _WORDS + chars + ["##" + c for c in chars if c.isalnum()]


def _t5_vocab() -> list[tuple[str, float]]:
    """Unigram pieces (T5's ids 0-2 are pad, eos, unk): the words whole, then single characters; log-probabilities
    favour whole words."""
    chars = [chr(c) for c in range(33, 127)]
    return ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -2.0) for w in _WORDS]
            + [("\u2581", -3.0)] + [(c, -5.0) for c in chars])


# The names the suites load, by suite (accelerate's tests/deepspeed and its external_deps scripts; transformers'
# tests/trainer/distributed/test_trainer_distributed_deepspeed.py).
MODELS: dict[str, ModelSpec] = {
    "sshleifer/tiny-gpt2": ModelSpec(_gpt2(16), "AutoModelForCausalLM", "bytes"),
    "gpt2": ModelSpec(_gpt2(32), "AutoModelForCausalLM", "bytes"),
    "hf-internal-testing/tiny-random-gpt2": ModelSpec(_gpt2(32, 2), "AutoModelForCausalLM", "bytes"),
    "hf-internal-testing/tiny-random-LlamaForCausalLM": ModelSpec(_llama, "AutoModelForCausalLM", "bytes"),
    "peft-internal-testing/tiny-random-qwen-1.5-MoE": ModelSpec(_qwen_moe, "AutoModelForCausalLM", "bytes"),
    "apple/mobilevit-xx-small": ModelSpec(_mobilevit, None, None),
    "bert-base-cased": ModelSpec(_bert(len(_bert_vocab())), "AutoModelForSequenceClassification", "bert-cased"),
    "hf-internal-testing/mrpc-bert-base-cased": ModelSpec(
        _bert(len(_bert_vocab())), "AutoModelForSequenceClassification", "bert-cased"
    ),
    "distilbert-base-uncased": ModelSpec(
        _distilbert(len(_bert_vocab())), "AutoModelForSequenceClassification", "bert-uncased"
    ),
    "patrickvonplaten/t5-tiny-random": ModelSpec(_t5, "AutoModelForSeq2SeqLM", "t5"),
    "hf-internal-testing/tiny-random-gptj": ModelSpec(_gptj, "AutoModelForCausalLM", "bytes"),
    # DeepSpeed-Chat's actor and critic (scripts/deepspeed_chat/run.py)
    "facebook/opt-125m": ModelSpec(_opt(32), "AutoModelForCausalLM", "gpt2"),
    "facebook/opt-350m": ModelSpec(_opt(16), "AutoModelForCausalLM", "gpt2"),
    # DeepSpeedExamples' training scripts (scripts/ds_examples/run.py): HelloDeepSpeed loads the tokenizer only
    "roberta-base": ModelSpec(_roberta, None, "roberta"),
}

# Datasets: (name, config) -> {split: rows}, random sentences over _WORDS in each dataset's columns (_COLUMNS).
DATASETS: dict[tuple[str, str], dict[str, int]] = {
    ("nyu-mll/glue", "mrpc"): {"train": 64, "validation": 32, "test": 32},
    # DeepSpeedExamples' HelloDeepSpeed and bf16_master_weight
    ("wikitext", "wikitext-2-v1"): {"train": 256, "validation": 32, "test": 32},
    ("wikitext", "wikitext-103-raw-v1"): {"train": 2048, "validation": 32, "test": 32},
    # DeepSpeedExamples' DeepSpeed-ZenFlow/finetuning (load_dataset("tatsu-lab/alpaca"): the default config)
    ("tatsu-lab/alpaca", "default"): {"train": 64},
}


def _mrpc_rows(rng: random.Random, n: int) -> dict[str, list]:
    return {
        "sentence1": [" ".join(rng.choices(_WORDS, k=8)) for _ in range(n)],
        "sentence2": [" ".join(rng.choices(_WORDS, k=8)) for _ in range(n)],
        "label": [rng.randint(0, 1) for _ in range(n)],
        "idx": list(range(n)),
    }


def _wikitext_rows(rng: random.Random, n: int) -> dict[str, list]:
    """WikiText's one ``text`` column: paragraphs ending in a newline, every fourth line empty, some headings."""
    lines = []
    for i in range(n):
        if i % 4 == 3:
            lines.append("")
        elif i % 16 == 0:
            lines.append(f" = {' '.join(rng.choices(_WORDS, k=2)).title()} = \n")
        else:
            lines.append(" " + " ".join(rng.choices(_WORDS, k=rng.randint(8, 40))) + " . \n")
    return {"text": lines}


def _alpaca_rows(rng: random.Random, n: int) -> dict[str, list]:
    """Alpaca's columns: an instruction, an input (empty for every third row, as many of Alpaca's are), an output
    and the formatted ``text``."""
    def words(k):
        return " ".join(rng.choices(_WORDS, k=k))

    rows = {"instruction": [], "input": [], "output": [], "text": []}
    for i in range(n):
        instruction, given, output = words(8), "" if i % 3 == 0 else words(6), words(12)
        rows["instruction"].append(instruction)
        rows["input"].append(given)
        rows["output"].append(output)
        rows["text"].append(f"### Instruction:\n{instruction}\n\n### Response:\n{output}")
    return rows


_COLUMNS = {"nyu-mll/glue": _mrpc_rows, "wikitext": _wikitext_rows, "tatsu-lab/alpaca": _alpaca_rows}


def repo_dir(hub_cache: str, name: str, kind: str = "models") -> str:
    """The snapshot directory huggingface_hub reads for ``name`` in offline mode."""
    return os.path.join(hub_cache, f"{kind}--{name.replace('/', '--')}", "snapshots", _COMMIT)


def _write_tokenizer(kind: str, out_dir: str) -> None:
    from tokenizers import pre_tokenizers

    if kind.startswith("bert"):
        from transformers import BertTokenizerFast

        vocab = {token: i for i, token in enumerate(_bert_vocab())}
        BertTokenizerFast(vocab=vocab, do_lower_case=kind == "bert-uncased").save_pretrained(out_dir)
        return
    if kind == "roberta":
        # byte-level BPE without merges, RoBERTa's special tokens at RoBERTa's ids (0-3) and <mask> after the bytes
        from transformers import RobertaTokenizerFast

        os.makedirs(out_dir, exist_ok=True)
        vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
        for sym in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab[sym] = len(vocab)
        vocab["<mask>"] = len(vocab)
        vocab_file, merges_file = os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")
        with open(vocab_file, "w", encoding="utf-8") as f:
            json.dump(vocab, f)
        with open(merges_file, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
        RobertaTokenizerFast(vocab_file, merges_file).save_pretrained(out_dir)
        return
    if kind == "t5":
        from transformers import T5Tokenizer

        T5Tokenizer(vocab=_t5_vocab()).save_pretrained(out_dir)
        return
    # "bytes": byte-level BPE over the 256 byte symbols and no merges (every byte one token).
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {sym: i for i, sym in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    if kind == "gpt2":
        # the same vocabulary as a GPT2TokenizerFast (OPT's class): vocab.json + merges.txt, so that
        # save_vocabulary works as on the real model (DeepSpeed-Chat's save_hf_format calls it)
        from transformers import GPT2TokenizerFast

        os.makedirs(out_dir, exist_ok=True)
        vocab_file, merges_file = os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")
        with open(vocab_file, "w", encoding="utf-8") as f:
            json.dump(vocab, f)
        with open(merges_file, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
        # positional: transformers 4 names them vocab_file / merges_file, 5 vocab / merges (a path or the contents)
        GPT2TokenizerFast(vocab_file, merges_file, pad_token="<|endoftext|>").save_pretrained(out_dir)
        return
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(out_dir)


def _write_model(name: str, spec: ModelSpec, hub_cache: str) -> None:
    import torch
    import transformers

    out_dir = repo_dir(hub_cache, name)
    os.makedirs(out_dir, exist_ok=True)
    config = spec.config()
    if spec.auto_class is None:
        config.save_pretrained(out_dir)
    else:
        torch.manual_seed(0)
        model = getattr(transformers, spec.auto_class).from_config(config)
        model.save_pretrained(out_dir)
    if spec.tokenizer:
        _write_tokenizer(spec.tokenizer, out_dir)
    refs = os.path.join(hub_cache, f"models--{name.replace('/', '--')}", "refs")
    os.makedirs(refs, exist_ok=True)
    with open(os.path.join(refs, "main"), "w") as f:
        f.write(_COMMIT)


def _write_dataset(name: str, config_name: str, splits: dict[str, int], datasets_cache: str) -> None:
    """A prepared ``datasets`` cache entry: what ``load_dataset(name, config_name)`` reads in offline mode
    (``<cache>/<org>___<name>/<config>/0.0.0/<hash>/<name>-<split>.arrow`` + ``dataset_info.json``). Built by
    the parquet builder from generated rows, then renamed to the dataset's name and config."""
    import datasets

    rng = random.Random(0)

    def rows(n):
        return _COLUMNS[name](rng, n)

    scratch = os.path.join(datasets_cache, "_build")
    os.makedirs(scratch, exist_ok=True)
    files = {}
    for split, n in splits.items():
        files[split] = os.path.join(scratch, f"{split}.parquet")
        datasets.Dataset.from_dict(rows(n)).to_parquet(files[split])
    builder = datasets.load_dataset_builder("parquet", data_files=files, cache_dir=os.path.join(scratch, "cache"))
    builder.download_and_prepare()
    short = name.split("/")[-1]
    dst = os.path.join(datasets_cache, name.replace("/", "___"), config_name, "0.0.0", _COMMIT)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(builder.cache_dir, dst)
    for path in glob.glob(os.path.join(dst, "parquet-*.arrow")):
        os.rename(path, path.replace(os.sep + "parquet-", os.sep + f"{short}-"))
    info_path = os.path.join(dst, "dataset_info.json")
    with open(info_path, encoding="utf-8") as f:
        info = json.load(f)
    info.update(config_name=config_name, dataset_name=short, builder_name=short)
    for split_info in info.get("splits", {}).values():
        split_info["dataset_name"] = short
    with open(info_path, "w", encoding="utf-8") as f:
        json.dump(info, f)
    shutil.rmtree(scratch)


def build_hub(root: str, names: list[str] | None = None, with_datasets: bool = True) -> dict[str, str]:
    """Writes the stand-ins under ``root`` (once: a stamp file holding the list of names skips the rebuild)
    and returns the environment that points every process at them."""
    env = hub_env(root)
    os.environ.update({k: v for k, v in env.items() if "PROGRESS" in k})
    wanted = sorted(names if names is not None else MODELS)
    stamp = os.path.join(root, "built.json")
    want_stamp = {"models": wanted, "datasets": sorted(map("/".join, DATASETS)) if with_datasets else []}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want_stamp:
                return env
    for name in wanted:
        _write_model(name, MODELS[name], env["HF_HUB_CACHE"])
    if with_datasets:
        for (name, config_name), splits in DATASETS.items():
            _write_dataset(name, config_name, splits, env["HF_DATASETS_CACHE"])
    with open(stamp, "w") as f:
        json.dump(want_stamp, f)
    return env


def hub_env(root: str) -> dict[str, str]:
    """Offline mode, pointed at the stand-ins; HF_HOME too, so no user's accelerate config is read."""
    return {
        "HF_HOME": os.path.join(root, "hf_home"),
        "HF_HUB_CACHE": os.path.join(root, "hub"),
        "HF_DATASETS_CACHE": os.path.join(root, "datasets"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
