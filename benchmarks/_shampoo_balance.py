"""Shampoo's root computations and FSDP padding per rank at the catalogue's real shapes.

    .venv/bin/python benchmarks/_shampoo_balance.py [--block-size 1024]
        [--row-blocks 1024 128 32 8] [--worlds 64 256 1024] [--models ...]
    .venv/bin/python benchmarks/_shampoo_balance.py --owner [--worlds 256 1024 16384]
        [--models llama3-8b llama3-70b deepseek-v3]

Every model of ``REAL_MODELS`` is planned as ``train`` shards it (one ``fully_shard``
group per embedding, block and head; bf16, 128-byte alignment, up to ``fully_shard``'s
default ``max_buffers`` buffers per group, as it plans them) with
``shampoo_block_policy(block_size, row_block=r)`` for each ``r`` of ``--row-blocks``.
A rank's root cost is the sum, over the Shampoo blocks it holds, of ``m^3 + n^3`` (the
two eigendecompositions of an ``m x n`` block); the table prints the most loaded rank
over the mean, the padding the policy costs, the model's total root cost over that of
square ``block_size`` blocks, and the Shampoo statistics (``L``, ``R``, their roots)
per Shampoo parameter element. No tensor is allocated and no process group is made.

``--owner`` compares, per model and world size, the communication-free mode (the
layout of ``shampoo_block_policy``: the old default 128 x 1024 blocks and square
``block_size`` blocks) with the owner mode (``fully_shard``'s default 1-row blocks, square
blocks, owners from ``plan_owners`` over every Shampoo parameter of the model, as
``Shampoo`` plans them; see [Note: Shampoo block owners]). Besides balance, padding and
statistics it prints the state each rank keeps (``L``, ``R``, roots and the graft's
second moment; the most loaded rank over the mean) and the elements a rank sends per
step in both all-to-alls, over the Shampoo gradient elements per rank (the mean rank's
and the busiest rank's; it receives as many). Beside each balance, ``bound``: the least
balance any assignment of the row's blocks to the ranks reaches, whatever the owner rule
(``load_bound``, [Note: Shampoo balance bound]). Beside each padding, the same grouping's
under AdamW (the planner's default layout, which the owner mode uses by construction),
the planner's proven lower bound for the buffers it chose there, and torch FSDP2's
(every parameter ``Shard(0)``, dim 0 padded to ``ranks * ceil(dim0 / ranks)`` rows).
*beyond holders*: the share of blocks owned by a rank that holds none of their rows.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter

import numpy as np
import torch
from torch import nn

from raggedfsdp.fsdp import BlockPolicy
from raggedfsdp.models import get_config, param_groups
from raggedfsdp.models.catalogue import REAL_MODELS
from raggedfsdp.optim.muon import default_use_muon
from raggedfsdp.optim.shampoo import (
    ParamRows,
    blocks_of,
    load_bound,
    plan_owners,
    root_cost,
    shampoo_block_policy,
)
from raggedfsdp.planner import DEFAULT_MAX_BUFFERS, TensorSpec, plan_buffers


def _plan(g, world: int, policy):
    """Group ``g`` planned as ``train`` plans it (bf16, up to the default number of buffers)
    with ``policy``'s rows per block, and the buffer layout holding each tensor."""
    specs = [
        TensorSpec(
            name=p.fqn,
            shape=p.shape,
            stack=p.stack,
            block_rows=policy(p.fqn, nn.Parameter(torch.empty(p.shape, device="meta"))),
        )
        for p in g.params
    ]
    plan = plan_buffers(specs, world, dtype="bfloat16", max_buffers=DEFAULT_MAX_BUFFERS)
    return plan, {q.name: lay for lay in plan.layouts for q in lay.tensors}


def _blocks_on_ranks(params, layout_of: dict, size: int, row_block: int):
    """Each Shampoo block of ``params`` and the rank holding its first element: the rank
    that preconditions it in the communication-free mode, where blocks lie whole on one."""
    for p in params:
        if not _is_shampoo(p):
            continue
        members = p.shape[0] if len(p.shape) == 3 else 1
        rows, cols = p.shape[-2], p.shape[-1]
        layout = layout_of[p.fqn]
        t = layout[p.fqn]
        stride = t.member_stride if t.members == members else rows * cols
        for b in blocks_of(members, rows, cols, size, row_block):
            e, r0 = b[0], b[1]
            yield b, (t.offset + e * stride + r0 * cols) // layout.shard_size


def _is_shampoo(p) -> bool:
    return len(p.shape) in (2, 3) and default_use_muon(p.fqn, p)


