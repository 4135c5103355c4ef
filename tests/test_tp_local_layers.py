"""The local-compute TP layers (hf_zero/tensor_parallel/layers.py, regions.py): how many all-reduces one training
step issues, and what the parameters' gradients look like. Numerical parity with one process is test_tp_parity.py's.

Tiny Llama (2 layers), TP 2, no sequence parallelism. Per step the layers issue:
  forward   1 (vocabulary-parallel embedding) + 2 per layer (o_proj, down_proj)        = 5
  backward  2 per layer (attention input shared by q/k/v, MLP input shared by gate/up) + 1 (LM head input) = 5
One per projection instead (q, k, v, gate, up separately) would make the backward 11.
"""

from __future__ import annotations

from _tp_spawns import case, register
from _tp_util import make_model, token_data

LAYERS = 2  # _tp_util.make_model("llama")


def _count_worker():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hf_zero.tensor_parallel import apply_tp, build_mesh, regions

    model = apply_tp(make_model("llama"), build_mesh(dist.get_world_size()).tp_mesh)
    calls = []
    issue = regions._all_reduce

    def counted(t, group, what):
        calls.append(what)
        return issue(t, group, what)

    regions._all_reduce = counted
    try:
        ids = token_data(1)[0]
        out = model(input_ids=ids)
        forward = len(calls)
        logits = out.logits.to_local()
        logits.float().square().mean().backward()  # a loss without collectives of its own
        backward = len(calls) - forward
    finally:
        regions._all_reduce = issue
    grads = {n: (type(p.grad).__name__, p.grad.placements == p.placements if isinstance(p, DTensor) else None,
                 tuple(p.grad.shape) == tuple(p.shape))
             for n, p in model.named_parameters()}
    return {"forward": forward, "backward": backward, "grads": grads}


register(2, "local_layers", _count_worker)


def test_all_reduces_per_step_and_gradient_layouts():
    for rank, out in enumerate(case(2, "local_layers")):
        assert out["forward"] == 1 + 2 * LAYERS, (rank, out["forward"])
        assert out["backward"] == 2 * LAYERS + 1, (rank, out["backward"])
        for name, (kind, same_placement, same_shape) in out["grads"].items():
            assert same_shape, (rank, name)
            if same_placement is not None:  # a DTensor parameter: its gradient is laid out like it
                assert kind == "DTensor" and same_placement, (rank, name, kind)
