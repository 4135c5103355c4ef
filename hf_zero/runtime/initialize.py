"""``hf_zero.initialize``: DeepSpeed's entry point, same signature and same 4-tuple."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from hf_zero import comm
from hf_zero.config import load_config
from hf_zero.config.loader import read_config
from hf_zero.config.hf_zero_config import log_level_number
from hf_zero.config.errors import ConfigError
from hf_zero.parallel.current import set_run_mesh
from hf_zero.runtime.arguments import align_local_rank, config_from_args
from hf_zero.config.status import ConfigKeyIgnored
from hf_zero.runtime.mpu import read_mpu
from hf_zero.runtime.optimizers import plan_from_client, plan_from_config
from hf_zero.sequence_parallel import sequence_parallel_size
from hf_zero.runtime.parallelize import make_engine, parallelize, resolve_layout
from hf_zero.runtime.tp_setup import adopt_sharded_params
from hf_zero.tensor_parallel import tp_info
from hf_zero.tensor_parallel.config import parse_tp_config

__all__ = ["initialize"]

logger = logging.getLogger("hf_zero")


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ConfigError("", "initialize() got both config and config_params; pass one")
    source = config if config is not None else config_params
    from_args = config_from_args(args)
    if from_args is not None and source is not None:
        # DeepSpeed refuses this ambiguity too; silently preferring one would train with a config the user did not mean
        raise ConfigError("deepspeed_config", f"initialize() got a config both from args.deepspeed_config "
                                              f"({from_args!r}) and from config=/config_params=; pass only one")
    if source is None:
        source = from_args
    if source is None:
        raise ConfigError("", "initialize() needs a config: config=<dict | path to JSON | base64 JSON> "
                              "(or args.deepspeed_config, e.g. from --deepspeed_config with add_config_arguments)")
    return source


class MissingModelError(ValueError, AssertionError):
    """``initialize(model=None)``. Also an AssertionError: DeepSpeed asserts there, and scripts catch that type."""


def _with_mesh_param(raw: dict, mesh_param) -> dict:
    """DeepSpeed's ``mesh_param=(data_parallel, sequence_parallel)``: the same as the config keys
    ``data_parallel_size`` and ``sequence_parallel_size`` (DeepSpeed builds its mesh from either); a key that says
    otherwise is an error naming both."""
    if (not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh_param)):
        raise ValueError(f"hf_zero.initialize: mesh_param must be (data_parallel_size, sequence_parallel_size), two "
                         f"positive integers, got {mesh_param!r}")
    dp, sp = mesh_param
    world = comm.get_world_size()
    if dp * sp != world:
        raise ValueError(f"hf_zero.initialize: mesh_param {tuple(mesh_param)} covers {dp * sp} ranks, and the job "
                         f"has {world}")
    raw = dict(raw)
    for key, value in (("data_parallel_size", dp), ("sequence_parallel_size", sp)):
        if raw.get(key) not in (None, value):
            raise ConfigError(key, f"{raw[key]}, but mesh_param {tuple(mesh_param)} gives {value}; make them equal "
                                   f"or drop one")
        raw[key] = value
    return raw


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Wrap ``model`` in an :class:`HfZeroEngine`; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    DeepSpeed's signature. ``optimizer`` may be a torch optimizer built over the model's parameters (it is
    re-applied to the shards), a callable receiving the parameter groups, or None to build the config's
    ``optimizer`` section. ``lr_scheduler`` may be a scheduler or a callable receiving the engine's optimizer.
    """
    if model is None:
        raise MissingModelError("hf_zero.initialize: model is required")
    comm.init_distributed(dist_init_required=dist_init_required, distributed_port=distributed_port)
    align_local_rank(args)
    mpu_groups = read_mpu(mpu) if mpu is not None else None
    _default_logging(comm.get_rank())
    raw = read_config(_config_source(args, config, config_params))
    _apply_log_level(raw.get("log_level"))
    if mesh_param is not None:
        raw = _with_mesh_param(raw, mesh_param)
    tp_cfg = parse_tp_config(raw.get("tensor_parallel"))
    # the run's one device mesh, and every group hf_zero uses from it (runtime/parallelize.py); then the techniques
    # in their fixed order: tensor parallelism first -- it replaces the model's parameters
    layout = resolve_layout(model, tp_cfg, mpu_groups)
    tp = parallelize(model, layout, tp_cfg, raw.get("pipeline"))
    if model_parameters is not None:
        # Read once, here (it is used twice below): after tensor parallelism, so that `model.parameters()` -- a
        # generator, DeepSpeed's idiom -- yields the sharded parameters that replaced the model's, as DeepSpeed
        # reads it after AutoTP. A list taken before the sharding names the replaced ones: adopt_sharded_params
        # points it at their replacements, as DeepSpeed's AutoTP (which keeps the objects) effectively does.
        model_parameters = _unnamed(list(model_parameters))
    # batch sizes count data-parallel replicas, not every rank
    world_size, data_rank = layout.dp_size, layout.dp_rank
    # Ulysses: the ranks of one sequence-parallel group train one replica (hf_zero/sequence_parallel/setup.py)
    sp_size = sequence_parallel_size(raw.get("sequence_parallel_size"), getattr(mpu_groups, "sp_size", 1),
                                     model_parallel=("tensor parallelism" if tp is not None else
                                                     "a pipeline" if layout.pipeline is not None else None))
    cfg = load_config(raw, world_size=world_size // sp_size, rank=data_rank)
    if cfg.pipeline and layout.pipeline is None:
        raise ConfigError("pipeline", "the config has a pipeline section but the model is not a pipeline model; "
                                      "pass hf_zero.pipe.PipelineModule(...) or hf_zero.pipeline.wrap(model, "
                                      "num_stages) to initialize(), or remove the section (accelerate and the "
                                      "Trainer cannot drive a pipeline: see docs/pipeline.md)")
    if tp is not None:
        model_parameters = adopt_sharded_params(model, model_parameters, optimizer)
        _check_tp_params(model, model_parameters, optimizer, cfg, raw)

    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params)
    if isinstance(optimizer, torch.optim.Optimizer):
        if cfg.optimizer is not None and comm.get_rank() == 0:
            # DeepSpeed uses the client's optimizer and builds nothing from the section (it only logs "Using
            # client Optimizer as basic optimizer"); hf_zero does the same and says which key it ignores.
            warnings.warn(f"hf_zero: the config's \"optimizer\" section (type {cfg.optimizer.type!r}) is ignored: "
                          f"initialize() also got an optimizer ({type(optimizer).__name__}), which is used, as in "
                          "DeepSpeed. Remove one of them to silence this", ConfigKeyIgnored, stacklevel=2)
        plan = plan_from_client(optimizer, allow_untested=cfg.zero_allow_untested_optimizer)
    elif optimizer is not None:
        raise TypeError(f"hf_zero.initialize: optimizer must be a torch.optim.Optimizer or a callable, "
                        f"got {type(optimizer).__name__}")
    elif cfg.optimizer is not None:
        plan = plan_from_config(cfg.optimizer, params)
    else:
        plan = None  # DeepSpeed builds an engine for evaluation: forward only (backward/step raise)

    # last of the order: data parallelism / ZeRO over mesh["dp"], by the engine the layout asks for
    engine = make_engine(model, layout, tp, cfg, plan, lr_scheduler)
    engine.parallel_layout = layout  # the mesh every group of this engine comes from
    set_run_mesh(layout.mesh)  # deepspeed.utils.groups' getters answer from the last initialized run
    engine._mpu = mpu
    engine.collate_fn = collate_fn
    if training_data is not None:  # by data-parallel rank: the ranks of one TP group / pipeline read one batch
        engine.training_dataloader = engine.deepspeed_io(training_data)
        if layout.pipeline is not None:
            _pipeline_data(engine, training_data, layout)
    if cfg.dump_state and comm.get_rank() == 0:  # DeepSpeed's print_configuration(engine) (runtime/state_dump.py)
        from hf_zero.runtime.state_dump import format_engine_state

        logger.info("%s", format_engine_state(engine, cfg))
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _pipeline_data(engine, dataset, layout) -> None:
    """As DeepSpeed's pipeline engine: ``train_batch()`` without an iterator reads, forever, a second loader over
    ``dataset`` in index order (not shuffled); on the first and last stage -- the ones that read data -- that
    endless loader is also what initialize returns."""
    from torch.utils.data import DistributedSampler

    from hf_zero.pipeline.data import RepeatingLoader

    in_order = DistributedSampler(dataset, num_replicas=layout.dp_size, rank=layout.dp_rank, shuffle=False)
    repeating = RepeatingLoader(engine.deepspeed_io(dataset, data_sampler=in_order))
    engine.set_dataiterator(repeating)
    if engine.is_first_stage() or engine.is_last_stage():
        engine.training_dataloader = repeating


