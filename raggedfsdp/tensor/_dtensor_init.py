"""What model-init code calls on a RaggedShard DTensor (torch 2.13).

Installed by ``install()``, which ``raggedfsdp.tensor`` calls after
``_dtensor_ext.install()`` (see [Note: DTensor patches]):
in-place random ops, ``any`` / ``all`` and ``select`` as DTensor custom op handlers.
torch's state-dict helpers get their RaggedShard branch with the other checkpoint
patches, in ``_dtensor_ext/dcp.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp.tensor._dtensor_ext import (
    _is_ragged,
    _to_torch,
    ragged_axis,
    ragged_piece,
)
from raggedfsdp.tensor.placement import RaggedShard

__all__ = [
    "RANDOM_INPLACE",
    "any_all_handler",
    "install",
    "random_handler",
    "select_handler",
]

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# Custom op handlers
# ---------------------------------------------------------------------------------------------
# [Note: random init of RaggedShard]
# An in-place random op (``normal_``, ``uniform_``, ... as ``nn.init`` calls them) on a
# RaggedShard DTensor draws the *whole* tensor on every rank, with the generator it was
# given (or the device's default one), and keeps the rank's rows. Contract: with the
# same generator state on every rank (``torch.manual_seed(s)`` everywhere, as model
# init does), the full tensor is bit-identical to what the op gives an unsharded
# tensor with that state, at any world size and any block policy, on the CPU as on an
# accelerator; and every rank's generator advances as the unsharded op advances it.
# Cost: one transient full-size tensor per call, and the time of drawing it on one
# device (as single-device init). FSDP2's DTensor random ops, by contrast, draw only
# the local shard with offset-based Philox on CUDA, and on the CPU draw each shard
# from the local generator (the full tensor then depends on the world size).
RANDOM_INPLACE = (
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.cauchy_.default,
    aten.log_normal_.default,
    aten.geometric_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),  # 'from' is a Python keyword
    aten.random_.to,
)


def random_handler(op_call, args, kwargs):
    """DTensor custom handler for in-place random ops: see [Note: random init of RaggedShard]."""
    target = args[0]
    if not (isinstance(target, DTensor) and _is_ragged(target._spec)):
        return _to_torch(op_call, args, kwargs)
    if any(isinstance(a, DTensor) for a in (*args[1:], *kwargs.values())):
        raise NotImplementedError(f"{op_call} with DTensor arguments on a RaggedShard DTensor")
    local = target._local_tensor
    if local.device.type != "meta":
        piece = ragged_piece(tuple(target.shape), target.device_mesh, target.placements)
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        op_call(full, *args[1:], **kwargs)  # the whole tensor, as one device draws it
        local.copy_(piece.rows(full))
    return target


def any_all_handler(op_call, args, kwargs):
    """``any()`` / ``all()`` of a whole RaggedShard DTensor, reduced now to a Replicate
    bool: code branches on it (``nn.init.trunc_normal_``'s rejection loop), and a
    Partial's ``bool()`` would read this rank's part only. An empty shard gives the
    identity (False / True)."""
    target = args[0]
    if not (isinstance(target, DTensor) and _is_ragged(target._spec)) or len(args) > 1 or kwargs:
        return _to_torch(op_call, args, kwargs)
    axis, _ = ragged_axis(target.placements)
    mesh = target.device_mesh
    local = op_call(target._local_tensor).to(torch.uint8)
    op = dist.ReduceOp.MAX if op_call is aten.any.default else dist.ReduceOp.MIN
    for i, p in enumerate(target.placements):  # the RaggedShard and any Shard before it
        if not p.is_replicate():
            dist.all_reduce(local, op=op, group=mesh.get_group(i))
    return DTensor.from_local(local.bool(), mesh, [Replicate()] * mesh.ndim, run_check=False)


def select_handler(op_call, args, kwargs):
    """``t[i]`` / ``t.select(0, i)`` of a RaggedShard DTensor: a view of the selected rows
    where they live, itself a RaggedShard DTensor (HF's ``zeros_(weight[padding_idx])``
    writes through to the parameter). Rows are never split, so no data moves."""
    target = args[0]
    if not (isinstance(target, DTensor) and _is_ragged(target._spec)):
        return _to_torch(op_call, args, kwargs)
    dim, index = (args[1], args[2]) if len(args) > 2 else (kwargs["dim"], kwargs["index"])
    shape = tuple(target.shape)
    axis, rs = ragged_axis(target.placements)
    if any(not p.is_replicate() for i, p in enumerate(target.placements) if i != axis):
        raise NotImplementedError(
            f"select of a DTensor placed {target.placements}: only a RaggedShard beside "
            "Replicate() is supported; redistribute to Replicate() first"
        )
    k = len(rs.dims)
    if dim % len(shape) != 0 or len(shape) < 2:
        raise NotImplementedError(
            f"select(dim={dim}) of a RaggedShard DTensor of shape {shape}: only dim 0 of a "
            "tensor of 2 or more dims is supported; redistribute to Replicate() first"
        )
    index = index % shape[0]
    mesh, world = target.device_mesh, target.device_mesh.size(axis)
    inner = math.prod(shape[1:k])  # rows of one index of dim 0
    first, stop = index * inner, (index + 1) * inner
    rows = [rs.local_row_range(shape, r) for r in range(world)]
    counts = [max(0, min(hi, stop) - max(lo, first)) for lo, hi in rows]
    out_shape = shape[1:]
    if k == 1:  # one row: the whole result is one block on the rank holding it
        placement = RaggedShard((0,), tuple(int(c > 0) for c in counts))
    else:  # its rows, one block per row
        placement = RaggedShard(tuple(range(k - 1)), tuple(counts))
    me = mesh.get_local_rank(axis)
    lo = rows[me][0]
    start = max(lo, first) - lo
    local = target._local_tensor
    local = local[start] if k == 1 and counts[me] else local[start : start + counts[me]]
    if k == 1 and not counts[me]:
        local = local.new_empty((0, *out_shape[1:]))
    placements = tuple(placement if i == axis else p for i, p in enumerate(target.placements))
    stride = torch.empty(out_shape, device="meta").stride()
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(out_shape, stride, target.dtype))
    return DTensor(local, spec, requires_grad=False)


def install() -> None:
    """Register the custom op handlers. Idempotent: the same functions land in the same
    slots."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in RANDOM_INPLACE:
        handlers[op] = random_handler
    for op in (aten.any.default, aten.all.default):
        handlers[op] = any_all_handler
    handlers[aten.select.int] = select_handler
