"""RaggedShard: a DTensor placement that cuts a tensor only at block boundaries.

[Note: RaggedShard layout]
A tensor of shape ``(d_0, ..., d_{n-1})`` with ``dims = (0, ..., k-1)`` is seen as
a matrix of ``R = d_0 * ... * d_{k-1}`` *rows* of ``d_k * ... * d_{n-1}`` elements
(row-major). The rows are cut into ``B = sum(local_units)`` equal **blocks** of
``R / B`` rows; rank ``r`` holds ``local_units[r]`` consecutive blocks, zero
allowed. A 3-rank picture, ``local_units = (2, 0, 3)``, 10 rows, 2 rows per block::

    rows   0 1 | 2 3 | 4 5 | 6 7 | 8 9
    block   b0 |  b1 |  b2 |  b3 |  b4
    rank    r0    r0 |  r2    r2    r2      (r1 holds nothing)

The **local tensor** of rank r is its contiguous slice of those rows, kept shaped
``(local_rows, d_k, ..., d_{n-1})``: for ``dims=(0,)`` that is the natural
``(local_rows, *shape[1:])``; for ``dims=(0, 1)`` the first two dims are merged
into one row dim. The slice is contiguous in the row-major tensor, so the local
tensor of a DBuffer parameter is a plain view of a flat buffer (no copy), and a
``DTensor.from_local`` over such a view stays a view.

Semantics match veScale's public ``RaggedShard(dims, local_units)``; the DTensor
machinery that makes it a working placement (redistribute, element-wise ops,
norms, checkpoints) lives in ``raggedfsdp.tensor._dtensor_ext``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement

__all__ = ["RaggedShard"]


class RaggedShard(Placement):
    """Shard a tensor's leading ``dims`` into whole blocks, a different count per rank.

    Args:
        dims: a prefix ``(0, 1, ..., k-1)`` of the tensor's dims; their product is
            the number of rows that are cut into blocks. Default: ``(0,)``.
        local_units: blocks held by each rank of the mesh axis, in rank order;
            length = mesh axis size, each >= 0, sum > 0.

    Raises:
        ValueError: ``dims`` is not a prefix ``(0, ..., k-1)``, or ``local_units``
            is empty, holds a negative count, or sums to zero.
    """

    def __init__(self, dims: Sequence[int] = (0,), local_units: Sequence[int] = ()):
        super().__init__()
        dims = tuple(int(d) for d in dims)
        units = tuple(map(int, local_units))
        if not dims or dims != tuple(range(len(dims))):
            raise ValueError(
                f"RaggedShard: dims must be a prefix (0,), (0, 1), ... of the tensor's dims, "
                f"got {dims}; pass dims=(0,) to cut rows of dim 0"
            )
        if not units:
            raise ValueError(
                "RaggedShard: local_units must give one block count per rank of the mesh axis, "
                "got an empty tuple"
            )
        if units and min(units) < 0:
            r, u = next((r, u) for r, u in enumerate(units) if u < 0)
            raise ValueError(
                f"RaggedShard: local_units must be >= 0, got {u} for rank {r} in {units}"
            )
        if sum(units) == 0:
            raise ValueError(
                f"RaggedShard: local_units must hold at least one block in total, got {units}"
            )
        self.dims = dims
        self.local_units = units

    # ---- identity -------------------------------------------------------------------------
    @classmethod
    def from_layout(cls, layout, name: str) -> RaggedShard:
        """The placement of tensor ``name`` in a planner ``BufferLayout``.

        The planner stays free of torch; the runtime turns its layout into placements here.
        """
        dims, units = layout.ragged_shard_args(name)
        return cls(dims=dims, local_units=units)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RaggedShard)
            and self.dims == other.dims
            and self.local_units == other.local_units
        )

    def __hash__(self) -> int:
        return hash(("RaggedShard", self.dims, self.local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    __str__ = __repr__

    def __reduce__(self):
        # The pybind base has its own pickling; keep ours explicit and complete.
        return (RaggedShard, (self.dims, self.local_units))

    def __deepcopy__(self, memo):
        return self  # immutable

    # ---- layout ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Total number of blocks, ``sum(local_units)``."""
        return sum(self.local_units)

    @property
    def world_size(self) -> int:
        """Size of the mesh axis this placement describes."""
        return len(self.local_units)

    def num_rows(self, shape: Sequence[int]) -> int:
        """Rows of ``shape``: the product of its ``dims``."""
        return math.prod(shape[: len(self.dims)])

    def row_numel(self, shape: Sequence[int]) -> int:
        """Elements in one row of ``shape``."""
        return math.prod(shape[len(self.dims) :])

    def validate_for(self, shape: Sequence[int], world_size: int | None = None) -> None:
        """Check that this placement can cut a tensor of ``shape``.

        Raises:
            ValueError: the tensor has fewer dims than ``dims``, its rows are not a
                multiple of the block count, or ``local_units`` has the wrong length.
        """
        shape = tuple(shape)
        if len(shape) < len(self.dims):
            raise ValueError(
                f"{self}: the tensor has shape {shape} ({len(shape)} dims) but dims={self.dims} "
                f"needs at least {len(self.dims)}; use dims=(0,) or reshape the tensor"
            )
        rows = self.num_rows(shape)
        if rows % self.num_blocks:
            raise ValueError(
                f"{self}: the {rows} rows of dims {self.dims} of shape {shape} cannot be cut "
                f"into {self.num_blocks} equal blocks (sum(local_units)); choose local_units "
                f"whose sum divides {rows}"
            )
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"{self}: local_units has {self.world_size} entries but the mesh axis has "
                f"{world_size} ranks; give one block count per rank"
            )

    def rows_per_block(self, shape: Sequence[int]) -> int:
        """Rows in one block of a tensor of ``shape``."""
        return self.num_rows(shape) // self.num_blocks

    def local_row_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """``[start, end)`` rows held by ``rank``."""
        per_block = self.rows_per_block(shape)
        start = sum(self.local_units[:rank]) * per_block
        return start, start + self.local_units[rank] * per_block

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor: ``(local_rows, *shape[len(dims):])``."""
        start, end = self.local_row_range(shape, rank)
        return (end - start, *shape[len(self.dims) :])

    def local_view(self, full, rank: int):
        """``rank``'s local tensor as a view of the contiguous full tensor ``full``."""
        start, end = self.local_row_range(full.shape, rank)
        rows = full.reshape(self.num_rows(full.shape), *full.shape[len(self.dims) :])
        return rows[start:end]
