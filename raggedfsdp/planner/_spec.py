"""The planner's input: one tensor of a param group, its shape and its block.

A *row* is one row of the tensor seen as a matrix ``[numel / last_dim, last_dim]``
(a stacked ``[E, out, in]`` tensor has ``E * out`` rows, each a row of one member);
a 1-D tensor's rows are its elements, as FSDP2's ``Shard(0)`` cuts it (a 0-d tensor
is one row). A *block* is ``block_rows`` consecutive rows and is the atomic unit a
shard boundary may not split. When the row count is not a multiple of
``block_rows`` the last block is shorter; no boundary can fall inside it either.

By default (``block_rows=1``) a 1-D tensor is thus divisible between any two
elements; the layout's alignment still puts every cut a multiple of the alignment
unit from the tensor's start (``S`` and every offset are multiples of it), so a
bias of 32,000 fp32 elements is cut in runs of 32, and a tensor shorter than one
alignment unit is never cut at all. ``block_rows="whole"`` keeps it whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

# Element sizes of the dtypes a buffer may hold, by torch's name without "torch.".
_ITEMSIZE = {
    "float64": 8,
    "double": 8,
    "int64": 8,
    "long": 8,
    "float32": 4,
    "float": 4,
    "int32": 4,
    "int": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}

WHOLE: Literal["whole"] = "whole"


def dtype_name_and_itemsize(dtype: Any) -> tuple[str, int]:
    """Return ``(name, bytes per element)`` for a dtype given as a string or ``torch.dtype``.

    Args:
        dtype: ``"bfloat16"``, ``"torch.float32"`` or a ``torch.dtype``. Strings are
            resolved without importing torch.

    Raises:
        ValueError: the dtype is unknown.
    """
    itemsize = getattr(dtype, "itemsize", None)
    name = str(dtype).removeprefix("torch.")
    if isinstance(itemsize, int) and not isinstance(dtype, str):
        return name, itemsize
    if name not in _ITEMSIZE:
        raise ValueError(
            f"planner: dtype {dtype!r} is unknown; expected one of "
            f"{sorted(_ITEMSIZE)} or a torch.dtype"
        )
    return name, _ITEMSIZE[name]


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One tensor of a param group, as the planner sees it.

    Args:
        name: the parameter's fully qualified name; unique within a group.
        shape: the tensor's shape.
        block_rows: rows per block (see the module docstring), or ``"whole"``: the
            whole tensor, or for a stack each whole member matrix. Default 1.
        stack: dim 0 indexes members of a fused stack (MoE experts ``[E, out, in]``).
            A stack may get padding between its members when the plan allows
            member gaps; with a gap, it is cut only between members (a block is
            one whole member). Default False.

    Raises:
        ValueError: a bad shape or block, naming the tensor and the fix.
    """

    name: str
    shape: tuple[int, ...]
    block_rows: int | Literal["whole"] = 1
    stack: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.name:
            raise ValueError(f"planner: a tensor of shape {self.shape} has an empty name")
        if any(d < 1 for d in self.shape):
            raise ValueError(
                f"planner: tensor {self.name!r} has shape {self.shape}; every dim must be "
                f">= 1 (the planner does not place empty tensors; leave them out of the group)"
            )
        if self.stack and len(self.shape) < 2:
            raise ValueError(
                f"planner: tensor {self.name!r} of shape {self.shape} is declared a stack but "
                f"has fewer than 2 dims; a stack is [members, ...]; pass stack=False"
            )
        if self.block_rows != WHOLE:
            if isinstance(self.block_rows, bool) or not isinstance(self.block_rows, int):
                raise ValueError(
                    f"planner: tensor {self.name!r}: block_rows must be a positive int or "
                    f"'whole', got {self.block_rows!r}"
                )
            if self.block_rows < 1:
                raise ValueError(
                    f"planner: tensor {self.name!r}: block_rows must be >= 1, got {self.block_rows}"
                )
            if self.block_rows > self.rows:
                raise ValueError(
                    f"planner: tensor {self.name!r} of shape {self.shape} has {self.rows} "
                    f"rows, fewer than its block of {self.block_rows} rows; pass "
                    f"block_rows<={self.rows} or block_rows='whole'"
                )

    # --- derived sizes ----------------------------------------------------------
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_elems(self) -> int:
        """Elements per row: the last dim (1 for a 1-D or 0-d tensor)."""
        return self.shape[-1] if len(self.shape) >= 2 else 1

    @property
    def rows(self) -> int:
        return self.numel // self.row_elems

    @property
    def members(self) -> int:
        """Members of a stack (dim 0), 1 for a plain tensor."""
        return self.shape[0] if self.stack else 1

    @property
    def member_rows(self) -> int:
        return self.rows // self.members

    @property
    def member_numel(self) -> int:
        return self.numel // self.members

    @property
    def resolved_block_rows(self) -> int:
        """Rows per block with ``"whole"`` resolved (a member's rows for a stack)."""
        if self.block_rows == WHOLE:
            return self.member_rows
        return int(self.block_rows)

    @property
    def block_elems(self) -> int:
        return self.resolved_block_rows * self.row_elems


def with_block_rows(spec: TensorSpec, block_rows: int | Literal["whole"]) -> TensorSpec:
    """Apply a model-wide block policy to one tensor, clamped to the tensor.

    A model-wide ``block_rows=k`` means "blocks of k rows where the tensor has that
    many": a 64-row matrix gets one whole block. It is a count of matrix rows, so a
    1-D tensor (a norm weight, a bias) keeps blocks of one element; ``"whole"`` applies
    to every tensor. A per-tensor ``block_rows`` larger than the tensor is an error
    instead (see ``TensorSpec``).
    """
    if block_rows == WHOLE:
        return TensorSpec(name=spec.name, shape=spec.shape, block_rows=WHOLE, stack=spec.stack)
    if len(spec.shape) == 1:
        block_rows = 1
    rows = spec.member_rows if spec.stack else spec.rows
    return TensorSpec(
        name=spec.name, shape=spec.shape, block_rows=min(int(block_rows), rows), stack=spec.stack
    )
