"""Every hook that makes ``RaggedShard`` a working DTensor placement in torch 2.13.

[Note: DTensor patches]
DTensor 2.13 has no registry for new placements (its sharding propagation, redistribute
and ``full_tensor`` know only its own placements). This module is the one place that
patches it; each patch handles a DTensor only when a ``RaggedShard`` is among its
placements and hands every other DTensor to torch's original code unchanged:

=====================================  ==============================================
patched                                what it does for RaggedShard
=====================================  ==============================================
``DTensor.from_local``                 validates placements, shape and local size
``distribute_tensor``                  broadcast as Replicate, keep the rank's rows
``redistribute_local_tensor`` (x3)     RS<->R, RS<->Shard(0), RS<->RS (one
                                       all-to-all), Partial->RS (one reduce-scatter)
``ShardingPropagator`` (instance)      element-wise / foreach ops keep RS (a Replicate
                                       argument of the same rows is sliced locally;
                                       broadcasts within rows allowed); norms and sums
                                       give a Partial; row-wise reductions, softmax and
                                       views keep RS, no communication; ``t``,
                                       ``transpose`` / ``permute`` moving rows and
                                       ``addmm`` gather RS to Replicate (one all-gather):
                                       [Note: row-wise ops]; others raise, naming the op
                                       and the placements
custom op handlers                     norms, amax, amin safe on empty shards;
                                       in-place random ops, any/all, select:
                                       ``_dtensor_init``
``DTensor.__create_write_items__``,    DCP boxes of a ragged row range
``__create_chunk_list__``,
``__get_tensor_shard__``
``compute_local_shape_and_global_offset``  the box of the rank's rows (``_dtensor_init``)
``_state_dict_utils._distribute_tensors``  broadcast_from_rank0 keeps the rank's rows
=====================================  ==============================================

The patches are installed once, by ``install()``, when the package ``raggedfsdp.tensor``
is imported (as it is by anything that uses a RaggedShard: ``from raggedfsdp import
RaggedShard`` or ``fully_shard``),
and only on the torch versions in ``_SUPPORTED_TORCH``; anything else refuses to
import rather than risk silently wrong results, unless ``RAGGEDFSDP_UNTESTED_TORCH=1``
asks to try it (with a warning). Torch's
``distribute_tensor`` keeps its function object (names bound before ``import
raggedfsdp`` see the change) and gets a trampoline as its code.
"""

from __future__ import annotations

import itertools
import math
import os
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.tensor._api as dtensor_api
import torch.distributed.tensor._dispatch as dtensor_dispatch
import torch.distributed.tensor._redistribute as dtensor_redistribute
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor._sharding_prop import LocalLRUCache
from torch.utils import _pytree as pytree

from raggedfsdp.tensor.collectives import all_gather_single, reduce_scatter_single
from raggedfsdp.tensor.placement import RaggedShard

_SUPPORTED_TORCH = ("2.13.",)
# Set to "1" to import on another torch anyway, with a warning (how the GPU check ran on
# the accelerator machine's own torch); the tests here run on the supported one only.
UNTESTED_TORCH_ENV = "RAGGEDFSDP_UNTESTED_TORCH"
aten = torch.ops.aten
_installed = False


# ---------------------------------------------------------------------------------------------
# Placement checks
# ---------------------------------------------------------------------------------------------
def ragged_axis(placements: Sequence) -> tuple[int, RaggedShard] | None:
    """The (mesh axis, RaggedShard) of ``placements``, or None.

    [Note: composed placements] A RaggedShard may follow ``Shard(d)`` placements on
    earlier mesh axes: placements apply left to right, so the Shard axes cut the global
    tensor first (as torch.chunk: unevenly, 14 and 13 of 27 rows, where the dim does not
    divide) and the RaggedShard cuts the rows of the piece they leave.
    That is FSDP x TP: the sharded parameter lives on the ``(tp, dp)`` mesh placed
    ``(Shard(d), RaggedShard(...))``, the TP shard's rows cut over the data-parallel
    ranks. (FSDP2 puts the dp axis first and calls its placement ``_StridedShard``;
    putting the tp axis first says the same with plain placements.) ``Replicate()``
    may sit on any other axis (HSDP).

    Raises:
        ValueError: more than one RaggedShard in one placement tuple.
        NotImplementedError: a Partial or other placement beside a RaggedShard, or a
            Shard after it.
    """
    found = [(i, p) for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"placements {tuple(placements)} hold {len(found)} RaggedShards; at most one mesh "
            "axis may be RaggedShard, use Replicate() on the others"
        )
    axis, rs = found[0]
    for i, p in enumerate(placements):
        if i == axis or p.is_replicate():
            continue
        if type(p) is Shard and i < axis:
            continue
        where = "after" if i > axis else "beside"
        raise NotImplementedError(
            f"placements {tuple(placements)}: a RaggedShard composes with Replicate() on any "
            f"mesh axis and Shard(d) on the axes before it, got {p} {where} it; "
            "redistribute that axis first"
        )
    return axis, rs


class RaggedPiece(NamedTuple):
    """Where a RaggedShard cuts, under the Shard axes before it ([Note: composed placements])."""

    axis: int  # the RaggedShard's mesh axis
    rs: RaggedShard
    shape: tuple[int, ...]  # the piece the earlier Shard axes leave: what the rows cut
    offset: tuple[int, ...]  # that piece's offset in the global tensor
    coord: int  # this rank's coordinate on the RaggedShard axis

    def chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the global tensor ``full`` (a view)."""
        for d, (o, n) in enumerate(zip(self.offset, self.shape)):
            if n != full.shape[d]:
                full = full.narrow(d, o, n)
        return full

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor from the global tensor ``full`` (a view when it can be)."""
        return self.rs.local_view(self.chunk(full).contiguous(), self.coord)


