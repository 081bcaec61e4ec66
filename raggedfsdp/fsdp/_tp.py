"""FSDP x TP: parameters that tensor parallelism already placed on a ``tp`` mesh axis.

[Note: FSDP x TP]
A module parallelized with ``parallelize_module`` on the ``tp`` axis of a ``(dp, tp)``
mesh holds DTensor parameters placed ``Shard(d)`` or ``Replicate()`` on ``tp``; then
``fully_shard(block, mesh=mesh["dp"])`` as with FSDP2. raggedfsdp plans and cuts the
parameter's *TP-local* tensor: the planner lays out the local shapes, RaggedShard
blocks count local rows, and every collective of the group runs over ``dp`` alone
(the local tensors of one tp coordinate form one ordinary buffer).

- The sharded parameter is a DTensor on the ``(tp, dp)`` mesh (the tp axis first)
  placed ``(tp placement, RaggedShard)``: placements apply left to right, so tp cuts
  the global tensor and RaggedShard cuts the rows of the TP-local piece (see
  [Note: composed placements] in ``_dtensor_ext.py``). Under HSDP the mesh is
  ``(tp, replicate, shard)`` with ``Replicate()`` on replicate.
- The unsharded parameter the module sees is the TP DTensor, as the module had it,
  its local tensor a view of the group's global storage; its ``.grad`` likewise a
  view of the global gradient storage (autograd accumulates into it in place, a
  Partial gradient of a tp-Replicate parameter all-reduced over tp on the way).
- A ``Shard(d)`` that splits its dim unevenly (27 rows over 2 tp ranks: pieces of 14
  and 13) is planned as each rank's own piece: the ranks of one tp coordinate share a
  piece shape and so one layout, and the TP DTensor is rebuilt with its global shape
  and stride given explicitly.

The composed mesh is built from the ranks of both meshes, however they were made, over
the existing process groups (no new group): see [Note: meshes as given] in ``_mesh.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp.fsdp._mesh import compose, dim_group_ranks, same_ranks_dim

__all__ = ["TPSpec", "tp_spec_of"]


@dataclass(frozen=True)
class TPSpec:
    """How tensor parallelism placed one parameter, and the mesh its sharded form lives on."""

    mesh: DeviceMesh  # the parameter's 1-D tp mesh
    placements: tuple  # on ``mesh``: Shard(d) or Replicate()
    shape: torch.Size  # global
    stride: tuple[int, ...]  # global
    composed_mesh: DeviceMesh  # (tp, *dp dims)

    def spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The unsharded parameter's DTensor spec (the module's own TP spec)."""
        return DTensorSpec(
            self.mesh, self.placements, tensor_meta=TensorMeta(self.shape, self.stride, dtype)
        )

    def unsharded(self, local: torch.Tensor, requires_grad: bool) -> DTensor:
        """``local`` (a view of the global storage) as the module's TP DTensor."""
        return DTensor(local, self.spec(local.dtype), requires_grad=requires_grad)


def tp_spec_of(fqn: str, param: torch.Tensor, dp_mesh: DeviceMesh) -> TPSpec | None:
    """The TP placement of ``param``, or None for a plain tensor.

    The parameter's mesh and ``dp_mesh`` may be built in any way (see [Note: meshes as
    given] in ``_mesh.py``); they are compared by their ranks, not their names. A
    ``Shard(d)`` that splits its dim unevenly is taken: each rank plans its own TP piece.

    Raises:
        ValueError: a DTensor on a mesh that runs along ``dp_mesh``'s ranks (one of its
            dims, or overlapping them).
        NotImplementedError: a placement the composed placement cannot express.
    """
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    where = f"fully_shard: parameter {fqn!r} is a DTensor on mesh {mesh}"
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"{where} ({mesh.ndim}-D); FSDP x TP takes a parameter on one tp mesh axis: "
            "parallelize it on mesh['tp']"
        )
    same = same_ranks_dim(mesh, dp_mesh)
    if same is not None:
        raise ValueError(
            f"{where}, over ranks {dim_group_ranks(mesh, 0)}: its axis is one of the "
            f"fully_shard mesh's dims (dim {same} of {dp_mesh}); a parameter already sharded "
            "over the data-parallel ranks cannot be sharded again"
        )
    placements = tuple(param.placements)
    for p in placements:
        if type(p) is not Shard and not isinstance(p, Replicate):
            raise NotImplementedError(
                f"{where} placed {p}; FSDP x TP composes RaggedShard with Shard(d) or "
                "Replicate() on tp (not Partial or strided placements)"
            )
    try:
        composed = compose(mesh, dp_mesh)
    except ValueError as e:
        raise ValueError(
            f"{where}, which overlaps the fully_shard mesh {dp_mesh} ({e}); parallelize it on "
            "a mesh of other ranks than the data-parallel ones"
        ) from None
    return TPSpec(mesh, placements, param.shape, tuple(param.stride()), composed)
