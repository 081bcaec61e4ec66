"""Pure planning for distributed Muon: the matrices of a step, their root ranks, the
communication rounds and each rank's all-to-all segments; whole-matrix blocks.

Nothing here needs a process group or allocates a tensor: every rank computes the
same answers from the same shapes and placements, so no rank has to agree with
another at run time.

[Note: Muon roots]
Newton-Schulz (NS) needs a whole matrix. Each matrix gets one *root* rank that
runs its NS; the ranks that hold pieces of it send them there and get their
pieces of the result back. A matrix that one rank holds whole is rooted on that
rank and needs no communication. The others are assigned greedily, largest NS
cost first, each to the rank with the least NS cost so far (LPT scheduling, within
4/3 of the best makespan); ties go to the rank holding most of the matrix (fewer
bytes moved), then to the lowest rank. The input is identical on every rank and
the order is total, so every rank computes the same roots.

Rounds pipeline the communication: round ``k`` holds about ``per_round`` matrices
of every root, in each root's own order (largest first). All gathers are issued
up front; while round ``k``'s NS runs, later rounds' pieces are in flight, and
round ``k``'s results travel back while round ``k + 1`` computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raggedfsdp.planner import DEFAULT_ALIGNMENT_BYTES, WHOLE, BufferLayout, TensorSpec, plan_buffer

__all__ = [
    "Exchange",
    "Matrix",
    "Round",
    "StepPlan",
    "WholeMatrixPlan",
    "assign_roots",
    "build_plan",
    "comm_free_matrices",
    "matrix_members",
    "ns_flops",
    "plan_matrices",
    "plan_rounds",
    "plan_whole_matrices",
]


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs of ``steps`` quintic Newton-Schulz steps on a ``rows x cols`` matrix.

    With ``m = min(rows, cols)``, ``n = max(rows, cols)``: per step ``X X^T`` (2 m^2 n),
    ``b A + c A A`` (2 m^3) and ``a X + B X`` (2 m^2 n).
    """
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def assign_roots(
    flops: Sequence[float], held: Sequence[Sequence[int]], world_size: int
) -> tuple[list[int], list[float]]:
    """Root rank of every matrix, balancing NS FLOPs; see [Note: Muon roots].

    Args:
        flops: NS cost of each matrix.
        held: per matrix, the elements each rank holds (length ``world_size``).
        world_size: ranks.

    Returns:
        ``(roots, load)``: the root of each matrix and the NS FLOPs of each rank.

    Raises:
        ValueError: ``held`` rows of the wrong length, or a matrix nobody holds.
    """
    if len(flops) != len(held):
        raise ValueError(f"assign_roots: {len(flops)} costs but {len(held)} holder rows")
    load = [0.0] * world_size
    roots = [-1] * len(flops)
    free = []
    for i, h in enumerate(held):
        if len(h) != world_size:
            raise ValueError(
                f"assign_roots: matrix {i} has {len(h)} holder counts, expected {world_size}"
            )
        holders = [r for r, n in enumerate(h) if n > 0]
        if not holders:
            raise ValueError(f"assign_roots: matrix {i} is held by no rank")
        if len(holders) == 1:  # whole on one rank: no choice, no communication
            roots[i] = holders[0]
            load[holders[0]] += flops[i]
        else:
            free.append(i)
    free.sort(key=lambda i: (-flops[i], i))
    for i in free:
        r = min(range(world_size), key=lambda r: (load[r], -held[i][r], r))
        roots[i] = r
        load[r] += flops[i]
    return roots, load


def plan_rounds(
    order: Iterable[int], roots: Sequence[int], world_size: int, per_round: int = 1
) -> list[list[int]]:
    """Cut the matrices that need communication into pipeline rounds.

    Args:
        order: the matrices needing communication, largest NS cost first.
        roots: root of every matrix (indexed by matrix).
        world_size: ranks.
        per_round: matrices of each root per round (>= 1).

    Returns:
        The rounds, each a list of matrix indices in increasing order.
    """
    if per_round < 1:
        raise ValueError(f"plan_rounds: per_round must be >= 1, got {per_round}")
    queues: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        queues[roots[i]].append(i)
    n_rounds = max((math.ceil(len(q) / per_round) for q in queues), default=0)
    return [
        sorted(i for q in queues for i in q[k * per_round : (k + 1) * per_round])
        for k in range(n_rounds)
    ]


# ---------------------------------------------------------------------------------------------
# The step plan: matrices, roots, rounds (identical on every rank)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Matrix:
    """One Muon matrix of a step: a 2-D parameter, or one member of a stack."""

    item: int  # index of its parameter among the step's sharded Muon parameters
    start: int  # first element in the flattened parameter
    shape: tuple[int, int]  # (rows, cols) of the matrix
    pieces: tuple[tuple[int, int], ...]  # per rank, [lo, hi) elements of the parameter

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def held(self, rank: int) -> int:
        lo, hi = self.pieces[rank]
        return hi - lo


