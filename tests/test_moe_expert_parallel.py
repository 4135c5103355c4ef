"""MoE expert parallelism (``MoE(..., ep_size > 1)``) against one process holding every expert.

Every rank gates its own micro-batch over all experts and exchanges tokens with the ranks of its expert-parallel
group; the reference runs each rank's micro-batch through the same model with all experts in one process and
averages the losses. Experts start from weights drawn by *global* expert index, so a rank holding the wrong experts
(or a wrong all-to-all order) shows up in the first loss. Checked at ZeRO stages 0, 1 and 2, world 2 / ep 2,
world 4 / ep 2 and world 4 / ep 4: losses, every parameter after the steps, the clipped global gradient norm, the
experts each rank holds (DeepSpeed's rank layout), a checkpoint round trip restoring parameters and optimizer
states exactly, and the offline converter (zero_to_fp32) giving the fp32 masters of every expert, bit for bit,
under its global index. Also (``_case``): fp16 with an overflow in one rank's experts (every rank skips the step),
bf16, gradient accumulation, a client optimizer mixing experts and dense parameters in one group at stage 0 (with
its StepLR), and ``use_data_before_expert_parallelism``'s rank layout. DeepSpeed 0.19.8 on the "2+fp16" run (world
2, CPU): losses 0.1420547, 0.7732590, 0.6703633, norms 0.448842, inf, 0.857820, loss scale 256, 128, 128, skipped
0, 1, 1 on both ranks (hf_zero: 0.1420547, 0.7731016, 0.6703329; 0.449010, inf, 0.858089; the same scales and
skips; the fp32 reference: 0.1420528, 0.7730771, 0.6703705).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from hf_zero.moe import MoE
from hf_zero.testing import run_distributed

H, E, STEPS, BATCH, LR, CLIP = 6, 4, 3, 5, 0.02, 0.05


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))


class Net(nn.Module):
    def __init__(self, ep_size: int):
        super().__init__()
        self.inp = nn.Linear(3, H)
        # top-2, capacity small enough that tokens are dropped: the per-rank capacity must be reproduced exactly
        self.moe = MoE(H, _expert(), num_experts=E, ep_size=ep_size, k=2, capacity_factor=0.75, min_capacity=1,
                       use_rts=False, top2_2nd_expert_sampling=False)
        self.out = nn.Linear(H, 1)

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h), l_aux


def _build(ep_size: int, ep_rank: int) -> Net:
    """The same dense weights everywhere; expert ``g`` (global index) drawn from its own seed."""
    torch.manual_seed(0)
    model = Net(ep_size)
    local = model.moe.num_local_experts
    with torch.no_grad():
        for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(1000 + ep_rank * local + i)
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _data(world: int):
    g = torch.Generator().manual_seed(4)
    return torch.randn(STEPS, world, BATCH, 3, generator=g), torch.randn(STEPS, world, BATCH, 1, generator=g)


def _loss(model, x, y):
    pred, l_aux = model(x)
    return nn.functional.mse_loss(pred.float(), y) + 0.01 * l_aux.float()


def _case(case) -> dict:
    """A run's settings from its name: the ZeRO stage, then "+"-joined options -- ``offload`` (offload_optimizer to
    the CPU), ``gas2`` (2 micro-batches a step), ``fp16`` (dynamic loss scale; one expert gradient of rank 1 is
    made infinite at step ``INF_STEP``, so every rank must skip that step), ``bf16``, ``client`` (the script's own
    torch Adam with one parameter group mixing experts and dense parameters, and a StepLR built on it)."""
    name = str(case)
    opts = set(name.split("+")[1:])
    return {"stage": int(name[0]), "offload": "offload" in opts, "gas": 2 if "gas2" in opts else 1,
            "fp16": "fp16" in opts, "bf16": "bf16" in opts, "client": "client" in opts}


INF_STEP, GAMMA = 1, 0.5


def _reference(world: int, case=0):
    """The losses, clipped norms and parameters of one process holding every expert, over the same micro-batches
    (``world * gas`` a step); steps an fp16 run skips are skipped; the client case's StepLR halves the rate."""
    c = _case(case)
    model = _build(1, 0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA) if c["client"] else None
    micro = world * c["gas"]
    x, y = _data(micro)
    losses, norms = [], []
    for s in range(STEPS):
        loss = sum(_loss(model, x[s, r], y[s, r]) for r in range(micro)) / micro
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
        if not (c["fp16"] and s == INF_STEP):
            opt.step()
            if sched is not None:
                sched.step()
        norms.append(norm)
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _global_name(name: str, ep_rank: int, local: int) -> str:
    """A parameter's name in the model holding every expert (local expert i of EP rank e is e * local + i)."""
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    if not name.startswith(prefix):
        return name
    index, rest = name[len(prefix):].split(".", 1)
    return f"{prefix}{ep_rank * local + int(index)}.{rest}"


