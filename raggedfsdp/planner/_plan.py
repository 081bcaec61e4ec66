"""``plan_buffer`` and ``plan_groups``: validate the input, search, build the layout."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from raggedfsdp.planner._layout import BufferLayout, TensorPlacement
from raggedfsdp.planner._spec import TensorSpec, dtype_name_and_itemsize
from raggedfsdp.planner.search import search

DEFAULT_ALIGNMENT_BYTES = 128
"""Default alignment of shard starts and tensor offsets, in bytes.

128 bytes is one GPU L2 cache line and one NCCL LL128 line, and a multiple of the
16-byte vectors NCCL's kernels load and store. With ``S`` a multiple of it, every
rank's slice of the all-gather output and reduce-scatter input starts on a line, so
NCCL stays on its aligned fast path; with offsets a multiple of it, every parameter
view is aligned for vectorized kernels (``_foreach_`` ops, fused optimizers). It
costs at most ``m * 128`` bytes of padding per buffer, a rounding error next to a
transformer block.
"""

_DEFAULT_ORDERS_SMALL = 24  # groups of <= 8 tensors: try many orders, they are cheap
_DEFAULT_ORDERS = 8


def alignment_elems(dtype: Any, alignment_bytes: int) -> tuple[str, int]:
    """``(dtype name, alignment in elements)``; raises ValueError on a bad pair."""
    name, itemsize = dtype_name_and_itemsize(dtype)
    if isinstance(alignment_bytes, bool) or not isinstance(alignment_bytes, int):
        raise ValueError(f"planner: alignment_bytes must be an int, got {alignment_bytes!r}")
    if alignment_bytes < 1 or alignment_bytes % itemsize:
        raise ValueError(
            f"planner: alignment_bytes={alignment_bytes} is not a positive multiple of "
            f"{name}'s {itemsize} bytes per element; pass a multiple such as "
            f"{DEFAULT_ALIGNMENT_BYTES}"
        )
    return name, alignment_bytes // itemsize


def _check_world(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"planner: world_size must be an int >= 1, got {world_size!r}")
    return world_size


def plan_buffer(
    tensors: Iterable[TensorSpec],
    world_size: int,
    *,
    dtype: Any = "bfloat16",
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    member_gaps: bool | str = False,
    max_orders: int | None = None,
) -> BufferLayout:
    """Plan one param group's flat buffer over ``world_size`` ranks.

    Args:
        tensors: the group's tensors (``TensorSpec``), in module order.
        world_size: ranks sharing the buffer (``m >= 1``).
        dtype: the buffer's dtype, a string (``"bfloat16"``) or ``torch.dtype``.
            Default ``"bfloat16"``.
        alignment_bytes: alignment of ``S`` and of every offset, in bytes.
            Default ``DEFAULT_ALIGNMENT_BYTES`` (128; see its docstring).
        member_gaps: let tensors declared ``stack=True`` have padding between their
            members where that lowers the padding (True), or wherever a member fits in a
            shard (``"always"``: to exercise the gapped layout). Default False (opt-in;
            see [Note: member gaps]).
        max_orders: tensor orders to try. Default 24 for groups of up to 8
            tensors, else 8.

    Returns:
        The ``BufferLayout``; it has checked its own invariants.

    Raises:
        ValueError: no tensors, duplicate names, a bad world size, dtype or
            alignment.
    """
    specs = tuple(tensors)
    m = _check_world(world_size)
    name, a = alignment_elems(dtype, alignment_bytes)
    if not specs:
        raise ValueError("planner: a group needs at least one tensor, got none")
    for s in specs:
        if not isinstance(s, TensorSpec):
            raise ValueError(f"planner: expected TensorSpec objects, got {type(s).__name__}")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"planner: tensor names must be unique in a group; repeated: {dup}")
    if max_orders is not None and max_orders < 1:
        raise ValueError(f"planner: max_orders must be >= 1, got {max_orders}")
    gaps = check_member_gaps(member_gaps)
    canonical = canonical_plan(structure(specs), m, a, name, gaps, max_orders)
    return canonical.renamed({f"#{i}": s.name for i, s in enumerate(specs)})


def structure(specs: Sequence[TensorSpec]) -> tuple:
    """What a plan depends on, names aside: ``(shape, block_rows, stack)`` per tensor."""
    return tuple((s.shape, s.block_rows, s.stack) for s in specs)


def canonical_plan(
    key: tuple, m: int, a: int, dtype: str, member_gaps: bool | str, max_orders: int | None = None
) -> BufferLayout:
    """The plan of tensors named ``#0, #1, ...`` of structure ``key`` (cached: identical
    groups share it); ``plan_buffer`` renames it. Inputs already checked."""
    if max_orders is None:
        max_orders = _DEFAULT_ORDERS_SMALL if len(key) <= 8 else _DEFAULT_ORDERS
    return _plan_cached(key, m, a, dtype, member_gaps, max_orders)


@functools.lru_cache(maxsize=4096)
def _plan_cached(
    key: tuple, m: int, a: int, dtype: str, member_gaps: bool | str, max_orders: int
) -> BufferLayout:
    """Plan tensors named ``#0, #1, ...``; identical groups (every layer) share it."""
    specs = [
        TensorSpec(name=f"#{i}", shape=shape, block_rows=block, stack=stack)
        for i, (shape, block, stack) in enumerate(key)
    ]
    eligible = [bool(member_gaps) and gap_eligible(s) for s in specs]
    res = search(
        specs,
        m,
        a,
        gap_eligible=eligible,
        max_orders=max_orders,
        force_gaps=member_gaps == "always",
    )
    placements = []
    for item, off in zip(res.items, res.offsets, strict=True):
        s = specs[item.index]
        placements.append(
            TensorPlacement(
                name=s.name,
                shape=s.shape,
                offset=off,
                block_rows=s.member_rows if item.members > 1 else s.resolved_block_rows,
                row_elems=s.row_elems,
                members=item.members,
                member_gap=item.gap,
            )
        )
    placements.sort(key=lambda t: t.offset)
    return BufferLayout(
        world_size=m,
        shard_size=res.shard_size,
        alignment=a,
        dtype=dtype,
        tensors=tuple(placements),
        lower_bound=res.lower_bound,
    )


