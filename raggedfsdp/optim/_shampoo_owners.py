"""Which rank preconditions each Shampoo block, and what travels: pure planning.

[Note: Shampoo block owners]
A Shampoo block is ``m x n`` (``row_block`` rows by at most ``block_size`` columns of one
matrix, see [Note: Shampoo blocks on ranks] in ``shampoo.py``); ``fully_shard`` cuts a
parameter into runs of whole rows, one run per rank of the shard dim. When every block
lies whole on one rank (``shampoo_block_policy``), that rank is its *owner* and the step
needs no communication: the *communication-free* mode. Otherwise (any other layout, the
planner's fine default blocks included) each block gets an owner chosen here, the
*owner* mode, as distributed Muon roots each matrix (see [Note: Muon roots]):

1. the ranks holding rows of a block (its *holders*) send those rows of the gradient to
   the owner (one all-to-all for the whole shard group, asynchronous);
2. the owner keeps the block's statistics, roots and grafting state, updates them and
   computes the block's grafted, preconditioned direction;
3. the direction goes back to the holders (a second all-to-all), who apply momentum,
   weight decay and the update to their rows, element-wise.

The owners are chosen once per shard group, over every Shampoo parameter of the
optimizer, identically on every rank, and always among a block's holders:

- a parameter's state (its owned blocks' matrices concatenated in the global block
  order) is one 1-D ``RaggedShard`` DTensor only if every rank holds one contiguous run
  of it, in rank order: a parameter's owners must never decrease in block order.
  Holders do that by themselves: a later row block's holders are never lower ranks than
  an earlier one's, so owners picked among holders (sorted within a row block) keep
  every parameter's owners in order, whatever order the row blocks are planned in;
- a holder already has some of the block's rows: the fewer bytes move.

Row blocks (all column blocks of ``row_block`` rows share their holders) are planned
fewest holders first (a block whole on one rank has no choice). Each column block goes
to the holder that stays within the *cap* (5% over the mean root cost, ``m^3 + n^3``,
per rank, or the load that the largest blocks spread evenly leave on some rank, if
more), while sending the fewest elements per step (owning an ``m x n`` block of which it
holds ``h`` elements changes what a rank sends by ``m n - 2 h``); when every holder would
pass the cap, to the least loaded. Then ranks still over the cap hand blocks on along
chains of holders (``r`` gives a block to a co-holder ``q``, which gives one of the same
cost to its own co-holder, ..., until a rank with room; the shortest chain first). Ties
go to the lowest rank. A rank thus sends about its own rows and receives about its own
blocks: per step each gradient block travels to its owner once and each direction back
once, less what the owner already holds. ``benchmarks/_shampoo_balance.py --owner``
measures balance, state and bytes at the catalogue's shapes (results: ``optim.md``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from raggedfsdp.optim.muon_plan import Exchange

__all__ = [
    "COMMUNICATION_FREE",
    "OWNER",
    "BlockPlace",
    "OwnerPlan",
    "ParamRows",
    "block_state_numel",
    "plan_owners",
]

_CHAIN_HOPS = 16  # longest chain of moves ``_repair`` looks for
_SLACK_PERCENT = 5  # root cost a rank may take beyond the mean before load decides alone
COMMUNICATION_FREE = "communication-free"
OWNER = "owner"

Block = tuple[int, int, int, int, int]  # (member, r0, r1, c0, c1), rows member-relative


def _splits(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def root_cost_of(block: Block) -> int:
    """``m^3 + n^3``: the two eigendecompositions of an ``m x n`` block's roots."""
    _, r0, r1, c0, c1 = block
    return (r1 - r0) ** 3 + (c1 - c0) ** 3


def block_state_numel(block: Block) -> int:
    """State elements a block's owner keeps: ``L``, ``R``, their roots and the graft's
    second moment (``2 m^2 + 2 n^2 + m n``)."""
    _, r0, r1, c0, c1 = block
    m, n = r1 - r0, c1 - c0
    return 2 * m * m + 2 * n * n + m * n


