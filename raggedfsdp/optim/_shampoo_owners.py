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
optimizer, identically on every rank, among a block's holders where they can carry the
load:

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
go to the lowest rank.

Holders alone cannot always carry the load: where the layout leaves ranks without rows
(a padded layout's last ranks at large world sizes, whatever the optimizer) or with few,
the others must take more than the cap. Then, last, owners go beyond the holders
(*spill*), still never decreasing within a parameter: all blocks, in the order (owner,
parameter, block), form one sequence in which each rank's blocks are one run and each
parameter's blocks keep their order, so any cut of it into one run per rank, in rank
order, keeps every parameter's owners in order. The cut keeps each run's start where
the cap allows and moves it as little as it must (runs over the cap pass their last
blocks up to the next rank, or, sweeping down, their first blocks to the one before; the
sweep that moves fewer blocks wins), within the cap or, where no cut fits it, the least
limit one fits (never above the holders' plan). A block owned beyond its holders has
all of its rows sent; where the catalogue's models spill (16,384 ranks) an owner holds a
tiny part of each block anyway. No plan does better than ``load_bound`` (see [Note:
Shampoo balance bound]), whatever its rule.

A rank thus sends about its own rows and receives about its own blocks: per step each
gradient block travels to its owner once and each direction back once, less what the
owner already holds. ``benchmarks/_shampoo_balance.py --owner`` measures balance
against the bound, state and bytes at the catalogue's shapes (results: ``optim.md``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raggedfsdp.optim.muon_plan import Exchange

__all__ = [
    "COMMUNICATION_FREE",
    "OWNER",
    "BlockPlace",
    "OwnerPlan",
    "ParamRows",
    "block_state_numel",
    "load_bound",
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


def load_bound(costs: Sequence[int], world_size: int) -> int:
    """The least root cost the most loaded rank can have, whatever the owner rule: a lower
    bound over every assignment of blocks of these ``costs`` to ``world_size`` ranks.

    [Note: Shampoo balance bound]
    With the costs sorted descending, ``c_1 >= c_2 >= ...`` (``B`` of them, ``W`` ranks):
    for every ``k >= 0`` with ``k W + 1 <= B``, the ``k W + 1`` largest blocks on ``W``
    ranks put ``k + 1`` of them on one rank (pigeonhole), and those ``k + 1`` cost at
    least the ``k + 1`` smallest of them: the most loaded rank carries at least
    ``c_{kW-k+1} + ... + c_{kW+1}``. ``k = 0`` is the largest block alone. It also carries
    at least the mean, ``ceil(sum / W)`` (loads are integers). The bound is the largest
    of these; it ignores where blocks lie (holders, padding), so no owner plan is below
    it, and for equal costs it is reached: ``ceil(B / W)`` blocks. It can be above every
    plan's reach: ``[7, 5, 4, 4]`` on 2 ranks gives 10, the best split 11.

    Args:
        costs: each block's root cost (``m^3 + n^3``), in any order; non-negative.
        world_size: ranks.

    Raises:
        ValueError: ``world_size < 1``, a negative cost, or costs so large that the
            largest times their count does not fit in 63 bits.
    """
    if world_size < 1:
        raise ValueError(f"load_bound: world_size must be >= 1, got {world_size}")
    c = np.sort(np.asarray(costs, dtype=np.int64))[::-1]  # 1D, descending
    if c.size == 0:
        return 0
    if c[-1] < 0 or int(c[0]) * c.size >= 2**63:  # the sum below 2**63: exact
        raise ValueError(
            f"load_bound: costs must be non-negative, the largest times their count below "
            f"2**63; got the largest {int(c[0])}, the smallest {int(c[-1])}, {c.size} blocks"
        )
    prefix = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(c)])  # prefix[i] = c_1..c_i
    k = np.arange((c.size - 1) // world_size + 1, dtype=np.int64)
    top = k * world_size + 1  # the k W + 1 largest ...
    pigeon = prefix[top] - prefix[top - k - 1]  # ... of which the k + 1 smallest
    total = int(prefix[-1])
    return max(int(pigeon.max()), -(-total // world_size))


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


def _least_starts(prefix: list[int], cap: int, world: int) -> list[int]:
    """``least[x]``: the earliest position of a sequence of blocks (``prefix``: the prefix
    sums of its costs) from which ranks ``x..world-1``, one run each of cost at most
    ``cap``, can still cover the rest (the runs packed from the end). The sequence fits
    ``world`` such runs if and only if ``least[0] == 0``."""
    least = [len(prefix) - 1] * (world + 1)
    for x in range(world - 1, -1, -1):
        least[x] = bisect.bisect_left(prefix, prefix[least[x + 1]] - cap)
    return least


def _cut(prefix: list[int], start: list[int], cap: int) -> list[int]:
    """New starts of the ranks' runs of a sequence of blocks (``prefix``: the prefix sums of
    its costs; ``start[x]``: where rank ``x``'s run starts now, ``start[-1]`` the end), no
    run over ``cap`` (which some cut must fit). Rank by rank from rank 0, each start stays
    where it is unless that breaks the cap: it moves down to the end of the longest run
    within the cap (a run over the cap passes its last blocks on up), or up to
    ``least`` (the ranks after could not hold the rest: this one takes the first blocks
    of the next run). Each start thus lies in ``[least[x], end of the longest run]``,
    never empty since the previous one does (by induction from ``least[0] == 0``)."""
    world = len(start) - 1
    least = _least_starts(prefix, cap, world)
    assert least[0] == 0, "no cut of the sequence fits the cap"
    out = [0] * (world + 1)
    out[world] = start[world]
    for x in range(world - 1):
        most = bisect.bisect_right(prefix, prefix[out[x]] + cap) - 1  # rank x's run at most
        out[x + 1] = min(max(start[x + 1], least[x + 1], out[x]), most)
    return out


def _spill(places, owners: list[list[int]], cap: int, world_size: int) -> None:
    """Bring ranks still over ``cap`` after ``_repair`` within it, or as close as any cut
    allows, with owners beyond the holders; see [Note: Shampoo block owners].

    All blocks in the order (owner, parameter, block) are one sequence in which each rank's
    blocks are one run and each parameter's blocks keep their order: any cut of it into
    ``world_size`` runs, given to the ranks in order, keeps every parameter's owners
    non-decreasing. ``_cut`` moves the runs' starts as little as it must, sweeping up the
    ranks or down them (the sequence reversed); the sweep moving fewer blocks wins (up on
    a tie). Deterministic: every rank cuts alike."""
    seq = sorted(
        (owners[k][j], k, j) for k, blocks in enumerate(places) for j in range(len(blocks))
    )
    costs = [root_cost_of(places[k][j][0]) for _, k, j in seq]
    load = [0] * world_size
    for (r, _, _), c in zip(seq, costs):
        load[r] += c
    if max(load, default=0) <= cap:
        return
    n = len(seq)
    start = [0] * (world_size + 1)  # start[x]: where rank x's run starts in seq
    for r, _, _ in seq:
        start[r + 1] += 1
    for x in range(world_size):
        start[x + 1] += start[x]
    up, down = [0], [0]  # prefix sums of the costs along seq and reversed
    for c in costs:
        up.append(up[-1] + c)
    for c in reversed(costs):
        down.append(down[-1] + c)
    limit = cap
    if _least_starts(up, cap, world_size)[0] > 0:  # no cut fits the cap: the least that fits
        lo, hi = cap + 1, max(load)  # the current owners are one cut within max(load)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _least_starts(up, mid, world_size)[0] == 0 else (mid + 1, hi)
        limit = lo
    if limit >= max(load):
        return
    rising = _cut(up, start, limit)
    falling = [n - a for a in _cut(down, [n - a for a in start[::-1]], limit)[::-1]]

    def moved(cut: list[int]) -> int:
        kept = sum(
            max(0, min(cut[x + 1], start[x + 1]) - max(cut[x], start[x])) for x in range(world_size)
        )
        return n - kept

    best = falling if moved(falling) < moved(rising) else rising
    for x in range(world_size):
        for _, k, j in seq[best[x] : best[x + 1]]:
            owners[k][j] = x


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
        _spill(places, owners, cap, world_size)
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
