"""Pure planning for distributed Muon: root ranks, communication rounds, whole-matrix blocks.

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raggedfsdp.planner import DEFAULT_ALIGNMENT_BYTES, WHOLE, BufferLayout, TensorSpec, plan_buffer

__all__ = [
    "WholeMatrixPlan",
    "assign_roots",
    "comm_free_matrices",
    "ns_flops",
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