def rank_costs(model: str, world: int, size: int, row_block: int) -> dict:
    """Root cost of every rank summed over the model's groups, the padding share, the
    model's root cost and statistics elements, and its Shampoo elements."""
    policy = shampoo_block_policy(size, row_block=row_block)
    load = [0.0] * world
    pad = total = cost = stats = numel = 0
    costs: Counter = Counter()  # root cost -> blocks
    cache: dict = {}
    for g in param_groups(get_config(model)):
        key = tuple((p.shape, p.stack) for p in g.params)
        if key not in cache:
            plan, layout_of = _plan(g, world, policy)
            group = [0.0] * world
            g_costs: Counter = Counter()
            g_cost = g_stats = 0
            g_numel = sum(math.prod(p.shape) for p in g.params if _is_shampoo(p))
            for b, rank in _blocks_on_ranks(g.params, layout_of, size, row_block):
                _, r0, r1, c0, c1 = b
                group[rank] += root_cost(b)
                g_costs[root_cost(b)] += 1
                g_cost += root_cost(b)
                g_stats += 2 * ((r1 - r0) ** 2 + (c1 - c0) ** 2)
            cache[key] = (group, plan.padding, plan.total_numel, g_cost, g_stats, g_numel, g_costs)
        group, p_pad, p_total, g_cost, g_stats, g_numel, g_costs = cache[key]
        costs.update(g_costs)
        load = [a + b for a, b in zip(load, group)]
        pad, total = pad + p_pad, total + p_total
        cost, stats, numel = cost + g_cost, stats + g_stats, numel + g_numel
    return dict(
        load=load, pad=pad / total, cost=cost, stats=stats, numel=numel, bound=_bound(costs, world)
    )


def _bound(costs: Counter, world: int) -> int:
    """``load_bound`` of a multiset of block costs (see [Note: Shampoo balance bound])."""
    values = sorted(costs)
    return load_bound(
        np.repeat(np.array(values, dtype=np.int64), [costs[v] for v in values]), world
    )


