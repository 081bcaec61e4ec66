"""BufferLayout: the planner's output, a frozen value that checks its own invariants.

See the planner package docstring for the picture and the rules. Everything here is
integer arithmetic on element counts: no process group, no tensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np


def _fail(msg: str) -> AssertionError:
    return AssertionError(f"BufferLayout invariant broken: {msg}")


@dataclass(frozen=True, kw_only=True)
class TensorPlacement:
    """Where one tensor lies in the global buffer.

    Args:
        name: the parameter's FQN.
        shape: the tensor's shape.
        offset: first element of the tensor in the global buffer (``m * S`` elements).
        block_rows: rows per block, resolved (``"whole"`` already turned into rows).
        row_elems: elements per row (the last dim).
        members: members laid out with a gap between them; 1 unless the tensor is a
            stack planned with member gaps.
        member_gap: padding elements after each member but the last. Default 0.

    With ``members == 1`` blocks are ``block_rows`` rows of the flattened tensor.
    With ``members > 1`` a block is one whole member (``block_rows`` is the member's
    rows: the stack is cut only between members) and member ``i`` starts at
    ``offset + i * member_stride``. See [Note: member gaps] in ``raggedfsdp.planner``.
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    block_rows: int
    row_elems: int
    members: int = 1
    member_gap: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.numel // self.row_elems

    @property
    def block_elems(self) -> int:
        return self.block_rows * self.row_elems

    @property
    def member_numel(self) -> int:
        return self.numel // self.members

    @property
    def member_stride(self) -> int:
        """Elements from one member's start to the next (member numel + gap)."""
        return self.member_numel + self.member_gap

    @property
    def extent(self) -> int:
        """Elements of the buffer the tensor spans, gaps included."""
        return (self.members - 1) * self.member_stride + self.member_numel

    @property
    def end(self) -> int:
        return self.offset + self.extent

    @property
    def unit_rows(self) -> int:
        """Rows per RaggedShard unit: every cut in this tensor is a multiple of it."""
        return math.gcd(self.block_rows, self.rows // self.members)

    def is_cut_ok(self, y: int) -> bool:
        """Whether a shard boundary ``y`` elements after ``offset`` splits no block."""
        if self.members == 1:
            return y % self.block_elems == 0
        r = y % self.member_stride
        return r >= self.member_numel or r % self.block_elems == 0

    def logical_before(self, y: int) -> int:
        """Tensor elements (gaps excluded) stored in the first ``y`` buffer elements."""
        y = min(max(y, 0), self.extent)
        if self.members == 1:
            return y
        full, r = divmod(y, self.member_stride)
        return full * self.member_numel + min(r, self.member_numel)


@dataclass(frozen=True, kw_only=True)
class BufferLayout:
    """The layout of one param group's flat buffer: a frozen, self-checking value.

    Rank ``k`` owns global elements ``[k * S, (k + 1) * S)``; every tensor is one
    contiguous span (or, with member gaps, a strided run of members); padding sits
    between tensors only. Built by ``plan_buffer``; identical on every rank.

    Args:
        world_size: ranks ``m`` sharing the buffer.
        shard_size: ``S``, elements per rank.
        alignment: alignment unit in elements; ``S`` and every offset are multiples.
        dtype: the buffer's dtype name (``"bfloat16"``).
        tensors: the placements, in offset order.
        lower_bound: a proven lower bound on ``S`` over the layouts the planner
            searched (see ``lower_bound_shard_size``).

    Raises:
        AssertionError: an invariant is broken (a planner bug, not a user error).
    """

    world_size: int
    shard_size: int
    alignment: int
    dtype: str
    tensors: tuple[TensorPlacement, ...]
    lower_bound: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        m, S, a = self.world_size, self.shard_size, self.alignment
        if m < 1 or S < 1 or a < 1:
            raise _fail(f"world_size={m}, shard_size={S}, alignment={a} must be >= 1")
        if S % a:
            raise _fail(f"shard_size {S} is not a multiple of the alignment {a}")
        if not 1 <= self.lower_bound <= S:
            raise _fail(f"lower bound {self.lower_bound} is not in [1, shard_size={S}]")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise _fail(f"duplicate tensor names in {names}")
        prev_end, prev_name = 0, None
        for t in self.tensors:
            self._check_tensor(t)
            if t.offset < prev_end:
                raise _fail(f"{t.name!r} at {t.offset} overlaps {prev_name!r} ending {prev_end}")
            prev_end, prev_name = t.end, t.name
        if prev_end > m * S:
            raise _fail(f"{prev_name!r} ends at {prev_end}, past the buffer's {m * S} elements")

    def _check_tensor(self, t: TensorPlacement) -> None:
        S, a = self.shard_size, self.alignment
        if t.offset < 0 or t.offset % a:
            raise _fail(f"{t.name!r}: offset {t.offset} is negative or not a multiple of {a}")
        if t.numel % t.row_elems or t.numel % t.members or t.rows % t.members:
            raise _fail(f"{t.name!r}: shape {t.shape} does not fit row_elems/members")
        if not 1 <= t.block_rows <= t.rows // t.members:
            raise _fail(f"{t.name!r}: block of {t.block_rows} rows out of range")
        if t.member_gap < 0 or (t.members == 1 and t.member_gap):
            raise _fail(f"{t.name!r}: member gap {t.member_gap} with {t.members} members")
        if t.members > 1 and t.member_stride % a:
            raise _fail(f"{t.name!r}: member stride {t.member_stride} not a multiple of {a}")
        if t.members > 1 and t.block_rows != t.rows // t.members:
            raise _fail(f"{t.name!r}: a stack with member gaps must be cut between members only")
        # Every boundary k*S strictly inside the tensor must fall between blocks.
        first = (t.offset // S + 1) * S
        if first >= t.end:
            return
        if t.members == 1:
            # Boundaries are first, first + S, ...: all fine iff the first is and,
            # when there are two or more, S is a whole number of blocks.
            if (first - t.offset) % t.block_elems or (first + S < t.end and S % t.block_elems):
                raise _fail(f"{t.name!r}: a shard boundary splits a block of {t.block_elems}")
            return
        for b in range(first, t.end, S):
            if not t.is_cut_ok(b - t.offset):
                raise _fail(f"{t.name!r}: boundary {b} splits a block of a member")

    # --- sizes --------------------------------------------------------------------
    @property
    def global_size(self) -> int:
        """Elements of the global (unsharded) buffer: ``m * S``."""
        return self.world_size * self.shard_size

    @property
    def total_numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def padding(self) -> int:
        """Padding elements: ``m * S - total``."""
        return self.global_size - self.total_numel

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the tensors' elements."""
        return self.padding / self.total_numel

    @property
    def lower_bound_padding(self) -> int:
        return self.world_size * self.lower_bound - self.total_numel

    @property
    def lower_bound_padding_ratio(self) -> float:
        return self.lower_bound_padding / self.total_numel

    # --- lookups --------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> Mapping[str, TensorPlacement]:
        return {t.name: t for t in self.tensors}

    def __getitem__(self, name: str) -> TensorPlacement:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(
                f"BufferLayout: no tensor {name!r}; it holds {list(self._by_name)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[TensorPlacement]:
        return iter(self.tensors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"BufferLayout: rank {rank} out of range; expected 0 <= rank < {self.world_size}"
            )

    # --- per-rank views -----------------------------------------------------------------
    def shard_range(self, name: str, rank: int) -> tuple[int, int]:
        """Buffer elements of ``name`` on ``rank``, relative to the rank's shard storage.

        Returns ``(start, stop)`` with ``0 <= start <= stop <= S``; ``start == stop``
        when the rank holds none of the tensor. With member gaps the range is the
        tensor's span clipped to the shard: gaps included, also a gap (or its end)
        before the rank's first member or after its last; ``local_view_args`` gives
        the members themselves.
        """
        self._check_rank(rank)
        t, S = self[name], self.shard_size
        lo, hi = max(t.offset, rank * S), min(t.end, (rank + 1) * S)
        if lo >= hi:
            return (0, 0)
        return (lo - rank * S, hi - rank * S)

    def local_range(self, name: str, rank: int) -> tuple[int, int]:
        """Elements ``[start, stop)`` of the flattened tensor held by ``rank``."""
        self._check_rank(rank)
        t, S = self[name], self.shard_size
        lo = t.logical_before(rank * S - t.offset)
        hi = t.logical_before((rank + 1) * S - t.offset)
        return (lo, hi)

    def local_units(self, name: str) -> tuple[int, ...]:
        """RaggedShard units per rank (length ``m``; sums to the tensor's unit count).

        A unit is ``unit_rows`` rows: ``block_rows`` rows when every member's row
        count is a multiple of it, else the gcd of the two (every cut is still a
        whole number of blocks, see ``ragged_shard_args``).
        """
        t, S = self[name], self.shard_size
        unit = t.unit_rows * t.row_elems
        # Every rank at once (16,384 ranks in one vector operation): rank r holds the
        # tensor elements stored in buffer elements [r S, (r + 1) S) of the tensor's extent.
        starts = np.arange(self.world_size + 1, dtype=np.int64) * S - t.offset
        y = np.clip(starts, 0, t.extent)
        if t.members > 1:
            full, r = np.divmod(y, t.member_stride)
            y = full * t.member_numel + np.minimum(r, t.member_numel)
        return tuple((np.diff(y) // unit).tolist())

    def ragged_shard_args(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(dims, local_units)`` for ``RaggedShard(dims, local_units)`` of ``name``.

        ``raggedfsdp.tensor.placement.RaggedShard.from_layout`` builds the placement from them.

        ``dims`` is every dim but the last (``(0,)`` for a 1-D tensor, whose rows are
        its elements; ``(0,)`` for a stack with member gaps, cut into whole members);
        their product, the row count, is cut into ``sum(local_units)`` units of ``unit_rows`` rows.

        Raises:
            NotImplementedError: a 0-d tensor (no dim to shard on).
        """
        t = self[name]
        if not t.shape:
            raise NotImplementedError(
                f"BufferLayout: {name!r} is 0-d; RaggedShard needs at least one dim"
            )
        if len(t.shape) == 1 or t.members > 1:  # a gapped stack: whole members, units of one
            return (0,), self.local_units(name)
        return tuple(range(len(t.shape) - 1)), self.local_units(name)

    def local_view_args(self, name: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """``(size, stride, offset)`` of ``rank``'s local tensor of ``name`` as a view of
        its shard storage (1D, S elements): ``RaggedShard.local_shape``, row-major, from
        the first element the rank holds; a gapped stack's whole members ``member_stride``
        apart (see [Note: member gaps])."""
        t = self[name]
        lo, hi = self.local_range(name, rank)
        dims, _ = self.ragged_shard_args(name)
        rest = t.shape[len(dims) :]
        row = math.prod(rest)
        size = ((hi - lo) // row, *rest)
        stride = [1] * len(size)
        for d in range(len(size) - 2, -1, -1):
            stride[d] = stride[d + 1] * size[d + 1]
        if hi == lo:
            return size, tuple(stride), 0
        if t.members > 1:
            stride[0] = t.member_stride
            first = t.offset + (lo // t.member_numel) * t.member_stride
            return size, tuple(stride), first - rank * self.shard_size
        return size, tuple(stride), t.offset + lo - rank * self.shard_size

    def unsharded_view_args(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """``(size, stride, storage_offset)`` of ``name`` as a view of the global buffer.

        ``torch.as_strided(global_buffer, *args)`` gives the unsharded parameter
        without a copy; with member gaps the stride of dim 0 is ``member_stride``.
        """
        t = self[name]
        stride = []
        acc = 1
        for d in reversed(t.shape):
            stride.append(acc)
            acc *= d
        stride.reverse()
        if t.members > 1:
            stride[0] = t.member_stride
        return t.shape, tuple(stride), t.offset

    def rank_tensors(self, rank: int) -> tuple[str, ...]:
        """Names of the tensors with at least one element on ``rank``, in offset order."""
        self._check_rank(rank)
        spans = ((t.name, self.local_range(t.name, rank)) for t in self.tensors)
        return tuple(name for name, (lo, hi) in spans if hi > lo)

    def renamed(self, names: Mapping[str, str]) -> BufferLayout:
        """The same layout with tensors renamed (``old -> new``); unlisted names stay."""
        tensors = tuple(
            dataclasses.replace(t, name=names.get(t.name, t.name)) for t in self.tensors
        )
        return dataclasses.replace(self, tensors=tensors)

    def describe(self) -> str:
        """A short human-readable summary."""
        return (
            f"BufferLayout(m={self.world_size}, S={self.shard_size}, {len(self.tensors)} "
            f"tensors, padding {self.padding} = {100 * self.padding_ratio:.3f}%, lower bound "
            f"{100 * self.lower_bound_padding_ratio:.3f}%)"
        )
