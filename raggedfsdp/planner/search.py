"""The search: greedy placement for a fixed order, the shard-size search, the lower bound.

See [Note: the search] in ``raggedfsdp.planner`` for the reasoning; the functions
here work on plain integers (element counts) and never see a tensor.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raggedfsdp.planner._spec import TensorSpec

# Shard sizes tried one alignment unit apart, from the lower bound up, before the
# search switches to galloping + bisection (see [Note: the search]).
_LINEAR_STEPS = 32
# Local search after the main search (see [Note: the search]): admissible sizes
# below the best tried, and greedy runs spent on them, per tensor in the group.
_IMPROVE_SIZES = 4
_IMPROVE_RUNS_PER_GROUP = 20_000


def ceil_to(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True, slots=True)
class Item:
    """One tensor as the search sees it.

    ``members == 1``: ``numel`` contiguous elements cut every ``block`` elements.
    ``members > 1``: ``members`` runs of ``numel`` elements, ``stride`` apart, each
    cut every ``block`` elements from its own start; a cut in a gap is free.
    """

    index: int  # position in the caller's tensor list
    numel: int  # elements per member (all elements when members == 1)
    block: int  # block size in elements
    members: int = 1
    stride: int = 0  # member stride (numel + gap); unused when members == 1

    @property
    def extent(self) -> int:
        if self.members == 1:
            return self.numel
        return (self.members - 1) * self.stride + self.numel

    @property
    def gap(self) -> int:
        return self.stride - self.numel if self.members > 1 else 0


# --- lower bound ----------------------------------------------------------------------
def next_admissible(S: int, runs: Sequence[tuple[int, int]], a: int) -> int:
    """Smallest S' >= S that is a multiple of ``a`` and of every forced run's block.

    A run (contiguous stretch of a tensor, cut every ``block`` elements, never
    broken by padding) of ``length >= 2 * S'`` contains a whole shard wherever it
    is placed, so both ends of that shard are block starts and ``S'`` must be a
    multiple of ``block``. Forced runs only drop out as ``S'`` grows, so the S axis
    splits into intervals with a fixed forced set; the first interval holding a
    multiple of its lcm gives the answer.
    """
    S = ceil_to(max(S, 1), a)
    while True:
        forced = [(length, g) for length, g in runs if length >= 2 * S]
        if not forced:
            return S
        L = math.lcm(a, *(g for _, g in forced))
        cand = ceil_to(S, L)
        limit = min(length // 2 for length, _ in forced)  # forced set fixed up to here
        if cand <= limit:
            return cand
        S = ceil_to(limit + 1, a)


def lower_bound_shard_size(
    specs: Sequence[TensorSpec], world_size: int, alignment: int, gap_eligible: Sequence[bool]
) -> int:
    """A shard size no layout in the planner's search space can beat.

    The largest of: ``ceil(total / m)``; the largest block (a block sits in one
    shard); both rounded up to the alignment; and the smallest such size that is a
    multiple of the block of every run long enough to contain a whole shard (see
    ``next_admissible``). A stack that may get member gaps counts member by member
    with its own block: a relaxation of both its gapped layout (cut only between
    members) and its plain one.
    """
    total = sum(s.numel for s in specs)
    runs = _runs(specs, gap_eligible)
    biggest_block = max(1, *(min(g, length) for length, g in runs))
    S0 = max(-(-total // world_size), biggest_block)
    return next_admissible(S0, runs, alignment)


# --- placement of one tensor ----------------------------------------------------------------
def _place_contiguous(x: int, ext: int, g: int, S: int, a: int) -> int | None:
    """Earliest offset ``o >= x`` (multiple of ``a``) where ``[o, o + ext)`` splits no block.

    Closed form, O(1): either the tensor fits before the next boundary ``b``, or
    it straddles ``b`` with a block start on ``b``; with two or more boundaries
    inside, ``S`` must be a multiple of ``g``. If straddling ``b`` fails, the only
    other shape is straddling ``b + S`` with the start in ``[b, b + S]``; any later
    boundary repeats that case, so failing both means no offset exists.
    """
    o = ceil_to(x, a)
    b = (o // S + 1) * S
    if o + ext <= b:
        return o
    step = math.lcm(a, g)  # b - o must be a multiple of g, and o of a (b is)
    multi_ok = S % g == 0
    for room, boundary in ((b - o, b), (S, b + S)):
        y = (room // step) * step  # elements of the tensor before `boundary`
        if y >= ext:  # cannot happen for the first boundary (o + ext > b)
            y = ((ext - 1) // step) * step
        if ext - y <= S or multi_ok:
            return boundary - y
    return None


def _place_strided(x: int, it: Item, S: int, a: int, limit: int) -> int | None:
    """Earliest offset for a gapped stack: shift past each block a boundary would split.

    Shifting the start by less than the distance back to the offending boundary's
    block start cannot help (that boundary would still split the block), so each
    shift keeps the answer the earliest one.
    """
    o = ceil_to(x, a)
    ext, p, mu, g = it.extent, it.stride, it.numel, it.block
    for _ in range(4 * it.members + 16):
        if o + ext > limit:
            return None
        first = (o // S + 1) * S
        if S % p == 0:  # every boundary at the same member position: check one
            checks = range(first, min(first + 1, o + ext))
        else:
            checks = range(first, o + ext, S)
        shift = 0
        for b in checks:
            r = (b - o) % p
            if r < mu and r % g:
                shift = r % g
                break
        if not shift:
            return o
        o = ceil_to(o + shift, a)
    return None


def place(x: int, it: Item, S: int, a: int, limit: int) -> int | None:
    if it.members == 1:
        return _place_contiguous(x, it.numel, it.block, S, a)
    return _place_strided(x, it, S, a, limit)


# --- greedy for a fixed order ---------------------------------------------------------------
def greedy(items: Sequence[Item], order: Sequence[int], S: int, m: int, a: int) -> list[int] | None:
    """Place ``items`` in ``order`` for shard size ``S``; return offsets, or None if they don't fit.

    Each tensor goes to the earliest hole (padding left by an earlier tensor) where
    it fits, else at the earliest valid offset after the last tensor. Appending at
    the earliest offset is optimal for a fixed order (a later end never opens an
    option), and filling holes never moves the end later.
    """
    total = m * S
    end = 0
    holes: list[tuple[int, int]] = []  # padding between placed tensors, in order
    offsets = [0] * len(items)
    for i in order:
        it = items[i]
        ext = it.extent
        done = False
        for h, (hs, he) in enumerate(holes):
            if he - hs < ext:
                continue
            o = place(hs, it, S, a, he)
            if o is not None and o + ext <= he:
                offsets[i] = o
                new = [(s, e) for s, e in ((hs, o), (o + ext, he)) if e - s >= a]
                holes[h : h + 1] = new
                done = True
                break
        if done:
            continue
        o = place(end, it, S, a, total)
        if o is None or o + ext > total:
            return None
        if o - end >= a:
            holes.append((end, o))
        offsets[i] = o
        end = o + ext
    return offsets


# --- orders and variants --------------------------------------------------------------------
def candidate_orders(
    items: Sequence[Item], max_orders: int, seed: int = 0
) -> list[tuple[int, ...]]:
    """Module order, then size- and block-sorted orders, then seeded shuffles; no repeats."""
    n = len(items)
    idx = list(range(n))
    orders = [
        tuple(idx),
        tuple(sorted(idx, key=lambda i: -items[i].extent)),
        tuple(sorted(idx, key=lambda i: (-items[i].block, -items[i].extent))),
        tuple(sorted(idx, key=lambda i: (-(items[i].extent // max(items[i].block, 1)), i))),
        tuple(reversed(idx)),
        tuple(sorted(idx, key=lambda i: items[i].extent)),
    ]
    rng = random.Random(seed)
    for _ in range(4 * max_orders):
        if len(dict.fromkeys(orders)) >= max_orders:
            break
        perm = idx[:]
        rng.shuffle(perm)
        orders.append(tuple(perm))
    return list(dict.fromkeys(orders))[:max_orders]


def plain_items(specs: Sequence[TensorSpec]) -> list[Item]:
    return [Item(index=i, numel=s.numel, block=s.block_elems) for i, s in enumerate(specs)]


def gapped_items(
    specs: Sequence[TensorSpec], eligible: Sequence[bool], S: int, a: int, force: bool = False
) -> list[Item]:
    """Items for shard size ``S`` with every eligible stack given a member gap.

    A member no larger than a shard gets the stride that packs ``q = S // member``
    members per shard (rounded down to the alignment), so member starts repeat at
    the same shard position, and is cut only between members (its block is the
    whole member: every rank holds whole members, see [Note: member gaps]). A stack
    whose members are larger than a shard, or that needs no gap, stays plain; with
    ``force``, one that needs no gap gets one of one alignment unit.
    """
    out = []
    for i, (s, ok) in enumerate(zip(specs, eligible, strict=True)):
        mu, g = s.member_numel, s.block_elems
        stride = 0
        q = S // mu if ok else 0
        while q >= 1:
            p = (S // q) // a * a
            if p >= mu:
                stride = p
                break
            q -= 1
        if force and stride == mu:
            stride += a
        if stride > mu:
            out.append(Item(index=i, numel=mu, block=mu, members=s.members, stride=stride))
        else:
            out.append(Item(index=i, numel=s.numel, block=g))
    return out


@dataclass(frozen=True)
class SearchResult:
    shard_size: int
    lower_bound: int
    items: list[Item]
    offsets: list[int]
    tried: int  # greedy runs made


def search(
    specs: Sequence[TensorSpec],
    world_size: int,
    alignment: int,
    *,
    gap_eligible: Sequence[bool],
    max_orders: int,
    force_gaps: bool = False,
) -> SearchResult:
    """Find a small feasible shard size and its offsets. See [Note: the search].

    Layouts without member gaps are searched first; if some stack may take gaps,
    layouts with gaps are then searched below that size, and the smaller wins
    (with ``force_gaps``, at any size, and they win whenever one is found). The
    reported lower bound holds over both.
    """
    m, a = world_size, alignment
    no_gaps = [False] * len(specs)
    plain = plain_items(specs)
    orders = candidate_orders(plain, max_orders)
    plain_runs = _runs(specs, no_gaps)
    lb_plain = lower_bound_shard_size(specs, m, a, no_gaps)
    # Everything in rank 0's shard always fits: the upper bound to search below.
    ub = next_admissible(max(lb_plain, sum(ceil_to(s.numel, a) for s in specs)), plain_runs, a)
    counter = [0]
    best = _search_family(
        lambda S: plain, orders, plain_runs, lb_plain, ub + a, m, a, counter, cap=ub
    )
    if best is None:
        raise AssertionError("planner: the single-shard layout did not fit (a bug)")
    lb = lb_plain
    if any(gap_eligible):
        lb = min(lb_plain, lower_bound_shard_size(specs, m, a, gap_eligible))
        gap_runs = _runs(specs, gap_eligible)
        found = _search_family(
            lambda S: gapped_items(specs, gap_eligible, S, a, force_gaps),
            orders,
            gap_runs,
            lb,
            _forced_gap_cap(specs, gap_eligible, ub, a) if force_gaps else best[0],
            m,
            a,
            counter,
        )
        if found is not None:
            best = found
    if best[0] > lb_plain and not (force_gaps and any(it.members > 1 for it in best[1])):
        better = _improve(best[0], lb_plain, orders, plain, plain_runs, m, a, counter)
        if better is not None and (best is None or better[0] < best[0]):
            best = better
    S, items, offsets = best
    return SearchResult(S, lb, items, offsets, tried=counter[0])


def _forced_gap_cap(specs: Sequence[TensorSpec], eligible: Sequence[bool], ub: int, a: int) -> int:
    """A shard size below which forced gaps are searched: every stack gapped in one shard
    (each member rounded up to the alignment plus a gap of one unit) fits under it, so
    ``member_gaps="always"`` gaps every eligible stack whose member fits in a shard."""
    one_shard = sum(
        s.members * (ceil_to(s.member_numel, a) + a) if ok else ceil_to(s.numel, a)
        for s, ok in zip(specs, eligible, strict=True)
    )
    return max(4 * ub, one_shard) + a


def _improve(
    best_S: int,
    lb: int,
    orders: list[tuple[int, ...]],
    items: list[Item],
    runs: list[tuple[int, int]],
    m: int,
    a: int,
    counter: list[int],
) -> tuple[int, list[Item], list[int]] | None:
    """Local search: move one tensor elsewhere in a tried order, at sizes below the best.

    For up to ``_IMPROVE_SIZES`` admissible sizes below ``best_S`` (largest first),
    try every order that moves one tensor of a tried order to another position,
    within a budget of greedy runs that shrinks with the group's size.
    """
    n = len(items)
    if n < 2:
        return None
    budget = _IMPROVE_RUNS_PER_GROUP // n
    sizes: list[int] = []
    S = best_S - a
    while S >= lb and len(sizes) < _IMPROVE_SIZES:
        if next_admissible(S, runs, a) == S:
            sizes.append(S)
        S -= a
    found = None
    for S in sizes:
        hit = None
        for base in orders:
            for i in range(n):
                rest = base[:i] + base[i + 1 :]
                for j in range(n):
                    if j == i or budget <= 0:
                        continue
                    order = rest[:j] + (base[i],) + rest[j:]
                    budget -= 1
                    counter[0] += 1
                    offsets = greedy(items, order, S, m, a)
                    if offsets is not None:
                        hit = (S, items, offsets)
                        break
                if hit or budget <= 0:
                    break
            if hit or budget <= 0:
                break
        if hit:
            found = hit  # keep going: a still smaller size may work too
        if budget <= 0:
            break
    return found


def _search_family(
    items_for: Callable[[int], list[Item]],
    orders: list[tuple[int, ...]],
    runs: list[tuple[int, int]],
    lb: int,
    below: int,
    m: int,
    a: int,
    counter: list[int],
    cap: int | None = None,
) -> tuple[int, list[Item], list[int]] | None:
    """Smallest shard size found in ``[lb, below)`` for one family of layouts.

    ``cap``, if given, is a size known to be feasible (it ends the gallop).

    Sizes are admissible ones (``next_admissible`` over ``runs``): the lower bound
    and the next ``_LINEAR_STEPS`` one alignment unit apart, then galloping up and
    bisecting back (feasibility is monotone in S apart from the lcm steps, which
    admissible sizes skip). At each size every order is tried, the last one that
    worked first.
    """
    orders = list(orders)

    def feasible(S: int) -> tuple[int, list[Item], list[int]] | None:
        items = items_for(S)
        for k, order in enumerate(orders):
            counter[0] += 1
            offsets = greedy(items, order, S, m, a)
            if offsets is not None:
                orders.insert(0, orders.pop(k))
                return S, items, offsets
        return None

    S = lb
    for _ in range(_LINEAR_STEPS):
        if S >= below:
            return None
        found = feasible(S)
        if found is not None:
            return found
        S = next_admissible(S + a, runs, a)
    lo, step, hit = S - a, a, None
    while hit is None:
        if S >= below:
            if cap is None or lo >= cap:
                return None
            S = cap  # galloped past: the known-feasible size ends the gallop
        hit = feasible(S)
        if hit is None:
            lo, step = S, step * 2
            S = next_admissible(S + step, runs, a)
    hi = S
    while True:
        mid = next_admissible(ceil_to((lo + hi) // 2, a), runs, a)
        if mid <= lo:
            mid = next_admissible(lo + a, runs, a)
        if mid >= hi:
            return hit
        found = feasible(mid)
        if found is not None:
            hi, hit = mid, found
        else:
            lo = mid


def _runs(specs: Sequence[TensorSpec], gap_eligible: Sequence[bool]) -> list[tuple[int, int]]:
    """``(run length, block)`` of each tensor; a gap-eligible stack counts member by
    member (gapped or not, none of its runs is shorter, and no block of it smaller)."""
    return [
        (s.member_numel if ok else s.numel, s.block_elems)
        for s, ok in zip(specs, gap_eligible, strict=True)
    ]
