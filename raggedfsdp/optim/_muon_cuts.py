"""Where a Muon parameter is cut across its mesh, and which cuts Muon takes.

``fully_shard`` cuts a parameter's rows with a ``RaggedShard`` on the mesh's last (shard)
dim; under HSDP a ``Replicate()`` comes before it, under tensor or expert parallelism one
``Shard(d)``. ``muon_cut`` reads those placements into a ``MuonCut`` that the step
(``_muon_exchange.py``) plans and exchanges with; ``check_muon_param`` and
``check_one_tp_group`` refuse, when a parameter group is added, the cuts the step cannot
take (see [Note: Muon under HSDP] and [Note: Muon under TP and EP] in
``_muon_exchange.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from raggedfsdp.optim.flat import name_of
from raggedfsdp.tensor import RaggedPiece, ragged_piece
from raggedfsdp.tensor.placement import RaggedShard

__all__ = ["MuonCut", "check_muon_param", "check_one_tp_group", "muon_cut"]


@dataclass(frozen=True)
class MuonCut:
    """Where ``fully_shard`` (and tensor or expert parallelism before it) cut a Muon
    parameter: see [Note: Muon under TP and EP]."""

    piece: RaggedPiece  # the RaggedShard and the TP-local piece it cuts
    group: dist.ProcessGroup  # the shard dim's
    tp_axis: int | None  # the mesh axis that cuts each matrix (None: every matrix whole)
    member_dim: int  # the dim of each member matrix that axis cuts
    tp_group: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int

    def piece_start(self, rank: int) -> int:
        """First element of shard rank ``rank``'s rows in the flattened TP-local piece."""
        rs, shape = self.piece.rs, self.piece.shape
        return rs.local_row_range(shape, rank)[0] * rs.row_numel(shape)


def muon_cut(p: Tensor) -> MuonCut | None:
    """How a Muon parameter is cut (None: whole on every rank)."""
    if not isinstance(p, DTensor) or not any(isinstance(q, RaggedShard) for q in p.placements):
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    piece = ragged_piece(tuple(p.shape), mesh, placements)
    cut: dict[str, Any] = dict(tp_axis=None, member_dim=0, tp_group=None, tp_size=1, tp_rank=0)
    for axis, q in enumerate(placements[: piece.axis]):
        if type(q) is Shard and not (p.dim() == 3 and q.dim == 0):  # Shard(0): whole experts
            cut = dict(
                tp_axis=axis,
                member_dim=q.dim - (p.dim() - 2),
                tp_group=mesh.get_group(axis),
                tp_size=mesh.size(axis),
                tp_rank=mesh.get_local_rank(axis),
            )
    return MuonCut(piece, mesh.get_group(piece.axis), **cut)


def check_one_tp_group(named: Sequence[tuple[str, Tensor]]) -> None:
    """Raise if the tensor-parallel Muon parameters of one shard group lie on two tp groups."""
    seen: dict[str, tuple[str, dist.ProcessGroup]] = {}
    for name, p in named:
        cut = muon_cut(p)
        if cut is None or cut.tp_group is None:
            continue
        first = seen.setdefault(cut.group.group_name, (name, cut.tp_group))
        if first[1] is not cut.tp_group:
            raise NotImplementedError(
                f"Muon: parameters {first[0]!r} and {name!r} are sharded over the same "
                "data-parallel ranks but cut by tensor parallelism over different process "
                "groups; one Muon optimizer gathers a shard group's matrices across one tp "
                "group: make one Muon per tp mesh"
            )


def check_muon_param(p: Tensor, fallback: str, distributed: str) -> None:
    """Raise, naming ``p`` (``fallback`` if it has no name), if Muon cannot step it: not a
    matrix or a stack of matrices, or cut otherwise than ``fully_shard`` cuts (with one tp
    or ep axis before it)."""
    name = name_of(p, fallback)
    if p.dim() not in (2, 3):
        raise ValueError(
            f"Muon: parameter {name!r} has shape {tuple(p.shape)}; a Muon parameter must be a "
            "matrix (out, in) or a stack of matrices (E, out, in); put it in a group with "
            "use_muon=False (AdamW), e.g. with muon_param_groups(model)"
        )
    if not isinstance(p, DTensor):
        return
    mesh, placements = p.device_mesh, tuple(p.placements)
    if not any(isinstance(q, RaggedShard) for q in placements):
        for placement in placements:
            if not isinstance(placement, Replicate):
                raise NotImplementedError(
                    f"Muon: parameter {name!r} is sharded as {placement!r} and not by "
                    "fully_shard; Muon needs RaggedShard (raggedfsdp.fully_shard) or "
                    "Replicate: shard the model with raggedfsdp"
                )
        return
    where = f"Muon: parameter {name!r} is placed {placements} on mesh {mesh.mesh_dim_names}"
    try:
        piece = ragged_piece(tuple(p.shape), mesh, placements)
    except (ValueError, NotImplementedError) as err:
        raise NotImplementedError(f"{where}: {err}") from None
    if piece.axis != mesh.ndim - 1:
        raise NotImplementedError(
            f"{where}; Muon needs the RaggedShard on the mesh's last (shard) dim, as "
            "fully_shard places it (under HSDP (Replicate(), RaggedShard))"
        )
    cuts = [q for q in placements if type(q) is Shard]
    if len(cuts) > 1:
        raise NotImplementedError(
            f"{where}: cut by {len(cuts)} Shard axes before fully_shard's; Muon gathers a "
            "matrix across one tensor- or expert-parallel axis: parallelize on one mesh axis"
        )
    cut = muon_cut(p) if cuts else None  # not None with cuts: p is RaggedShard-placed
    if cut is not None and distributed == "replicated" and cut.tp_axis is not None:
        raise NotImplementedError(
            f"{where}: a tensor-parallel matrix, which distributed='replicated' (the "
            "baseline) does not gather across tp; use distributed='root'"
        )
    if cut is not None and cut.tp_axis is not None:
        dim = cast(Shard, placements[cut.tp_axis]).dim
        if p.shape[dim] % cut.tp_size:
            # The tp stage exchanges equal pieces, and each tp rank plans its own piece's
            # rows over the shard dim: uneven pieces would give the tp ranks other plans.
            raise NotImplementedError(
                f"{where}: its dim {dim} of size {p.shape[dim]} is cut unevenly over "
                f"{cut.tp_size} tensor-parallel ranks; Muon gathers a matrix across tp from "
                "equal pieces: pad the layer to a multiple of the tp size, or step it with "
                "the AdamW part (use_muon=False)"
            )
    piece.rs.validate_for(piece.shape, mesh.size(piece.axis))
