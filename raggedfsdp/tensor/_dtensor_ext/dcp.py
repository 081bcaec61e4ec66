"""Checkpoints: the boxes of a RaggedShard's row range for distributed checkpoint (DCP),
and torch's two state-dict helpers that need a RaggedShard's rows
(``compute_local_shape_and_global_offset``, ``_state_dict_utils._distribute_tensors``,
installed by ``install_state_dict_helpers``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed._state_dict_utils as state_dict_utils
import torch.distributed.tensor._utils as dtensor_utils
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from raggedfsdp.tensor._dtensor_ext.checks import _is_ragged, ragged_axis, ragged_piece
from raggedfsdp.tensor._dtensor_ext.creation import _copy_of


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


# ---------------------------------------------------------------------------------------------
# Local shape and offset (torch's checkpoint and state-dict helpers)
# ---------------------------------------------------------------------------------------------
_orig_distribute_tensors = state_dict_utils._distribute_tensors
_torch_local_shape_and_offset = dtensor_utils.compute_local_shape_and_global_offset
_orig_local_shape_and_offset = _copy_of(_torch_local_shape_and_offset)


def _local_shape_and_offset_trampoline(global_shape, mesh, placements, skip_offset=False):
    # Runs with the globals of torch's tensor._utils, where install() puts the name below.
    return _raggedfsdp_local_shape_and_offset(  # noqa: F821
        global_shape, mesh, placements, skip_offset
    )


def _local_shape_and_offset(global_shape, mesh, placements, skip_offset=False):
    """torch's ``compute_local_shape_and_global_offset``, and for a RaggedShard the box of
    the rank's rows in the global tensor's dims.

    With ``dims=(0,)`` the rows are always a box ``(rows, *rest)`` at ``(start, 0, ...)``.
    With several dims (a stack ``[E, out, in]`` cut over ``E * out`` rows) they are a box
    only when they start and end on member boundaries or stay inside one member.

    Raises:
        NotImplementedError: rows that are not a box of the global tensor.
    """
    if ragged_axis(placements) is None:
        return _orig_local_shape_and_offset(global_shape, mesh, placements, skip_offset)
    piece = ragged_piece(tuple(global_shape), mesh, placements)
    rs, rank, cut = piece.rs, piece.coord, piece.shape  # see [Note: composed placements]
    lo, hi = rs.local_row_range(cut, rank)
    k = len(rs.dims)
    lead, rest = tuple(cut[:k]), tuple(cut[k:])
    inner = math.prod(lead[1:])  # rows per index of dim 0
    if k == 1:
        shape, offset = (hi - lo, *rest), (lo,)
    elif lo % inner == 0 and hi % inner == 0:
        shape, offset = (hi // inner - lo // inner, *lead[1:], *rest), (lo // inner,)
    elif k == 2 and (hi == lo or lo // inner == (hi - 1) // inner):
        shape, offset = (1 if hi > lo else 0, hi - lo, *rest), (lo // inner, lo % inner)
    else:
        raise NotImplementedError(
            f"RaggedShard {rs} of shape {tuple(global_shape)}: rank {rank}'s rows [{lo}, {hi}) "
            "are not a box of the global tensor; use raggedfsdp.checkpoint, or a block policy "
            "that keeps whole members (BlockPolicy(rows='whole'))"
        )
    offset = (*offset, *([0] * (len(global_shape) - len(offset))))
    offset = tuple(o + p for o, p in zip(offset, piece.offset))
    return shape, offset


def _distribute_tensors(local_state_dict, keys, device, pg=None):
    """torch's ``_state_dict_utils._distribute_tensors`` (``set_model_state_dict`` with
    ``broadcast_from_rank0``): a RaggedShard DTensor takes its rows of the broadcast full
    tensor; every other entry goes to torch's function."""
    ragged = []
    for key in keys:
        entry = local_state_dict.get(key)
        if entry is None or torch.is_tensor(entry):
            continue
        local_state, full = entry
        if isinstance(local_state, DTensor) and _is_ragged(local_state._spec):
            ragged.append(key)
            piece = ragged_piece(
                tuple(local_state.shape), local_state.device_mesh, local_state.placements
            )
            rows = piece.rows(full)
            if local_state.is_meta:
                local_state = DTensor.from_local(
                    rows.detach().clone(),
                    local_state.device_mesh,
                    local_state.placements,
                    shape=local_state.shape,
                    stride=local_state.stride(),
                )
            else:
                local_state.to_local().copy_(rows)
            local_state_dict[key] = local_state
    rest = [k for k in keys if k not in set(ragged)]
    return _orig_distribute_tensors(local_state_dict, rest, device, pg)


def install_state_dict_helpers() -> None:
    """Give torch's two state-dict helpers their RaggedShard branch (idempotent)."""
    # a deliberate patch: mypy forbids setting an attribute the module does not declare
    dtensor_utils._raggedfsdp_local_shape_and_offset = _local_shape_and_offset  # type: ignore[attr-defined]
    _torch_local_shape_and_offset.__code__ = _local_shape_and_offset_trampoline.__code__
    state_dict_utils._distribute_tensors = _distribute_tensors
