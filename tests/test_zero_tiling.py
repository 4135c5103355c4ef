"""``deepspeed.zero.TiledLinear`` / ``TiledLinearReturnBias`` (hf_zero/zero/tiling.py): the tiles DeepSpeed 0.19.8
builds (tests/data/tiling/deepspeed_tiling.json, written by make_fixture.py beside it with real DeepSpeed), outputs
and gradients equal to ``nn.Linear``'s, and ZeRO-3 on 2 ranks: partitioned tiles train to a plain Linear's losses
and ``copy_params_from`` writes into them."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hf_zero
from hf_zero.testing import run_distributed
from hf_zero.zero import GatheredParameters, TiledLinear, TiledLinearReturnBias
from hf_zero.zero.tiling import tile_boundaries

from _shim_util import ds as _ds
from _tiling_fixture import BiasSkippingLinear, inputs, weights

FIXTURE = json.loads((Path(__file__).parent / "data" / "tiling" / "deepspeed_tiling.json").read_text())


def _tile_shapes(module: TiledLinear) -> list:
    return [[[list(t.weight.shape), None if t.bias is None else list(t.bias.shape)] for t in row]
            for row in module.linears]


def _assembled(module: TiledLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full weight (and bias) the tiles make up."""
    weight = torch.cat([torch.cat([t.weight for t in row], dim=1) for row in module.linears], dim=0)
    biases = [row[-1].bias for row in module.linears]
    return weight, None if biases[0] is None else torch.cat(biases)


# ---------------------------------------------------------------- what DeepSpeed builds


def test_fixture_is_deepspeeds():
    assert FIXTURE["deepspeed_version"] == "0.19.8"


def test_constructor_signature_and_defaults_are_deepspeeds():
    ours = [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
            for p in inspect.signature(TiledLinear.__init__).parameters.values()]
    assert ours == FIXTURE["signature"]


def test_tile_boundaries_are_deepspeeds_partition_uniform():
    assert len(FIXTURE["boundaries"]) == 13 * 13
    for n, k, expected in FIXTURE["boundaries"]:
        assert tile_boundaries(n, k) == expected, (n, k)


def _case_id(case: dict) -> str:
    return f"{case['in_features']}x{case['out_features']}-" + "-".join(f"{k}={v}" for k, v in case["kwargs"].items())


@pytest.mark.parametrize("case", FIXTURE["shapes"], ids=_case_id)
def test_tiles_are_deepspeeds(case):
    m = TiledLinear(case["in_features"], case["out_features"], **case["kwargs"])
    assert (m.in_parts, m.out_parts) == (case["in_parts"], case["out_parts"])
    assert _tile_shapes(m) == case["tiles"]
    # the parameter names a state dict carries are DeepSpeed's too: linears.<row>.<col>.weight / .bias
    names = [f"linears.{r}.{c}.{kind}" for r, row in enumerate(case["tiles"]) for c, (_, bias) in enumerate(row)
             for kind in (("weight",) if bias is None else ("weight", "bias"))]
    assert [name for name, _ in m.named_parameters()] == names


@pytest.mark.parametrize("case", FIXTURE["errors"], ids=_case_id)
def test_bad_splits_raise_deepspeeds_exception_naming_the_argument(case):
    assert case["exception"] == "RuntimeError"
    (name, value), = case["kwargs"].items()
    features = "in_features=10" if name == "in_splits" else "out_features=7"
    with pytest.raises(RuntimeError, match=rf"{name}={value} must be in \[1, {features}\]"):
        TiledLinear(case["in_features"], case["out_features"], **case["kwargs"])


def test_non_integer_splits_are_refused_by_name():
    with pytest.raises(TypeError, match=r"in_splits must be an int, got 2\.0"):
        TiledLinear(10, 7, in_splits=2.0)
    with pytest.raises(TypeError, match=r"out_splits must be an int, got True"):
        TiledLinear(10, 7, out_splits=True)


@pytest.mark.parametrize("case", FIXTURE["forward"], ids=lambda c: c["class"] + "-" + "-".join(
    f"{k}={v}" for k, v in c["kwargs"].items()))
