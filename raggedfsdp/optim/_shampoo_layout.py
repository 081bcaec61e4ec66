"""Shampoo's blocks, the block policy that keeps them whole on ranks, and where
``fully_shard`` cut a Shampoo parameter.

Pure planning, as ``muon_plan``: every rank computes the same answers from the
parameter's shape and placements, so the checks raise on every rank alike. Which rank
preconditions which block is ``_shampoo_owners``'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from raggedfsdp.fsdp import BlockPolicy, BlockRows
from raggedfsdp.optim._muon_policy import default_use_muon
from raggedfsdp.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    DEFAULT_MAX_BUFFERS,
    WHOLE,
    TensorSpec,
    plan_buffers,
)
from raggedfsdp.tensor import ragged_piece
from raggedfsdp.tensor.placement import RaggedShard

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ShampooBlockPolicy",
    "ShampooCut",
    "ShampooLayoutChoice",
    "block_rows_for",
    "blocks_of",
    "member_view",
    "resolve_row_block",
    "root_cost",
    "rows_view",
    "shampoo_auto_policy",
    "shampoo_block_policy",
    "shampoo_cut",
]

DEFAULT_BLOCK_SIZE = 1024  # square 1024 x 1024 blocks, the published setting

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
    ``block_size`` on a side); None gives ``block_size`` (square blocks)."""
    _check_block_size(where, block_size)
    if row_block is None:
        return block_size
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
    rows, else whole members: every rank then holds whole row blocks, cuts them into
    column blocks of ``block_size`` and preconditions them itself, with no
    communication (the communication-free mode of [Note: Shampoo block owners]). It
    costs padding where a row block exceeds a rank's share (square 1024 blocks past a
    few dozen ranks); without it Shampoo sends blocks to owner ranks instead. Every
    other parameter gets ``base``'s block.

    Args:
        block_size: Shampoo's largest block side (the column blocks' width); pass the
            same to ``Shampoo``. Default 1024.
        row_block: rows per Shampoo block, ``1 <= row_block <= block_size``; pass the
            same to ``Shampoo``. Default None: ``block_size`` (square blocks).
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
    """The block policy for ``fully_shard(..., block_policy=...)`` under which ``Shampoo``
    steps without communication.

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


@dataclass(frozen=True)
class ShampooLayoutChoice:
    """The layout ``shampoo_auto_policy`` chose, and why.

    Args:
        policy: the block policy to pass to ``fully_shard``.
        mode: ``"communication-free"`` (``shampoo_block_policy``: every block whole on a
            rank) or ``"owner"`` (the base policy: blocks go to owner ranks).
        numel: elements of every group.
        padding_free, padding_base: padding elements of every group under
            ``shampoo_block_policy`` and under the base policy.
    """

    policy: Callable[[str, nn.Parameter], BlockRows]
    mode: str
    numel: int
    padding_free: int
    padding_base: int


def shampoo_auto_policy(
    model: nn.Module,
    world_size: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    row_block: int | None = None,
    whole_matrices: bool = False,
    base: BlockPolicy | None = None,
    max_extra_padding: float = 0.01,
    modules: Iterable[nn.Module] | None = None,
    use_shampoo: Callable[[str, Tensor], bool] = default_use_muon,
    max_buffers: int = DEFAULT_MAX_BUFFERS,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> ShampooLayoutChoice:
    """Shampoo's communication-free layout where it is cheap, else the base layout (owner
    mode): see [Note: Shampoo block owners] in ``_shampoo_owners.py``.

    Every group ``fully_shard`` will make is planned twice (as ``fully_shard`` plans it,
    no tensor allocated): with ``shampoo_block_policy`` and with ``base``. The first is
    chosen when its padding exceeds the second's by at most ``max_extra_padding`` of the
    elements (always under ``whole_matrices``, which ``grafting="parameter"`` needs).

    Args:
        model: the model, before ``fully_shard`` (it may be on ``meta``).
        world_size: ranks of the shard dim.
        block_size, row_block, whole_matrices, use_shampoo: as ``shampoo_block_policy``.
        base: the policy of every parameter in the owner mode, and of the non-Shampoo
            ones in both. Default ``BlockPolicy()``.
        max_extra_padding: padding the communication-free layout may add, as a share of
            the elements. Default 0.01.
        modules: the modules ``fully_shard`` will be applied to, bottom-up. Default:
            ``model.transformer_blocks()`` (if it has them), then ``model``.
        max_buffers, alignment_bytes: as passed to ``fully_shard``.
    """
    base = base if base is not None else BlockPolicy()
    free = shampoo_block_policy(
        block_size,
        row_block=row_block,
        whole_matrices=whole_matrices,
        use_shampoo=use_shampoo,
        base=base,
    )
    if modules is None:
        has_blocks = hasattr(model, "transformer_blocks")  # raggedfsdp's models define it
        blocks = cast(Any, model).transformer_blocks() if has_blocks else []
        modules = [*blocks, model]
    claimed: set[int] = set()
    numel = padding_free = padding_base = 0
    for mod in modules:
        group = [(n, p) for n, p in mod.named_parameters() if id(p) not in claimed]
        claimed.update(id(p) for _, p in group)
        if not group:
            continue
        dtype = group[0][1].dtype
        plans = []
        for policy in (free, base):
            specs = [
                TensorSpec(
                    name=n, shape=tuple(p.shape), block_rows=policy(n, p), stack=p.dim() >= 3
                )
                for n, p in group
            ]
            plans.append(
                plan_buffers(
                    specs,
                    world_size,
                    max_buffers=max_buffers,
                    dtype=dtype,
                    alignment_bytes=alignment_bytes,
                )
            )
        numel += plans[1].total_numel
        padding_free += plans[0].padding
        padding_base += plans[1].padding
    cheap = padding_free <= padding_base + max_extra_padding * numel
    if whole_matrices or cheap:
        return ShampooLayoutChoice(free, "communication-free", numel, padding_free, padding_base)
    return ShampooLayoutChoice(base, "owner", numel, padding_free, padding_base)


def _check_block_size(where: str, size) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}: block_size must be a positive int, got {size!r}")


# ---------------------------------------------------------------------------------------------
# One parameter: where fully_shard cut it, and where its state lives
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShampooCut:
    """Where ``fully_shard`` cut a Shampoo parameter, seen from this rank.

    Args:
        rows, cols: of one member matrix.
        members: members in the piece the RaggedShard cuts (1 for a matrix).
        segments: ``(rank, g0, g1)``: shard rank ``rank`` holds rows ``[g0, g1)`` of the
            piece seen as ``(members * rows, cols)`` (ranks without rows left out); one
            segment over every row for a parameter whole on every rank.
        coord: this rank on the shard dim (0 when whole).
        world_size: ranks of the shard dim (1 when whole).
        outer: pieces of the same layout along the mesh dims before the shard dim
            (experts cut evenly by ``Shard(0)`` over ep).
        placements: the parameter's placements (None: a plain tensor).
        mesh: its mesh (None for a plain tensor).
        group: the shard dim's process group (None when whole on every rank).
    """

    rows: int
    cols: int
    members: int
    segments: tuple[tuple[int, int, int], ...]
    coord: int
    world_size: int
    outer: int
    placements: tuple | None
    mesh: DeviceMesh | None
    group: Any

    @property
    def first_row(self) -> int:
        """This rank's first row of the piece seen as ``(members * rows, cols)``."""
        return next((a for r, a, _ in self.segments if r == self.coord), 0)

    @property
    def key(self) -> str:
        """The shard group this parameter is planned in (``""``: whole on every rank)."""
        return "" if self.group is None else self.group.group_name

    def state(self, local: Tensor, units: tuple[int, ...]) -> Tensor:
        """A 1-D state (this rank's owned blocks' values, concatenated in the global block
        order) as the optimizer state: a RaggedShard DTensor over the global
        concatenation, ``units[r]`` elements on shard rank r; ``local`` itself for a plain
        tensor. The global length is ``outer * sum(units)``, whatever the world size."""
        if self.placements is None:
            return local
        placements = [
            RaggedShard(dims=(0,), local_units=units) if isinstance(q, RaggedShard) else q
            for q in self.placements
        ]
        numel = self.outer * sum(units) if self.group is not None else local.numel()
        return DTensor.from_local(
            local, self.mesh, placements, shape=torch.Size((numel,)), stride=(1,), run_check=False
        )