def _ragged_axis_of(placements: Sequence) -> tuple[int, RaggedShard]:
    """``ragged_axis`` of placements that hold a RaggedShard."""
    found = ragged_axis(placements)
    assert found is not None, f"no RaggedShard in {placements}"
    return found


def _meta(spec: DTensorSpec) -> TensorMeta:
    """``spec``'s tensor meta (sharding propagation sets it on every argument)."""
    assert spec.tensor_meta is not None
    return spec.tensor_meta


def ragged_piece(global_shape: Sequence[int], mesh, placements: Sequence) -> RaggedPiece:
    """The RaggedShard of ``placements`` and the piece of ``global_shape`` it cuts (a
    Shard axis that splits its dim unevenly leaves each rank torch.chunk's piece)."""
    axis, rs = _ragged_axis_of(placements)
    shape, offset = list(global_shape), [0] * len(global_shape)
    for i, p in enumerate(placements[:axis]):
        if p.is_replicate():
            continue
        # torch.chunk's pieces, as DTensor cuts an uneven Shard (27 rows over 2: 14, 13);
        # each rank's RaggedShard cuts its own piece
        size, start = Shard.local_shard_size_and_offset(
            shape[p.dim], mesh.size(i), mesh.get_local_rank(i)
        )
        shape[p.dim] = size
        offset[p.dim] += start
    return RaggedPiece(axis, rs, tuple(shape), tuple(offset), mesh.get_local_rank(axis))


def _check(spec_shape: Sequence[int], mesh, placements: Sequence) -> RaggedPiece:
    """Validate a RaggedShard spec; return where it cuts for this rank."""
    piece = ragged_piece(spec_shape, mesh, placements)
    piece.rs.validate_for(piece.shape, mesh.size(piece.axis))
    return piece


def _is_ragged(spec: DTensorSpec) -> bool:
    return any(isinstance(p, RaggedShard) for p in spec.placements)


# ---------------------------------------------------------------------------------------------
# from_local and distribute_tensor
# ---------------------------------------------------------------------------------------------
_orig_from_local = DTensor.from_local


# A copy of torch's function: install() rewrites the original's code (see there).
def _copy_of(fn: Callable[..., Any]) -> types.FunctionType:
    """A new function object with ``fn``'s code, before install() rewrites ``fn``'s."""
    assert isinstance(fn, types.FunctionType)  # a Python function of torch's
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


_torch_distribute_tensor = dtensor_api.distribute_tensor
_orig_distribute_tensor = _copy_of(_torch_distribute_tensor)


def _from_local(
    local_tensor,
    device_mesh=None,
    placements=None,
    *,
    run_check=False,
    shape=None,
    stride=None,
    grad_placements=None,
):
    if placements is not None and ragged_axis(placements) is not None:
        mesh = device_mesh or dtensor_api._mesh_resources.get_current_mesh()
        if shape is None or stride is None:
            raise ValueError(
                "DTensor.from_local with a RaggedShard needs the global shape= and stride=: "
                "ranks hold different numbers of rows, so they cannot be inferred"
            )
        piece = _check(shape, mesh, placements)
        expected = piece.rs.local_shape(piece.shape, piece.coord)
        if tuple(local_tensor.shape) != expected:
            raise ValueError(
                f"DTensor.from_local: rank {piece.coord} of {piece.rs} over global shape "
                f"{tuple(shape)}{'' if piece.shape == tuple(shape) else f' (piece {piece.shape})'} "
                f"must hold a local tensor of shape {expected}, got {tuple(local_tensor.shape)}"
            )
    # grad_placements only when given: torch before 2.12 has no such argument.
    extra = {} if grad_placements is None else {"grad_placements": grad_placements}
    return _orig_from_local(
        local_tensor,
        device_mesh,
        placements,
        run_check=run_check,
        shape=shape,
        stride=stride,
        **extra,
    )