def test_forward_results_are_deepspeeds(case):
    kw = dict(case["kwargs"])
    if kw.get("linear_cls") == "BiasSkippingLinear":
        kw["linear_cls"] = BiasSkippingLinear
    cls = {"TiledLinear": TiledLinear, "TiledLinearReturnBias": TiledLinearReturnBias}[case["class"]]
    in_f, out_f = case["in_features"], case["out_features"]
    m = cls(in_f, out_f, init_linear=weights(in_f, out_f, kw.get("bias", True)), **kw)
    x = inputs(in_f)
    if kw.get("input_is_already_split"):
        x = [x[..., m.in_parts[i]:m.in_parts[i + 1]] for i in range(m.in_splits)]
    with torch.no_grad():
        result = m(x)

    def check(ours, theirs):
        if theirs is None:
            assert ours is None
        elif isinstance(ours, torch.Tensor):
            torch.testing.assert_close(ours, torch.tensor(theirs), rtol=1e-6, atol=1e-6)
        else:
            assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs)
            for o, t in zip(ours, theirs):
                check(o, t)

    check(result, case["result"])


def test_tiles_draw_their_initial_values_row_by_row():
    """Built in DeepSpeed's order, a seeded script starts from the values DeepSpeed's TiledLinear would give."""
    torch.manual_seed(3)
    m = TiledLinear(10, 7, in_splits=3, out_splits=2)
    torch.manual_seed(3)
    expected = [nn.Linear(i, o, bias=c == 2) for o in (4, 3) for c, i in enumerate((4, 3, 3))]
    for tile, ref in zip([t for row in m.linears for t in row], expected):
        torch.testing.assert_close(tile.weight, ref.weight, rtol=0, atol=0)
        if ref.bias is not None:
            torch.testing.assert_close(tile.bias, ref.bias, rtol=0, atol=0)


# ---------------------------------------------------------------- a Linear, in pieces

SPLITS = [  # in_features, out_features, in_splits, out_splits, bias
    (10, 7, 1, 1, True),
    (10, 7, 3, 4, True),     # uneven both ways
    (10, 7, 10, 7, False),   # one feature per tile
    (16, 12, 4, 3, True),    # even
    (13, 5, 4, 1, False),
    (9, 11, 1, 5, True),
]


