"""Redistribute to, from and between RaggedShards (one collective per changed mesh axis)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed.tensor._redistribute as dtensor_redistribute
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from raggedfsdp.tensor._dtensor_ext.checks import _check, _is_ragged, ragged_axis
from raggedfsdp.tensor.collectives import all_gather_single, reduce_scatter_single
from raggedfsdp.tensor.placement import RaggedShard

_orig_redistribute_local_tensor = dtensor_redistribute.redistribute_local_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _element_ranges(placement, shape: Sequence[int], world: int) -> list[tuple[int, int]]:
    """Per rank, the ``[start, end)`` elements of the row-major tensor it holds."""
    if isinstance(placement, RaggedShard):
        row = placement.row_numel(shape)
        row_ranges = (placement.local_row_range(shape, r) for r in range(world))
        return [(start * row, end * row) for start, end in row_ranges]
    if isinstance(placement, Shard) and placement.dim == 0:
        row = math.prod(shape[1:])
        ranges = []
        for r in range(world):
            size, offset = Shard.local_shard_size_and_offset(shape[0], world, r)
            ranges.append((offset * row, (offset + size) * row))
        return ranges
    raise NotImplementedError(
        f"redistribute between RaggedShard and {placement} is not supported; "
        "go through Replicate() or Shard(0)"
    )


def _all_to_all(local, src_ranges, dst_ranges, group, rank, dst_shape) -> torch.Tensor:
    """Move rows from one contiguous-per-rank layout to another with one all-to-all."""

    def overlap(a, b):
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    world = len(src_ranges)
    send = [overlap(src_ranges[rank], dst_ranges[q]) for q in range(world)]
    recv = [overlap(src_ranges[q], dst_ranges[rank]) for q in range(world)]
    out = local.new_empty(sum(recv))
    dist.all_to_all_single(out, local.contiguous().view(-1), recv, send, group=group)
    return out.view(dst_shape)


def _gather_ragged(local, ranges, group, full_shape) -> torch.Tensor:
    """RaggedShard -> Replicate: one all-gather of equal, padded pieces."""
    world = len(ranges)
    width = max(end - start for start, end in ranges)
    piece = local.new_zeros(width)
    piece[: local.numel()].copy_(local.reshape(-1))
    gathered = local.new_empty(world * width)
    all_gather_single(gathered, piece, group=group)
    full = local.new_empty(math.prod(full_shape))
    for r, (start, end) in enumerate(ranges):
        full[start:end].copy_(gathered[r * width : r * width + end - start])
    return full.view(full_shape)


def _reduce_scatter_ragged(local, ranges, group, rank, op, dst_shape) -> torch.Tensor:
    """Partial -> RaggedShard: one reduce-scatter of equal, padded pieces."""
    world = len(ranges)
    width = max(end - start for start, end in ranges)
    flat = local.contiguous().view(-1)
    if all(end - start == width for start, end in ranges):
        padded = flat  # already m equal pieces in rank order: no copy
    else:
        padded = local.new_zeros(world * width)
        for r, (start, end) in enumerate(ranges):
            padded[r * width : r * width + end - start].copy_(flat[start:end])
    out = local.new_empty(width)
    reduce_scatter_single(out, padded, op=op, group=group)
    start, end = ranges[rank]
    return out[: end - start].view(dst_shape)


def _redistribute_local_tensor(
    local_tensor,
    current_spec,
    target_spec,
    *,
    async_op=False,
    use_graph_based_transform=None,
    is_explicit=False,
):
    if not (_is_ragged(current_spec) or _is_ragged(target_spec)):
        return _orig_redistribute_local_tensor(
            local_tensor,
            current_spec,
            target_spec,
            async_op=async_op,
            use_graph_based_transform=use_graph_based_transform,
            is_explicit=is_explicit,
        )
    changed = [
        i for i, (a, b) in enumerate(zip(current_spec.placements, target_spec.placements)) if a != b
    ]
    if not changed:
        return local_tensor
    if len(changed) > 1:  # [Note: composed placements]: the ragged axis on its own
        return _redistribute_in_steps(local_tensor, current_spec, target_spec, async_op=async_op)
    axis = changed[0]
    src, dst = current_spec.placements[axis], target_spec.placements[axis]
    mesh = current_spec.mesh
    ragged = target_spec if isinstance(dst, RaggedShard) else current_spec
    # The rows the RaggedShard cuts: the piece the Shard axes before it leave.
    shape = _check(tuple(ragged.shape), mesh, ragged.placements).shape
    for spec in (current_spec, target_spec):
        if ragged_axis(spec.placements) is not None:
            _check(tuple(spec.shape), mesh, spec.placements)
    if shape != tuple(current_spec.shape) and Shard in (type(src), type(dst)):
        raise NotImplementedError(
            f"redistribute {current_spec.placements} -> {target_spec.placements}: under a Shard "
            "axis, a RaggedShard converts to and from Replicate() (and from Partial) only"
        )
    group, rank, world = mesh.get_group(axis), mesh.get_local_rank(axis), mesh.size(axis)

    if isinstance(dst, RaggedShard):
        dst_shape = dst.local_shape(shape, rank)
        if src.is_replicate():  # a local slice, no communication
            return dst.local_view(local_tensor.contiguous(), rank)
        if src.is_partial():
            if type(src) is not Partial:
                raise NotImplementedError(f"redistribute {src} -> RaggedShard is not supported")
            ranges = _element_ranges(dst, shape, world)
            op = _REDUCE_OPS[src.reduce_op]
            return _reduce_scatter_ragged(local_tensor, ranges, group, rank, op, dst_shape)
        src_ranges = _element_ranges(src, shape, world)
        dst_ranges = _element_ranges(dst, shape, world)
        return _all_to_all(local_tensor, src_ranges, dst_ranges, group, rank, dst_shape)

    # src is the RaggedShard
    if dst.is_replicate():
        return _gather_ragged(local_tensor, _element_ranges(src, shape, world), group, shape)
    if isinstance(dst, Shard) and dst.dim == 0:
        size, _ = Shard.local_shard_size_and_offset(shape[0], world, rank)
        dst_shape = (size, *shape[1:])
        src_ranges = _element_ranges(src, shape, world)
        dst_ranges = _element_ranges(dst, shape, world)
        return _all_to_all(local_tensor, src_ranges, dst_ranges, group, rank, dst_shape)
    raise NotImplementedError(
        f"redistribute RaggedShard -> {dst} is not supported; "
        "RaggedShard converts to Replicate(), Shard(0) and other RaggedShards"
    )


def _redistribute_in_steps(local_tensor, current_spec, target_spec, *, async_op=False):
    """Several mesh axes change: gather the current RaggedShard axis first (to
    Replicate), let torch change the others, then cut the target's RaggedShard axis
    (a local slice). Each step sees one RaggedShard at most on one axis."""

    def respec(spec, placements):
        return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)

    spec = current_spec
    found = ragged_axis(spec.placements)
    if found is not None and spec.placements[found[0]] != target_spec.placements[found[0]]:
        step = respec(
            spec, [Replicate() if i == found[0] else p for i, p in enumerate(spec.placements)]
        )
        local_tensor = _redistribute_local_tensor(local_tensor, spec, step)
        spec = step
    found = ragged_axis(target_spec.placements)
    middle = target_spec
    if found is not None and spec.placements[found[0]] != target_spec.placements[found[0]]:
        middle = respec(
            target_spec,
            [Replicate() if i == found[0] else p for i, p in enumerate(target_spec.placements)],
        )
    if _is_ragged(spec) or _is_ragged(middle):
        changed = [i for i, (a, b) in enumerate(zip(spec.placements, middle.placements)) if a != b]
        if changed:
            raise NotImplementedError(
                f"redistribute {current_spec.placements} -> {target_spec.placements}: the mesh "
                f"axes {changed} change beside an unchanged RaggedShard; redistribute the "
                "RaggedShard axis to Replicate() first"
            )
    elif spec != middle:
        local_tensor = _orig_redistribute_local_tensor(
            local_tensor, spec, middle, async_op=async_op
        )
    if middle is not target_spec:
        local_tensor = _redistribute_local_tensor(local_tensor, middle, target_spec)
    return local_tensor