def shampoo_cut(p: Tensor, name: str) -> ShampooCut:
    """Where Shampoo parameter ``p`` (named ``name``) lies.

    Raises:
        ValueError: ``p`` is not a matrix or a stack of matrices.
        NotImplementedError: a placement Shampoo cannot step (tensor parallelism, a
            RaggedShard on another than the mesh's last dim).
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
        placements = tuple(p.placements) if isinstance(p, DTensor) else None
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        whole = ((0, 0, members * rows),)
        return ShampooCut(rows, cols, members, whole, 0, 1, 1, placements, mesh, None)
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
            f"{where}: cut by {q!r} on mesh dim {axis}; Shampoo preconditions blocks of whole "
            "matrices within the shard dim, so it steps matrices that only fully_shard cuts "
            "(and stacks of experts cut evenly by Shard(0)); step this one with the AdamW "
            "part (use_shampoo=False)"
        )
    shape = piece.shape
    members = int(shape[0]) if len(shape) == 3 else 1
    row_numel = piece.rs.row_numel(shape)
    segments: list[tuple[int, int, int]] = []
    for r in range(piece.rs.world_size):
        lo, hi = piece.rs.local_row_range(shape, r)
        g0, g1 = lo * row_numel // cols, hi * row_numel // cols  # rows of (members*rows, cols)
        if g1 > g0:
            segments.append((r, g0, g1))
    return ShampooCut(
        rows,
        cols,
        members,
        tuple(segments),
        piece.coord,
        piece.rs.world_size,
        outer,
        placements,
        mesh,
        mesh.get_group(piece.axis),
    )


def rows_view(t: Tensor, cut: ShampooCut, a: int, b: int, c0: int, c1: int) -> Tensor:
    """Rows ``[a, b)`` (of the piece seen as ``(members * rows, cols)``, within one member,
    held by this rank) and columns ``[c0, c1)`` of this rank's local tensor ``t`` (a view),
    whatever its strides: ``(local rows, cols)``, or whole members ``(k, rows, cols)`` of
    a gapped stack."""
    row = a - cut.first_row  # in this rank's rows
    if t.dim() == 3 and not t.is_contiguous():  # whole members, with gaps between them
        member, r = divmod(row, cut.rows)
        return t[member, r : r + b - a, c0:c1]
    return t.view(-1, cut.cols)[row : row + b - a, c0:c1]


def member_view(t: Tensor, cut: ShampooCut, member: int) -> Tensor:
    """Member ``member`` (of the piece) of this rank's local tensor, which holds it whole."""
    return rows_view(t, cut, member * cut.rows, (member + 1) * cut.rows, 0, cut.cols)