@dataclass(frozen=True)
class ParamRows:
    """A Shampoo parameter (the piece ``fully_shard`` cuts) and the rows each rank holds.

    Args:
        members, rows, cols: ``members`` matrices of ``rows x cols`` (1 for a matrix).
        segments: ``(rank, g0, g1)``: rank ``rank`` holds rows ``[g0, g1)`` of the piece
            seen as ``(members * rows, cols)``; ranks without rows left out; sorted.
    """

    members: int
    rows: int
    cols: int
    segments: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class BlockPlace:
    """One Shampoo block, its owner and its holders.

    Args:
        block: ``(member, r0, r1, c0, c1)``.
        owner: the rank that preconditions it.
        pieces: ``(rank, a, b)``: rank ``rank`` holds rows ``[a, b)`` of the block (rows
            of the piece seen as ``(members * rows, cols)``), in rank order.
    """

    block: Block
    owner: int
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def shape(self) -> tuple[int, int]:
        _, r0, r1, c0, c1 = self.block
        return (r1 - r0, c1 - c0)

    @property
    def numel(self) -> int:
        m, n = self.shape
        return m * n

    def held(self, rank: int) -> int:
        """Elements of the block that ``rank`` holds."""
        cols = self.shape[1]
        return sum((b - a) * cols for r, a, b in self.pieces if r == rank)


