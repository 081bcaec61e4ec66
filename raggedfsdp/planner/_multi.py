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
from the cheapest, single classes move to another buffer (or a new one, while fewer
than ``max_buffers`` are used) as long as the best move lowers the cost. So a split need
not follow the order: DeepSeek-V3's layers at 1024 ranks pad least with ``wo``,
``wq_b`` and the experts' ``w2`` in one buffer and the rest in the other. In a group of
at most ``FINE_SEARCH_TENSORS`` tensors, single tensors then move the same way (two
tensors of one class may belong apart). A group whose whole padding costs less than one
more buffer is not searched at all. The search runs once per group structure (shapes,
blocks, stacks: every layer of a model shares it), on cached plans of the candidate
parts, and only the chosen parts get their tensors' names. ``plan_buffers_exact`` (in
``_exact.py``) is the reference: every partition, each buffer solved by HiGHS.

Cost, in bytes on the wire: a buffer's padding is gathered and reduced like its data,
so each padding element costs its bytes on every step's collectives; one more buffer
costs one more collective's latency, counted as ``alpha_bytes``. A ring collective's
latency grows with its ranks, about 5 us per rank, and a rank moves about 25 GB/s, so
the default counts 128 KiB per rank of the buffer (``DEFAULT_ALPHA_BYTES_PER_RANK``:
0.5 MiB over 4 ranks, 128 MiB over 1024). A split is kept only when it saves more
padding bytes than the collectives it adds cost, so small groups, whose padding is a
few kilobytes, stay in one buffer, and so do large ones whose padding is a small share.

Lower bounds. Each buffer's layout carries its proven lower bound on ``S`` (see
``lower_bound_shard_size``); their sum bounds the padding of the chosen split. Over the
choice of split, the bound reported is the least such sum among the splits the search
evaluated, some of them rejected for their cost (a bound for those splits, not for
every partition of the tensors).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from raggedfsdp.planner._layout import BufferLayout
from raggedfsdp.planner._plan import (
    DEFAULT_ALIGNMENT_BYTES,
    alignment_elems,
    canonical_plan,
    check_member_gaps,
    plan_buffer,
    register_cache,
    structure,
)
from raggedfsdp.planner._spec import TensorSpec, dtype_name_and_itemsize

__all__ = ["DEFAULT_ALPHA_BYTES_PER_RANK", "DEFAULT_MAX_BUFFERS", "MultiPlan", "plan_buffers"]

DEFAULT_ALPHA_BYTES_PER_RANK = 128 << 10
DEFAULT_MAX_BUFFERS = 4  # fully_shard's default; plan_buffers' own default is 1
FINE_SEARCH_TENSORS = 8  # groups up to this size also try moving single tensors


@dataclass(frozen=True)
class MultiPlan:
    """A group's buffers (one or more) and the single-buffer plan it was weighed against.

    Args:
        layouts: the buffers, each a ``BufferLayout`` of some of the group's tensors.
        single: the one-buffer layout of all of them.
        lower_bound_padding: a proven lower bound on the padding of the chosen split
            (the sum of its buffers' bounds), in elements.
        searched_lower_bound_padding: the least such bound over the splits searched.
    """

    layouts: tuple[BufferLayout, ...]
    single: BufferLayout
    lower_bound_padding: int
    searched_lower_bound_padding: int

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
        alpha_bytes: the cost of one more buffer's collectives, in bytes. Default (None):
            ``DEFAULT_ALPHA_BYTES_PER_RANK * world_size``. A negative cost favours
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
    if alpha_bytes is None:
        alpha_bytes = DEFAULT_ALPHA_BYTES_PER_RANK * world_size
    if isinstance(alpha_bytes, bool) or not isinstance(alpha_bytes, int):
        raise ValueError(f"planner: alpha_bytes must be an int or None, got {alpha_bytes!r}")
    specs = tuple(tensors)
    kw = dict(dtype=dtype, alignment_bytes=alignment_bytes, member_gaps=member_gaps)
    single = plan_buffer(specs, world_size, **kw)  # checks every input
    if max_buffers == 1 or len(specs) == 1:
        return MultiPlan((single,), single, single.lower_bound_padding, single.lower_bound_padding)
    name, a = alignment_elems(dtype, alignment_bytes)
    parts, searched = _split(
        structure(specs),
        world_size,
        a,
        name,
        check_member_gaps(member_gaps),
        max_buffers,
        alpha_bytes,
    )
    if len(parts) == 1:
        final: tuple[BufferLayout, ...] = (single,)
    else:
        final = tuple(plan_buffer([specs[i] for i in part], world_size, **kw) for part in parts)
    return MultiPlan(final, single, _lb_padding(final), min(searched, _lb_padding(final)))


@functools.lru_cache(maxsize=1024)
def _split(
    key: tuple, m: int, a: int, dtype: str, gaps: bool | str, max_buffers: int, alpha_bytes: int
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The search of ``plan_buffers`` on a group's structure (identical groups, every
    layer, search once): ``(the chosen parts as tensor indices, the least bound searched)``.
    Parts are planned by structure and renamed only once chosen."""
    specs = [
        TensorSpec(name=f"#{i}", shape=sh, block_rows=b, stack=st)
        for i, (sh, b, st) in enumerate(key)
    ]
    itemsize = dtype_name_and_itemsize(dtype)[1]
    single = canonical_plan(key, m, a, dtype, gaps)
    keys = sorted({_key(s) for s in specs})  # the block-size classes, in order
    fine = len(specs) <= FINE_SEARCH_TENSORS
    if (len(keys) == 1 and not fine) or single.padding * itemsize <= alpha_bytes:
        return (tuple(range(len(specs))),), single.lower_bound_padding  # no split can pay
    evaluated: dict[tuple[int, ...], tuple[int, tuple[tuple[int, ...], ...]]] = {}
    planned: dict[tuple[int, ...], tuple[int, int]] = {}  # part -> (padding, bound)
    class_of = [keys.index(_key(s)) for s in specs]

    def evaluate(assign: tuple[int, ...]) -> int:
        """The cost of putting tensor ``t`` in buffer ``assign[t]`` (buffers numbered by
        first tensor, so each split has one name)."""
        if assign not in evaluated:
            parts = []
            for b in range(max(assign) + 1):
                part = tuple(i for i, buf in enumerate(assign) if buf == b)
                if part not in planned:
                    plan = canonical_plan(tuple(key[i] for i in part), m, a, dtype, gaps)
                    planned[part] = (plan.padding, plan.lower_bound_padding)
                parts.append(part)
            padding = sum(planned[part][0] for part in parts)
            evaluated[assign] = (padding * itemsize + alpha_bytes * (len(parts) - 1), tuple(parts))
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
    best = tuple([0] * len(specs))
    for cuts in _compositions(len(keys), 2):
        assign = of_classes(tuple(b for b, n in enumerate(cuts) for _ in range(n)))
        if evaluate(assign) < evaluate(best):
            best = assign
    # 2. single classes moved; 3. in a small group, single tensors too
    best = descend(best, [[i for i, c in enumerate(class_of) if c == k] for k in range(len(keys))])
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