def _train(ep_size: int, stages, checkpoint_dir: str | None, data_before_expert: bool = False):
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_fp32_param

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    name = f"ep_size_{ep_size}"
    groups._create_expert_and_data_parallel(ep_size, use_data_before_expert_parallel_=data_before_expert)
    ep_rank = groups._get_expert_parallel_rank(name)
    layout = {"ep_rank": ep_rank, "ep_ranks": groups._get_expert_parallel_group_ranks(name),
              "edp_ranks": groups._get_expert_data_parallel_group_ranks(name),
              "edp_world": groups._get_expert_data_parallel_world_size(name)}
    x, y = _data(world)
    out = {"layout": layout}
    for stage in stages:  # a _case name: 0, 1, 2, "2+offload", "1+gas2", "2+fp16", "0+client", ...
        c = _case(stage)
        zero = {"stage": c["stage"]}
        if c["offload"]:
            zero["offload_optimizer"] = {"device": "cpu"}
        model = _build(ep_size, ep_rank)
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": c["gas"],
                  "gradient_clipping": CLIP, "zero_optimization": zero, "steps_per_print": 1000,
                  "fp16": {"enabled": c["fp16"], "initial_scale_power": 8, "hysteresis": 1},
                  "bf16": {"enabled": c["bf16"]}, "use_data_before_expert_parallelism": data_before_expert}
        if c["client"]:  # one group: dense parameters and this rank's experts together
            client = torch.optim.Adam(model.parameters(), lr=LR)
            sched = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=GAMMA)
            engine, *_ = deepspeed.initialize(model=model, optimizer=client, lr_scheduler=sched, config=config)
            result_groups = (len(client.param_groups), len(engine.optimizer.param_groups))
        else:
            config["optimizer"] = {"type": "Adam", "params": {"lr": LR}}
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            result_groups = None
        micro = world * c["gas"]
        x, y = _data(micro)
        low = torch.float16 if c["fp16"] else torch.bfloat16 if c["bf16"] else torch.float32
        expert_param = next(model.moe.deepspeed_moe.experts.deepspeed_experts.parameters())
        losses, norms, scales, skipped, lrs = [], [], [], [], []
        for s in range(STEPS):
            total = torch.zeros(())
            for m in range(c["gas"]):
                hook = None
                if c["fp16"] and s == INF_STEP and rank == 1 and m == 0:  # an overflow in one rank's experts only
                    hook = expert_param.register_hook(lambda grad: grad * float("inf"))
                loss = _loss(engine, x[s, m * world + rank].to(low), y[s, m * world + rank])
                engine.backward(loss)
                engine.step()
                if hook is not None:
                    hook.remove()
                total += loss.detach()
            torch.distributed.all_reduce(total)
            losses.append(total.item() / micro)
            norms.append(engine.get_global_grad_norm())
            scales.append(engine.get_loss_scale() if c["fp16"] else None)
            skipped.append(engine.skipped_steps)
            lrs.append(engine.get_lr()[0])
        # the fp32 masters (gathered over each expert's EDP group); offloaded ones are not readable so: the model's
        # fp32 weights, published from them
        params = {_global_name(n, ep_rank, E // ep_size):
                  (p.detach() if c["offload"] else safe_get_full_fp32_param(p)).clone()
                  for n, p in model.named_parameters()}
        held = len(model.moe.deepspeed_moe.experts.deepspeed_experts)
        result = {"losses": losses, "norms": norms, "params": params, "held": held, "scales": scales,
                  "skipped": skipped, "lrs": lrs, "param_groups": result_groups}
        if checkpoint_dir is not None and set(str(stage).split("+")[1:]) <= {"offload"}:
            # the consolidated weights hold every expert under its global index (rank 0 returns them)
            result["full"] = engine._zero3_consolidated_16bit_state_dict()
            engine.save_checkpoint(checkpoint_dir, tag=f"stage{stage}")
            before = {k: v.clone() for k, v in engine.optimizer.shard_state().items()}
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            fresh = _build(ep_size, ep_rank)
            engine2, *_ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config={
                "train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": CLIP, "zero_optimization": zero,
                "optimizer": {"type": "Adam", "params": {"lr": LR}}, "steps_per_print": 1000,
                "use_data_before_expert_parallelism": data_before_expert})
            engine2.load_checkpoint(checkpoint_dir, tag=f"stage{stage}")
            after = engine2.optimizer.shard_state()
            same_state = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
            same_weights = all(torch.equal(weights[n], p.detach()) for n, p in fresh.named_parameters())
            # the next step of both engines is the same step
            nxt = [_loss(e, x[0, rank], y[0, rank]) for e in (engine, engine2)]
            for e, loss in zip((engine, engine2), nxt):
                e.backward(loss)
                e.step()
            same_next = all(torch.equal(a.detach(), b.detach())
                            for a, b in zip(model.parameters(), fresh.parameters()))
            result["checkpoint"] = (same_state, same_weights, same_next, len(before))
            if rank == 0:  # offline, as a user would run it after training: every expert under its global index
                from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                          get_fp32_state_dict_from_zero_checkpoint)

                result["fp32"] = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=f"stage{stage}")
                out_file = f"{checkpoint_dir}/fp32_stage{stage}.safetensors"
                convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, out_file, tag=f"stage{stage}")
                result["fp32_file"] = out_file
            engine2.destroy()
        out[stage] = result
        engine.destroy()
    return out


