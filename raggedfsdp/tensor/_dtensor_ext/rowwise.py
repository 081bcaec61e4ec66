"""Row-wise ops: the rules for ops that treat each row of a RaggedShard apart."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._ops._math_ops import _NormPartial

from raggedfsdp.tensor._dtensor_ext.checks import (
    _is_ragged,
    _ragged_axis_of,
    _same_rows,
    ragged_axis,
    ragged_piece,
)
from raggedfsdp.tensor.placement import RaggedShard

aten = torch.ops.aten


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


def _partial_for_norm(norm_type) -> Partial:
    """The Partial whose reduction completes per-rank parts of a sum or a p-norm."""
    if norm_type is None or norm_type == 0:  # a sum; the 0-"norm" counts non-zeros
        return Partial("sum")
    if math.isinf(norm_type):
        return Partial("max" if norm_type > 0 else "min")
    return _NormPartial(norm_type)


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
