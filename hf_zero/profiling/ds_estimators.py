"""DeepSpeed's four ``estimate_zero{2,3}_model_states_mem_needs_all_{live,cold}``, answered with hf_zero's numbers.

Same names, arguments and printed table shape as DeepSpeed; the figures are hf_zero's exact model-state bytes
(:func:`hf_zero.profiling.memory.model_state_bytes`, pinned to the engine by a test) for 16-bit training with
AdamW, the estimators' own assumption. ``_all_live`` reads true parameter sizes, so a ``zero.Init`` model is not
reported as empty. Like DeepSpeed's, these are model states only: the table ends with a line pointing at
``hf-zero estimate``, which adds activations, buckets and the rest of the per-rank peak.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_zero.profiling.memory import ParamLayout, model_state_bytes, param_layout

__all__ = ["estimate_zero2_model_states_mem_needs_all_live", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero3_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold",
           "zero_model_states_mem_needs"]

_POINTER = ("hf_zero: model states only (parameters, gradients, master weights, Adam moments); activations, "
            "buckets and gathered layers are not included -- run `hf-zero estimate` for the full per-rank peak.")


def zero_model_states_mem_needs(layout: ParamLayout, *, stage: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                offload_optimizer: bool = False, offload_param: bool = False, zero_init: bool = True,
                                additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(bytes per CPU node, bytes per GPU) of bf16 + AdamW model states."""
    world = num_gpus_per_node * num_nodes
    parts = model_state_bytes(layout, stage=stage, world_size=world, compute_dtype=torch.bfloat16,
                              offload_optimizer="cpu" if offload_optimizer else "none",
                              offload_param="cpu" if offload_param else "none", accelerator="cuda")
    gpu = sum(p.nbytes for p in parts if p.device == "accelerator")
    cpu = sum(p.nbytes for p in parts if p.device == "host") * num_gpus_per_node
    if not zero_init:  # every process of the node loads the whole model (fp32) before partitioning
        cpu += layout.total * 4 * num_gpus_per_node
    return int(cpu * additional_buffer_factor), gpu


def _header(total: int, largest: int | None, num_gpus_per_node: int, num_nodes: int) -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    largest_part = f", {int(largest / 1e6)}M largest layer params." if largest is not None else "."
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
          f"SW: Model with {int(total / 1e6)}M total params{largest_part}")
    print("  per CPU  |  per GPU |   Options")


def _cold_layout(total_params: int, largest_layer_params: int = 0) -> ParamLayout:
    return ParamLayout((int(total_params),), (True,), int(largest_layer_params))


def _zero2_table(layout: ParamLayout, num_gpus_per_node: int, num_nodes: int, factor: float) -> None:
    _header(layout.total, None, num_gpus_per_node, num_nodes)
    for offload in (True, False):
        cpu, gpu = zero_model_states_mem_needs(layout, stage=2, num_gpus_per_node=num_gpus_per_node,
                                               num_nodes=num_nodes, offload_optimizer=offload,
                                               additional_buffer_factor=factor)
        print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | offload_optimizer={'cpu ' if offload else 'none'}")
    print(_POINTER)


def _zero3_table(layout: ParamLayout, num_gpus_per_node: int, num_nodes: int, factor: float) -> None:
    _header(layout.total, layout.largest_module_numel, num_gpus_per_node, num_nodes)
    for offload_opt, offload_param in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu = zero_model_states_mem_needs(layout, stage=3, num_gpus_per_node=num_gpus_per_node,
                                                   num_nodes=num_nodes, offload_optimizer=offload_opt,
                                                   offload_param=offload_param, zero_init=zero_init,
                                                   additional_buffer_factor=factor)
            options = (f"offload_param={'cpu ' if offload_param else 'none'}, "
                       f"offload_optimizer={'cpu ' if offload_opt else 'none'}, zero_init={int(zero_init)}")
            print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}")
    print(_POINTER)


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    _zero2_table(param_layout(model), num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    _zero2_table(_cold_layout(total_params), num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    _zero3_table(param_layout(model), num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    _zero3_table(_cold_layout(total_params, largest_layer_params), num_gpus_per_node, num_nodes,
                 additional_buffer_factor)