def _unnamed(items: list) -> list:
    """``model.named_parameters()`` as DeepSpeed takes it (it hands model_parameters to a torch optimizer, which
    accepts (name, parameter) pairs): the parameters, also inside parameter-group dicts."""
    def strip(ps):
        return [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p for p in ps]

    return [dict(g, params=strip(list(g["params"]))) if isinstance(g, dict) else g for g in strip(items)]


def _default_logging(rank: int) -> None:
    """Rank 0 prints hf_zero's INFO lines (config table, step logs) unless the application configured logging (a
    handler). A bare ``setLevel`` on the logger is not that: the Trainer sets DeepSpeed's logger to its own verbosity
    (WARNING by default) before every job, which would hide the start-up table; the config's ``log_level`` is the
    way to quieten hf_zero (applied after this). DeepSpeed keeps such a level (its TestLogLevelEndToEnd)."""
    if rank == 0 and not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hf_zero] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _apply_log_level(value) -> None:
    """``log_level``: hf_zero's logger (DeepSpeed's, under ``import deepspeed``) and its handlers, set before the
    config table is logged, as DeepSpeed sets its logger's early in the engine's construction."""
    level = log_level_number(value)
    if level is None:
        return
    logger.setLevel(level)
    for handler in logger.handlers:
        handler.setLevel(level)


