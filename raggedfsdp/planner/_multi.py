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

The split is searched, not written per model: the tensors are ordered by block size
(their ``block_elems``; a stack counts as apart from the plain tensors when the block
sizes tie), and every cut of that order into two contiguous classes is planned; the
best cut is kept, and the part that pads most is cut again while buffers are left
(``max_buffers``). Each buffer is planned from its tensors in module order (the
planner then places them as ``plan_buffer`` does); the buffers come in the order of
their first tensor.

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
choice of split, the bound reported is the least such sum among the splits searched
(a bound for this family of splits, not for every partition of the tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from raggedfsdp.planner._layout import BufferLayout
from raggedfsdp.planner._plan import DEFAULT_ALIGNMENT_BYTES, plan_buffer
from raggedfsdp.planner._spec import TensorSpec, dtype_name_and_itemsize

__all__ = ["DEFAULT_ALPHA_BYTES_PER_RANK", "DEFAULT_MAX_BUFFERS", "MultiPlan", "plan_buffers"]

DEFAULT_ALPHA_BYTES_PER_RANK = 128 << 10
DEFAULT_MAX_BUFFERS = 4  # fully_shard's default; plan_buffers' own default is 1


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
    member_gaps: bool = False,
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
    itemsize = dtype_name_and_itemsize(dtype)[1]
    single = plan_buffer(specs, world_size, **kw)

    def plan(part: Sequence[TensorSpec]) -> BufferLayout:
        return plan_buffer(part, world_size, **kw)

    def cost(layouts: Sequence[BufferLayout]) -> int:
        return sum(x.padding for x in layouts) * itemsize + alpha_bytes * (len(layouts) - 1)

    parts: list[tuple[TensorSpec, ...]] = [specs]
    layouts: list[BufferLayout] = [single]
    searched = _lb_padding(layouts)
    while len(parts) < max_buffers:
        best = None  # (cost, index of the part cut, the two halves, their layouts)
        for k, part in enumerate(parts):
            for halves in _cuts(part):
                pair = [plan(h) for h in halves]
                trial = [*layouts[:k], *pair, *layouts[k + 1 :]]
                searched = min(searched, _lb_padding(trial))
                c = cost(trial)
                if best is None or c < best[0]:
                    best = (c, k, halves, pair)
        if best is None or best[0] >= cost(layouts):
            break
        _, k, halves, pair = best
        parts[k : k + 1] = list(halves)
        layouts[k : k + 1] = pair
    order = {s.name: i for i, s in enumerate(specs)}
    chosen = sorted(zip(parts, layouts), key=lambda pl: order[pl[0][0].name])
    final = tuple(layout for _, layout in chosen)
    return MultiPlan(final, single, _lb_padding(final), min(searched, _lb_padding(final)))


def _cuts(part: Sequence[TensorSpec]) -> list[tuple[tuple[TensorSpec, ...], ...]]:
    """Every cut of ``part`` into two non-empty classes along its block-size order (ties:
    plain tensors before stacks); each half keeps module order."""
    keys = sorted({(s.block_elems, s.stack) for s in part})
    out = []
    for threshold in keys[:-1]:
        low = tuple(s for s in part if (s.block_elems, s.stack) <= threshold)
        high = tuple(s for s in part if (s.block_elems, s.stack) > threshold)
        out.append((low, high))
    return out
