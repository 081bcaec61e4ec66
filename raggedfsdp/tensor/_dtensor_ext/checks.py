"""Placement checks: where a RaggedShard cuts a DTensor's rows, and whether it may."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp.tensor.placement import RaggedShard


def ragged_axis(placements: Sequence) -> tuple[int, RaggedShard] | None:
    """The (mesh axis, RaggedShard) of ``placements``, or None.

    [Note: composed placements] A RaggedShard may follow ``Shard(d)`` placements on
    earlier mesh axes: placements apply left to right, so the Shard axes cut the global
    tensor first (as torch.chunk: unevenly, 14 and 13 of 27 rows, where the dim does not
    divide) and the RaggedShard cuts the rows of the piece they leave.
    That is FSDP x TP: the sharded parameter lives on the ``(tp, dp)`` mesh placed
    ``(Shard(d), RaggedShard(...))``, the TP shard's rows cut over the data-parallel
    ranks. (FSDP2 puts the dp axis first and calls its placement ``_StridedShard``;
    putting the tp axis first says the same with plain placements.) ``Replicate()``
    may sit on any other axis (HSDP).

    Raises:
        ValueError: more than one RaggedShard in one placement tuple.
        NotImplementedError: a Partial or other placement beside a RaggedShard, or a
            Shard after it.
    """
    found = [(i, p) for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"placements {tuple(placements)} hold {len(found)} RaggedShards; at most one mesh "
            "axis may be RaggedShard, use Replicate() on the others"
        )
    axis, rs = found[0]
    for i, p in enumerate(placements):
        if i == axis or p.is_replicate():
            continue
        if type(p) is Shard and i < axis:
            continue
        where = "after" if i > axis else "beside"
        raise NotImplementedError(
            f"placements {tuple(placements)}: a RaggedShard composes with Replicate() on any "
            f"mesh axis and Shard(d) on the axes before it, got {p} {where} it; "
            "redistribute that axis first"
        )
    return axis, rs


class RaggedPiece(NamedTuple):
    """Where a RaggedShard cuts, under the Shard axes before it ([Note: composed placements])."""

    axis: int  # the RaggedShard's mesh axis
    rs: RaggedShard
    shape: tuple[int, ...]  # the piece the earlier Shard axes leave: what the rows cut
    offset: tuple[int, ...]  # that piece's offset in the global tensor
    coord: int  # this rank's coordinate on the RaggedShard axis

    def chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the global tensor ``full`` (a view)."""
        for d, (o, n) in enumerate(zip(self.offset, self.shape)):
            if n != full.shape[d]:
                full = full.narrow(d, o, n)
        return full

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor from the global tensor ``full`` (a view when it can be)."""
        return self.rs.local_view(self.chunk(full).contiguous(), self.coord)


def _ragged_axis_of(placements: Sequence) -> tuple[int, RaggedShard]:
    """``ragged_axis`` of placements that hold a RaggedShard."""
    found = ragged_axis(placements)
    assert found is not None, f"no RaggedShard in {placements}"
    return found


def _meta(spec: DTensorSpec) -> TensorMeta:
    """``spec``'s tensor meta (sharding propagation sets it on every argument)."""
    assert spec.tensor_meta is not None
    return spec.tensor_meta


def ragged_piece(global_shape: Sequence[int], mesh, placements: Sequence) -> RaggedPiece:
    """The RaggedShard of ``placements`` and the piece of ``global_shape`` it cuts (a
    Shard axis that splits its dim unevenly leaves each rank torch.chunk's piece)."""
    axis, rs = _ragged_axis_of(placements)
    shape, offset = list(global_shape), [0] * len(global_shape)
    for i, p in enumerate(placements[:axis]):
        if p.is_replicate():
            continue
        # torch.chunk's pieces, as DTensor cuts an uneven Shard (27 rows over 2: 14, 13);
        # each rank's RaggedShard cuts its own piece
        size, start = Shard.local_shard_size_and_offset(
            shape[p.dim], mesh.size(i), mesh.get_local_rank(i)
        )
        shape[p.dim] = size
        offset[p.dim] += start
    return RaggedPiece(axis, rs, tuple(shape), tuple(offset), mesh.get_local_rank(axis))


def _check(spec_shape: Sequence[int], mesh, placements: Sequence) -> RaggedPiece:
    """Validate a RaggedShard spec; return where it cuts for this rank."""
    piece = ragged_piece(spec_shape, mesh, placements)
    piece.rs.validate_for(piece.shape, mesh.size(piece.axis))
    return piece


def _is_ragged(spec: DTensorSpec) -> bool:
    return any(isinstance(p, RaggedShard) for p in spec.placements)


def _same_rows(shape, ragged: DTensorSpec) -> bool:
    """Whether a tensor of ``shape`` has the row dims of the RaggedShard ``ragged`` (and its
    number of dims), so that the RaggedShard cuts it into the same rows."""
    k = len(_ragged_axis_of(ragged.placements)[1].dims)
    rows = _meta(ragged).shape
    return len(shape) == len(rows) and shape[:k] == rows[:k]
