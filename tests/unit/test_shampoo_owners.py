"""Shampoo's owner plan (pure planning): who owns each block, what each rank sends."""

from __future__ import annotations

import itertools
import random

import pytest

from raggedfsdp.optim.shampoo import ParamRows, blocks_of, load_bound, plan_owners, root_cost


def _even(members, rows, cols, world):
    """Rows cut as evenly as whole rows allow over ``world`` ranks."""
    total = members * rows
    cuts = [total * r // world for r in range(world + 1)]
    segments = tuple((r, cuts[r], cuts[r + 1]) for r in range(world) if cuts[r + 1] > cuts[r])
    return ParamRows(members, rows, cols, segments)


PARAMS = [_even(1, 96, 96, 5), _even(1, 260, 96, 5), _even(6, 44, 96, 5), _even(1, 32, 96, 5)]


def test_owners_hold_rows_never_decrease_and_balance():
    plan = plan_owners(PARAMS, 5, 16, 16)
    assert plan.mode == "owner"
    for p, blocks in zip(PARAMS, plan.params):
        assert [b.block for b in blocks] == blocks_of(p.members, p.rows, p.cols, 16, 16)
        owners = [b.owner for b in blocks]
        assert owners == sorted(owners)  # so each rank's state is one run of the global state
        for b in blocks:
            assert b.owner in {r for r, _, _ in b.pieces}  # among its holders: they suffice
            e, r0, r1 = b.block[:3]
            assert sum(hi - lo for _, lo, hi in b.pieces) == r1 - r0
            assert b.pieces[0][1] == e * p.rows + r0 and b.pieces[-1][2] == e * p.rows + r1
    costs = [
        (b.block[2] - b.block[1]) ** 3 + (b.block[4] - b.block[3]) ** 3
        for bs in plan.params
        for b in bs
    ]
    assert sum(plan.load) == sum(costs)
    left, right, graft = plan.units(0)
    assert sum(graft) == 96 * 96 and sum(left) == sum(right) == 6 * 6 * 16 * 16  # 36 blocks


def test_balance_reaches_the_optimum():
    """80 x 64 over 6 ranks cut at rows 8, 24, 40, 56, 72: each 16-row block has two
    holders, and 20 blocks of 16 x 16 on 6 ranks put at least 4 on some rank."""
    cuts = [0, 8, 24, 40, 56, 72, 80]
    p = ParamRows(1, 80, 64, tuple((r, cuts[r], cuts[r + 1]) for r in range(6)))
    plan = plan_owners([p], 6, 16, 16)
    assert max(plan.load) == 4 * 2 * 16**3


def test_traffic_and_exchanges_agree():
    """Rank r's gather sends each of its pieces of others' blocks to their owner; the
    owner's gather receives the same pieces in the same order; the scatter reverses it."""
    world = 5
    plan = plan_owners(PARAMS, world, 16, 16)
    ex = [plan.exchanges(r, range(len(PARAMS))) for r in range(world)]
    for src in range(world):
        for dst in range(world):
            sent = [s for s in ex[src][0].send if _owner(plan, s[0]) == dst]
            got = [s for s in ex[dst][0].recv if s[1] == src]
            assert sent == got
            assert ex[src][0].send_splits[dst] == ex[dst][0].recv_splits[src]
            assert ex[src][1].send_splits[dst] == ex[dst][1].recv_splits[src]
    for r in range(world):
        g, s = ex[r]
        assert sum(g.send_splits) + sum(s.send_splits) == plan.traffic()[r]


def _owner(plan, gid):
    for blocks in plan.params:
        if gid < len(blocks):
            return blocks[gid].owner
        gid -= len(blocks)
    raise AssertionError(gid)


def test_whole_blocks_are_communication_free():
    p = ParamRows(1, 64, 40, ((0, 0, 32), (2, 32, 64)))  # rank 1 holds no rows
    plan = plan_owners([p], 3, 16, 16)
    assert plan.mode == "communication-free"
    assert [b.owner for b in plan.params[0]] == [0] * 6 + [2] * 6
    assert plan.traffic() == [0, 0, 0]


def test_rows_not_covered_refused():
    with pytest.raises(ValueError, match=r"parameter 0 has segments .* do not cover its 8 rows"):
        plan_owners([ParamRows(1, 8, 4, ((0, 0, 4), (1, 5, 8)))], 2, 4, 4)
    with pytest.raises(ValueError, match=r"parameter 0 covers 6 of its 8 rows"):
        plan_owners([ParamRows(1, 8, 4, ((0, 0, 6),))], 2, 4, 4)


def _best_max_load(costs, world):
    """The least most-loaded rank over every assignment of ``costs`` to ``world`` ranks."""
    best = None
    for owners in itertools.product(range(world), repeat=len(costs)):
        load = [0] * world
        for c, r in zip(costs, owners):
            load[r] += c
        best = max(load) if best is None else min(best, max(load))
    return best


def test_load_bound_hand_cases():
    """Sorted descending c_1 >= c_2 >= ...: max(c_{kW-k+1} + ... + c_{kW+1} over k, ceil(mean))."""
    assert load_bound([3] * 10, 4) == 9  # k = 2: the 9 largest put 3 on one rank; mean 7.5
    assert load_bound([100, 1, 1, 1], 2) == 100  # k = 0: the largest block alone
    assert load_bound([5, 1, 5, 1, 5, 1], 2) == 10  # k = 1: two of the three 5s; mean 9
    assert load_bound([1, 2, 4, 8], 1) == 15  # one rank: everything
    assert load_bound([7, 5, 4, 4], 2) == 10  # the mean; the best split is 11 (below)
    assert load_bound([2, 2, 1], 5) == 2  # more ranks than blocks: the largest
    assert load_bound([], 3) == 0
    with pytest.raises(ValueError, match=r"load_bound: world_size must be >= 1, got 0"):
        load_bound([1], 0)
    with pytest.raises(ValueError, match=r"load_bound: costs must be non-negative"):
        load_bound([3, -1], 2)


def test_load_bound_against_brute_force():
    """Never above the best of every assignment (enumerated), equal to it where the bound
    is known exact (up to W + 1 blocks, one rank, equal costs), below it on [7, 5, 4, 4]."""
    values = (1, 2, 3, 5, 8)
    below = 0
    for world in (1, 2, 3):
        for n in range(1, 6):
            for costs in itertools.combinations_with_replacement(values, n):
                best = _best_max_load(costs, world)
                bound = load_bound(list(costs), world)
                assert bound <= best, (costs, world)
                if n <= world + 1 or world == 1 or len(set(costs)) == 1:
                    assert bound == best, (costs, world)
                below += bound < best
    assert below > 0  # a bound, not the optimum
    assert _best_max_load([7, 5, 4, 4], 2) == 11


def _tail_empty(world, rows, cols, size, empty):
    """One ``rows x cols`` matrix cut evenly over the ranks but ``empty`` (which hold no
    rows, as a padded layout's last ranks do)."""
    ranks = [r for r in range(world) if r not in empty]
    cuts = [rows * i // len(ranks) for i in range(len(ranks) + 1)]
    return ParamRows(1, rows, cols, tuple((r, cuts[i], cuts[i + 1]) for i, r in enumerate(ranks)))


@pytest.mark.parametrize("empty", [{3}, {0}, {0, 5}])
def test_owners_beyond_holders_reach_the_bound(empty):
    """6 blocks of 16 x 16 on 6 ranks, some holding no rows: among the holders some rank
    owns two; owners beyond them give every rank one (the bound), still in block order."""
    world = 6
    p = _tail_empty(world, 96, 16, 16, empty)
    plan = plan_owners([p, p], world, 16, 16)
    costs = [root_cost(b.block) for blocks in plan.params for b in blocks]
    assert max(plan.load) == load_bound(costs, world) == 2 * 2 * 16**3
    for blocks in plan.params:
        owners = [b.owner for b in blocks]
        assert owners == sorted(owners)
    owners = {b.owner for blocks in plan.params for b in blocks}
    assert empty <= owners  # the ranks without rows own blocks
    again = plan_owners([p, p], world, 16, 16)
    assert again == plan  # deterministic: every rank plans alike


def test_plans_never_below_the_bound():
    """Small layouts, every rank count: the plan's most loaded rank is at least the bound,
    and every parameter's owners are in block order."""
    for world in (2, 3, 4, 5):
        for rows, cols in ((40, 24), (33, 16), (96, 40)):
            params = [_even(1, rows, cols, world), _even(2, rows // 2, cols, world)]
            plan = plan_owners(params, world, 16, 8)
            costs = [root_cost(b.block) for blocks in plan.params for b in blocks]
            assert max(plan.load) >= load_bound(costs, world)
            for blocks in plan.params:
                owners = [b.owner for b in blocks]
                assert owners == sorted(owners)


def test_equal_blocks_stay_within_the_cap_on_any_layout():
    """Square blocks of one size on random layouts, some ranks holding no rows: in the owner
    mode the most loaded rank stays within the cap (5% over the mean, or the bound if
    more), which every cut of equal blocks fits (the communication-free mode keeps each
    block on its one holder); owners in block order, the plan the same when planned again."""
    rng = random.Random(0)
    size, cost = 8, 2 * 8**3
    owner_mode = 0
    for _ in range(200):
        world = rng.randint(2, 7)
        params = []
        for _ in range(rng.randint(1, 3)):
            members, rows, cols = rng.choice([1, 2]), 8 * rng.randint(1, 5), 8 * rng.randint(1, 3)
            ranks = sorted(rng.sample(range(world), rng.randint(1, world)))
            inner = sorted(rng.sample(range(1, members * rows), len(ranks) - 1))
            cuts = [0, *inner, members * rows]
            segments = tuple((r, cuts[i], cuts[i + 1]) for i, r in enumerate(ranks))
            params.append(ParamRows(members, rows, cols, segments))
        plan = plan_owners(params, world, size, size)
        total = sum(plan.load)
        bound = load_bound([cost] * (total // cost), world)
        if plan.mode == "owner":
            owner_mode += 1
            assert max(plan.load) <= max(total * 105 // (100 * world), bound), (world, params)
        for blocks in plan.params:
            owners = [b.owner for b in blocks]
            assert owners == sorted(owners)
        assert plan_owners(params, world, size, size) == plan
    assert owner_mode > 150
