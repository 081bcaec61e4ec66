"""Where a Shampoo parameter's blocks lie: on which rank, and where its states go.

Pure planning, as ``muon_plan``: every rank computes the same answers from the
parameter's shape and placements, so the checks raise on every rank alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from raggedfsdp.fsdp import BlockPolicy, BlockRows
from raggedfsdp.optim._muon_policy import default_use_muon
from raggedfsdp.planner import WHOLE
from raggedfsdp.tensor import ragged_piece
from raggedfsdp.tensor.placement import RaggedShard

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_ROW_BLOCK",
    "ShampooBlockPolicy",
    "ShampooLayout",
    "block_rows_for",
    "blocks_of",
    "resolve_row_block",
    "root_cost",
    "shampoo_block_policy",
    "shampoo_layout",
]

DEFAULT_BLOCK_SIZE = 1024
DEFAULT_ROW_BLOCK = 128  # measured: see [Note: Shampoo blocks on ranks] in shampoo.py

Block = tuple[int, int, int, int, int]  # (member, r0, r1, c0, c1), rows member-relative


def _splits(n: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``torch.split(range(n), size)``: the last block shorter."""
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def blocks_of(
    members: int, rows: int, cols: int, size: int, row_block: int | None = None
) -> list[Block]:
    """Every Shampoo block of ``members`` matrices ``rows x cols``, in the global order:
    member, then row block, then column block; rows cut as ``torch.split(row_block)``
    (default ``size``), columns as ``torch.split(size)``."""
    return [
        (e, r0, r1, c0, c1)
        for e in range(members)
        for r0, r1 in _splits(rows, size if row_block is None else row_block)
        for c0, c1 in _splits(cols, size)
    ]


def root_cost(block: Block) -> int:
    """Cost of one root recomputation of a block, in units of one ``n^3``: the two
    eigendecompositions (``L``: ``m x m``, ``R``: ``n x n``), each ~``n^3``."""
    _, r0, r1, c0, c1 = block
    return (r1 - r0) ** 3 + (c1 - c0) ** 3


def block_rows_for(member_rows: int, row_block: int, whole_matrices: bool = False) -> BlockRows:
    """The RaggedShard block (in rows) that never cuts a Shampoo block of ``row_block``
    rows: ``row_block`` rows when they divide a member's rows, else the whole member."""
    if whole_matrices or member_rows <= row_block or member_rows % row_block:
        return WHOLE
    return row_block


def resolve_row_block(where: str, block_size: int, row_block: int | None) -> int:
    """``row_block``, checked (``1 <= row_block <= block_size``: blocks are at most
    ``block_size`` on a side); None gives ``min(DEFAULT_ROW_BLOCK, block_size)``."""
    _check_block_size(where, block_size)
    if row_block is None:
        return min(DEFAULT_ROW_BLOCK, block_size)
    if (
        isinstance(row_block, bool)
        or not isinstance(row_block, int)
        or not (1 <= row_block <= block_size)
    ):
        raise ValueError(
            f"{where}: row_block must be an int in [1, block_size={block_size}] (a Shampoo "
            f"block is at most block_size x block_size), got {row_block!r}"
        )
    return row_block