def _distribute_tensor_trampoline(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
    # Runs with the globals of torch's _api module, where install() puts the name below.
    return _raggedfsdp_distribute_tensor(  # noqa: F821
        tensor, device_mesh, placements, src_data_rank=src_data_rank
    )


def _distribute_tensor(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
    if placements is None or ragged_axis(placements) is None:
        return _orig_distribute_tensor(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    mesh = device_mesh or dtensor_api._mesh_resources.get_current_mesh()
    piece = _check(tensor.shape, mesh, placements)
    replicated = [Replicate() if i == piece.axis else p for i, p in enumerate(placements)]
    full = _orig_distribute_tensor(tensor, mesh, replicated, src_data_rank=src_data_rank)
    # full's local tensor is the piece; clone: the rank keeps its rows only.
    local = piece.rs.local_view(full._local_tensor.contiguous(), piece.coord).clone()
    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype)
    )
    return DTensor(
        local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad
    )


# ---------------------------------------------------------------------------------------------
# Redistribute
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# Sharding propagation: which ops keep a RaggedShard
# ---------------------------------------------------------------------------------------------
# Ops that are element-wise on their tensor arguments but carry no pointwise tag.
_ELEMENTWISE_EXTRA = {
    aten.clone.default,
    aten._to_copy.default,
    aten.copy_.default,
    aten.detach.default,
    aten.alias.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.masked_fill.Scalar,  # norm_backward's masking of zero norms
    aten.masked_fill_.Scalar,
    aten.masked_fill.Tensor,
    aten.masked_fill_.Tensor,
}
_NOT_ELEMENTWISE_FOREACH = {"aten::_foreach_norm", "aten::_foreach_max"}
# x.new_empty(size) and friends read only x's mesh: torch's rule (a Replicate result).
_NEW_FACTORIES = {
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
}


def _is_elementwise(op) -> bool:
    if op in _ELEMENTWISE_EXTRA or torch.Tag.pointwise in op.tags:
        return True
    name = op._schema.name
    return (
        name.startswith(("aten::_foreach_", "aten::_fused_adam", "aten::_fused_sgd"))
        and name not in _NOT_ELEMENTWISE_FOREACH
    )


def _specs_in(obj) -> list[DTensorSpec]:
    if isinstance(obj, DTensorSpec):
        return [obj]
    if isinstance(obj, list | tuple):
        return [s for child in obj for s in _specs_in(child)]
    return []


def _schema_is_ragged(op_schema: OpSchema) -> bool:
    args = list(op_schema.args_schema) + list(op_schema.kwargs_schema.values())
    return any(_is_ragged(s) for s in _specs_in(args))


def _is_scalar_like(spec: DTensorSpec) -> bool:
    return _meta(spec).shape == torch.Size([]) and all(p.is_replicate() for p in spec.placements)


def _elementwise_columns(op_schema: OpSchema) -> list[list[DTensorSpec]]:
    """The tensor specs that meet at each element of the output (one column per list item)."""
    args = list(op_schema.args_schema) + list(op_schema.kwargs_schema.values())
    lengths = {len(a) for a in args if isinstance(a, list | tuple) and _specs_in(a)}
    if len(lengths) > 1:
        raise AssertionError(f"{op_schema.op}: tensor lists of different lengths {lengths}")
    n = lengths.pop() if lengths else 1
    columns: list[list[DTensorSpec]] = [[] for _ in range(n)]
    for a in args:
        if isinstance(a, DTensorSpec):
            for col in columns:
                col.append(a)
        elif isinstance(a, list | tuple) and _specs_in(a):
            for col, item in zip(columns, a):
                col.extend(_specs_in(item))
    return columns


def _column_placements(op, column: list[DTensorSpec]):
    """The placements an element-wise op keeps for one column of argument specs."""
    main = [s for s in column if not _is_scalar_like(s)]
    if not main:
        return column[0].placements
    first = next((s for s in main if _is_ragged(s)), main[0])
    for s in main:
        same = s.placements == first.placements and _meta(s).shape == _meta(first).shape
        if not (same or _broadcasts_by_rows(s, first)):
            raise NotImplementedError(
                f"{op}: a RaggedShard DTensor meets a DTensor of another layout "
                f"({first.placements} {tuple(first.shape)} vs {s.placements} {tuple(s.shape)}); "
                "element-wise ops need the same shape and placements on every tensor argument, "
                "redistribute one of them first"
            )
    if any(p.is_partial() for p in first.placements):
        raise NotImplementedError(f"{op}: Partial placements {first.placements} with a RaggedShard")
    return first.placements


def _broadcasts_by_rows(spec: DTensorSpec, ragged: DTensorSpec) -> bool:
    """Whether ``spec`` meets the RaggedShard ``ragged`` in an element-wise op by broadcasting
    within rows only (see [Note: row-wise ops]): a RaggedShard of the same placements and the
    same row dims, or a Replicate that spans trailing dims only (``w * scale[None]`` is not:
    its leading 1 would need the local row dims)."""
    found = ragged_axis(ragged.placements)
    if found is None or spec.mesh != ragged.mesh:
        return False
    k = len(found[1].dims)
    shape, rows = _meta(spec).shape, _meta(ragged).shape
    if spec.placements == ragged.placements:
        return _same_rows(shape, ragged)
    return all(p.is_replicate() for p in spec.placements) and len(shape) <= len(rows) - k


def _same_rows(shape, ragged: DTensorSpec) -> bool:
    """Whether a tensor of ``shape`` has the row dims of the RaggedShard ``ragged`` (and its
    number of dims), so that the RaggedShard cuts it into the same rows."""
    k = len(_ragged_axis_of(ragged.placements)[1].dims)
    rows = _meta(ragged).shape
    return len(shape) == len(rows) and shape[:k] == rows[:k]


def _localized_replicas(op_schema: OpSchema) -> OpSchema | None:
    """The schema with every Replicate argument that meets a RaggedShard of its shape in an
    element-wise op placed as that RaggedShard (its local slice: no communication), or
    None when there is none (see [Note: Replicate meets RaggedShard])."""
    columns = _elementwise_columns(op_schema)
    targets = [next((s for s in col if _is_ragged(s)), None) for col in columns]

    def localize(spec, target):
        if (
            isinstance(spec, DTensorSpec)
            and target is not None
            and not _is_ragged(spec)
            and not _is_scalar_like(spec)
            and all(p.is_replicate() for p in spec.placements)
            and spec.mesh == target.mesh
            and _same_rows(spec.tensor_meta.shape, target)
        ):
            return DTensorSpec(spec.mesh, target.placements, tensor_meta=spec.tensor_meta)
        return spec

    def walk(arg):
        if isinstance(arg, DTensorSpec):
            return localize(arg, targets[0]) if len(targets) == 1 else arg
        if isinstance(arg, list | tuple) and _specs_in(arg) and len(arg) == len(targets):
            return type(arg)(localize(a, t) for a, t in zip(arg, targets))
        return arg

    args = tuple(walk(a) for a in op_schema.args_schema)
    kwargs = {k: walk(v) for k, v in op_schema.kwargs_schema.items()}
    if args == tuple(op_schema.args_schema) and kwargs == dict(op_schema.kwargs_schema):
        return None
    return OpSchema(op_schema.op, args, kwargs, schema_info=op_schema.schema_info)


def _ragged_output_sharding(prop, op_schema: OpSchema) -> OutputSharding:
    """[Note: Replicate meets RaggedShard]
    An element-wise op between a RaggedShard DTensor and a Replicate one of the same
    shape (``sharded.copy_(replicated)``, ``add_``, ``lerp_``: what checkpoint loaders
    and init code do), or of the same rows (a row-wise reduction's gradient, shape
    ``(rows, 1)``), runs on the replicated side's local slice: the propagation asks
    the dispatcher to redistribute it to the RaggedShard placement, which for a
    Replicate source is a view of its rows, with no communication.
    """
    op = op_schema.op
    if _is_elementwise(op):
        localized = _localized_replicas(op_schema)
        if localized is not None:
            out = _ragged_output_sharding(prop, localized)
            return OutputSharding(
                out.output_spec, redistribute_schema=localized, needs_redistribute=True
            )
    out_meta = prop._propagate_tensor_meta_non_cached(op_schema)
    mesh = _specs_in(list(op_schema.args_schema))[0].mesh

    def spec(placements, meta):
        return None if meta is None else DTensorSpec(mesh, tuple(placements), tensor_meta=meta)

    if op in _REDUCTIONS:
        return OutputSharding(_REDUCTIONS[op](op_schema, out_meta, spec))
    if op in _ROW_REDUCTIONS:  # see [Note: row-wise ops]
        return _row_reduction(op_schema, out_meta, spec)
    if op in _ROW_VIEWS:
        view = _row_view(op_schema, out_meta, spec)
        if view is not None:
            return view
    if op in _GATHERED:
        return _gathered(op_schema)

    if not _is_elementwise(op):
        placements = [s.placements for s in _specs_in(list(op_schema.args_schema))]
        raise NotImplementedError(
            f"{op} is not supported on a RaggedShard DTensor (argument placements "
            f"{placements}): RaggedShard supports element-wise and foreach ops, norms, sums, "
            "row-wise reductions and views (see [Note: row-wise ops] in "
            "raggedfsdp.tensor._dtensor_ext); redistribute to Replicate() or Shard(0) first"
        )
    columns = [_column_placements(op, col) for col in _elementwise_columns(op_schema)]
    if out_meta is None:
        return OutputSharding(None)
    if isinstance(out_meta, TensorMeta):
        return OutputSharding(spec(columns[0], out_meta))
    # a sequence: one output per list item (foreach), or several outputs of one op
    if len(columns) > 1:
        if len(out_meta) != len(columns):
            raise AssertionError(f"{op}: {len(out_meta)} outputs for {len(columns)} list items")
        return OutputSharding([spec(p, m) for p, m in zip(columns, out_meta)])
    return OutputSharding(tuple(spec(columns[0], m) for m in out_meta))


def _partial_for_norm(norm_type) -> Partial:
    """The Partial whose reduction completes per-rank parts of a sum or a p-norm."""
    if norm_type is None or norm_type == 0:  # a sum; the 0-"norm" counts non-zeros
        return Partial("sum")
    if math.isinf(norm_type):
        return Partial("max" if norm_type > 0 else "min")
    return _NormPartial(norm_type)


def _reduced_placement(placements, norm_type=None):
    """A full reduction of each placement: RaggedShard -> Partial, Replicate stays."""
    out = []
    for p in placements:
        if isinstance(p, RaggedShard | Shard):  # Shard: before it ([Note: composed placements])
            out.append(_partial_for_norm(norm_type))
        elif p.is_replicate():
            out.append(p)
        else:
            raise NotImplementedError(f"reduction of a RaggedShard DTensor placed as {placements}")
    return out


# [Note: norms over several meshes]
# ``torch.nn.utils.clip_grad_norm_`` takes ``_foreach_norm`` of every gradient, then
# ``torch.stack`` of the norms. Under FSDP x TP the gradients live on two meshes, the
# ``(tp, dp)`` mesh of TP parameters and the ``dp`` mesh of the others, and stack needs one.
# Each norm is the Partial reduction of its own input's placements, lifted onto the
# input mesh with the most dims when every other input mesh is made of its dims (each
# dim's ranks are those of one of its dims, as the composed mesh reuses the dp groups,
# or of several, as a flattened dp spans EP's ``(ep, dp_mod_ep)``): on a dim the input's
# mesh lacks, the norm is ``Replicate()`` (every rank of that dim holds the same partial
# value); over a flattened dim's parts, its Partial on each (a sum, a p-norm or a max
# over a grid is the same reduction done one dim after the other). A dp-mesh norm
# ``(Partial,)`` becomes ``(Replicate(), Partial)`` on ``(tp, dp)``, and a ``(tp, dp)``
# norm keeps its tp part. Meshes that do
# not nest keep their own mesh (``torch.stack`` then refuses them as it does FSDP2's), and
# so do norms taken apart (``foreach=False``: one ``linalg.vector_norm`` per tensor), which
# meet first in ``torch.stack``: lifting them there would change torch's stack of every
# DTensor, not only RaggedShard's (see [Note: DTensor patches]).
def _dims_spanning(ranks: set[int], mesh) -> tuple[int, ...] | None:
    """The dims of ``mesh`` whose grid through this rank holds exactly ``ranks`` (one dim,
    or the several a flatten joined), or None."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    for k in range(1, mesh.ndim + 1):
        for dims in itertools.combinations(range(mesh.ndim), k):
            index = tuple(slice(None) if i in dims else c for i, c in enumerate(coordinate))
            if set(mesh.mesh[index].flatten().tolist()) == ranks:
                return dims
    return None


def _lift(spec_mesh, placements, to_mesh) -> tuple | None:
    """Reduced ``placements`` (Partial or Replicate) on ``spec_mesh`` as placements on
    ``to_mesh``: Replicate on the dims ``spec_mesh`` lacks; None where ``spec_mesh``'s dims
    are not made of ``to_mesh``'s."""
    if spec_mesh == to_mesh:
        return tuple(placements)
    out: list = [Replicate()] * to_mesh.ndim
    used: set[int] = set()
    for d, p in enumerate(placements):
        ranks = set(dist.get_process_group_ranks(spec_mesh.get_group(d)))
        dims = _dims_spanning(ranks, to_mesh)
        if dims is None or used & set(dims):
            return None
        used |= set(dims)
        for t in dims:
            out[t] = p
    return tuple(out)


def _foreach_norm_rule(op_schema, out_meta, spec):
    """Each norm the Partial reduction of its own input, on a mesh every norm shares
    where the input meshes nest (see [Note: norms over several meshes])."""
    del spec  # each output names its mesh
    srcs = op_schema.args_schema[0]
    ord_ = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 2
    reduced = [(s.mesh, _reduced_placement(s.placements, ord_)) for s in srcs]
    widest = max((mesh for mesh, _ in reduced), key=lambda m: m.ndim)
    lifted = [_lift(mesh, placements, widest) for mesh, placements in reduced]
    if any(p is None for p in lifted):
        return [
            DTensorSpec(mesh, tuple(p), tensor_meta=m) for (mesh, p), m in zip(reduced, out_meta)
        ]
    return [DTensorSpec(widest, p, tensor_meta=m) for p, m in zip(lifted, out_meta)]


def _sum_rule(op_schema, out_meta, spec):
    return spec(_reduced_placement(op_schema.args_schema[0].placements), out_meta)


_REDUCTIONS = {
    aten._foreach_norm.Scalar: _foreach_norm_rule,
    aten.sum.default: _sum_rule,
}


# ---------------------------------------------------------------------------------------------
# Row-wise ops
# ---------------------------------------------------------------------------------------------
# [Note: row-wise ops]
# A rank of a RaggedShard holds whole rows: the leading ``k = len(dims)`` dims. An op that
# treats each row apart keeps them where they are, and its result is the same RaggedShard
# of the result's shape (the same rows on every rank), computed on the local rows with no
# communication:
#   - a reduction, softmax or cumsum over trailing dims only (``w.norm(dim=1)``,
#     ``w.sum(-1)``, ``w.amax(1)``, ``w.mean(1)``, ``w.max(1)``, ``softmax(w, -1)``);
#   - a view, ``expand``, ``unsqueeze`` / ``squeeze``, ``transpose`` / ``permute`` that
#     leave dims ``0..k-1`` in place;
#   - an element-wise op whose arguments broadcast within rows: a RaggedShard of the same
#     placements and row dims (``w / w.norm(dim=1, keepdim=True)``) or a Replicate that
#     spans trailing dims only (``w * scale`` with ``scale`` of shape ``w.shape[1:]``).
# The local tensor merges the k row dims into one, so a trailing global dim ``d`` is local
# dim ``d - k + 1`` and a shape argument's k row sizes become the local row count: the
# rule hands those rewritten arguments to the local op.
# A reduction over every row dim (and maybe others) gives a Partial: sum, p-norm, amax and
# amin, to which a rank holding no rows contributes the identity. ``mean`` over the rows,
# a reduction over some row dims only, and a view that regroups rows raise.
# Ops that put the rows elsewhere -- ``t``, ``transpose`` / ``permute`` moving a row dim,
# ``addmm`` (``F.linear``'s bias) -- have no ragged placement for their result. Their
# RaggedShard arguments are gathered to Replicate first, then torch's own rule runs: one
# all-gather of the whole tensor per call, its full size alive on every rank (what an
# unshard costs); the result is a copy (writing into ``w.t()`` does not change ``w``),
# and its gradient reaches the RaggedShard leaf as a Replicate, as torch's does for a
# Shard(0) parameter under the same ops.
class _RowReduction(NamedTuple):
    dim_arg: int  # the position of the ``dim`` argument
    partial: str | None  # how a reduction over the rows completes; None: it cannot


_ROW_REDUCTIONS = {
    aten.linalg_vector_norm.default: _RowReduction(2, "norm"),
    aten.sum.dim_IntList: _RowReduction(1, "sum"),
    aten.amax.default: _RowReduction(1, "max"),
    aten.amin.default: _RowReduction(1, "min"),
    aten.mean.dim: _RowReduction(1, None),
    aten.prod.dim_int: _RowReduction(1, None),
    aten.max.dim: _RowReduction(1, None),
    aten.min.dim: _RowReduction(1, None),
    aten.argmax.default: _RowReduction(1, None),
    aten.argmin.default: _RowReduction(1, None),
    aten.logsumexp.default: _RowReduction(1, None),
    aten.var.correction: _RowReduction(1, None),
    aten.std.correction: _RowReduction(1, None),
    aten.any.dim: _RowReduction(1, None),
    aten.all.dim: _RowReduction(1, None),
    # dim-preserving: the result has the input's shape
    aten._softmax.default: _RowReduction(1, None),
    aten._log_softmax.default: _RowReduction(1, None),
    aten._softmax_backward_data.default: _RowReduction(2, None),
    aten._log_softmax_backward_data.default: _RowReduction(2, None),
    aten.cumsum.default: _RowReduction(1, None),
}
_ROW_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.transpose.int,
    aten.permute.default,
    aten.t.default,
}
# gathered to Replicate where they move rows (see the Note)
_GATHERED = {aten.t.default, aten.transpose.int, aten.permute.default, aten.addmm.default}
_torch_propagate: Callable[[OpSchema], OutputSharding] | None = (
    None  # torch's own propagate_op_sharding_non_cached: _install_propagation
)