@pytest.mark.parametrize("in_f,out_f,in_splits,out_splits,bias", SPLITS)
def test_forward_and_gradients_equal_linear(in_f, out_f, in_splits, out_splits, bias):
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f, bias=bias)
    m = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits)
    m.copy_params_from(ref)
    w, b = _assembled(m)
    torch.testing.assert_close(w, ref.weight, rtol=0, atol=0)
    assert (b is None) == (not bias) and (b is None or torch.equal(b, ref.bias))

    x = torch.randn(3, 4, in_f)
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x_ref), m(x_tiled)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    grad_out = torch.randn_like(y_ref)
    y_ref.backward(grad_out)
    y.backward(grad_out)
    torch.testing.assert_close(x_tiled.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for r, row in enumerate(m.linears):
        r0, r1 = m.out_parts[r], m.out_parts[r + 1]
        for c, tile in enumerate(row):
            c0, c1 = m.in_parts[c], m.in_parts[c + 1]
            torch.testing.assert_close(tile.weight.grad, ref.weight.grad[r0:r1, c0:c1], rtol=1e-5, atol=1e-6)
            if c == in_splits - 1 and bias:
                torch.testing.assert_close(tile.bias.grad, ref.bias.grad[r0:r1], rtol=1e-5, atol=1e-6)
            else:
                assert tile.bias is None


def test_init_linear_copies_at_construction_and_kwargs_reach_the_tiles():
    torch.manual_seed(1)
    ref = nn.Linear(12, 6, dtype=torch.float64)
    m = TiledLinear(12, 6, in_splits=5, out_splits=4, init_linear=ref, dtype=torch.float64)
    assert {p.dtype for p in m.parameters()} == {torch.float64}
    w, b = _assembled(m)
    assert torch.equal(w, ref.weight) and torch.equal(b, ref.bias)
    x = torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(m(x), ref(x), rtol=1e-12, atol=1e-12)


def test_input_already_split_and_output_left_split():
    torch.manual_seed(2)
    ref = nn.Linear(10, 7)
    m = TiledLinear(10, 7, in_splits=3, out_splits=2, input_is_already_split=True, combine_out_splits=False,
                    init_linear=ref)
    x = torch.randn(4, 10)
    pieces = [x[:, 0:4], x[:, 4:7], x[:, 7:10]]  # DeepSpeed's in_parts [0, 4, 7, 10]
    outs = m(pieces)
    assert isinstance(outs, list) and [o.shape[-1] for o in outs] == [4, 3]
    torch.testing.assert_close(torch.cat(outs, dim=-1), ref(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"in_splits=3, input_is_already_split=True\) got 2 input pieces"):
        m(pieces[:2])
    # one column: the input is passed whole even when it is said to be split, as DeepSpeed does
    one = TiledLinear(10, 7, input_is_already_split=True, init_linear=ref)
    torch.testing.assert_close(one(x), ref(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"in_features=10\) got an input whose last dimension is 9"):
        TiledLinear(10, 7, in_splits=2)(torch.randn(2, 9))


@pytest.mark.parametrize("combine", [True, False])
def test_return_bias_returns_the_unadded_bias(combine):
    torch.manual_seed(4)
    ref = nn.Linear(10, 7)
    m = TiledLinearReturnBias(10, 7, in_splits=3, out_splits=3, linear_cls=BiasSkippingLinear,
                              combine_out_splits=combine, init_linear=ref)
    x = torch.randn(2, 5, 10, requires_grad=True)
    result = m(x)
    if combine:
        out, bias = result
    else:
        assert isinstance(result, list) and len(result) == 3
        out, bias = torch.cat([o for o, _ in result], -1), torch.cat([b for _, b in result])
    torch.testing.assert_close(out, F.linear(x, ref.weight), rtol=1e-5, atol=1e-6)
    assert torch.equal(bias, ref.bias)
    (out.sum() + bias.sum()).backward()
    torch.testing.assert_close(x.grad, ref.weight.sum(0).expand(2, 5, 10), rtol=1e-5, atol=1e-6)
    assert torch.equal(m.linears[1][2].bias.grad, torch.ones(2))  # row 1 holds output features [3, 5)
    # without a bias no tile returns one, and the layer returns None for it
    nb = TiledLinearReturnBias(10, 7, bias=False, in_splits=2, out_splits=2, linear_cls=BiasSkippingLinear)
    assert nb(torch.randn(3, 10))[1] is None
    with pytest.raises(TypeError, match=r"tile \(0, 0\) returned Tensor; its linear_cls must return an "
                                        r"\(output, bias\) pair"):
        TiledLinearReturnBias(10, 7, in_splits=2)(torch.randn(3, 10))


def test_copy_params_from_refuses_a_mismatched_layer():
    m = TiledLinear(10, 7, in_splits=2)
    with pytest.raises(ValueError, match=r"weight of shape \(7, 9\), expected \(out_features, in_features\) = "
                                         r"\(7, 10\)"):
        m.copy_params_from(nn.Linear(9, 7))
    with pytest.raises(ValueError, match="has a bias .bias=True. and Linear has none"):
        m.copy_params_from(nn.Linear(10, 7, bias=False))
    with pytest.raises(ValueError, match="Linear has a bias and this layer was built with bias=False"):
        TiledLinear(10, 7, bias=False).copy_params_from(nn.Linear(10, 7))
    with pytest.raises(ValueError, match="Identity has no weight tensor"):
        m.copy_params_from(nn.Identity())


def test_deepspeed_names_are_hf_zeros():
    import hf_zero.zero.tiling as tiling

    zero = _ds("deepspeed.runtime.zero")
    assert zero.TiledLinear is TiledLinear and zero.TiledLinearReturnBias is TiledLinearReturnBias
    assert _ds("deepspeed").zero.TiledLinear is TiledLinear
    mod = _ds("deepspeed.runtime.zero.tiling")
    assert (mod.TiledLinear, mod.TiledLinearReturnBias) == (TiledLinear, TiledLinearReturnBias)
    chunks = mod.split_tensor_along_last_dim(torch.arange(10.0).reshape(2, 5), [3, 2])
    assert [c.tolist() for c in chunks] == [[[0, 1, 2], [5, 6, 7]], [[3, 4], [8, 9]]]
    assert mod.split_tensor_along_last_dim is tiling.split_tensor_along_last_dim
    assert all(c.is_contiguous() for c in mod.split_tensor_along_last_dim(torch.ones(2, 5), 2, True))


# ---------------------------------------------------------------- ZeRO-3, 2 ranks

STEPS = 4


class Net(nn.Module):
    def __init__(self, tiled: bool):
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.proj = TiledLinear(12, 10, in_splits=3, out_splits=2) if tiled else nn.Linear(12, 10)
        self.out = nn.Linear(10, 3)

    def forward(self, x):
        return self.out(torch.relu(self.proj(torch.relu(self.inp(x)))))


def _config() -> dict:
    # persistence threshold 0: every tile is partitioned and gathered by the forward hooks
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "steps_per_print": 1000, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _train(tiled: bool) -> tuple[list[float], torch.Tensor]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = Net(tiled=False)
    if tiled:
        model = Net(tiled=True)
        model.inp.load_state_dict(plain.inp.state_dict())
        model.out.load_state_dict(plain.out.state_dict())
        model.proj.copy_params_from(plain.proj)
    else:
        model = plain
    engine, *_ = hf_zero.initialize(model=model, config=_config())
    if tiled:
        assert all(p.numel() == 0 for p in engine.module.proj.parameters())  # partitioned between steps
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 2, 5, 6, generator=g), torch.randn(2, 2, 5, 3, generator=g)  # one batch: loss must fall
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(engine(x[rank]), y[rank])
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / 2)
    proj = engine.module.proj
    with GatheredParameters(list(proj.parameters())):
        if tiled:
            w, b = _assembled(proj)
            final = torch.cat([w, b[:, None]], dim=1).detach().clone()
        else:
            final = torch.cat([proj.weight, proj.bias[:, None]], dim=1).detach().clone()
    engine.destroy()
    return losses, final


def _train_both():
    return _train(tiled=False), _train(tiled=True)


def test_zero3_tiled_linear_trains_like_linear():
    for (plain_losses, plain_w), (tiled_losses, tiled_w) in run_distributed(_train_both, 2, timeout_s=200):
        assert len(tiled_losses) == STEPS and tiled_losses[-1] < tiled_losses[0]
        torch.testing.assert_close(torch.tensor(tiled_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(tiled_w, plain_w, rtol=1e-5, atol=1e-6)


def _copy_into_partitioned():
    from hf_zero.zero import Init
    from hf_zero.zero.stage3.param import ZeroParamStatus

    rank = dist.get_rank()
    torch.manual_seed(10 + rank)  # every rank's source differs: rank 0's must win
    src = nn.Linear(12, 10)
    rank0 = [src.weight.detach().clone(), src.bias.detach().clone()]
    dist.broadcast_object_list(rank0, src=0)
    out = {}
    with Init(config_dict_or_path=_config()):
        m = TiledLinear(12, 10, in_splits=3, out_splits=2)
        built_with = TiledLinear(12, 10, in_splits=3, out_splits=2, init_linear=src)
        src_partitioned = nn.Linear(12, 10)
    tiles = list(m.parameters())
    out["partitioned"] = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in tiles)
    out["shapes"] = [list(p.ds_shape) for p in tiles]
    m.copy_params_from(src)
    with GatheredParameters(tiles + list(built_with.parameters())):
        out["copied"] = [t.detach().clone() for t in _assembled(m)]
        out["init_linear"] = [t.detach().clone() for t in _assembled(built_with)]
    out["repartitioned"] = all(p.numel() == 0 for p in tiles)

    # a partitioned source (built under zero.Init too) is gathered for the copy
    with GatheredParameters(list(src_partitioned.parameters()), modifier_rank=0):
        if rank == 0:
            src_partitioned.weight.detach().fill_(0.5)
            src_partitioned.bias.detach().copy_(torch.arange(10.0))
    m.copy_params_from(src_partitioned)
    with GatheredParameters(tiles):
        out["from_partitioned"] = [t.detach().clone() for t in _assembled(m)]
    out["rank0"] = rank0
    return out


def test_zero3_copy_params_from_writes_partitioned_tiles():
    for out in run_distributed(_copy_into_partitioned, 2, timeout_s=120):
        assert out["partitioned"] and out["repartitioned"]
        assert out["shapes"] == [[5, 4], [5, 4], [5, 4], [5], [5, 4], [5, 4], [5, 4], [5]]
        weight, bias = out["rank0"]
        for got in (out["copied"], out["init_linear"]):
            assert torch.equal(got[0], weight) and torch.equal(got[1], bias)
        w, b = out["from_partitioned"]
        assert torch.equal(w, torch.full((10, 12), 0.5)) and torch.equal(b, torch.arange(10.0))
