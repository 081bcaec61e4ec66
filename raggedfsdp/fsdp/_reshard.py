"""``reshard_after_forward``: its values, as FSDP2 reads them, and the smaller group an int
keeps a group's parameters sharded over after forward."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch.distributed as dist

from raggedfsdp.fsdp._device import new_group_like

__all__ = ["PostForwardGroup", "resolve_reshard_after_forward"]


class PostForwardGroup(NamedTuple):
    """The smaller group a ``reshard_after_forward=int`` group stays sharded over."""

    process_group: dist.ProcessGroup
    position: int  # this rank's index in it
    size: int


def resolve_reshard_after_forward(
    value: bool | int | None, mesh_size: int, *, warn: bool = False
) -> tuple[bool, int | None]:
    """``(reshard after forward, size of the post-forward group or None)``, as FSDP2.

    Raises:
        ValueError: not a bool, an int or None; an int that is not a factor of the
            mesh size.
    """
    if value is None or isinstance(value, bool):
        return value is not False, None
    m = mesh_size
    if not isinstance(value, int) or value < 1 or value > m or m % value:
        raise ValueError(
            f"fully_shard: reshard_after_forward={value!r}: an int must be a factor of the "
            f"mesh size {m} (the group size to keep parameters sharded over after forward); "
            "pass True, False, None or a factor"
        )
    if value == 1:
        if warn:
            warnings.warn(
                "fully_shard: reshard_after_forward=1 (int) means resharding parameters to "
                "world size 1, i.e. keeping them unsharded until backward (as FSDP2); pass "
                "True to free them after forward",
                stacklevel=4,
            )
        return False, None
    if value == m:
        return True, None
    return True, value


def _post_forward_group(mesh, size: int) -> PostForwardGroup:
    """This rank's group of ``size`` consecutive ranks of ``mesh`` (``reshard_after_forward``)."""
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard: reshard_after_forward={size} on a {mesh.ndim}-D mesh (HSDP) is not "
            "supported; pass True or False"
        )
    ranks = mesh.mesh.flatten().tolist()
    mine = None
    for start in range(0, len(ranks), size):
        members = ranks[start : start + size]
        pg = new_group_like(members, mesh.get_group(0))  # every rank makes every group
        if dist.get_rank() in members:
            mine = PostForwardGroup(pg, members.index(dist.get_rank()), size)
    assert mine is not None  # the groups cover every rank of the mesh
    return mine
