"""Multi-buffer groups: one ``fully_shard`` group's tensors split over several buffers.

[Note: multi-buffer groups]
One buffer per group is a choice, not a law. Every rank holds the same ``S`` elements
of a buffer, and a tensor longer than two shards forces ``S`` to a multiple of its
block; a group mixing blocks of ``b1`` and ``b2`` elements is then held to multiples
of ``lcm(b1, b2)``, which at large world sizes pads far more than either class alone
(DeepSeek-V3's dense layers over 1024 ranks: 54%). Putting each class in a buffer of
its own lifts that: each buffer is planned alone (``plan_buffer``) and gets its own
all-gather and reduce-scatter, issued back to back and waited together, each still in
place (no copy).

The split is searched, not written per model, over the group's block-size classes
(tensors of equal ``block_elems``; a stack apart from plain tensors when they tie):
first every cut of the classes, in block-size order, into two contiguous runs; then,
from the cheapest cut and from one buffer (the better end is kept), single classes move
to another buffer (or a new one, while fewer than ``max_buffers`` are used) as long as
the best move lowers the cost. So a split need not follow the order: DeepSeek-V3's
layers at 1024 ranks pad least with ``wo``, ``wq_b`` and the experts' ``w2`` in one
buffer and the rest in the other. In a group of at most ``FINE_SEARCH_TENSORS``
tensors, single tensors then move the same way (two tensors of one class may belong
apart). A group whose whole padding costs less than one more buffer (and whose one
buffer is not bloated, below) is not searched at all. The search runs once per group
structure (shapes, blocks, stacks: every layer of a model shares it), on cached plans
of the candidate parts, and only the chosen parts get their tensors' names.
``plan_buffers_exact`` (in ``exact.py``) is the reference: every partition, each
buffer solved by HiGHS, the same objective.

Cost: what a split costs a training step, in time and at the memory peak, counted in
bytes of padding; one more buffer costs ``alpha`` of them. Every step all-gathers each
buffer in forward and again in backward and reduce-scatters it
(``COLLECTIVES_PER_STEP`` = 3), so, in seconds::

    a padding byte    t_pad = COLLECTIVES_PER_STEP * (m - 1) / m / LINK_BYTES_PER_S
                              + PEAK_COPIES * PEAK_BYTE_S
    one more buffer   t_buf = COLLECTIVES_PER_STEP * (COLLECTIVE_LATENCY_S
                              + COLLECTIVE_HOP_LATENCY_S * ceil(log2 m))
    alpha(m) = t_buf / t_pad  bytes                      (default_alpha_bytes)
    cost(split) = itemsize * padding + alpha(m) * (buffers - 1)

- Wire: padding is gathered and reduced like data; each rank receives ``(m - 1) / m`` of
  every gathered buffer and sends as much of every reduce-scatter input.
- Latency: all-gather and reduce-scatter by a log-depth algorithm (NCCL's PAT; recursive
  doubling and halving, Thakur, Rabenseifner and Gropp 2005) take ``ceil(log2 m)`` steps,
  each a network hop, after a fixed launch. Collectives are prefetched, so both time
  terms overlap compute alike; neither is discounted, their ratio decides.
- Memory: a buffer's ``m * S`` elements are alive at the peak twice, as the unsharded
  parameters and as the reduce-scatter input (``PEAK_COPIES``; one storage under [Note:
  gradients in place], two without it, as in FSDP2). A byte there is priced at the
  recompute that would otherwise free one (``PEAK_BYTE_S``). The planner sees one group
  at a time, so every group is charged as if it set the peak.

Its sources are the constants' comments. ``alpha`` is 0.40 MB at 4 ranks, 0.65 MB at 64,
0.97 MB at 1,024 and 1.3 MB at 16,384: it grows with ``log2 m`` where the cost of earlier
versions grew with ``m`` (128 KiB per rank: 128 MiB at 1,024). NCCL's own tuning model
still adds 2.8 us per rank to PAT ("still a linear part") and prices a ring at ``m - 1``
hops; on a fabric whose collectives run as rings at scale, pass ``alpha_bytes``.

Guard: never a bloated split when another is not. A split is bloated when its unsharded
buffers hold more than ``MAX_UNSHARDED_RATIO`` (2) times the group's elements, i.e. more
padding than parameters sit at the peak. The objective is lexicographic, ``(bloated,
cost)``: a bloated split is chosen only when every split weighed is bloated (for
``plan_buffers_exact``: every partition). An explicit ``alpha_bytes`` is the cost of
earlier versions, ``itemsize * padding + alpha_bytes * (buffers - 1)`` without the guard:
how tests and experiments force (negative) or forbid splits.

Bounds. The objective changes what is chosen, not what is proven. Each buffer's layout
carries its proven lower bound on ``S`` (see ``lower_bound_shard_size``); their sum,
``lower_bound_padding``, bounds the chosen split's padding, so its cost is within
``itemsize * (padding - lower_bound_padding)`` of the best layouts of the same split.
Over every split into at most ``max_buffers`` buffers (``max_buffers`` >= 2), any split
costs at least ``min(itemsize * single.lower_bound_padding, alpha)``: one buffer pads at
least its bound, two or more cost ``alpha`` at least (``MultiPlan.lower_bound_cost``).
With the default cost, or ``alpha_bytes >= 0``, the chosen split pads no more than one
buffer: it replaces the one buffer only when cheaper, which takes less padding, or when
the guard rejects the one buffer, which takes less too (a split that is not bloated pads
at most ``(MAX_UNSHARDED_RATIO - 1)`` times the group's elements, a bloated one more).
``searched_lower_bound_padding``, the least bound over the splits the search evaluated
(some rejected for their cost), bounds those splits, not every partition of the tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from raggedfsdp.planner._layout import BufferLayout
from raggedfsdp.planner._plan import (
    DEFAULT_ALIGNMENT_BYTES,
    _check_world,
    alignment_elems,
    canonical_plan,
    check_member_gaps,
    plan_buffer,
    register_cache,
    structure,
)
from raggedfsdp.planner._spec import TensorSpec, dtype_name_and_itemsize

__all__ = [
    "DEFAULT_MAX_BUFFERS",
    "MAX_UNSHARDED_RATIO",
    "MultiPlan",
    "default_alpha_bytes",
    "plan_buffers",
    "split_objective",
]

DEFAULT_MAX_BUFFERS = 4  # fully_shard's default; plan_buffers' own default is 1
FINE_SEARCH_TENSORS = 8  # groups up to this size also try moving single tensors

# --- the cost of a split; see [Note: multi-buffer groups] ---------------------------------
COLLECTIVES_PER_STEP = 3  # all-gather in forward, again in backward, reduce-scatter
# Per rank, one 200 Gb/s InfiniBand HDR link per GPU (a DGX A100's eight ConnectX-6).
LINK_BYTES_PER_S = 25e9
# NCCL's tuning model (src/graph/tuning.cc, NCCL 2.23+) prices a PAT all-gather or
# reduce-scatter at an 8 us base plus log2(nodes) network hops of interLat / 3.5, with
# interLat the 14 us of a Simple-protocol network hop: 4 us per doubling of the ranks
# (PAT runs one rank per node). Its 2.8 us per rank on top is left out: see the Note.
COLLECTIVE_LATENCY_S = 8e-6
COLLECTIVE_HOP_LATENCY_S = 14e-6 / 3.5
PEAK_COPIES = 2  # unsharded parameters and reduce-scatter input, m * S elements each
# A byte at the memory peak costs the recompute that would otherwise free it: a
# transformer layer keeps 34 h bytes of activations per token (Korthikanti et al. 2022,
# eq. 1, 16-bit, attention scores aside) for a forward of 24 h^2 FLOPs per token
# (Narayanan et al. 2021): 0.7 h FLOPs a byte, at h = 8192 and 400 TFLOP/s (40% of an
# H100's 989 dense bf16 TFLOP/s) 14.5 ps, about a third of a byte's 40 ps on the link.
PEAK_BYTE_S = 24 * 8192 / 34 / 400e12
MAX_UNSHARDED_RATIO = 2  # the guard: a split above it loses to any split below it


def collective_latency_s(world_size: int) -> float:
    """The latency of one all-gather or reduce-scatter over ``world_size`` ranks, seconds:
    a launch and ``ceil(log2 m)`` hops."""
    m = _check_world(world_size)
    return COLLECTIVE_LATENCY_S + COLLECTIVE_HOP_LATENCY_S * (m - 1).bit_length()


def default_alpha_bytes(world_size: int) -> float:
    """The cost of one more buffer over ``world_size`` ranks, in bytes of padding: what it
    adds to a step (its collectives' latency) over what a padding byte costs (on the
    wire and at the memory peak). See [Note: multi-buffer groups].

    Raises:
        ValueError: a bad world size.
    """
    m = _check_world(world_size)
    t_pad = COLLECTIVES_PER_STEP * (m - 1) / m / LINK_BYTES_PER_S + PEAK_COPIES * PEAK_BYTE_S
    return COLLECTIVES_PER_STEP * collective_latency_s(m) / t_pad


def split_objective(
    layouts: Sequence[BufferLayout], alpha_bytes: int | None = None
) -> tuple[bool, float]:
    """What ``plan_buffers`` minimises over the splits of a group: ``(bloated, cost in
    bytes)``, compared in that order (see [Note: multi-buffer groups]).

    Args:
        layouts: a split, one layout per buffer (the same world size and dtype).
        alpha_bytes: as for ``plan_buffers``. Default (None): ``default_alpha_bytes``
            and the guard.
    """
    first = layouts[0]
    alpha, guard = _alpha(alpha_bytes, first.world_size)
    padding = sum(x.padding for x in layouts)
    total = sum(x.total_numel for x in layouts)
    return _objective(padding, len(layouts), total, _itemsize(first), alpha, guard)


def _alpha(alpha_bytes: Any, world_size: int) -> tuple[float, bool]:
    """``(the cost of one more buffer, whether the guard applies)``; checks ``alpha_bytes``."""
    if alpha_bytes is None:
        return default_alpha_bytes(world_size), True
    if isinstance(alpha_bytes, bool) or not isinstance(alpha_bytes, int):
        raise ValueError(f"planner: alpha_bytes must be an int or None, got {alpha_bytes!r}")
    return alpha_bytes, False


def _objective(
    padding: int, buffers: int, total: int, itemsize: int, alpha: float, guard: bool
) -> tuple[bool, float]:
    """``(bloated, cost)`` of a split padding ``padding`` elements over ``buffers`` buffers
    of a group of ``total`` elements."""
    bloated = guard and padding > (MAX_UNSHARDED_RATIO - 1) * total
    return bloated, padding * itemsize + alpha * (buffers - 1)


def _itemsize(layout: BufferLayout) -> int:
    return dtype_name_and_itemsize(layout.dtype)[1]


@dataclass(frozen=True)
class MultiPlan:
    """A group's buffers (one or more) and the single-buffer plan it was weighed against.

    Args:
        layouts: the buffers, each a ``BufferLayout`` of some of the group's tensors.
        single: the one-buffer layout of all of them.
        lower_bound_padding: a proven lower bound on the padding of the chosen split
            (the sum of its buffers' bounds), in elements.
        searched_lower_bound_padding: the least such bound over the splits searched.
        alpha_bytes: the cost of one more buffer it was planned with, in bytes. Default 0.
        max_buffers: the most buffers it could use. Default 1.
    """

    layouts: tuple[BufferLayout, ...]
    single: BufferLayout
    lower_bound_padding: int
    searched_lower_bound_padding: int
    alpha_bytes: float = 0.0
    max_buffers: int = 1

    @property
    def total_numel(self) -> int:
        return self.single.total_numel

    @property
    def padding(self) -> int:
        return sum(layout.padding for layout in self.layouts)

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.total_numel

    @property
    def lower_bound_padding_ratio(self) -> float:
        return self.lower_bound_padding / self.total_numel

    @property
    def single_buffer_lower_bound_padding_ratio(self) -> float:
        return self.single.lower_bound_padding_ratio

    @property
    def cost(self) -> float:
        """The chosen split's cost, bytes: ``itemsize * padding + alpha * (buffers - 1)``."""
        return self.padding * _itemsize(self.single) + self.alpha_bytes * (len(self.layouts) - 1)

    @property
    def lower_bound_cost(self) -> float:
        """A proven lower bound on the cost of every split into at most ``max_buffers``
        buffers (see the bounds in [Note: multi-buffer groups])."""
        one = self.single.lower_bound_padding * _itemsize(self.single)
        return min(one, *(self.alpha_bytes * (n - 1) for n in range(2, self.max_buffers + 1)))


def _lb_padding(layouts: Sequence[BufferLayout]) -> int:
    return sum(layout.lower_bound_padding for layout in layouts)


def plan_buffers(
    tensors: Iterable[TensorSpec],
    world_size: int,
    *,
    max_buffers: int = 1,
    alpha_bytes: int | None = None,
    dtype: Any = "bfloat16",
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    member_gaps: bool | str = False,
) -> MultiPlan:
    """Plan one group into at most ``max_buffers`` buffers; see [Note: multi-buffer groups].

    Args:
        tensors: the group's tensors, in module order.
        world_size: ranks sharing each buffer.
        max_buffers: the most buffers the group may use (>= 1). Default 1.
        alpha_bytes: the cost of one more buffer, in bytes of padding. Default (None):
            ``default_alpha_bytes(world_size)`` (its collectives' latency against what a
            padding byte costs on the wire and at the memory peak), and no bloated split
            where another is not. An int: the cost of earlier versions, padding bytes plus
            ``alpha_bytes`` per extra buffer, without that guard; a negative one favours
            splitting (a split is then taken as long as it costs less than
            ``-alpha_bytes`` of padding): how tests and experiments force several buffers.
        dtype, alignment_bytes, member_gaps: as for ``plan_buffer``.

    Returns:
        The ``MultiPlan``; its buffers hold every tensor once.

    Raises:
        ValueError: a bad ``max_buffers`` or ``alpha_bytes``, or what ``plan_buffer`` raises.
    """
    if isinstance(max_buffers, bool) or not isinstance(max_buffers, int) or max_buffers < 1:
        raise ValueError(f"planner: max_buffers must be an int >= 1, got {max_buffers!r}")
    alpha, guard = _alpha(alpha_bytes, world_size)
    specs = tuple(tensors)
    kw = dict(dtype=dtype, alignment_bytes=alignment_bytes, member_gaps=member_gaps)
    single = plan_buffer(specs, world_size, **kw)  # checks every input
    done: dict[str, Any] = dict(alpha_bytes=alpha, max_buffers=max_buffers)
    if max_buffers == 1 or len(specs) == 1:
        lb = single.lower_bound_padding
        return MultiPlan((single,), single, lb, lb, **done)
    name, a = alignment_elems(dtype, alignment_bytes)
    parts, searched = _split(
        structure(specs),
        world_size,
        a,
        name,
        check_member_gaps(member_gaps),
        max_buffers,
        alpha,
        guard,
    )
    if len(parts) == 1:
        final: tuple[BufferLayout, ...] = (single,)
    else:
        final = tuple(plan_buffer([specs[i] for i in part], world_size, **kw) for part in parts)
    return MultiPlan(final, single, _lb_padding(final), min(searched, _lb_padding(final)), **done)


@functools.lru_cache(maxsize=1024)
def _split(
    key: tuple,
    m: int,
    a: int,
    dtype: str,
    gaps: bool | str,
    max_buffers: int,
    alpha: float,
    guard: bool,
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The search of ``plan_buffers`` on a group's structure (identical groups, every
    layer, search once): ``(the chosen parts as tensor indices, the least bound searched)``.
    Parts are planned by structure and renamed only once chosen."""
    specs = [
        TensorSpec(name=f"#{i}", shape=sh, block_rows=b, stack=st)
        for i, (sh, b, st) in enumerate(key)
    ]
    itemsize = dtype_name_and_itemsize(dtype)[1]
    total = sum(s.numel for s in specs)
    single = canonical_plan(key, m, a, dtype, gaps)
    keys = sorted({_key(s) for s in specs})  # the block-size classes, in order
    fine = len(specs) <= FINE_SEARCH_TENSORS
    one = _objective(single.padding, 1, total, itemsize, alpha, guard)
    if (len(keys) == 1 and not fine) or (not one[0] and one[1] <= alpha):
        return (tuple(range(len(specs))),), single.lower_bound_padding  # no split can pay
    evaluated: dict[tuple[int, ...], tuple[tuple[bool, float], tuple[tuple[int, ...], ...]]] = {}
    planned: dict[tuple[int, ...], tuple[int, int]] = {}  # part -> (padding, bound)
    class_of = [keys.index(_key(s)) for s in specs]

    def evaluate(assign: tuple[int, ...]) -> tuple[bool, float]:
        """The objective of putting tensor ``t`` in buffer ``assign[t]`` (buffers numbered
        by first tensor, so each split has one name)."""
        if assign not in evaluated:
            parts = []
            for b in range(max(assign) + 1):
                part = tuple(i for i, buf in enumerate(assign) if buf == b)
                if part not in planned:
                    plan = canonical_plan(tuple(key[i] for i in part), m, a, dtype, gaps)
                    planned[part] = (plan.padding, plan.lower_bound_padding)
                parts.append(part)
            padding = sum(planned[part][0] for part in parts)
            cost = _objective(padding, len(parts), total, itemsize, alpha, guard)
            evaluated[assign] = (cost, tuple(parts))
        return evaluated[assign][0]

    def of_classes(by_class: tuple[int, ...]) -> tuple[int, ...]:
        return _canonical(tuple(by_class[c] for c in class_of))

    def descend(best: tuple[int, ...], units: list[list[int]]) -> tuple[int, ...]:
        """Move one unit (a class, or a tensor) to another buffer, or to a new one while
        fewer than ``max_buffers`` are used, taking the best move while it lowers the cost."""
        for _ in range(2 * len(units)):
            moves = [
                _canonical(tuple(b if i in unit else x for i, x in enumerate(best)))
                for unit in units
                for b in range(min(max(best) + 2, max_buffers))
                if b != best[unit[0]]
            ]
            improved = min(moves, key=evaluate, default=best)
            if evaluate(improved) >= evaluate(best):
                break
            best = improved
        return best

    # 1. every cut of the class order into one or two contiguous runs
    one_buffer = best = tuple([0] * len(specs))
    for cuts in _compositions(len(keys), 2):
        assign = of_classes(tuple(b for b, n in enumerate(cuts) for _ in range(n)))
        if evaluate(assign) < evaluate(best):
            best = assign
    # 2. single classes moved, from the best cut and from one buffer (a cheap cut can
    # trap the moves: a class that pads alone is reached from one buffer in a move);
    # 3. in a small group, single tensors too
    classes = [[i for i, c in enumerate(class_of) if c == k] for k in range(len(keys))]
    best = min((descend(best, classes), descend(one_buffer, classes)), key=evaluate)
    if fine:
        best = descend(best, [[i] for i in range(len(specs))])
    searched = min(sum(planned[p][1] for p in parts) for _, parts in evaluated.values())
    return evaluated[best][1], searched


register_cache(_split)


def _key(s: TensorSpec) -> tuple[int, bool]:
    """A tensor's block-size class (ties: plain tensors before stacks)."""
    return (s.block_elems, s.stack)


def _canonical(assign: tuple[int, ...]) -> tuple[int, ...]:
    """``assign`` with its buffers renumbered in order of first use (one name per split)."""
    names: dict[int, int] = {}
    return tuple(names.setdefault(b, len(names)) for b in assign)


def _compositions(n: int, parts: int):
    """Every way to cut ``n`` ordered classes into 1..``parts`` non-empty runs (run lengths)."""
    if n == 0:
        yield ()
        return
    for first in range(1, n + 1):
        if first == n:
            yield (n,)
        elif parts > 1:
            for rest in _compositions(n - first, parts - 1):
                yield (first, *rest)