def _check_tp_params(model: nn.Module, model_parameters, optimizer, cfg, raw: dict) -> None:
    """Parameters handed in must be the sharded model's (apply_tp replaced every split parameter)."""
    current = set(model.parameters())
    given = []
    for item in model_parameters or ():
        given += list(item["params"]) if isinstance(item, dict) else [item]
    if isinstance(optimizer, torch.optim.Optimizer):
        given += [p for g in optimizer.param_groups for p in g["params"]]
    if any(p not in current for p in given):
        raise ValueError("hf_zero.initialize: the optimizer / model_parameters hold parameters that are not the "
                         "tensor-parallel model's (nor ones its sharding replaced); build them from this model's "
                         "parameters (or pass the optimizer as a config section or a callable)")
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    have = names[cfg.compute_dtype]
    tp_dtype = (raw.get("tensor_parallel") or {}).get("dtype")
    if tp_dtype is not None and parse_tp_config({"dtype": tp_dtype}).dtype != have:
        raise ConfigError("tensor_parallel.dtype", f"{tp_dtype!r} disagrees with the training dtype {have} "
                                                   "(set by the fp16 / bf16 sections); make them agree")
    init_dtype = tp_info(model).dtype
    if init_dtype is not None and names.get(init_dtype) != have:
        raise ConfigError("bf16.enabled / fp16.enabled", f"tp_model_init(dtype={init_dtype}) disagrees with the "
                                                         f"training dtype {have} these sections select")