@dataclass(frozen=True)
class OwnerPlan:
    """Owners of every Shampoo block of one shard group, identical on every rank.

    Args:
        world_size: ranks of the shard dim.
        mode: ``"communication-free"`` (every block whole on its owner) or ``"owner"``.
        params: per parameter (in the order given), its blocks in the global order.
        load: root cost (``m^3 + n^3`` summed) of the blocks each rank owns.
        state: state elements (``block_state_numel`` summed) each rank keeps.
    """

    world_size: int
    mode: str
    params: tuple[tuple[BlockPlace, ...], ...]
    load: tuple[int, ...]
    state: tuple[int, ...]

    def units(self, param: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Elements of ``param``'s left (``L`` or its root), right and graft states on each
        rank: the ``local_units`` of their 1-D ``RaggedShard``."""
        left, right, graft = [0] * self.world_size, [0] * self.world_size, [0] * self.world_size
        for place in self.params[param]:
            m, n = place.shape
            left[place.owner] += m * m
            right[place.owner] += n * n
            graft[place.owner] += m * n
        return tuple(left), tuple(right), tuple(graft)

    def owned(self, param: int, rank: int) -> list[int]:
        """Indices (in ``params[param]``) of the blocks ``rank`` owns, in order."""
        return [i for i, place in enumerate(self.params[param]) if place.owner == rank]

    def traffic(self) -> list[int]:
        """Elements each rank sends in one step, both all-to-alls (it receives as many: its
        rows' directions come back, its blocks' rows came in)."""
        sent = [0] * self.world_size
        for blocks in self.params:
            for place in blocks:
                cols = place.shape[1]
                for r, a, b in place.pieces:
                    if place.owner != r:  # r's rows out, their direction back
                        sent[r] += (b - a) * cols
                        sent[place.owner] += (b - a) * cols
        return sent

    def exchanges(self, rank: int, params: Sequence[int]) -> tuple[Exchange, Exchange]:
        """``(gather, scatter)`` of ``rank`` for the blocks of ``params``: segments are
        ``(global block id, rank of the piece)``, block ids numbering the blocks of
        ``params`` in order; per peer in block order."""
        gather_send: list[list] = [[] for _ in range(self.world_size)]
        gather_recv: list[list] = [[] for _ in range(self.world_size)]
        gid = 0
        for k in params:
            for place in self.params[k]:
                for r, _, _ in place.pieces:
                    if r == place.owner:
                        continue
                    if r == rank:
                        gather_send[place.owner].append((gid, r))
                    elif place.owner == rank:
                        gather_recv[r].append((gid, r))
                gid += 1
        sizes = {}
        gid = 0
        for k in params:
            for place in self.params[k]:
                for r, a, b in place.pieces:
                    sizes[gid, r] = (b - a) * place.shape[1]
                gid += 1
        gather, scatter = Exchange(), Exchange()
        for peer in range(self.world_size):
            gather.send += gather_send[peer]
            gather.recv += gather_recv[peer]
            gather.send_splits.append(sum(sizes[s] for s in gather_send[peer]))
            gather.recv_splits.append(sum(sizes[s] for s in gather_recv[peer]))
            scatter.send += gather_recv[peer]  # the direction of each piece, back to it
            scatter.recv += gather_send[peer]
        scatter.send_splits = list(gather.recv_splits)
        scatter.recv_splits = list(gather.send_splits)
        return gather, scatter


def _pieces(p: ParamRows, g0: int, g1: int, starts: list[int]) -> tuple[tuple[int, int, int], ...]:
    """The ``(rank, a, b)`` holding rows ``[g0, g1)`` of ``p``."""
    out = []
    k = max(bisect.bisect_right(starts, g0) - 1, 0)
    while k < len(p.segments) and p.segments[k][1] < g1:
        r, a, b = p.segments[k]
        lo, hi = max(a, g0), min(b, g1)
        if hi > lo:
            out.append((r, lo, hi))
        k += 1
    return tuple(out)


def _columns(blocks: list) -> int:
    """Column blocks per row block of one parameter's blocks (the same for every row)."""
    first = blocks[0][0][:3]
    return next((i for i, (b, _) in enumerate(blocks) if b[:3] != first), len(blocks))


def _pick(
    row: list,
    held: dict[int, int],
    cap: int,
    load: list[int],
    sent: list[int],
    state: list[int],
) -> list[int]:
    """Owners of one row block's column blocks among its holders (``held``: the rows each
    holds); see [Note: Shampoo block owners]. Owning an ``m x n`` block of which
    it holds ``h`` elements changes what a rank sends by ``m n - 2 h``. Returned sorted,
    so they never decrease."""
    extra: dict[int, tuple[int, int, int]] = {}
    owners = []
    for block, _ in row:
        _, r0, r1, c0, c1 = block
        m, n = r1 - r0, c1 - c0
        cost = m**3 + n**3

        def key(r: int, m=m, n=n, cost=cost) -> tuple:
            x = extra.get(r, (0, 0, 0))
            after = load[r] + x[0] + cost
            h = held.get(r, 0)
            moved = m * n - 2 * h * n
            if after > cap:  # over the cap: the least loaded
                return (1, after, h == 0, sent[r] + x[1] + moved, state[r] + x[2], -h, r)
            # within it: a holder, then the least sent (balancing the bytes), ...
            return (0, h == 0, sent[r] + x[1] + moved, after, state[r] + x[2], -h, r)

        owner = min(held, key=key)
        x = extra.get(owner, (0, 0, 0))
        moved = m * n - 2 * held.get(owner, 0) * n
        extra[owner] = (x[0] + cost, x[1] + moved, x[2] + block_state_numel(block))
        owners.append(owner)
    return sorted(owners)


def _repair(places, rows, owners, cap, load, sent, state) -> None:
    """Shift blocks off ranks loaded over ``cap``, along chains of holders: rank ``r``
    gives a block to a co-holder ``q``, which gives one of the same cost to its own
    co-holder, and so on to a rank that stays within ``cap`` (a breadth-first search,
    shortest chain first). Owners stay holders, so a parameter's owners still never
    decrease once each row block's are sorted again. Deterministic: every rank repairs
    alike."""
    mine: dict[int, dict[tuple[int, int], None]] = {}  # rank -> its blocks (insertion order)
    for k, i, n in rows:
        for j in range(i, i + n):
            mine.setdefault(owners[k][j], {})[k, j] = None

    def move(ref: tuple[int, int], src: int, dst: int) -> None:
        k, j = ref
        block, pieces = places[k][j]
        cols = block[4] - block[3]
        held = {q: b - a for q, a, b in pieces}
        for x, sign in ((src, -1), (dst, 1)):
            load[x] += sign * root_cost_of(block)
            state[x] += sign * block_state_numel(block)
            sent[x] += sign * ((block[2] - block[1]) * cols - 2 * held.get(x, 0) * cols)
        del mine[src][ref]
        mine.setdefault(dst, {})[ref] = None
        owners[k][j] = dst

    def chain(r: int, cost: int) -> list | None:
        """Shortest chain of moves of blocks of ``cost`` from ``r`` to a rank with room."""
        back: dict[int, tuple[int, tuple[int, int]] | None] = {r: None}
        frontier = [r]
        for _ in range(_CHAIN_HOPS):
            nxt = []
            for x in frontier:
                for ref in mine.get(x, {}):
                    block, pieces = places[ref[0]][ref[1]]
                    if root_cost_of(block) != cost:
                        continue
                    for q, _, _ in pieces:
                        if q in back:
                            continue
                        back[q] = (x, ref)
                        if load[q] + cost <= cap:
                            path, y = [], q
                            while back[y] is not None:
                                x0, ref0 = back[y]  # type: ignore[misc]
                                path.append((ref0, x0, y))
                                y = x0
                            return path
                        nxt.append(q)
            frontier = nxt
        return None

    for r in sorted(mine, key=lambda r: (-load[r], r)):
        while load[r] > cap:
            costs = sorted({root_cost_of(places[k][j][0]) for k, j in mine[r]}, reverse=True)
            path = next((p for c in costs if (p := chain(r, c)) is not None), None)
            if path is None:
                break
            for ref, src, dst in path:
                move(ref, src, dst)
    for k, i, n in rows:  # each row block's owners in order again
        owners[k][i : i + n] = sorted(owners[k][i : i + n])


def plan_owners(
    params: Sequence[ParamRows], world_size: int, block_size: int, row_block: int
) -> OwnerPlan:
    """The owner of every block of ``params``: see [Note: Shampoo block owners].

    Args:
        params: the shard group's Shampoo parameters, in a fixed order.
        world_size: ranks of the shard dim.
        block_size, row_block: the Shampoo blocks' columns and rows.

    Raises:
        ValueError: a parameter whose segments do not cover its rows in order.
    """
    places: list[list[tuple[Block, tuple]]] = []
    whole = True
    for k, p in enumerate(params):
        total, at = p.members * p.rows, 0
        for r, a, b in p.segments:
            if a != at or b <= a or not 0 <= r < world_size:
                raise ValueError(
                    f"plan_owners: parameter {k} has segments {p.segments}, which do not cover "
                    f"its {total} rows in order on {world_size} ranks"
                )
            at = b
        if at != total:
            raise ValueError(f"plan_owners: parameter {k} covers {at} of its {total} rows")
        starts = [a for _, a, _ in p.segments]
        blocks = []
        for e in range(p.members):
            for r0, r1 in _splits(p.rows, row_block):
                pieces = _pieces(p, e * p.rows + r0, e * p.rows + r1, starts)
                whole = whole and len(pieces) == 1
                for c0, c1 in _splits(p.cols, block_size):
                    blocks.append(((e, r0, r1, c0, c1), pieces))
        places.append(blocks)
    load, state, sent = [0] * world_size, [0] * world_size, [0] * world_size
    for blocks in places:  # a rank that owns nothing sends all its rows
        for (_, _, _, c0, c1), pieces in blocks:
            for r, a, b in pieces:
                sent[r] += (b - a) * (c1 - c0)
    costs = [root_cost_of(b) for blocks in places for b, _ in blocks]
    total, largest = sum(costs), max(costs, default=1)
    # loads up to the cap count alike: 5% over the mean, or what the largest blocks,
    # spread evenly, put on some rank anyway
    cap = max(
        total * (100 + _SLACK_PERCENT) // (100 * world_size),
        largest * -(-total // (largest * world_size)),
    )
    owners: list[list[int]] = [[0] * len(blocks) for blocks in places]
    rows = []  # (param, first block, column blocks): one row block's column blocks
    for k, blocks in enumerate(places):
        n = _columns(blocks)
        rows += [(k, i, n) for i in range(0, len(blocks), n)]
    if not whole:  # the row blocks with the fewest holders first (the least choice)
        rows.sort(key=lambda e: (len(places[e[0]][e[1]][1]), e[0], e[1]))
    for k, i, n in rows:
        row = places[k][i : i + n]
        pieces = row[0][1]
        held = {r: b - a for r, a, b in pieces}
        picks = [pieces[0][0]] * n if whole else _pick(row, held, cap, load, sent, state)
        for j, ((block, _), owner) in enumerate(zip(row, picks)):
            _, r0, r1, c0, c1 = block
            load[owner] += (r1 - r0) ** 3 + (c1 - c0) ** 3
            state[owner] += block_state_numel(block)
            sent[owner] += (r1 - r0) * (c1 - c0) - 2 * held.get(owner, 0) * (c1 - c0)
            owners[k][i + j] = owner
    if not whole:
        _repair(places, rows, owners, cap, load, sent, state)
    out = tuple(
        tuple(BlockPlace(block, owner, pieces) for (block, pieces), owner in zip(blocks, own))
        for blocks, own in zip(places, owners)
    )
    load, state = [0] * world_size, [0] * world_size  # as placed (sorting moved some)
    for placed in out:
        for done in placed:
            load[done.owner] += root_cost_of(done.block)
            state[done.owner] += block_state_numel(done.block)
    mode = COMMUNICATION_FREE if whole else OWNER
    return OwnerPlan(world_size, mode, out, tuple(load), tuple(state))
