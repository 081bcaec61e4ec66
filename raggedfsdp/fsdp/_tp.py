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
  [Note: composed placements] in ``_dtensor_ext``). Under HSDP the mesh is
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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp.fsdp._mesh import compose, dim_group_ranks, same_ranks_dim

__all__ = ["TPSpec", "tp_spec_of"]


@dataclass(frozen=True)
class TPSpec:
    """How tensor parallelism placed one parameter, and the mesh its sharded form lives on.

    Two kinds: FSDP x TP (``mesh`` is the 1-D tp mesh, ``model_placements`` its placements)
    and the SPMD mesh (``mesh`` is the whole mesh given to ``fully_shard`` with
    ``dp_mesh_dims``; ``dp_axes`` are its data-parallel dims, ``Replicate()`` in
    ``placements``, and ``model_placements`` are those of its other dims: see [Note: the
    SPMD mesh] in ``_spmd.py``).
    """

    mesh: DeviceMesh  # the parameter's mesh: the 1-D tp mesh, or the whole SPMD mesh
    placements: tuple  # on ``mesh``: Shard(d) or Replicate()
    shape: torch.Size  # global
    stride: tuple[int, ...]  # global
    composed_mesh: DeviceMesh  # (model dims..., *dp dims): the sharded parameter's mesh
    model_placements: tuple  # on composed_mesh's model dims (all of ``placements`` for TP)
    dp_axes: tuple[int, ...] = ()  # SPMD: the dims of ``mesh`` the group's collectives reduce

    @property
    def model_parallel(self) -> bool:
        """Whether the sharded parameter's mesh has model dims before the data-parallel
        ones (FSDP x TP; the SPMD mesh with tp, cp... dims). False for a parameter of the
        SPMD mesh that has only data-parallel dims: its sharded form is a classic one."""
        return bool(self.model_placements)

    def spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The unsharded parameter's DTensor spec (the module's own TP spec)."""
        return DTensorSpec(
            self.mesh, self.placements, tensor_meta=TensorMeta(self.shape, self.stride, dtype)
        )

    def unsharded(self, local: torch.Tensor, requires_grad: bool) -> DTensor:
        """``local`` (a view of the global storage) as the module's TP DTensor."""
        return DTensor(local, self.spec(local.dtype), requires_grad=requires_grad)

    def grad_view(self, local: torch.Tensor, like: torch.Tensor | None = None) -> DTensor:
        """``local`` (a view of the global gradient storage) as the unsharded ``.grad``.

        Under FSDP x TP it is placed as the parameter. On the SPMD mesh the data-parallel
        dims take the placements of ``like``, the gradient autograd is about to add into
        it (``Partial()`` when ``like`` is None: the gradient of a parameter replicated
        over the batch's dims), so that accumulating it is a local add, as FSDP2 keeps a
        gradient's placements on those dims and reduces its local tensor.
        """
        if not self.dp_axes:
            return self.unsharded(local, False)
        spec = DTensorSpec(
            self.mesh,
            self.grad_placements(like),
            tensor_meta=TensorMeta(self.shape, self.stride, local.dtype),
        )
        return DTensor(local, spec, requires_grad=False)

    def grad_placements(self, like: torch.Tensor | None) -> tuple:
        """The placements of ``grad_view(..., like)``."""
        given = like.placements if isinstance(like, DTensor) else None
        return tuple(
            (given[i] if given is not None else Partial()) if i in self.dp_axes else p
            for i, p in enumerate(self.placements)
        )

    def grad_local(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of a gradient of the unsharded parameter, its model dims placed
        as the parameter's (redistributed where they differ, as FSDP2 does), its
        data-parallel dims as they are."""
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(
            grad.placements[i] if i in self.dp_axes else p for i, p in enumerate(self.placements)
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        return grad._local_tensor


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
    return TPSpec(mesh, placements, param.shape, tuple(param.stride()), composed, placements)