# ---------------------------------------------------------------------------------------------
# The block policy
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ShampooBlockPolicy:
    """A ``fully_shard`` block policy under which RaggedShard never cuts a Shampoo block.

    A Shampoo parameter (``use_shampoo(fqn, param)``: 2-D matrices and 3-D stacks)
    gets blocks of ``row_block`` whole rows when they divide its (each member's)
    rows, else whole members: every rank then holds whole row blocks, and cuts them
    into column blocks of ``block_size`` locally (see [Note: Shampoo blocks on ranks]
    in ``shampoo.py``). Every other parameter gets ``base``'s block.

    Args:
        block_size: Shampoo's largest block side (the column blocks' width); pass the
            same to ``Shampoo``. Default 1024.
        row_block: rows per Shampoo block, ``1 <= row_block <= block_size``; pass the
            same to ``Shampoo``. Default None: ``min(128, block_size)``.
        whole_matrices: keep every Shampoo matrix whole on one rank (needed by
            ``grafting="parameter"``). Default False.
        use_shampoo: ``(fqn, param) -> bool``; the fqn is relative to the module
            ``fully_shard`` is applied to. Default ``default_use_muon``.
        base: the policy of every other parameter. Default ``BlockPolicy()``.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    row_block: int | None = None
    whole_matrices: bool = False
    use_shampoo: Callable[[str, Tensor], bool] = default_use_muon
    base: BlockPolicy = BlockPolicy()

    def __post_init__(self) -> None:
        row_block = resolve_row_block("ShampooBlockPolicy", self.block_size, self.row_block)
        object.__setattr__(self, "row_block", row_block)

    def __call__(self, fqn: str, param: nn.Parameter) -> BlockRows:
        if param.dim() not in (2, 3) or not self.use_shampoo(fqn, param):
            return self.base(fqn, param)
        shape = tuple((param.to_local() if isinstance(param, DTensor) else param).shape)
        assert self.row_block is not None  # resolved by __post_init__
        return block_rows_for(shape[-2], self.row_block, self.whole_matrices)


def shampoo_block_policy(
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    row_block: int | None = None,
    whole_matrices: bool = False,
    use_shampoo: Callable[[str, Tensor], bool] = default_use_muon,
    base: BlockPolicy | None = None,
) -> ShampooBlockPolicy:
    """The block policy for ``fully_shard(..., block_policy=...)`` that ``Shampoo`` needs.

    See ``ShampooBlockPolicy``; pass the same ``block_size`` and ``row_block`` as to
    ``Shampoo``.
    """
    return ShampooBlockPolicy(
        block_size=block_size,
        row_block=row_block,
        whole_matrices=whole_matrices,
        use_shampoo=use_shampoo,
        base=base if base is not None else BlockPolicy(),
    )


def _check_block_size(where: str, size) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}: block_size must be a positive int, got {size!r}")


# ---------------------------------------------------------------------------------------------
# One parameter's layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShampooLayout:
    """A Shampoo parameter on this rank.

    Args:
        rows, cols: of one member matrix.
        members: members in the piece the RaggedShard cuts (1 for a matrix).
        first_row: this rank's first row of the piece seen as ``(members * rows, cols)``.
        blocks: this rank's blocks, in the global order (``blocks_of``).
        left_units, right_units: elements of the left / right statistics of every
            rank of the shard dim (None: the parameter is not sharded).
        left_numel, right_numel: of the global left / right statistics.
        placements: the statistics' placements (None: plain tensors).
        mesh: the parameter's mesh (None for a plain tensor).
    """

    rows: int
    cols: int
    members: int
    first_row: int
    blocks: tuple[Block, ...]
    left_units: tuple[int, ...] | None
    right_units: tuple[int, ...] | None
    left_numel: int
    right_numel: int
    placements: tuple | None
    mesh: DeviceMesh | None

    def left_local(self) -> int:
        return sum((b[2] - b[1]) ** 2 for b in self.blocks)

    def right_local(self) -> int:
        return sum((b[4] - b[3]) ** 2 for b in self.blocks)

    def state(self, local: Tensor, numel: int, units: tuple[int, ...] | None) -> Tensor:
        """A statistic (1D, this rank's blocks' matrices concatenated) as the optimizer
        state: a RaggedShard DTensor over the global concatenation when sharded."""
        if self.placements is None:
            return local
        assert units is not None  # a sharded statistic: its ranks' units
        placements = [
            RaggedShard(dims=(0,), local_units=units) if isinstance(q, RaggedShard) else q
            for q in self.placements
        ]
        return DTensor.from_local(
            local, self.mesh, placements, shape=torch.Size((numel,)), stride=(1,), run_check=False
        )


def shampoo_layout(
    p: Tensor, name: str, size: int, row_block: int, whole_matrices: bool
) -> ShampooLayout:
    """The layout of Shampoo parameter ``p`` (named ``name``) with blocks of ``row_block``
    rows and (at most) ``size`` columns.

    Raises:
        ValueError: ``p`` is not a matrix or a stack of matrices.
        NotImplementedError: a RaggedShard cut that splits a Shampoo block on some rank
            (or a member, under ``whole_matrices``), or a placement Shampoo cannot step
            without communication (tensor parallelism).
    """
    if p.dim() not in (2, 3):
        raise ValueError(
            f"Shampoo: parameter {name!r} has shape {tuple(p.shape)}; a Shampoo parameter must "
            "be a matrix (out, in) or a stack of matrices (E, out, in); put it in a group "
            "with use_shampoo=False (AdamW)"
        )
    rows, cols = int(p.shape[-2]), int(p.shape[-1])
    if not isinstance(p, DTensor) or not any(isinstance(q, RaggedShard) for q in p.placements):
        if isinstance(p, DTensor) and not all(isinstance(q, Replicate) for q in p.placements):
            raise NotImplementedError(
                f"Shampoo: parameter {name!r} is placed {tuple(p.placements)} and not by "
                "fully_shard; Shampoo needs RaggedShard (raggedfsdp.fully_shard) or Replicate"
            )
        members = int(p.shape[0]) if p.dim() == 3 else 1
        blocks = tuple(blocks_of(members, rows, cols, size, row_block))
        left = sum((b[2] - b[1]) ** 2 for b in blocks)
        right = sum((b[4] - b[3]) ** 2 for b in blocks)
        placements = tuple(p.placements) if isinstance(p, DTensor) else None
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        return ShampooLayout(
            rows, cols, members, 0, blocks, None, None, left, right, placements, mesh
        )
    mesh, placements = p.device_mesh, tuple(p.placements)
    where = f"Shampoo: parameter {name!r} is placed {placements}"
    piece = ragged_piece(tuple(p.shape), mesh, placements)
    if piece.axis != mesh.ndim - 1:
        raise NotImplementedError(
            f"{where}; Shampoo needs the RaggedShard on the mesh's last (shard) dim, as "
            "fully_shard places it (under HSDP (Replicate(), RaggedShard))"
        )
    outer = 1  # pieces of the same layout along the axes before the shard dim
    for axis, q in enumerate(placements[: piece.axis]):
        if isinstance(q, Replicate):
            continue
        if type(q) is Shard and q.dim == 0 and p.dim() == 3 and p.shape[0] % mesh.size(axis) == 0:
            outer *= mesh.size(axis)  # whole experts over ep
            continue
        raise NotImplementedError(
            f"{where}: cut by {q!r} on mesh dim {axis}; Shampoo preconditions whole blocks "
            "without communication, so it steps matrices that only fully_shard cuts (and "
            "stacks of experts cut evenly by Shard(0)); step this one with the AdamW part "
            "(use_shampoo=False)"
        )
    shape = piece.shape
    members = int(shape[0]) if len(shape) == 3 else 1
    all_blocks = blocks_of(members, rows, cols, size, row_block)
    policy = f"shampoo_block_policy({size}, row_block={row_block})"
    world = piece.rs.world_size
    row_numel = piece.rs.row_numel(shape)
    left_units: list[int] = []
    right_units: list[int] = []
    mine: tuple[Block, ...] = ()
    for r in range(world):
        lo, hi = piece.rs.local_row_range(shape, r)
        g0, g1 = lo * row_numel // cols, hi * row_numel // cols  # rows of (members*rows, cols)
        for g in (g0, g1):
            if whole_matrices and g % rows:
                raise NotImplementedError(
                    f"{where}: shard rank {r} holds rows [{g0}, {g1}) of its "
                    f"{members} x {rows} rows, which cut a matrix; grafting='parameter' needs "
                    "every matrix whole on one rank: shard with block_policy="
                    f"shampoo_block_policy({size}, row_block={row_block}, whole_matrices=True)"
                )
            if (g % rows) % row_block:
                raise NotImplementedError(
                    f"{where}: shard rank {r} holds rows [{g0}, {g1}) of its "
                    f"{members} x {rows} rows, which cut a Shampoo block of {row_block} rows; "
                    f"shard with block_policy={policy} (a block of {row_block} rows, or "
                    f"whole matrices where {row_block} does not divide {rows})"
                )
        held = [b for b in all_blocks if g0 <= b[0] * rows + b[1] < g1]
        left_units.append(sum((b[2] - b[1]) ** 2 for b in held))
        right_units.append(sum((b[4] - b[3]) ** 2 for b in held))
        if r == piece.coord:
            first_row, mine = g0, tuple(held)
    left = sum(left_units) * outer
    right = sum(right_units) * outer
    return ShampooLayout(
        rows,
        cols,
        members,
        first_row,
        mine,
        tuple(left_units),
        tuple(right_units),
        left,
        right,
        placements,
        mesh,
    )


def block_view(t: Tensor, lay: ShampooLayout, block: Block) -> Tensor:
    """Block ``block`` of this rank's local tensor ``t`` (a view), whatever its strides:
    ``(local rows, cols)``, or whole members ``(k, rows, cols)`` of a gapped stack."""
    e, r0, r1, c0, c1 = block
    row = e * lay.rows + r0 - lay.first_row  # in this rank's rows
    if t.dim() == 3 and not t.is_contiguous():  # whole members, with gaps between them
        member, r = divmod(row, lay.rows)
        return t[member, r : r + r1 - r0, c0:c1]
    return t.view(-1, lay.cols)[row : row + r1 - r0, c0:c1]


def member_view(t: Tensor, lay: ShampooLayout, member: int) -> Tensor:
    """Member ``member`` (of the piece) of this rank's local tensor, which holds it whole."""
    row = member * lay.rows - lay.first_row
    if t.dim() == 3 and not t.is_contiguous():
        return t[row // lay.rows]
    return t.view(-1, lay.cols)[row : row + lay.rows]


def members_held(lay: ShampooLayout) -> list[int]:
    """The members (of the piece) this rank's blocks belong to, in order."""
    return sorted({b[0] for b in lay.blocks})
