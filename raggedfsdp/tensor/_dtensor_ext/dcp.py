"""Distributed checkpoint (DCP): the boxes of a RaggedShard's row range."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from raggedfsdp.tensor._dtensor_ext.checks import _is_ragged, ragged_piece


def range_to_boxes(start: int, end: int, dims: Sequence[int]) -> list[tuple[tuple, tuple]]:
    """Cut the row-major index range ``[start, end)`` of a ``dims`` box into hyper-rectangles.

    Each returned (offsets, sizes) covers a contiguous run of the range, in order; at
    most ``2 * len(dims) - 1`` boxes.
    """
    if start >= end:
        return []
    if len(dims) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(dims[1:])
    boxes = []
    head, rest = divmod(start, inner)
    if rest:  # a partial first slice of dim 0
        stop = min(end, (head + 1) * inner)
        for off, size in range_to_boxes(rest, stop - head * inner, dims[1:]):
            boxes.append(((head, *off), (1, *size)))
        start = stop
    first_full, last_full = -(-start // inner), end // inner
    if last_full > first_full:
        boxes.append(((first_full,) + (0,) * (len(dims) - 1), (last_full - first_full, *dims[1:])))
    if end % inner and end > max(start, last_full * inner):
        for off, size in range_to_boxes(0, end - last_full * inner, dims[1:]):
            boxes.append(((last_full, *off), (1, *size)))
    return boxes


def _local_boxes(t: DTensor) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
    """(global offsets, sizes, local view) of each DCP box of a RaggedShard DTensor."""
    piece = ragged_piece(tuple(t.shape), t.device_mesh, t.placements)
    rs, shape = piece.rs, piece.shape
    k, rest = len(rs.dims), shape[len(rs.dims) :]
    start, end = rs.local_row_range(shape, piece.coord)
    local, cursor, boxes = t._local_tensor, 0, []
    for offsets, sizes in range_to_boxes(start, end, shape[:k]):
        rows = math.prod(sizes)
        view = local[cursor : cursor + rows].view(*sizes, *rest)
        at = [o + p for o, p in zip((*offsets, *(0,) * len(rest)), piece.offset)]
        boxes.append((torch.Size(at), torch.Size((*sizes, *rest)), view))
        cursor += rows
    return boxes


_orig_create_write_items = DTensor.__create_write_items__
_orig_create_chunk_list = DTensor.__create_chunk_list__
_orig_get_tensor_shard = DTensor.__get_tensor_shard__


def _create_write_items(self, fqn: str, object):
    if not _is_ragged(self._spec):
        return _orig_create_write_items(self, fqn, object)
    props = TensorProperties.create_from_tensor(self._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=props,
                size=self.size(),
            ),
        )
        for offsets, sizes, _ in _local_boxes(self)
    ]


def _create_chunk_list(self):
    if not _is_ragged(self._spec):
        return _orig_create_chunk_list(self)
    return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in _local_boxes(self)]


def _get_tensor_shard(self, index):
    if not _is_ragged(self._spec):
        return _orig_get_tensor_shard(self, index)
    for offsets, _, view in _local_boxes(self):
        if offsets == index.offset:
            return view
    raise AssertionError(f"{index.fqn}: this rank holds no box at offset {tuple(index.offset)}")