def _row_args(op_schema: OpSchema, index: int, value) -> OpSchema:
    """``op_schema`` with positional argument ``index`` replaced by ``value``."""
    args = list(op_schema.args_schema)
    args[index] = value
    return OpSchema(op_schema.op, tuple(args), op_schema.kwargs_schema, op_schema.schema_info)


def _with_local_args(output_spec, local_schema: OpSchema | None) -> OutputSharding:
    """An OutputSharding whose local op runs with the arguments of ``local_schema``."""
    if local_schema is None:
        return OutputSharding(output_spec)
    return OutputSharding(
        output_spec,
        redistribute_schema=local_schema,
        needs_redistribute=True,
        use_val_from_redistribute_schema=True,
    )


def _row_reduction(op_schema: OpSchema, out_meta, spec) -> OutputSharding:
    op, args = op_schema.op, op_schema.args_schema
    rule = _ROW_REDUCTIONS[op]
    src = next(a for a in args if isinstance(a, DTensorSpec) and _is_ragged(a))
    ndim, placements = len(src.shape), src.placements
    axis, rs = _ragged_axis_of(placements)
    k = len(rs.dims)
    dim: Any = (
        args[rule.dim_arg] if len(args) > rule.dim_arg else op_schema.kwargs_schema.get("dim")
    )
    given = [dim] if isinstance(dim, int) else list(dim or ())
    dims = sorted({d % ndim for d in given}) if given else list(range(ndim))
    metas = [out_meta] if isinstance(out_meta, TensorMeta) else list(out_meta)
    keepdim = len(metas[0].shape) == ndim

    def fail(why):
        return NotImplementedError(
            f"{op} over dims {dim} of a DTensor of shape {tuple(src.shape)} placed "
            f"{placements}: {why}; redistribute to Replicate() first"
        )

    if all(d >= k for d in dims):  # row-wise: every rank reduces its own rows
        out = []
        for p in placements:
            if type(p) is Shard:  # before the RaggedShard: [Note: composed placements]
                if p.dim in dims:
                    raise fail("it reduces the dim a Shard before the RaggedShard cuts")
                p = p if keepdim else Shard(p.dim - sum(d < p.dim for d in dims))
            out.append(p)
        local = None
        if k > 1 and given:  # local dim d - k + 1 (see the Note)
            moved = [d % ndim - k + 1 for d in given]
            local = _row_args(op_schema, rule.dim_arg, moved[0] if isinstance(dim, int) else moved)
        # another tensor argument of the same rows (softmax's backward: the gradient), if
        # Replicate, runs on its local rows (a slice, no communication)
        for i, a in enumerate(args):
            if isinstance(a, DTensorSpec) and a.placements != placements:
                if not (all(p.is_replicate() for p in a.placements) and _same_rows(a.shape, src)):
                    raise fail(f"its argument {i} is placed {a.placements}")
                local = _row_args(
                    local or op_schema, i, DTensorSpec(a.mesh, placements, a.tensor_meta)
                )
        outs = tuple(spec(out, m) for m in metas)
        return _with_local_args(outs[0] if isinstance(out_meta, TensorMeta) else outs, local)
    if rule.partial is None or not set(range(k)) <= set(dims):
        what = "over the rows" if rule.partial is None else "over some of the row dims only"
        raise fail(f"only a reduction within rows is supported for it, not one {what}")
    if k > 1 and given:
        raise fail("a reduction over the rows of a RaggedShard of several row dims needs dim=None")
    if rule.partial == "norm":
        ord_ = args[1] if len(args) > 1 else op_schema.kwargs_schema.get("ord", 2)
        partial = _partial_for_norm(ord_)
    else:
        partial = Partial(rule.partial)
    out = []
    for p in placements:
        if isinstance(p, RaggedShard) or (type(p) is Shard and p.dim in dims):
            p = partial
        elif type(p) is Shard and not keepdim:
            p = Shard(p.dim - sum(d < p.dim for d in dims))
        out.append(p)
    return OutputSharding(spec(out, out_meta))


