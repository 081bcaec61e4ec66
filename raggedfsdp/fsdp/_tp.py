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

The composed mesh is built from the existing process groups (no new group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

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


_COMPOSED: dict[tuple, DeviceMesh] = {}


def tp_spec_of(fqn: str, param: torch.Tensor, dp_mesh: DeviceMesh) -> TPSpec | None:
    """The TP placement of ``param``, or None for a plain tensor.

    Raises:
        ValueError: a DTensor on a mesh that is not a ``tp`` axis beside ``dp_mesh``
            (another root mesh, an axis of ``dp_mesh`` itself, or no dim names).
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
    names, dp_names = mesh.mesh_dim_names, dp_mesh.mesh_dim_names
    if not names or not dp_names:
        raise ValueError(
            f"{where}: FSDP x TP needs named mesh dims; build the mesh with "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp')) and pass mesh['dp'] to fully_shard"
        )
    if names[0] in dp_names:
        raise ValueError(
            f"{where}: its axis {names[0]!r} is one of the fully_shard mesh's dims {dp_names}; "
            "a parameter already sharded over the data-parallel ranks cannot be sharded again"
        )
    root = mesh._get_root_mesh()
    if dp_mesh._get_root_mesh() != root:
        raise ValueError(
            f"{where}, which is not part of the fully_shard mesh {dp_mesh}'s device mesh; "
            "slice both from one init_device_mesh(...) (mesh['dp'] and mesh['tp'])"
        )
    placements = tuple(param.placements)
    for p in placements:
        if type(p) is Shard:
            n = mesh.size(0)
            if param.shape[p.dim] % n:
                raise NotImplementedError(
                    f"{where} placed {p}: dim {p.dim} of shape {tuple(param.shape)} does not "
                    f"split evenly over {n} tp ranks, and RaggedShard composes with an even "
                    "Shard only (ranks would hold TP pieces of different shapes); pad the dim "
                    "or choose a tp size that divides it"
                )
        elif not isinstance(p, Replicate):
            raise NotImplementedError(
                f"{where} placed {p}; FSDP x TP composes RaggedShard with Shard(d) or "
                "Replicate() on tp (not Partial or strided placements)"
            )
    return TPSpec(
        mesh, placements, param.shape, tuple(param.stride()), _composed_mesh(mesh, dp_mesh)
    )


def _composed_mesh(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> DeviceMesh:
    """The ``(tp, *dp dims)`` mesh of this rank, over the existing process groups."""
    root = tp_mesh._get_root_mesh()
    names = (*tp_mesh.mesh_dim_names, *dp_mesh.mesh_dim_names)
    in_root = [n for n in root.mesh_dim_names if n in names]  # root order
    sub = root[tuple(in_root)] if len(in_root) < root.ndim else root
    order = [in_root.index(n) for n in names]
    ranks = sub.mesh.permute(order).contiguous()
    key = (names, tuple(ranks.flatten().tolist()), tp_mesh.device_type)
    if key not in _COMPOSED:
        groups = [tp_mesh.get_group(0)] + [dp_mesh.get_group(i) for i in range(dp_mesh.ndim)]
        _COMPOSED[key] = DeviceMesh.from_group(
            groups, tp_mesh.device_type, mesh=ranks, mesh_dim_names=names
        )
    return _COMPOSED[key]
