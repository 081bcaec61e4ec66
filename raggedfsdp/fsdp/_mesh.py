"""Meshes as given: the data-parallel dims of a buffer and the mesh of a TP/EP parameter,
read from the meshes and process groups a caller passes, however they were built.

[Note: meshes as given]
A caller reaches ``fully_shard`` with meshes built in many ways: ``init_device_mesh``
and named slices (``mesh["dp"]``), ``_unflatten`` of a 1-D world mesh (torchtitan builds
every mesh so, one unflatten per family: its ``tp`` and its ``fsdp`` dims come from two
different unflattens, and neither name is in the world mesh), ``_flatten`` of several
dims, ``DeviceMesh.from_group`` (no names at all), and a mesh per parameter
(``shard_placement_fn`` returning torch's ``ShardPlacementResult``, whose mesh info
names the mesh and its shard / replicate dims). This module never compares meshes by
names in a root mesh. It compares:

- **data-parallel meshes by their process groups**, ``(shard group, replicate group)``
  (as FSDP2 groups its parameters): parameters whose groups agree share a buffer;
- **a TP/EP parameter's mesh with the data-parallel mesh by rank layout**: the
  sharded parameter lives on the ``(tp, *dp dims)`` mesh whose rank grid is read from
  the meshes' layouts over their common rank map (every mesh sliced, flattened or
  unflattened from one root shares it), or, for meshes made from process groups,
  from this rank's groups (``grid[i, j] = tp[i] + dp[j] - rank``: the strided grid
  every DeviceMesh constructor makes). The composed mesh reuses both process groups
  (``DeviceMesh.from_group``): no new group is created.
"""

from __future__ import annotations

import weakref
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

__all__ = [
    "compose",
    "concat_dims",
    "dim_group_ranks",
    "dp_key",
    "placement_and_mesh",
    "same_ranks_dim",
    "shard_mesh",
]


def dp_key(mesh: DeviceMesh) -> tuple:
    """What identifies a data-parallel mesh: its ``(shard group, replicate group)``
    (the replicate group None on a 1-D mesh)."""
    return mesh.get_group(mesh.ndim - 1), mesh.get_group(0) if mesh.ndim == 2 else None


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of ``mesh``'s shard dim (its last), named or not."""
    return mesh if mesh.ndim == 1 else _dim_mesh(mesh, mesh.ndim - 1)


def dim_group_ranks(mesh: DeviceMesh, dim: int) -> list[int]:
    """The global ranks of this rank's group on ``dim`` of ``mesh``, in mesh order."""
    return dist.get_process_group_ranks(mesh.get_group(dim))


def _dim_mesh(mesh: DeviceMesh, dim: int) -> DeviceMesh:
    names = mesh.mesh_dim_names
    if names:
        return mesh[names[dim]]
    return DeviceMesh.from_group(mesh.get_group(dim), mesh.device_type)


def placement_and_mesh(fqn: str, result, default: DeviceMesh) -> tuple[Shard | None, DeviceMesh]:
    """A ``shard_placement_fn`` result as ``(placement, data-parallel mesh)``.

    ``None`` and ``Shard(d)`` keep ``default``; torch's ``ShardPlacementResult`` gives the
    parameter its own mesh, read from its mesh info: the shard dim alone (a 1-D mesh,
    FSDP) or the ``(replicate, shard)`` dims (HSDP), whatever the order and number of
    dims of the mesh it names.

    Raises:
        ValueError: a result of another type, or mesh info without a shard dim.
    """
    if result is None or isinstance(result, Shard):
        return result, default
    info = getattr(result, "mesh_info", None)
    if type(result).__name__ != "ShardPlacementResult" or info is None:
        raise ValueError(
            f"fully_shard: shard_placement_fn gives parameter {fqn!r} {result!r}; expected "
            "None, Shard(dim) or torch's ShardPlacementResult(placement, mesh_info)"
        )
    mesh, shard = info.mesh, getattr(info, "shard_mesh_dim", None)
    replicate = getattr(info, "replicate_mesh_dim", None)
    if shard is None:
        raise ValueError(
            f"fully_shard: shard_placement_fn gives parameter {fqn!r} mesh info without a "
            f"shard dim ({type(info).__name__}); give it FSDPMeshInfo or HSDPMeshInfo"
        )
    if replicate is None:
        return result.placement, _dim_mesh(mesh, shard) if mesh.ndim > 1 else mesh
    if mesh.ndim == 2 and (replicate, shard) == (0, 1):
        return result.placement, mesh
    return result.placement, _concat([_dim_mesh(mesh, replicate), _dim_mesh(mesh, shard)])


