"""The SPMD mesh: ``fully_shard(module, mesh=<whole mesh>, dp_mesh_dims=...)``.

[Note: the SPMD mesh]
torch 2.13's FSDP2 takes, besides a data-parallel mesh, the whole mesh of a model whose
parameters are already DTensors on it (``distribute_module``, torchtitan's ``spmd_types``
and ``full_dtensor`` backends), with ``DataParallelMeshDims`` naming its data-parallel
dims: ``shard`` (FSDP; several names are flattened into one dim) and ``replicate`` (HSDP).
Every parameter must be ``Replicate()`` on those dims; its other dims (tp, cp, ...) keep
the caller's ``Shard(d)`` or ``Replicate()``.

raggedfsdp reads it as FSDP x TP read from one mesh:

- the group's data-parallel mesh is the shard dim (1-D), or ``(replicate, shard)``;
- each parameter's local tensor (its piece under the model dims) is what the planner lays
  out, as for FSDP x TP ([Note: FSDP x TP] in ``_tp.py``);
- the sharded parameter lives on ``(model dims..., [replicate], shard)`` placed
  ``(model placements..., [Replicate()], RaggedShard)``: the mesh's own dims, the
  data-parallel ones moved last (FSDP2 keeps the mesh's order and writes
  ``_StridedShard`` where a model dim cuts the same tensor dim; the values are the same);
- the unsharded parameter is the caller's DTensor spec over a view of the global storage;
- a gradient keeps its placements on the data-parallel dims (``Partial()`` where the batch
  is sharded over them): its local tensor is accumulated in the gradient storage and
  reduce-scattered with FSDP2's divide factors; its model dims are redistributed to the
  parameter's placements first, as FSDP2 does.

So a sharded model of this mode is the one classic ``fully_shard(mesh=mesh['dp'])`` makes
of the same TP model: optimizers, checkpoints and reshards see the same DTensors, and a
checkpoint moves between the two modes.

A parameter that ``shard_placement_fn`` gives a mesh of its own (torch's
``ShardPlacementResult``, its mesh info holding its whole mesh and data-parallel dims: the
routed experts of torchtitan's MoE on their sparse mesh) is read the same way from its
own whole mesh, in buffers of its own ([Note: a mesh per parameter] in ``_planning.py``).

Not taken (each refused by name): a mesh without a shard dim (``replicate`` alone: DDP),
an int ``reshard_after_forward`` (FSDP2 refuses it too), and placements other than
``Shard(d)`` / ``Replicate()`` on the model dims.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from raggedfsdp.fsdp._mesh import concat_dims
from raggedfsdp.fsdp._tp import TPSpec

__all__ = ["SPMDMesh", "spmd_mesh", "spmd_of_placement"]


@dataclass(frozen=True)
class SPMDMesh:
    """The whole mesh of a ``dp_mesh_dims`` call and what ``fully_shard`` reads from it."""

    full: DeviceMesh  # the mesh the parameters are DTensors on
    dp: DeviceMesh  # the group's mesh: (shard,) or (replicate, shard)
    dp_axes: tuple[int, ...]  # dims of ``full`` that are data-parallel
    model_axes: tuple[int, ...]  # the others, in order

    def spec_of(self, fqn: str, param: nn.Parameter) -> TPSpec:
        """How ``param`` is placed on the whole mesh (see [Note: the SPMD mesh]).

        Raises:
            ValueError: a plain tensor, a DTensor on another mesh, or one not
                ``Replicate()`` on a data-parallel dim (FSDP2's checks).
            NotImplementedError: a placement other than ``Shard(d)`` or ``Replicate()`` on a
                model dim.
        """
        names = self.full.mesh_dim_names
        assert names is not None  # checked by spmd_mesh
        if not isinstance(param, DTensor):
            raise ValueError(
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full "
                f"SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter "
                f"{fqn!r}: distribute it on the mesh given to fully_shard, Replicate() on "
                f"the data-parallel dims"
            )
        if param.device_mesh != self.full:
            raise ValueError(
                "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but "
                f"parameter {fqn!r} is on {param.device_mesh}, not {self.full}"
            )
        placements = tuple(param.placements)
        for i in self.dp_axes:
            if not isinstance(placements[i], Replicate):
                raise ValueError(
                    f"Expected Replicate() on DP dim {names[i]!r} (index {i}) but got "
                    f"{placements[i]} for parameter {fqn!r}; the data-parallel dims hold the "
                    "whole parameter until fully_shard shards it"
                )
        for i in self.model_axes:
            p = placements[i]
            if type(p) is not Shard and not isinstance(p, Replicate):
                raise NotImplementedError(
                    f"fully_shard: parameter {fqn!r} is placed {p} on mesh dim {names[i]!r}; "
                    "with dp_mesh_dims raggedfsdp composes RaggedShard with Shard(d) or "
                    "Replicate() on the other dims (not Partial or strided placements)"
                )
        if self.model_axes:
            composed = concat_dims([self.full[names[i]] for i in self.model_axes], self.dp)
        else:
            composed = self.dp
        return TPSpec(
            mesh=self.full,
            placements=placements,
            shape=param.shape,
            stride=tuple(param.stride()),
            composed_mesh=composed,
            model_placements=tuple(placements[i] for i in self.model_axes),
            dp_axes=self.dp_axes,
        )


def spmd_mesh(mesh: DeviceMesh, dims) -> SPMDMesh:
    """The ``SPMDMesh`` of ``fully_shard(mesh=mesh, dp_mesh_dims=dims)``.

    Raises:
        ValueError: FSDP2's checks of ``dp_mesh_dims`` (neither dim named, a mesh without
            dim names, a name not in the mesh), and a dim named twice.
        NotImplementedError: ``replicate`` alone (FSDP2's DDP mode).
    """
    shard = _names(getattr(dims, "shard", None))
    replicate = _names(getattr(dims, "replicate", None))
    if not (hasattr(dims, "shard") or hasattr(dims, "replicate")):
        raise ValueError(
            "fully_shard: dp_mesh_dims must be torch.distributed.fsdp.DataParallelMeshDims("
            f"shard=..., replicate=...), got {type(dims).__name__}"
        )
    if not shard and not replicate:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided: "
            "init_device_mesh(..., mesh_dim_names=...)"
        )
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    if len(set(shard + replicate)) < len(shard + replicate):
        raise ValueError(
            f"fully_shard: dp_mesh_dims names a mesh dim twice (shard={shard}, replicate="
            f"{replicate}); name each data-parallel dim once"
        )
    if not shard:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims with replicate={replicate} and no shard dim (FSDP2's "
            "DDP mode) is not supported: raggedfsdp shards; name the dim as shard= (FSDP) "
            "or keep replicate= beside a shard dim (HSDP)"
        )
    shard_mesh = _one_dim(mesh, shard)
    dp = shard_mesh
    if replicate:
        dp = concat_dims([_one_dim(mesh, replicate)], shard_mesh)
    dp_axes = tuple(sorted(names.index(n) for n in (*shard, *replicate)))
    model_axes = tuple(i for i in range(mesh.ndim) if i not in dp_axes)
    return SPMDMesh(mesh, dp, dp_axes, model_axes)


def spmd_of_placement(fqn: str, result) -> SPMDMesh:
    """The ``SPMDMesh`` of a parameter that ``shard_placement_fn`` gives a mesh of its own
    (torch's ``ShardPlacementResult``) in a ``dp_mesh_dims`` call: its mesh info names its
    whole mesh and data-parallel dims (torchtitan's routed experts on their sparse mesh).

    Raises:
        NotImplementedError: mesh info without them (a classic data-parallel mesh).
    """
    info = result.mesh_info
    full, dims = getattr(info, "spmd_mesh", None), getattr(info, "dp_mesh_dims", None)
    if full is None or dims is None:
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn gives parameter {fqn!r} a classic data-parallel "
            "mesh in a dp_mesh_dims call; give it the mesh info of its whole mesh "
            "(_get_mesh_info(mesh, dp_mesh_dims)), or return None or Shard(d)"
        )
    return spmd_mesh(full, dims)


def _names(dim) -> tuple[str, ...]:
    if dim is None:
        return ()
    return (dim,) if isinstance(dim, str) else tuple(dim)


def _one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh of ``names`` (several are flattened into one dim, as FSDP2 does)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))