def _row_view(op_schema: OpSchema, out_meta, spec) -> OutputSharding | None:
    """A view that keeps the rows in place (see [Note: row-wise ops]); None for a
    transpose or permute that moves them (gathered instead).

    Raises:
        NotImplementedError: a view that regroups rows, or one under a Shard axis.
    """
    op = op_schema.op
    args: tuple[Any, ...] = op_schema.args_schema  # a DTensorSpec, then the view's arguments
    src = args[0]
    shape, out_shape = tuple(src.shape), tuple(out_meta.shape)
    axis, rs = _ragged_axis_of(src.placements)
    k = len(rs.dims)

    def fail(why):
        return NotImplementedError(
            f"{op} of a DTensor of shape {shape} placed {src.placements} to shape {out_shape}: "
            f"{why}; redistribute to Replicate() first"
        )

    def local(d):  # a global dim >= k as a dim of the local tensor
        return d - k + 1

    if op in (aten.t.default, aten.transpose.int, aten.permute.default):
        if op is aten.t.default:
            perm = list(range(len(shape)))[::-1]
        elif op is aten.transpose.int:
            a, b = (d % max(len(shape), 1) for d in args[1:3])
            perm = list(range(len(shape)))
            perm[a], perm[b] = perm[b], perm[a]
        else:
            perm = [d % len(shape) for d in args[1]]
        if perm[:k] != list(range(k)):
            return None
        local_schema = None
        if k > 1 and op is aten.transpose.int and a != b:
            local_schema = _row_args(_row_args(op_schema, 1, local(a)), 2, local(b))
        elif k > 1 and op is aten.permute.default:
            local_schema = _row_args(op_schema, 1, [0, *(local(d) for d in perm[k:])])
    else:
        if any(type(p) is Shard for p in src.placements):
            raise fail("a view under a Shard axis before the RaggedShard is not supported")
        if out_shape[:k] != shape[:k] or len(out_shape) < k:
            raise fail(f"the result does not keep the {k} row dim(s) in place")
        if op in (aten.view.default, aten._unsafe_view.default, aten.expand.default):
            if op is aten.expand.default and len(args[1]) != len(shape):
                raise fail("expand adds leading dims")
            piece = ragged_piece(out_shape, src.mesh, src.placements)
            rows = rs.local_shape(piece.shape, piece.coord)[0]
            local_schema = _row_args(op_schema, 1, [rows, *args[1][k:]])
        else:
            if op is aten.unsqueeze.default:
                moved = [args[1] % len(out_shape)]
            elif op is aten.squeeze.dim:
                moved = [args[1] % len(shape)]
            else:
                moved = [d % len(shape) for d in args[1]]
            if any(d < k for d in moved):
                raise fail(f"it un/squeezes a row dim ({k} row dim(s))")
            local_schema = None
            if k > 1:
                new = [local(d) for d in moved]
                local_schema = _row_args(op_schema, 1, new if op is aten.squeeze.dims else new[0])
    return _with_local_args(spec(src.placements, out_meta), local_schema)


