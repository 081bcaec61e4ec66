"""DTensor custom op handlers for norms, amax and amin, and the propagation's install."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._sharding_prop import LocalLRUCache
from torch.utils import _pytree as pytree

from raggedfsdp.tensor._dtensor_ext import rowwise
from raggedfsdp.tensor._dtensor_ext.propagation import (
    _NEW_FACTORIES,
    _ragged_output_sharding,
    _schema_is_ragged,
)

aten = torch.ops.aten


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
    rowwise._torch_propagate = original

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
