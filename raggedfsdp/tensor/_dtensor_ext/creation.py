"""``DTensor.from_local`` and ``distribute_tensor`` with a RaggedShard."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.distributed.tensor._api as dtensor_api
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp.tensor._dtensor_ext.checks import _check, ragged_axis

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
