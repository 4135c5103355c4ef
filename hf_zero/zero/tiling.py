"""``TiledLinear`` / ``TiledLinearReturnBias`` (``deepspeed.zero``): one linear layer built as a grid of smaller ones.

Why tile: under ZeRO-3 every tile is its own module with its own parameters, so the forward gathers one tile's
weight at a time instead of the whole matrix, and a layer too large to gather at once still runs. Out of ZeRO-3 a
tiled layer computes what ``nn.Linear`` does, only in pieces.

The grid matches DeepSpeed's, tile for tile, so a seeded script initialises the same values and a state dict keyed
``linears.<row>.<col>.weight`` moves between the two: row ``r`` covers output features
``out_parts[r]:out_parts[r+1]``, column ``c`` input features ``in_parts[c]:in_parts[c+1]``; the boundaries come from
:func:`tile_boundaries` (the first ``features % splits`` tiles one feature wider); tiles are built row by row; only
the last column of each row carries a bias, so it is added once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .gathered import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias", "tile_boundaries", "split_tensor_along_last_dim"]


def tile_boundaries(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``[0, ..., num_items]`` of ``num_parts`` contiguous parts whose sizes differ by at most one, the
    larger ones first (DeepSpeed's ``partition_uniform``, which fixes the tile shapes). With no more items than
    parts, the first ``num_items`` parts hold one item each and the rest are empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: Sequence[int] | int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """``torch.split`` along the last dimension (``partitions``: the sizes, or one chunk size); the chunks are views
    unless ``contiguous_split_chunks``."""
    chunks = torch.split(tensor, partitions, dim=tensor.dim() - 1)
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks


def _check_splits(name: str, splits: int, features_name: str, features: int) -> None:
    if isinstance(splits, bool) or not isinstance(splits, int):
        raise TypeError(f"TiledLinear: {name} must be an int, got {splits!r}")
    # RuntimeError, as DeepSpeed raises here: a script catching it keeps working
    if not 1 <= splits <= features:
        raise RuntimeError(f"TiledLinear: {name}={splits} must be in [1, {features_name}={features}]: every tile "
                           f"needs at least one feature")


class TiledLinear(nn.Module):
    """A drop-in ``nn.Linear(in_features, out_features, bias)`` made of ``out_splits x in_splits`` tiles.

    :param in_splits: tiles along the input features (1 <= in_splits <= in_features).
    :param out_splits: tiles along the output features (1 <= out_splits <= out_features).
    :param input_is_already_split: ``forward`` receives a sequence of ``in_splits`` pieces of the input, cut at
        ``in_parts`` (ignored when ``in_splits == 1``: the input is then passed whole).
    :param combine_out_splits: False returns the ``out_splits`` output pieces as a list instead of concatenating
        them along the last dimension.
    :param linear_cls: builds each tile as ``linear_cls(tile_in, tile_out, bias=..., **kwargs)``.
    :param init_linear: a linear layer (``weight`` of shape ``(out_features, in_features)``, ``bias`` or None)
        whose values are copied into the tiles at construction (:meth:`copy_params_from`).

    Subclasses change how pieces are cut, summed and joined through ``_split_global_input``,
    ``_reduce_local_output`` and ``_combine_output_splits`` (DeepSpeed's extension points, same arguments).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: Callable[..., nn.Module] = nn.Linear, init_linear: nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        _check_splits("in_splits", in_splits, "in_features", in_features)
        _check_splits("out_splits", out_splits, "out_features", out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = tile_boundaries(in_features, in_splits)
        self.out_parts = tile_boundaries(out_features, out_splits)

        # Built row by row, as DeepSpeed does: the order fixes which random numbers each tile's init draws, and
        # under zero.Init each tile is partitioned as it is appended, so at most one full tile exists at a time.
        self.linears = nn.ModuleList()
        for row in range(out_splits):
            tiles = nn.ModuleList()
            self.linears.append(tiles)
            rows = self.out_parts[row + 1] - self.out_parts[row]
            for col in range(in_splits):
                cols = self.in_parts[col + 1] - self.in_parts[col]
                last = col == in_splits - 1
                tiles.append(linear_cls(cols, rows, bias=bias if last else False, **kwargs))

        if init_linear is not None:
            self.copy_params_from(init_linear)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"in_splits={self.in_splits}, out_splits={self.out_splits}")

    def forward(self, input_: Any) -> Any:
        inputs = self._input_pieces(input_)
        outputs = []
        for row in range(self.out_splits):
            reduced = None
            for col in range(self.in_splits):
                reduced = self._reduce_local_output(in_id=col, out_id=row, current_out=reduced,
                                                    new_out=self.linears[row][col](inputs[col]))
            outputs.append(reduced)
        if self.combine_out_splits:
            return self._combine_output_splits(outputs)
        return outputs

    def _input_pieces(self, input_: Any) -> Sequence[Any]:
        if self.in_splits == 1:
            return [input_]
        if self.input_is_already_split:
            pieces = list(input_)
            if len(pieces) != self.in_splits:
                raise ValueError(f"TiledLinear(in_splits={self.in_splits}, input_is_already_split=True) got "
                                 f"{len(pieces)} input pieces")
            return pieces
        if isinstance(input_, torch.Tensor) and input_.shape[-1] != self.in_features:
            raise ValueError(f"TiledLinear(in_features={self.in_features}) got an input whose last dimension is "
                             f"{input_.shape[-1]}")
        sizes = [self.in_parts[c + 1] - self.in_parts[c] for c in range(self.in_splits)]
        return self._split_global_input(input_, sizes)

    def _split_global_input(self, input: Any, split_sizes: list[int]) -> Sequence[Any]:  # noqa: A002 (DeepSpeed's)
        """Cut the whole input into the ``in_splits`` pieces the tile columns take (views of ``input``)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Add tile ``(out_id, in_id)``'s result to the sum over the row's earlier columns (None at column 0).

        Out of place, so autograd keeps every tile's result as it was produced."""
        if current_out is None:
            return new_out
        return current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """Join the rows' results into the full output along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy ``other.weight`` (``(out_features, in_features)``) and ``other.bias`` into the tiles.

        Under ZeRO-3 this is collective: each tile is gathered with ``GatheredParameters(modifier_rank=0)``, so
        rank 0's values of ``other`` become every rank's shards. ``other`` may itself be partitioned (built under
        ``zero.Init``): it is gathered whole, read-only, for the copy.
        """
        weight = getattr(other, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"TiledLinear.copy_params_from: {type(other).__name__} has no weight tensor")
        bias = getattr(other, "bias", None)
        with GatheredParameters([weight] if bias is None else [weight, bias]):
            if tuple(weight.shape) != (self.out_features, self.in_features):
                raise ValueError(f"TiledLinear.copy_params_from: weight of shape {tuple(weight.shape)}, expected "
                                 f"(out_features, in_features) = ({self.out_features}, {self.in_features})")
            if self.use_bias and bias is None:
                raise ValueError("TiledLinear.copy_params_from: this layer has a bias (bias=True) and "
                                 f"{type(other).__name__} has none")
            if not self.use_bias and bias is not None:
                raise ValueError(f"TiledLinear.copy_params_from: {type(other).__name__} has a bias and this layer "
                                 "was built with bias=False")
            if bias is not None and tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"TiledLinear.copy_params_from: bias of shape {tuple(bias.shape)}, expected "
                                 f"({self.out_features},)")
            for row in range(self.out_splits):
                r0, r1 = self.out_parts[row], self.out_parts[row + 1]
                for col in range(self.in_splits):
                    c0, c1 = self.in_parts[col], self.in_parts[col + 1]
                    tile = self.linears[row][col]
                    # the bias goes to the row's last tile only (the one built with it), as it is added once
                    tile_bias = tile.bias if bias is not None and col == self.in_splits - 1 else None
                    # one tile gathered at a time: the peak stays one tile above the shards
                    with GatheredParameters([tile.weight] if tile_bias is None else [tile.weight, tile_bias],
                                            modifier_rank=0):
                        tile.weight.copy_(weight[r0:r1, c0:c1])
                        if tile_bias is not None:
                            tile_bias.copy_(bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """A ``TiledLinear`` of tiles that return ``(output, bias)`` and leave adding the bias to the caller (Megatron's
    ``skip_bias_add`` linears, given as ``linear_cls``). The forward returns ``(output, bias)``: the tiles' outputs
    summed and joined as in ``TiledLinear``, and the rows' biases joined the same way (None when no tile returned
    one). With ``combine_out_splits=False``, a list of one ``(output, bias)`` pair per row."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise TypeError(f"TiledLinearReturnBias: tile ({out_id}, {in_id}) returned {type(new_out).__name__}; "
                            f"its linear_cls must return an (output, bias) pair")
        old_out, old_bias = (None, None) if current_out is None else current_out
        out, bias = new_out
        out = super()._reduce_local_output(in_id=in_id, out_id=out_id, current_out=old_out, new_out=out)
        return out, old_bias if bias is None else bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        out = super()._combine_output_splits([o for o, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return out, super()._combine_output_splits(biases) if biases else None