@dataclass
class Exchange:
    """One all-to-all of one rank: what it sends and receives, in order."""

    send: list[tuple[int, int]] = field(default_factory=list)  # (matrix, rank of the piece)
    recv: list[tuple[int, int]] = field(default_factory=list)  # (matrix, rank of the piece)
    send_splits: list[int] = field(default_factory=list)  # elements per peer
    recv_splits: list[int] = field(default_factory=list)


@dataclass
class Round:
    """The matrices of one round, the gather to their roots and the scatter back."""

    matrices: list[int]
    gather: Exchange
    scatter: Exchange | None  # None for the replicated baseline


@dataclass
class StepPlan:
    """What one rank does in ``Muon.step`` for the sharded Muon parameters."""

    matrices: list[Matrix]
    roots: list[int]
    load: list[float]  # NS FLOPs per rank
    local: list[int]  # matrices this rank roots that need no communication
    rounds: list[Round]


def matrix_members(shape: Sequence[int]) -> list[tuple[int, tuple[int, int]]]:
    """``(first element, (rows, cols))`` of each matrix of a 2-D or stacked 3-D shape."""
    if len(shape) == 2:
        return [(0, (shape[0], shape[1]))]
    E, rows, cols = shape
    return [(e * rows * cols, (rows, cols)) for e in range(E)]


def plan_matrices(
    params: Sequence[tuple[tuple[int, ...], Any, int]], world_size: int
) -> tuple[list[Matrix], list[float]]:
    """The matrices of RaggedShard Muon parameters, and the NS FLOPs of each.

    Args:
        params: per parameter, ``(global shape, its RaggedShard placement, ns_steps)``.
        world_size: ranks of the mesh dim the RaggedShard cuts (the shard dim under
            HSDP: see [Note: Muon under HSDP] in ``_muon_exchange.py``).
    """
    matrices, flops = [], []
    for k, (shape, rs, ns_steps) in enumerate(params):
        row = rs.row_numel(shape)
        ranges = [tuple(x * row for x in rs.local_row_range(shape, r)) for r in range(world_size)]
        for start, mshape in matrix_members(shape):
            stop = start + mshape[0] * mshape[1]
            pieces = []
            for lo, hi in ranges:
                a, b = max(lo, start), min(hi, stop)
                pieces.append((a, b) if b > a else (start, start))
            matrices.append(Matrix(k, start, mshape, tuple(pieces)))
            flops.append(float(ns_flops(*mshape, ns_steps)))
    return matrices, flops


PieceRule = Callable[[int, int, int], bool]  # (matrix, source rank, destination rank)


def _exchange(
    matrices: Sequence[Matrix],
    rnd: Sequence[int],
    me: int,
    world_size: int,
    moves: PieceRule,
    piece_rank: Callable[[int, int, int], int],
) -> Exchange:
    """Segments of one all-to-all: rank s sends piece ``piece_rank(m, s, d)`` of m to d
    wherever ``moves(m, s, d)``."""
    ex = Exchange()
    for peer in range(world_size):
        n_send = n_recv = 0
        for i in rnd:
            m = matrices[i]
            if peer != me and moves(i, me, peer):
                pr = piece_rank(i, me, peer)
                if m.held(pr):
                    ex.send.append((i, pr))
                    n_send += m.held(pr)
            if peer != me and moves(i, peer, me):
                pr = piece_rank(i, peer, me)
                if m.held(pr):
                    ex.recv.append((i, pr))
                    n_recv += m.held(pr)
        ex.send_splits.append(n_send)
        ex.recv_splits.append(n_recv)
    return ex