def same_ranks_dim(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> int | None:
    """The dim of ``dp_mesh`` whose ranks are the 1-D ``tp_mesh``'s, if one is."""
    ranks = dim_group_ranks(tp_mesh, 0)
    for d in range(dp_mesh.ndim):
        if dim_group_ranks(dp_mesh, d) == ranks:
            return d
    return None


# Composed meshes by (process-group names, dim names, device), each kept with weak
# references to the groups it was made over: torch names groups by a counter that starts
# again after destroy_process_group, so a name alone may mean another group (other ranks)
# in the next process group. A hit counts only while those very groups are the ones asked
# for; a stale entry is made again.
_COMPOSED: dict[tuple, tuple[tuple[weakref.ref, ...], DeviceMesh]] = {}


def compose(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> DeviceMesh:
    """The ``(tp, *dp dims)`` mesh of this rank, over the two meshes' process groups.

    Raises:
        ValueError: the two meshes share ranks other than this one (they overlap: the
            parameter's mesh runs along a data-parallel dim).
    """
    return concat_dims([tp_mesh], dp_mesh)


def concat_dims(first: list[DeviceMesh], dp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of the 1-D meshes ``first`` (in order), then ``dp_mesh``'s dims.

    Raises:
        ValueError: the meshes overlap (a rank grid that repeats a rank).
    """
    return _concat([*first, *(_dim_mesh(dp_mesh, d) for d in range(dp_mesh.ndim))])


def _concat(meshes: list[DeviceMesh]) -> DeviceMesh:
    """The mesh whose dims are the 1-D ``meshes``' (in order), over their process groups."""
    groups = [m.get_group(0) for m in meshes]
    names = [m.mesh_dim_names[0] if m.mesh_dim_names else None for m in meshes]
    if None in names or len(set(names)) < len(names):
        names = [f"dim{i}" for i in range(len(meshes))]
    key = (tuple(g.group_name for g in groups), tuple(names), meshes[0].device_type)
    cached = _COMPOSED.get(key)
    if cached is not None and all(ref() is g for ref, g in zip(cached[0], groups)):
        return cached[1]
    grid = _grid(meshes)  # (sizes...) global ranks
    if len(set(grid.flatten().tolist())) != grid.numel():
        raise ValueError(
            f"the meshes {meshes} overlap: their rank grid {grid.tolist()} repeats a "
            "rank; each mesh must run along other ranks"
        )
    mesh = DeviceMesh.from_group(
        groups,
        meshes[0].device_type,
        mesh=grid,
        mesh_dim_names=tuple(cast(list[str], names)),  # no None: replaced above
    )
    _COMPOSED[key] = (tuple(weakref.ref(g) for g in groups), mesh)
    return mesh


def _grid(meshes: list[DeviceMesh]) -> torch.Tensor:
    """This rank's grid of global ranks of the product of the 1-D ``meshes``: from their
    layouts where they share one rank map, else from this rank's groups."""
    rank = dist.get_rank()
    rank_map = meshes[0]._flatten_rank_map
    if all(m._flatten_rank_map == rank_map for m in meshes):
        from torch.distributed._mesh_layout import _MeshLayout

        layout = _MeshLayout([m._layout[0] for m in meshes])
        if layout.collapse().check_orthogonal():
            full = layout.remap_to_tensor(meshes[0]._rank_map)  # (groups, *sizes)
            mine = [g for g in full if bool((g == rank).any())]
            if len(mine) == 1:
                return mine[0].to(torch.int)
    grid = torch.zeros((), dtype=torch.int)
    for m in meshes:  # strided grids: each dim adds its offset from this rank
        ranks = torch.tensor(dim_group_ranks(m, 0), dtype=torch.int) - rank
        grid = grid.unsqueeze(-1) + ranks
    return grid + rank