def _check(world: int, ep_size: int, stages, tmp_path=None, data_before_expert: bool = False):
    refs = {stage: _reference(world, stage) for stage in stages}
    results = run_distributed(_train, world_size=world,
                              args=(ep_size, stages, str(tmp_path) if tmp_path is not None else None,
                                    data_before_expert), timeout_s=300)
    edp = world // ep_size
    for rank, res in enumerate(results):
        if data_before_expert:  # D + E: EDP groups of consecutive ranks, EP groups strided by world / ep_size
            assert res["layout"] == {"ep_rank": rank // edp, "ep_ranks": list(range(rank % edp, world, edp)),
                                     "edp_ranks": list(range(rank - rank % edp, rank - rank % edp + edp)),
                                     "edp_world": edp}
        else:  # DeepSpeed's default (E + D): EP groups of consecutive ranks, EDP groups strided by ep_size
            assert res["layout"] == {"ep_rank": rank % ep_size,
                                     "ep_ranks": list(range(rank - rank % ep_size, rank - rank % ep_size + ep_size)),
                                     "edp_ranks": list(range(rank % ep_size, world, ep_size)),
                                     "edp_world": edp}
        for stage in stages:
            c, got = _case(stage), res[stage]
            ref_losses, ref_norms, ref_params = refs[stage]
            # fp32 runs: to rounding. 16-bit ones compute the model in fp16 / bf16 against the fp32 reference: to
            # their precision (bf16: 8 bits of mantissa), through 3 Adam steps
            rtol, atol = ((1e-5, 1e-6) if not (c["fp16"] or c["bf16"]) else (2e-3, 2e-3) if c["fp16"] else
                          (2e-2, 2e-2))
            assert got["held"] == E // ep_size, "each rank holds num_experts / ep_size experts"
            assert got["losses"] == pytest.approx(ref_losses, rel=rtol), f"rank {rank} stage {stage}"
            stepped = [s for s in range(STEPS) if not (c["fp16"] and s == INF_STEP)]
            assert [got["norms"][s] for s in stepped] == pytest.approx([ref_norms[s] for s in stepped], rel=rtol), \
                f"rank {rank} stage {stage}"
            assert ref_norms[0] > CLIP  # clipping is active: the norm decides the update
            for n, p in got["params"].items():
                torch.testing.assert_close(p, ref_params[n], rtol=rtol, atol=atol, msg=f"rank {rank} stage {stage} {n}")
            if c["fp16"]:
                # rank 1's expert overflow skips the step on every rank: the norm all-reduce sees every expert
                assert got["skipped"] == [0, 1, 1] and got["scales"] == [256.0, 128.0, 128.0], (rank, stage, got)
                assert not torch.isfinite(torch.tensor(got["norms"][INF_STEP]))
            if c["client"]:  # the client's one group stays one; its StepLR drives experts and dense alike
                assert got["param_groups"] == (1, 1)
                assert got["lrs"] == pytest.approx([LR * GAMMA ** (s + 1) for s in range(STEPS)])
            if got.get("full") is not None:
                assert rank == 0 and set(got["full"]) == set(ref_params)
                for n, p in got["full"].items():
                    torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6, msg=f"consolidated {n}")
            if "checkpoint" in got:
                same_state, same_weights, same_next, numel = got["checkpoint"]
                assert same_state and same_weights and same_next and numel > 0, (rank, stage, got["checkpoint"])
    # every global expert is held by exactly the ranks of its EP rank
    names = {n for res in results for n in res[stages[0]]["params"]}
    assert names == set(ref_params)
    for stage in [s for s in stages if "fp32" in results[0][s]]:
        # the offline converter: the fp32 masters (as each expert's holders gathered them) bit for bit, every expert
        # under its global index; the file it writes holds the same bytes
        masters = {n: p for res in results for n, p in res[stage]["params"].items()}
        fp32 = results[0][stage]["fp32"]
        assert set(fp32) == set(ref_params), (stage, sorted(set(fp32) ^ set(ref_params)))
        written = load_file(results[0][stage]["fp32_file"])
        for n, p in fp32.items():
            assert p.dtype == torch.float32 and torch.equal(p, masters[n]), (stage, n)
            assert torch.equal(written[n], p), (stage, n)