def check_member_gaps(member_gaps: object) -> bool | str:
    """``member_gaps`` checked: False, True or ``"always"``.

    Raises:
        ValueError: anything else.
    """
    if isinstance(member_gaps, bool) or member_gaps == "always":
        return member_gaps
    raise ValueError(f"planner: member_gaps must be False, True or 'always', got {member_gaps!r}")


def gap_eligible(spec: TensorSpec) -> bool:
    """Whether a stack can take member gaps: it is cut only between members then, so
    a member must be a whole number of its blocks (the member stride is rounded to the
    alignment; a member's own size need not be)."""
    return spec.stack and spec.members > 1 and spec.member_rows % spec.resolved_block_rows == 0


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One group's plan and the wall time it took (0.0 when reused from a twin group)."""

    name: str
    kind: str
    layout: BufferLayout
    seconds: float


def plan_groups(
    groups: Sequence[tuple[str, str, Sequence[TensorSpec]]],
    world_size: int,
    **kwargs: Any,
) -> list[GroupPlan]:
    """Plan every group of a model; groups of identical shapes are planned once.

    Args:
        groups: ``(group name, group kind, tensors)`` per ``fully_shard`` group.
        world_size: ranks per buffer.
        **kwargs: passed to ``plan_buffer``.
    """
    out = []
    for name, kind, specs in groups:
        t0 = time.perf_counter()
        layout = plan_buffer(specs, world_size, **kwargs)
        out.append(GroupPlan(name=name, kind=kind, layout=layout, seconds=time.perf_counter() - t0))
    return out


_CACHES: list = [_plan_cached]  # every planner cache; see register_cache


def register_cache(cached) -> None:
    """Have ``clear_plan_cache`` clear ``cached`` (an ``lru_cache``d planner function)."""
    _CACHES.append(cached)


def clear_plan_cache() -> None:
    """Forget cached plans and splits (benchmarks call it to time a cold plan)."""
    for cached in _CACHES:
        cached.cache_clear()