def build_plan(
    matrices: list[Matrix],
    flops: list[float],
    world_size: int,
    me: int,
    mode: str,
    per_round: int,
) -> StepPlan:
    """Roots, rounds and this rank's exchanges; see [Note: Muon roots].

    Args:
        matrices, flops: from ``plan_matrices``.
        world_size, me: ranks of the mesh, and this rank.
        mode: ``"root"`` (NS of each matrix on its root) or ``"replicated"`` (every
            rank gathers every matrix and runs every NS).
        per_round: matrices of each root per round (``"replicated"``: of each rank).
    """
    held = [[m.held(r) for r in range(world_size)] for m in matrices]
    roots, load = assign_roots(flops, held, world_size)

    def source_piece(i, src, dst):
        return src

    if mode == "replicated":
        chunk = world_size * per_round
        rounds = []
        for k in range(0, len(matrices), chunk):
            rnd = list(range(k, min(k + chunk, len(matrices))))
            gather = _exchange(matrices, rnd, me, world_size, lambda i, s, d: True, source_piece)
            rounds.append(Round(rnd, gather, None))
        return StepPlan(matrices, roots, [float(sum(flops))] * world_size, [], rounds)
    needs_comm = [i for i in range(len(matrices)) if sum(h > 0 for h in held[i]) > 1]
    local = [i for i in range(len(matrices)) if roots[i] == me and i not in set(needs_comm)]
    order = sorted(needs_comm, key=lambda i: (-flops[i], i))
    rounds = []
    for rnd in plan_rounds(order, roots, world_size, per_round):
        gather = _exchange(
            matrices, rnd, me, world_size, lambda i, s, d: d == roots[i], source_piece
        )
        scatter = _exchange(
            matrices, rnd, me, world_size, lambda i, s, d: s == roots[i], lambda i, s, d: d
        )
        rounds.append(Round(rnd, gather, scatter))
    return StepPlan(matrices, roots, load, local, rounds)


# ---------------------------------------------------------------------------------------------
# Whole matrices on one rank (a block policy for Muon)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WholeMatrixPlan:
    """Which matrices of one group can be kept whole on one rank, and at what padding.

    Args:
        whole: names given ``block_rows="whole"``.
        base: the layout with the base block for every tensor.
        layout: the layout with ``whole`` made whole.
    """

    whole: frozenset[str]
    base: BufferLayout
    layout: BufferLayout


def plan_whole_matrices(
    specs: Sequence[TensorSpec],
    world_size: int,
    candidates: Iterable[str],
    *,
    max_extra_padding: float = 0.01,
    dtype: Any = "float32",
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> WholeMatrixPlan:
    """Keep as many ``candidates`` whole on one rank as padding allows.

    The goal is matrices that need no communication in ``Muon.step``: those held
    whole by one rank (each member of a stack counts). All candidates whole is
    tried first; if that costs more padding than allowed, candidates are made
    whole one at a time, smallest first, each kept only if the padding stays
    within budget and no matrix that was whole by luck gets split (the count of
    communication-free matrices never drops).

    Args:
        specs: the group's tensors with their base blocks.
        world_size: ranks.
        candidates: names of the Muon matrices / stacks.
        max_extra_padding: padding allowed beyond the base layout's, as a share of the
            group's elements. Default 0.01.
        dtype, alignment_bytes: as for ``plan_buffer``.

    Raises:
        ValueError: a candidate that is not in ``specs``, or a negative budget.
    """
    if not max_extra_padding >= 0:
        raise ValueError(
            f"plan_whole_matrices: max_extra_padding must be >= 0, got {max_extra_padding}"
        )
    specs = list(specs)
    by_name = {s.name: s for s in specs}
    cands = list(dict.fromkeys(candidates))
    missing = [c for c in cands if c not in by_name]
    if missing:
        raise ValueError(f"plan_whole_matrices: candidates {missing} are not in the group")
    members = {c: by_name[c].members for c in cands}
    kw = dict(dtype=dtype, alignment_bytes=alignment_bytes)
    base = plan_buffer(specs, world_size, **kw)
    budget = base.padding + max_extra_padding * base.total_numel

    def layout_with(whole: set[str]) -> BufferLayout:
        return plan_buffer(
            [
                TensorSpec(name=s.name, shape=s.shape, block_rows=WHOLE, stack=s.stack)
                if s.name in whole
                else s
                for s in specs
            ],
            world_size,
            **kw,
        )

    every = layout_with(set(cands))
    if every.padding <= budget:
        return WholeMatrixPlan(frozenset(cands), base, every)
    chosen: set[str] = set()
    best, free = base, comm_free_matrices(base, members)[0]
    for name in sorted(cands, key=lambda n: (by_name[n].member_numel, cands.index(n))):
        trial = layout_with(chosen | {name})
        trial_free = comm_free_matrices(trial, members)[0]
        if trial.padding <= budget and trial_free >= free:
            chosen.add(name)
            best, free = trial, trial_free
    return WholeMatrixPlan(frozenset(chosen), base, best)


def comm_free_matrices(layout: BufferLayout, members: Mapping[str, int]) -> tuple[int, int]:
    """``(matrices held whole by one rank, matrices)`` among the named tensors.

    Args:
        layout: the group's layout.
        members: name -> matrices in it (1 for a matrix, ``E`` for an ``[E, out, in]`` stack).
    """
    free = total = 0
    S = layout.shard_size
    for name, count in members.items():
        t = layout[name]
        member = t.numel // count
        stride = t.member_stride if t.members == count else member
        for i in range(count):
            start = t.offset + i * stride
            end = start + member
            total += 1
            free += start // S == (end - 1) // S
    return free, total