def test_world2_ep2_stages_0_1_2_with_checkpoints(tmp_path):
    _check(2, 2, (0, 1, 2, "0+client", "2+fp16"), tmp_path)


def test_world4_ep2_stages_0_1_2(tmp_path):
    _check(4, 2, (0, 1, 2, "0+client", "1+fp16", "2+gas2"), tmp_path)


def test_world4_ep2_use_data_before_expert_parallelism(tmp_path):
    """DeepSpeed 0.19.8 honours the config key (engine: set_deepspeed_parallelism(use_data_before_expert_parallel_))
    with the D + E layout: ranks 0, 1 hold experts 0-1 and ranks 2, 3 experts 2-3 (E + D: ranks 0, 2 and 1, 3)."""
    _check(4, 2, (2,), tmp_path, data_before_expert=True)


def test_world4_ep4_stages_0_2(tmp_path):
    _check(4, 4, (0, 2), tmp_path)


def test_world2_ep2_offload_bf16_and_accumulation(tmp_path):
    _check(2, 2, ("2+offload", "2+bf16", "1+gas2"), tmp_path)


def _refusals():
    import deepspeed

    errors = {}
    for key, ep_size, stage in (("world", 4, 2), ("stage3", 2, 3), ("mixed1", 2, 1), ("mixed2", 2, 2)):
        torch.manual_seed(0)
        model = Net(ep_size) if ep_size <= E else None
        config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": stage}}
        try:
            if key.startswith("mixed"):  # a client optimizer whose one group mixes experts with dense parameters
                deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=config)
            else:
                deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
                    **config, "optimizer": {"type": "Adam", "params": {"lr": LR}}})
            errors[key] = None
        except Exception as exc:  # noqa: BLE001 -- the message is what is checked
            errors[key] = f"{type(exc).__name__}: {exc}"
    return errors


def test_bad_ep_size_and_stage3_are_refused_by_name():
    with pytest.raises(ValueError, match=r"num_experts=4 .*ep_size=3"):
        MoE(H, _expert(), num_experts=4, ep_size=3)
    errors = run_distributed(_refusals, world_size=2, timeout_s=120)[0]
    assert "ep_size=4 does not divide the world size 2" in errors["world"]
    assert "zero_optimization.stage" in errors["stage3"] and "MoE(ep_size=2)" in errors["stage3"]
    # DeepSpeed 0.19.8 refuses these too (stage 1 and 2: "AssertionError: The model has moe layers, but None of the
    # param groups are marked as MoE"); its stage 0 trains them, as hf_zero's does (the "0+client" runs above)
    for key, stage in (("mixed1", 1), ("mixed2", 2)):
        assert "split_params_into_different_moe_groups_for_optimizer" in errors[key], errors[key]
        assert f"zero_optimization.stage {stage}" in errors[key], errors[key]


def test_saved_pieces_names_and_files():
    """The one statement of where expert-parallel pieces are (hf_zero/zero/saved_pieces.py): the prefixes it names
    parse back, nothing else does, and each key's pieces are in the files meta.json names."""
    from hf_zero.zero.layout import ShardLayout
    from hf_zero.zero.saved_pieces import SavedPieces, group_prefix, parse_group_prefix

    assert (group_prefix(3), group_prefix(3, 1)) == ("group3.", "group3.ep1.")
    assert [parse_group_prefix(p) for p in ("group3.", "group12.ep10.")] == [(3, None), (12, 10)]
    assert all(parse_group_prefix(p) is None for p in ("group3.ep1.master", "group.", "group+3.", "group3.ep01.",
                                                       "group3.x.", "xgroup3.", "group3.."))
    pieces = SavedPieces.of({"shard_world_size": 2, "groups": [{"names": ["w"], "numels": [5]},
                                                              {"expert": {"piece_ranks": [[0, 2], [1, 3]]}}]})
    assert pieces.all_ranks() == [0, 1, 2, 3]
    assert (pieces.prefix(0, 1), pieces.prefix(1, 1)) == ("group0.", "group1.ep1.")
    assert pieces.ranks("group1.ep1.master") == (1, 3) and pieces.ranks("group0.master") == (0, 1)
    assert pieces.file_of("group1.ep1.state.exp_avg", 1) == 3 and pieces.file_of("group0.master", 5) == 5
    assert pieces.layout("group1.ep0.master", (5,)) == ShardLayout((5,), 2)
    assert [pieces.missing(p) for p in ("group1.ep1.", "group1.ep2.", "group0.")] == [False, True, False]
