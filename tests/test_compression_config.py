"""compression_training parsing: DeepSpeed configs parse into typed sections; every mistake names its key path."""

import dataclasses
import json

import pytest

from hf_zero.compression.config import GROUPED_METHODS, CompressionConfig, parse_compression_config
from hf_zero.config.errors import ConfigError

FULL = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantizer_kernel": False, "schedule_offset": 10,
                              "quantize_groups": 1, "quantize_verbose": False, "quantization_type": "symmetric",
                              "quantize_weight_in_forward": True, "rounding": "nearest",
                              "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001}},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 50},
                                     "modules": ["self_attn", "mlp"]}},
    },
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "quantization_type": "asymmetric", "range_calibration": "dynamic",
                              "schedule_offset": 50},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["o_proj"]}},
    },
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 30, "method": "l1"},
        "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["q_proj"]}},
    },
    "row_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 20, "method": "topk"},
        "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["up_proj"],
                                     "related_modules": [["gate_proj", "down_proj"]]}},
    },
    "head_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 10, "method": "topk", "num_heads": 4},
        "different_groups": {"hp1": {"params": {"dense_ratio": 0.5}, "modules": ["o_proj"],
                                     "related_modules": [["q_proj", "k_proj", "v_proj"]]}},
    },
    "channel_pruning": {
        "shared_parameters": {"enabled": False, "schedule_offset": 0, "method": "l1"},
        "different_groups": {"cp1": {"params": {"dense_ratio": 0.5}, "modules": ["o_proj", "down_proj"]}},
    },
    "layer_reduction": {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "model.layers",
                        "teacher_layer": [1, 3], "other_module_name": ["model.embed_tokens", "model.norm", "lm_head"]},
}


def test_full_deepspeed_section_parses_typed():
    cfg = parse_compression_config(json.loads(json.dumps(FULL)))
    wq = cfg.weight_quantization
    assert wq.shared.schedule_offset == 10 and wq.shared.quantization_type == "symmetric"
    (group,) = wq.groups
    assert (group.name, group.params.start_bits, group.params.target_bits, group.params.quantization_period) == \
        ("wq1", 8, 4, 50)
    assert group.modules == ("self_attn", "mlp")
    assert cfg.row_pruning.groups[0].related_modules == ("gate_proj", "down_proj")
    assert cfg.head_pruning.shared.num_heads == 4
    assert cfg.layer_reduction.teacher_layer == (1, 3)
    # channel pruning is present but disabled: not applied
    assert [m.method for m in cfg.enabled_methods()] == ["weight_quantization", "activation_quantization",
                                                         "sparse_pruning", "row_pruning", "head_pruning"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.weight_quantization.shared.enabled = False  # type: ignore[misc]


def test_option_set_is_frozen():
    """Adding an option is a visible change of this test, not silent sprawl."""
    fields = {name: sorted(f.name for f in dataclasses.fields(shared)) +
              sorted(f.name for f in dataclasses.fields(params)) for name, (shared, params, _) in GROUPED_METHODS.items()}
    assert fields["weight_quantization"] == sorted(
        ["enabled", "schedule_offset", "quantization_type", "quantize_groups", "per_channel", "group_size",
         "rounding", "quantize_weight_in_forward", "quantizer_kernel", "quantize_verbose", "fp16_mixed_quantize"]) + \
        sorted(["start_bits", "target_bits", "quantization_period"])
    assert fields["sparse_pruning"] == sorted(
        ["enabled", "method", "schedule_offset", "schedule_offset_end", "schedule_offset_stride", "dense_ratio",
         "excluded_modules"]) + ["dense_ratio"]
    assert sorted(f.name for f in dataclasses.fields(CompressionConfig)) == sorted(
        [*GROUPED_METHODS, "layer_reduction"])


def _with(method, shared=None, group=None, name="g1"):
    base = json.loads(json.dumps(FULL[method]))
    if shared:
        base["shared_parameters"].update(shared)
    if group is not None:
        base["different_groups"] = {name: group}
    return {method: base}


@pytest.mark.parametrize("section, key_path, words", [
    ({"weight_quantisation": {}}, "compression_training.weight_quantisation", "did you mean 'weight_quantization'"),
    (_with("sparse_pruning", group={"params": {"dense_ratio": 1.5}, "modules": ["q_proj"]}, name="sp1"),
     "compression_training.sparse_pruning.different_groups.sp1.params.dense_ratio", "(0, 1]"),
    (_with("sparse_pruning", group={"params": {"dense_ratio": 0}, "modules": ["q_proj"]}),
     "compression_training.sparse_pruning.different_groups.g1.params.dense_ratio", "(0, 1]"),
    (_with("sparse_pruning", group={"params": {}, "modules": ["q_proj"]}),
     "compression_training.sparse_pruning.different_groups.g1.params.dense_ratio", "required"),
    (_with("weight_quantization", group={"params": {"start_bits": 4, "target_bits": 8, "quantization_period": 1},
                                         "modules": ["*"]}),
     "compression_training.weight_quantization.different_groups.g1.params.target_bits", "must not exceed"),
    (_with("weight_quantization", group={"params": {"start_bits": 8, "target_bits": 4}, "modules": ["*"]}),
     "compression_training.weight_quantization.different_groups.g1.params.quantization_period", "> 0"),
    (_with("weight_quantization", shared={"quantization_type": "sym"}),
     "compression_training.weight_quantization.shared_parameters.quantization_type", "'symmetric'"),
    (_with("weight_quantization", shared={"schedule_ofset": 3}),
     "compression_training.weight_quantization.shared_parameters.schedule_ofset", "did you mean 'schedule_offset'"),
    (_with("row_pruning", group={"params": {"dense_ratio": 0.5}, "modules": ["up_proj"]}),
     "compression_training.row_pruning.different_groups.g1.related_modules", "needs related_modules"),
    (_with("head_pruning", group={"params": {"dense_ratio": 0.5}, "modules": [], "related_modules": ["q"]}),
     "compression_training.head_pruning.different_groups.g1.modules", "at least one"),
    (_with("head_pruning", group={"params": {"dense_ratio": 0.5}, "modules": ["o_proj("], "related_modules": ["q"]}),
     "compression_training.head_pruning.different_groups.g1.modules[0]", "invalid regular expression"),
    (_with("row_pruning", group={"params": {"dense_ratio": 0.5}, "module": ["up"], "related_modules": ["d"]}),
     "compression_training.row_pruning.different_groups.g1.module", "did you mean 'modules'"),
    (_with("sparse_pruning", shared={"schedule_offset": 10, "schedule_offset_end": 5}),
     "compression_training.sparse_pruning.shared_parameters.schedule_offset_end", ">= schedule_offset"),
    ({"layer_reduction": {"enabled": True, "keep_number_layer": 2, "teacher_layer": [0, 1, 2]}},
     "compression_training.layer_reduction.teacher_layer", "keep_number_layer is 2"),
    ({"sparse_pruning": {"shared_parameters": {"enabled": True}, "different_groups": {}}},
     "compression_training.sparse_pruning.different_groups", "no groups"),
])
def test_bad_config_names_key_path(section, key_path, words):
    with pytest.raises(ConfigError) as info:
        parse_compression_config(section)
    assert info.value.key_path == key_path
    assert words in str(info.value)
