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
                                       argument of the same shape is sliced locally);
                                       norms and sums give a Partial; others raise
custom op handlers                     norms safe on empty shards; in-place random
                                       ops, any/all, select: ``_dtensor_init``
``DTensor.__create_write_items__``,    DCP boxes of a ragged row range
``__create_chunk_list__``,
``__get_tensor_shard__``
``compute_local_shape_and_global_offset``  the box of the rank's rows (``_dtensor_init``)
``_state_dict_utils._distribute_tensors``  broadcast_from_rank0 keeps the rank's rows
=====================================  ==============================================

The patches are installed once, by ``install()``, when this module is imported (as
``RaggedShard`` is: ``from raggedfsdp import RaggedShard`` or ``fully_shard``),
and only on the torch versions in ``_SUPPORTED_TORCH``; anything else refuses to
import rather than risk silently wrong results, unless ``RAGGEDFSDP_UNTESTED_TORCH=1``
asks to try it (with a warning). Torch's
``distribute_tensor`` keeps its function object (names bound before ``import
raggedfsdp`` see the change) and gets a trampoline as its code.
"""

from __future__ import annotations

import math
import os
import types
import warnings
from collections.abc import Sequence
from typing import NamedTuple

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

from raggedfsdp._collectives import all_gather_single, reduce_scatter_single
from raggedfsdp.placement import RaggedShard

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
    tensor first (evenly) and the RaggedShard cuts the rows of the piece they leave.
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


def ragged_piece(global_shape: Sequence[int], mesh, placements: Sequence) -> RaggedPiece:
    """The RaggedShard of ``placements`` and the piece of ``global_shape`` it cuts.

    Raises:
        NotImplementedError: a Shard axis that does not split its dim evenly.
    """
    axis, rs = ragged_axis(placements)
    shape, offset = list(global_shape), [0] * len(global_shape)
    for i, p in enumerate(placements[:axis]):
        if p.is_replicate():
            continue
        n = mesh.size(i)
        if shape[p.dim] % n:
            raise NotImplementedError(
                f"placements {tuple(placements)} over shape {tuple(global_shape)}: {p} on mesh "
                f"axis {i} splits {shape[p.dim]} over {n} ranks unevenly; a RaggedShard after "
                "a Shard needs an even Shard (pad the dim, or change the parallel plan)"
            )
        shape[p.dim] //= n
        offset[p.dim] += mesh.get_local_rank(i) * shape[p.dim]
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
def _copy_of(fn: types.FunctionType) -> types.FunctionType:
    """A new function object with ``fn``'s code, before install() rewrites ``fn``'s."""
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
        return [tuple(x * row for x in placement.local_row_range(shape, r)) for r in range(world)]
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
    return spec.tensor_meta.shape == torch.Size([]) and all(
        p.is_replicate() for p in spec.placements
    )


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
    first = main[0]
    for s in main[1:]:
        if s.placements != first.placements or s.tensor_meta.shape != first.tensor_meta.shape:
            raise NotImplementedError(
                f"{op}: a RaggedShard DTensor meets a DTensor of another layout "
                f"({first.placements} {tuple(first.shape)} vs {s.placements} {tuple(s.shape)}); "
                "element-wise ops need the same shape and placements on every tensor argument, "
                "redistribute one of them first"
            )
    if any(p.is_partial() for p in first.placements):
        raise NotImplementedError(f"{op}: Partial placements {first.placements} with a RaggedShard")
    return first.placements


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
            and spec.tensor_meta.shape == target.tensor_meta.shape
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
    and init code do) runs on the replicated side's local slice: the propagation asks
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

    if not _is_elementwise(op):
        raise NotImplementedError(
            f"{op} is not supported on a RaggedShard DTensor: RaggedShard supports element-wise "
            "and foreach ops between DTensors of the same placement, norms and sums; "
            "redistribute to Replicate() or Shard(0) first"
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


def _vector_norm_rule(op_schema, out_meta, spec):
    args = op_schema.args_schema
    src, ord_ = args[0], (args[1] if len(args) > 1 else 2)
    dim = args[2] if len(args) > 2 else op_schema.kwargs_schema.get("dim")
    if dim is not None and sorted(d % len(src.shape) for d in dim) != list(range(len(src.shape))):
        raise NotImplementedError(
            f"linalg.vector_norm over dims {dim} of a RaggedShard DTensor: only the norm of "
            "the whole tensor (dim=None) is supported"
        )
    return spec(_reduced_placement(src.placements, ord_), out_meta)


def _foreach_norm_rule(op_schema, out_meta, spec):
    srcs = op_schema.args_schema[0]
    ord_ = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 2
    return [spec(_reduced_placement(s.placements, ord_), m) for s, m in zip(srcs, out_meta)]


def _sum_rule(op_schema, out_meta, spec):
    return spec(_reduced_placement(op_schema.args_schema[0].placements), out_meta)


_REDUCTIONS = {
    aten.linalg_vector_norm.default: _vector_norm_rule,
    aten._foreach_norm.Scalar: _foreach_norm_rule,
    aten.sum.default: _sum_rule,
}


def _empty_safe_norm(op_call, args, kwargs):
    """Local norms where an empty shard contributes the reduction's identity.

    torch refuses the inf / -inf norm of an empty tensor (no identity), but a rank
    holding zero blocks of a RaggedShard must still join the reduction: its part
    is 0 for the inf norm (norms are >= 0) and +inf for the -inf norm.
    """
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if not math.isinf(ord_):
        return op_call(*args, **kwargs)

    def one(t):
        if t.numel():
            return aten.linalg_vector_norm.default(t, ord_, dtype=kwargs.get("dtype"))
        dtype = kwargs.get("dtype") or t.dtype
        return torch.full((), 0.0 if ord_ > 0 else math.inf, dtype=dtype, device=t.device)

    if op_call is aten._foreach_norm.Scalar:
        return [one(t) for t in args[0]]
    return one(args[0])


def _norm_handler(op_call, args, kwargs):
    """DTensor custom handler for norms: ragged inputs here, everything else to torch."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    if not _schema_is_ragged(op_info.schema):
        # hand the op back to torch's own path (as torch.distributed.tensor.parallel.loss does)
        return _to_torch(op_call, _norm_handler, args, kwargs)
    sharding = dispatcher.sharding_propagator.propagate_op_sharding(op_info.schema)
    local_args = op_info.local_args
    if op_info.args_tree_spec is not None:
        local_args = pytree.tree_unflatten(local_args, op_info.args_tree_spec)
    local = _empty_safe_norm(op_call, local_args, op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def _to_torch(op_call, handler, args, kwargs):
    """Run ``op_call`` through torch's own DTensor path (the handler stepped aside)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    del handlers[op_call]
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = handler


def _install_propagation() -> None:
    prop = DTensor._op_dispatcher.sharding_propagator
    original = prop.propagate_op_sharding_non_cached

    def propagate_op_sharding_non_cached(op_schema: OpSchema) -> OutputSharding:
        if _schema_is_ragged(op_schema) and op_schema.op not in _NEW_FACTORIES:
            return _ragged_output_sharding(prop, op_schema)
        return original(op_schema)

    # The cached entry point captured the bound original at construction: replace both.
    prop.propagate_op_sharding_non_cached = propagate_op_sharding_non_cached
    prop.propagate_op_sharding = LocalLRUCache(propagate_op_sharding_non_cached)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar):
        handlers[op] = _norm_handler
    from raggedfsdp import _dtensor_init  # needs this module's names: imported once here

    for op in _dtensor_init.RANDOM_INPLACE:
        handlers[op] = _dtensor_init.random_handler
    for op in (aten.any.default, aten.all.default):
        handlers[op] = _dtensor_init.any_all_handler
    handlers[aten.select.int] = _dtensor_init.select_handler


# ---------------------------------------------------------------------------------------------
# Distributed checkpoint (DCP)
# ---------------------------------------------------------------------------------------------
def _range_to_boxes(start: int, end: int, dims: Sequence[int]) -> list[tuple[tuple, tuple]]:
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
        for off, size in _range_to_boxes(rest, stop - head * inner, dims[1:]):
            boxes.append(((head, *off), (1, *size)))
        start = stop
    first_full, last_full = -(-start // inner), end // inner
    if last_full > first_full:
        boxes.append(((first_full,) + (0,) * (len(dims) - 1), (last_full - first_full, *dims[1:])))
    if end % inner and end > max(start, last_full * inner):
        for off, size in _range_to_boxes(0, end - last_full * inner, dims[1:]):
            boxes.append(((last_full, *off), (1, *size)))
    return boxes


def _local_boxes(t: DTensor) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
    """(global offsets, sizes, local view) of each DCP box of a RaggedShard DTensor."""
    piece = ragged_piece(tuple(t.shape), t.device_mesh, t.placements)
    rs, shape = piece.rs, piece.shape
    k, rest = len(rs.dims), shape[len(rs.dims) :]
    start, end = rs.local_row_range(shape, piece.coord)
    local, cursor, boxes = t._local_tensor, 0, []
    for offsets, sizes in _range_to_boxes(start, end, shape[:k]):
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
    DTensor.from_local = staticmethod(_from_local)
    # `from torch.distributed.tensor import distribute_tensor` may have bound torch's
    # function before raggedfsdp was imported: give that very function object our code.
    dtensor_api._raggedfsdp_distribute_tensor = _distribute_tensor
    _torch_distribute_tensor.__code__ = _distribute_tensor_trampoline.__code__
    for module in (dtensor_redistribute, dtensor_dispatch, dtensor_api):
        module.redistribute_local_tensor = _redistribute_local_tensor
    _install_propagation()
    from raggedfsdp import _dtensor_init

    _dtensor_init.install_state_dict_hooks()
    DTensor.__create_write_items__ = _create_write_items
    DTensor.__create_chunk_list__ = _create_chunk_list
    DTensor.__get_tensor_shard__ = _get_tensor_shard
    _installed = True


install()