def _gathered(op_schema: OpSchema) -> OutputSharding:
    """Gather every RaggedShard argument to Replicate, then torch's own rule (see
    [Note: row-wise ops]): one all-gather per RaggedShard argument."""

    def replicate(spec):
        if not isinstance(spec, DTensorSpec) or not _is_ragged(spec):
            return spec
        axis, _ = ragged_axis(spec.placements)
        placements = tuple(Replicate() if i == axis else p for i, p in enumerate(spec.placements))
        return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)

    gathered = OpSchema(
        op_schema.op,
        tuple(replicate(a) for a in op_schema.args_schema),
        {k: replicate(v) for k, v in op_schema.kwargs_schema.items()},
        schema_info=op_schema.schema_info,
    )
    assert _torch_propagate is not None  # set by _install_propagation
    out = _torch_propagate(gathered)
    if out.redistribute_schema is None:  # torch runs it as given: gathered is the input
        out.redistribute_schema, out.needs_redistribute = gathered, True
    return out


def _identity(op_call, args, kwargs, dtype) -> float | None:
    """The value a rank holding no rows contributes to a reduction over the rows, where
    torch refuses the reduction of an empty tensor (None where torch's own result is it)."""
    if op_call in (aten.amax.default, aten.amin.default):
        big = math.inf if dtype.is_floating_point else torch.iinfo(dtype).max
        return -big if op_call is aten.amax.default else big
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if not math.isinf(ord_):
        return None
    return 0.0 if ord_ > 0 else math.inf  # norms are >= 0: the max's identity is 0


