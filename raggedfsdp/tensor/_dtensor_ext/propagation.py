"""Sharding propagation: which ops keep a RaggedShard, and what their results are placed."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

from raggedfsdp.tensor._dtensor_ext.checks import (
    _is_ragged,
    _meta,
    _same_rows,
    ragged_axis,
)
from raggedfsdp.tensor._dtensor_ext.rowwise import (
    _GATHERED,
    _ROW_REDUCTIONS,
    _ROW_VIEWS,
    _gathered,
    _partial_for_norm,
    _row_reduction,
    _row_view,
)
from raggedfsdp.tensor.placement import RaggedShard

aten = torch.ops.aten


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