def fsdp2_padding(model: str, world: int) -> float:
    """Padding torch's FSDP2 adds, over the model's elements: each parameter is cut
    ``Shard(0)``, its dim 0 padded to ``world * ceil(dim0 / world)`` (the all-gather
    buffer's own alignment left out)."""
    pad = total = 0
    for g in param_groups(get_config(model)):
        for p in g.params:
            rest = math.prod(p.shape[1:])
            pad += (world * -(-p.shape[0] // world) - p.shape[0]) * rest
            total += p.shape[0] * rest
    return pad / total


def _rows_by_rank(t, layout, members: int, rows: int, cols: int) -> tuple:
    """``(rank, g0, g1)`` segments of a tensor's rows (of ``(members * rows, cols)``) as
    ``layout`` cuts them (whole rows on a rank: 1-row or larger blocks)."""
    S = layout.shard_size
    stride = t.member_stride if t.members == members else rows * cols
    segments: list[list[int]] = []
    for e in range(members):
        start = t.offset + e * stride  # the member's first element in the buffer
        for k in range(start // S, (start + rows * cols - 1) // S + 1):
            lo = max(0, -(-(k * S - start) // cols))
            hi = min(rows, -(-((k + 1) * S - start) // cols))
            if hi <= lo:
                continue
            g0, g1 = e * rows + lo, e * rows + hi
            if segments and segments[-1][0] == k and segments[-1][2] == g0:
                segments[-1][2] = g1
            else:
                segments.append([k, g0, g1])
    return tuple(tuple(x) for x in segments)


def owner_costs(model: str, world: int, size: int) -> dict:
    """The owner mode with square ``size`` blocks on ``fully_shard``'s default layout."""
    base = BlockPolicy()
    pad = floor = total = 0
    params: list[ParamRows] = []
    cache: dict = {}
    for g in param_groups(get_config(model)):
        key = tuple((p.shape, p.stack) for p in g.params)
        if key not in cache:
            plan, layout_of = _plan(g, world, base)
            rows_of = []
            for p in g.params:
                if not _is_shampoo(p):
                    continue
                members = p.shape[0] if len(p.shape) == 3 else 1
                rows, cols = p.shape[-2], p.shape[-1]
                layout = layout_of[p.fqn]
                segments = _rows_by_rank(layout[p.fqn], layout, members, rows, cols)
                rows_of.append(ParamRows(members, rows, cols, segments))
            cache[key] = (rows_of, plan.padding, plan.lower_bound_padding, plan.total_numel)
        rows_of, p_pad, p_floor, p_total = cache[key]
        params += rows_of
        pad, floor, total = pad + p_pad, floor + p_floor, total + p_total
    plan = plan_owners(params, world, size, size)
    numel = sum(p.members * p.rows * p.cols for p in params)
    costs = Counter(root_cost(b.block) for blocks in plan.params for b in blocks)
    stats = sum(
        2 * ((b.block[2] - b.block[1]) ** 2 + (b.block[4] - b.block[3]) ** 2)
        for blocks in plan.params
        for b in blocks
    )
    return dict(
        load=list(plan.load),
        state=list(plan.state),
        sent=plan.traffic(),
        pad=pad / total,
        floor=floor / total,  # the planner's proven bound for the buffers it chose
        stats=stats,
        numel=numel,
        mode=plan.mode,
        bound=_bound(costs, world),
        beyond=sum(  # blocks owned by a rank holding none of their rows
            b.owner not in {r for r, _, _ in b.pieces} for blocks in plan.params for b in blocks
        )
        / sum(costs.values()),
        plan=plan,  # for inspection
    )


def free_state(model: str, world: int, size: int, row_block: int) -> list[int]:
    """State elements (``L``, ``R``, roots, graft moment) per rank in the communication-free
    mode: each block's on the rank holding it."""
    policy = shampoo_block_policy(size, row_block=row_block)
    state = [0] * world
    cache: dict = {}
    for g in param_groups(get_config(model)):
        key = tuple((p.shape, p.stack) for p in g.params)
        if key in cache:
            state = [a + b for a, b in zip(state, cache[key])]
            continue
        group = [0] * world
        plan, layout_of = _plan(g, world, policy)
        for (_, r0, r1, c0, c1), rank in _blocks_on_ranks(g.params, layout_of, size, row_block):
            m, n = r1 - r0, c1 - c0
            group[rank] += 2 * m * m + 2 * n * n + m * n
        cache[key] = group
        state = [a + b for a, b in zip(state, group)]
    return state


def main_owner(args) -> None:
    size = args.block_size
    print(
        f"\nShampoo elements per rank = the model's Shampoo elements / ranks; comm = elements a "
        "rank sends per step (both all-to-alls) over that; state = L, R, roots and graft "
        f"moment; blocks {size} x {size} unless named; bound = load_bound of the row's "
        "blocks over the mean (no owner rule does better); padding = this row's layout's, "
        "AdamW = the planner's default layout's (the owner mode's by construction), AdamW's "
        "bound = the planner's proven lower bound for the buffers it chose, "
        "FSDP2 = Shard(0) with dim 0 padded to ranks x ceil(dim0 / ranks); beyond holders = "
        "blocks owned by a rank holding none of their rows\n"
    )
    print(
        "| model | ranks | mode | padding | padding, AdamW | AdamW's bound | padding, FSDP2 "
        "| root cost, most loaded / mean | bound | stats / elem "
        "| state, most loaded / mean | comm / grad, mean | comm / grad, max | beyond holders |"
    )
    print("| --- | ---: | --- |" + " ---: |" * 11)
    for model in args.models:
        for world in args.worlds:
            owner = owner_costs(model, world, size)
            pads = (
                f"{100 * owner['pad']:.2f}% | {100 * owner['floor']:.2f}% "
                f"| {100 * fsdp2_padding(model, world):.2f}%"
            )
            for row_block, label in (
                (128, f"communication-free, 128 x {size}"),
                (size, "communication-free"),
            ):
                r = rank_costs(model, world, size, row_block)
                state = free_state(model, world, size, row_block)
                load = r["load"]
                mean = sum(load) / world
                print(
                    f"| {model} | {world} | {label} | {100 * r['pad']:.2f}% | {pads} "
                    f"| {max(load) / mean:.2f} | {r['bound'] / mean:.2f} "
                    f"| {r['stats'] / r['numel']:.2f} "
                    f"| {max(state) / (sum(state) / world):.2f} | 0 | 0 | - |",
                    flush=True,
                )
            load, state, sent = owner["load"], owner["state"], owner["sent"]
            mean, share = sum(load) / world, owner["numel"] / world
            print(
                f"| {model} | {world} | {owner['mode']} | {100 * owner['pad']:.2f}% | {pads} "
                f"| {max(load) / mean:.2f} | {owner['bound'] / mean:.2f} "
                f"| {owner['stats'] / owner['numel']:.2f} "
                f"| {max(state) / (sum(state) / world):.2f} "
                f"| {sum(sent) / world / share:.2f} | {max(sent) / share:.2f} "
                f"| {100 * owner['beyond']:.1f}% |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--row-blocks", type=int, nargs="+", default=[1024, 128, 32, 8])
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--models", nargs="+", default=list(REAL_MODELS))
    parser.add_argument(
        "--owner", action="store_true", help="the owner mode beside the communication-free one"
    )
    args = parser.parse_args()
    size = args.block_size
    print("Command: python " + " ".join(sys.argv))
    if args.owner:
        main_owner(args)
        return
    print(
        f"\nblock_size {size}: root cost = sum of m^3 + n^3 over a rank's blocks; "
        f"cost x = the model's root cost over square {size} blocks'; "
        "stats / elem = L, R and roots per Shampoo element\n"
    )
    print(
        "| model | row_block | ranks | ranks with blocks | most loaded / mean | padding "
        "| cost x | stats / elem |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models:
        base = None
        for row_block in args.row_blocks:
            for world in args.worlds:
                r = rank_costs(model, world, size, row_block)
                if base is None:
                    base = rank_costs(model, world, size, size)["cost"]
                load = r["load"]
                mean = sum(load) / world
                busy = sum(x > 0 for x in load)
                print(
                    f"| {model} | {row_block} | {world} | {busy} | {max(load) / mean:.2f} "
                    f"| {100 * r['pad']:.2f}% | {r['cost'] / base:.2f} "
                    f"| {r['stats'] / r['numel']:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
