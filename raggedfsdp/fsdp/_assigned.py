"""What a group adopts when a value is put in a sharded parameter's place: checked, and
cut to this rank's piece of the shard storage (``ParamGroup.adopt_assigned`` and
``ParamGroup.adopt_registered`` copy the pieces in).

[Note: assigned parameters]
An assigning load (Hugging Face accelerate's ``cpu_ram_efficient_loading``, torch's
``set_model_state_dict`` on a meta model) replaces each module's sharded parameter with
the state dict's tensor, outside the buffer. Each one is taken by the module's
load_state_dict post-hook (``adopt_assigned``): a DTensor on the parameter's own mesh with
its own placements gives its local tensor; a plain tensor of the full shape gives this
rank's rows. The values are copied into the shard storage (rebuilt on their device, as
``reset_after_apply`` does, when the group was on meta or on another device), and every
parameter is again a view of it: the assigned DTensor parameter keeps its identity, its
local tensor now the view. A parameter a partial load (``strict=False``) left on meta is
listed in ``unloaded`` until a later load assigns it; a forward before then raises,
naming it.

[Note: parameters registered after fully_shard]
Between ``fully_shard`` and the first forward a model may put new values in its
parameters' place: re-assign one (``module.w = nn.Parameter(...)``: re-init, a norm
computed from other weights), or materialize a submodule inside the group
(``submodule.to_empty(device)``, any ``Module._apply`` on it, as torchtune's LoRA recipe
does): ``Module._apply`` swaps a DTensor parameter's contents, so it keeps its identity
but no longer views the shard storage. FSDP2 takes each such value at lazy init; so does
raggedfsdp (``adopt_registered``), through [Note: assigned parameters]'s path: a DTensor
on the parameter's mesh gives its rows (redistributed to the parameter's RaggedShard if
its placements differ), a plain tensor of the full shape this rank's rows; the storages
are rebuilt on the values' device when they were on meta. After lazy init, as in FSDP2, a
module's parameters are the group's: a later re-assignment is replaced at the next
unshard (``load_state_dict`` and the fully_shard module's own ``to_empty`` / ``to`` still
rebuild the storages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._records import ParamRef
from raggedfsdp.fsdp._subclass import values_of

if TYPE_CHECKING:
    from raggedfsdp.fsdp.dbuffer import DBuffer

__all__ = ["assigned_piece", "held", "views_shard"]


def held(ref: ParamRef) -> nn.Parameter:
    """The parameter ``ref``'s first module holds (``register`` put it there, or a load)."""
    module, name = ref.uses[0]
    return cast(nn.Parameter, module._parameters[name])


def views_shard(param: torch.Tensor, shard: torch.Tensor) -> bool:
    """Whether ``param`` (a sharded parameter) is still a view of ``shard`` (a group's shard
    storage)."""
    if not isinstance(param, DTensor):
        return False
    local = values_of(param._local_tensor)
    return local.untyped_storage()._cdata == shard.untyped_storage()._cdata


def assigned_piece(
    ref: ParamRef,
    new: torch.Tensor,
    name: str,
    group: str,
    mesh,
    placements: tuple,
    dtype: torch.dtype,
    rank: int,
    dbuf: DBuffer,
    *,
    registered: bool,
) -> torch.Tensor:
    """This rank's part of the tensor an assigning load (or, with ``registered``, the
    model before lazy init) put in ``ref``'s place, shaped as its shard view.

    Args:
        name: the parameter, as messages name it (its key in the state dict).
        group: the group, as messages name it.
        mesh, placements: the sharded parameter's (``ParamGroup.param_mesh``, ``placements``).
        dtype: the group's buffer's.
        rank: this rank's index on the group's shard dim.
        dbuf: the group's storages (the shape of a piece still on meta).

    Raises:
        NotImplementedError: ``registered``, a tensor of another dtype than the buffer's.
        ValueError: a tensor of another dtype (a load), shape, mesh or placement, or of a
            kind that is neither (the parameter named, with the fix).
    """
    what = "fully_shard (first forward)" if registered else "load_state_dict(assign=True)"
    if registered:
        if new.dtype != dtype:
            raise NotImplementedError(
                f"fully_shard: parameter {name!r} of {group} now holds a tensor of "
                f"dtype {new.dtype}; its buffer holds {dtype}, and a group's buffers "
                "are planned per dtype when fully_shard runs: change the dtype of the "
                "module passed to fully_shard (module.to(dtype) re-plans its buffers), "
                "or before fully_shard"
            )
        if new.shape != ref.shape:
            raise ValueError(
                f"fully_shard: parameter {name!r} of {group} now holds a tensor of "
                f"shape {tuple(new.shape)}, not {tuple(ref.shape)}; a group's buffers are "
                "planned when fully_shard runs: give it a tensor of its shape, or change "
                "the module before fully_shard"
            )
        if isinstance(new, DTensor) and new.device_mesh == mesh:
            if new.is_meta:  # still to be materialized: listed in ``unloaded``
                return torch.empty_like(dbuf.shard_view(ref.fqn), device="meta")
            if tuple(new.placements) != placements:
                new = new.redistribute(mesh, placements)
            return new._local_tensor
    fix = (
        "assign a DTensor made with the sharded parameter's own mesh and placements "
        "(distribute_tensor(full, param.device_mesh, param.placements), param from the "
        "model's state_dict()), or a full tensor, or load without assign=True"
    )
    if new.dtype != dtype:
        raise ValueError(
            f"{what}: parameter {name!r} was assigned a tensor of "
            f"dtype {new.dtype}; fully_shard holds it in {dtype}: cast the state "
            "dict's tensor to it, or load without assign=True (which casts)"
        )
    if isinstance(new, DTensor):
        if new.device_mesh == mesh and tuple(new.placements) == placements:
            return new._local_tensor
        raise ValueError(
            f"{what}: parameter {name!r} was assigned a DTensor "
            f"with placements {tuple(new.placements)} on {new.device_mesh}; expected "
            f"{placements} on {mesh} (its RaggedShard): {fix}"
        )
    if type(new) in (torch.Tensor, nn.Parameter) and new.shape == ref.shape:
        if ref.tp is not None:
            raise ValueError(
                f"{what}: parameter {name!r} is tensor-parallel "
                f"and was assigned a plain tensor; expected a DTensor with placements "
                f"{placements} on {mesh}: {fix}"
            )
        assert ref.placement is not None  # set by __init__
        return ref.placement.local_view(new.detach().contiguous(), rank)
    raise ValueError(
        f"{what}: parameter {name!r} was assigned a "
        f"{type(new).__name__} of shape {tuple(new.shape)}; expected a DTensor with "
        f"placements {placements} on {mesh} or a tensor of shape {tuple(ref.shape)}: {fix}"
    )