def _empty_safe_reduction(op_call, args, kwargs, partial: bool):
    """Local norms, amax and amin where an empty shard contributes the reduction's identity.

    torch refuses the inf / -inf norm, amax and amin of an empty tensor (no identity), but
    a rank holding zero blocks of a RaggedShard must still join a reduction over the rows
    (a ``partial`` result): it reduces one row of the identity instead.
    """
    identity = _identity(
        op_call, args, kwargs, (args[0][0] if isinstance(args[0], list) else args[0]).dtype
    )
    if identity is None or not partial:
        return op_call(*args, **kwargs)

    def one(t):
        return t.new_full((1, *t.shape[1:]), identity) if t.numel() == 0 else t

    if op_call is aten._foreach_norm.Scalar:
        return op_call([one(t) for t in args[0]], *args[1:], **kwargs)
    return op_call(one(args[0]), *args[1:], **kwargs)


def _reduction_handler(op_call, args, kwargs):
    """DTensor custom handler for norms, amax and amin: ragged inputs here, everything else
    to torch."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    if not _schema_is_ragged(op_info.schema):
        # hand the op back to torch's own path (as torch.distributed.tensor.parallel.loss does)
        return _to_torch(op_call, args, kwargs)
    sharding = dispatcher.sharding_propagator.propagate_op_sharding(op_info.schema)
    if sharding.needs_redistribute:  # the local op's own arguments: [Note: row-wise ops]
        dispatcher.redistribute_local_args(
            op_info, sharding.redistribute_schema, sharding.use_val_from_redistribute_schema
        )
    local_args = op_info.local_args
    if op_info.args_tree_spec is not None:
        local_args = pytree.tree_unflatten(local_args, op_info.args_tree_spec)
    specs = sharding.output_spec
    specs = specs if isinstance(specs, list | tuple) else [specs]
    partial = any(p.is_partial() for s in specs for p in s.placements)
    local = _empty_safe_reduction(op_call, local_args, op_info.local_kwargs, partial)
    return dispatcher.wrap(local, sharding.output_spec)


_REDUCTION_HANDLED = (
    aten.linalg_vector_norm.default,
    aten._foreach_norm.Scalar,
    aten.amax.default,
    aten.amin.default,
)


# [Note: torch's path from a handler] A custom handler that gets a plain (non-ragged)
# op hands it to torch's own DTensor path by running that path's Python steps itself
# (torch's dispatcher calls them from C++ for any op without a handler): unwrap, sharding
# propagation, the local results (redistribution and the RNG tracker included), the
# wrapping tail. It never takes itself out of torch's global handler table, so another
# thread (the async checkpoint's) never finds the handler missing, and nested calls need
# no bookkeeping.
def _to_torch(op_call, args, kwargs):
    """Run ``op_call`` on DTensors as torch's own dispatcher does (see [Note: torch's
    path from a handler])."""
    d = DTensor._op_dispatcher
    op_info = d.unwrap_to_op_info(op_call, args, kwargs)
    sharding = d._propagate_op_sharding_dispatch_slow_path(
        op_call, args, kwargs, op_info, try_cache=True
    )
    if not isinstance(sharding, OutputSharding):
        return sharding  # a CompositeImplicitAutograd op under inference mode: decomposed
    op_info.output_sharding = sharding
    local = d._dispatch_get_local_results_slow_path(op_call, args, op_info)
    inplace, out = op_info.schema.is_inplace_op(), op_info.schema.is_out_variant_op()
    if not (inplace or out or op_call is aten.equal.default):
        return d.wrap(local, sharding.output_spec)
    mesh = op_info.compute_mesh  # the tail: outputs that are inputs, and equal's bool
    participating = mesh._is_current_rank_part_of_mesh()
    return d._dispatch_fast_path_python_tail(
        op_call, args, kwargs, mesh, sharding, local, participating, inplace, out
    )


def _install_propagation() -> None:
    prop = DTensor._op_dispatcher.sharding_propagator
    original = prop.propagate_op_sharding_non_cached
    global _torch_propagate
    _torch_propagate = original

    def propagate_op_sharding_non_cached(op_schema: OpSchema) -> OutputSharding:
        if _schema_is_ragged(op_schema) and op_schema.op not in _NEW_FACTORIES:
            return _ragged_output_sharding(prop, op_schema)
        return original(op_schema)

    # The cached entry point captured the bound original at construction: replace both.
    # (a deliberate patch of torch's instance: mypy forbids assigning to a method)
    prop.propagate_op_sharding_non_cached = propagate_op_sharding_non_cached  # type: ignore[method-assign]
    prop.propagate_op_sharding = LocalLRUCache(propagate_op_sharding_non_cached)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _REDUCTION_HANDLED:
        handlers[op] = _reduction_handler


# ---------------------------------------------------------------------------------------------
# Distributed checkpoint (DCP)
# ---------------------------------------------------------------------------------------------
def range_to_boxes(start: int, end: int, dims: Sequence[int]) -> list[tuple[tuple, tuple]]:
    """Cut the row-major index range ``[start, end)`` of a ``dims`` box into hyper-rectangles.

    Each returned (offsets, sizes) covers a contiguous run of the range, in order; at
    most ``2 * len(dims) - 1`` boxes.
    """
    if start >= end:
        return []
    if len(dims) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(dims[1:])
    boxes = []
    head, rest = divmod(start, inner)
    if rest:  # a partial first slice of dim 0
        stop = min(end, (head + 1) * inner)
        for off, size in range_to_boxes(rest, stop - head * inner, dims[1:]):
            boxes.append(((head, *off), (1, *size)))
        start = stop
    first_full, last_full = -(-start // inner), end // inner
    if last_full > first_full:
        boxes.append(((first_full,) + (0,) * (len(dims) - 1), (last_full - first_full, *dims[1:])))
    if end % inner and end > max(start, last_full * inner):
        for off, size in range_to_boxes(0, end - last_full * inner, dims[1:]):
            boxes.append(((last_full, *off), (1, *size)))
    return boxes


def _local_boxes(t: DTensor) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
    """(global offsets, sizes, local view) of each DCP box of a RaggedShard DTensor."""
    piece = ragged_piece(tuple(t.shape), t.device_mesh, t.placements)
    rs, shape = piece.rs, piece.shape
    k, rest = len(rs.dims), shape[len(rs.dims) :]
    start, end = rs.local_row_range(shape, piece.coord)
    local, cursor, boxes = t._local_tensor, 0, []
    for offsets, sizes in range_to_boxes(start, end, shape[:k]):
        rows = math.prod(sizes)
        view = local[cursor : cursor + rows].view(*sizes, *rest)
        at = [o + p for o, p in zip((*offsets, *(0,) * len(rest)), piece.offset)]
        boxes.append((torch.Size(at), torch.Size((*sizes, *rest)), view))
        cursor += rows
    return boxes


_orig_create_write_items = DTensor.__create_write_items__
_orig_create_chunk_list = DTensor.__create_chunk_list__
_orig_get_tensor_shard = DTensor.__get_tensor_shard__


def _create_write_items(self, fqn: str, object):
    if not _is_ragged(self._spec):
        return _orig_create_write_items(self, fqn, object)
    props = TensorProperties.create_from_tensor(self._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=props,
                size=self.size(),
            ),
        )
        for offsets, sizes, _ in _local_boxes(self)
    ]


def _create_chunk_list(self):
    if not _is_ragged(self._spec):
        return _orig_create_chunk_list(self)
    return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in _local_boxes(self)]


def _get_tensor_shard(self, index):
    if not _is_ragged(self._spec):
        return _orig_get_tensor_shard(self, index)
    for offsets, _, view in _local_boxes(self):
        if offsets == index.offset:
            return view
    raise AssertionError(f"{index.fqn}: this rank holds no box at offset {tuple(index.offset)}")


# ---------------------------------------------------------------------------------------------
# Install
# ---------------------------------------------------------------------------------------------
def install() -> None:
    """Install every patch above once. Raises ImportError on an untested torch."""
    global _installed
    if _installed:
        return
    if not torch.__version__.startswith(_SUPPORTED_TORCH):
        found = (
            f"raggedfsdp patches DTensor internals tested on torch {_SUPPORTED_TORCH}, "
            f"found torch {torch.__version__}"
        )
        if os.environ.get(UNTESTED_TORCH_ENV) != "1":
            raise ImportError(
                f"{found}; install torch==2.13.0, or set {UNTESTED_TORCH_ENV}=1 to try this "
                f"torch at your own risk (a patched internal may be missing or differ)"
            )
        warnings.warn(f"{found}; going on because {UNTESTED_TORCH_ENV}=1", stacklevel=2)
    # Deliberate patches of torch's DTensor and modules (mypy forbids assigning to a method
    # or setting an attribute a module does not declare).
    DTensor.from_local = staticmethod(_from_local)  # type: ignore[method-assign]
    # `from torch.distributed.tensor import distribute_tensor` may have bound torch's
    # function before raggedfsdp was imported: give that very function object our code.
    dtensor_api._raggedfsdp_distribute_tensor = _distribute_tensor  # type: ignore[attr-defined]
    _torch_distribute_tensor.__code__ = _distribute_tensor_trampoline.__code__
    for module in (dtensor_redistribute, dtensor_dispatch, dtensor_api):
        module.redistribute_local_tensor = _redistribute_local_tensor  # type: ignore[attr-defined]
    _install_propagation()
    DTensor.__create_write_items__ = _create_write_items  # type: ignore[method-assign]
    DTensor.__create_chunk_list__ = _create_chunk_list  # type: ignore[method-assign]
    DTensor.__get_tensor_shard__ = _get_tensor_shard  # type: ignore[method-assign]
    _installed = True
