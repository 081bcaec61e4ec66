"""The exact reference: the planning problem as a MILP, solved by HiGHS (``scipy.optimize.milp``).

For small instances only (tests, ``plan --exact``): the model has ``3 * T * (m - 1)``
binaries. Member gaps are not modelled; stacks are laid out without gaps.

Variables (``a`` the alignment, ``M`` a big-M of ``m * S_ub``)::

    s            S = a * s                       integer, lower bound <= S <= heuristic's S
    u_t          o_t = a * u_t                   integer, offset of tensor t
    z_tu         1 if t lies before u            binary, one per pair
    B/A/C_tk     t before / after / cut by k*S   binary, one of the three per (t, k)
    j_tk         k*S - o_t = g_t * j_tk if C     integer in [1, blocks_t - 1]

    minimise s
    o_t + e_t <= m*S
    o_t + e_t <= o_u + M (1 - z_tu);  o_u + e_u <= o_t + M z_tu
    B + A + C = 1
    o_t + e_t <= k*S + M (1 - B);     o_t >= k*S - M (1 - A)
    |k*S - o_t - g_t j_tk| <= M (1 - C)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from raggedfsdp.planner._layout import BufferLayout, TensorPlacement
from raggedfsdp.planner._plan import DEFAULT_ALIGNMENT_BYTES, _check_world, alignment_elems
from raggedfsdp.planner._plan import plan_buffer as _plan_buffer
from raggedfsdp.planner._spec import TensorSpec, dtype_name_and_itemsize
from raggedfsdp.planner.multi import _alpha, _objective
from raggedfsdp.planner.search import lower_bound_shard_size

_MAX_BINARIES = 20_000


def plan_exact(
    tensors: Iterable[TensorSpec],
    world_size: int,
    *,
    dtype: Any = "bfloat16",
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    time_limit: float = 60.0,
    assume_lower_bound: bool = True,
) -> tuple[BufferLayout, bool]:
    """Solve the planning problem exactly (no member gaps) with HiGHS.

    Args:
        tensors: the group's tensors.
        world_size: ranks ``m``.
        dtype: the buffer's dtype. Default ``"bfloat16"``.
        alignment_bytes: alignment of ``S`` and offsets. Default 128.
        time_limit: seconds HiGHS may spend. Default 60.
        assume_lower_bound: start the search at the planner's lower bound. Tests
            pass False to check that bound against the solver's own optimum.
            Default True.

    Returns:
        ``(layout, proven)``: the best layout found (never worse than the
        heuristic's, which seeds the upper bound) and whether HiGHS proved it optimal.

    Raises:
        ValueError: the instance is too large for the MILP (it would have more
            than 20,000 binaries); use ``plan_buffer``.
    """
    specs = list(tensors)
    m = _check_world(world_size)
    dname, a = alignment_elems(dtype, alignment_bytes)
    heur = _plan_buffer(specs, m, dtype=dtype, alignment_bytes=alignment_bytes)
    T = len(specs)
    n_bin = 3 * T * (m - 1) + T * (T - 1) // 2
    if n_bin > _MAX_BINARIES:
        raise ValueError(
            f"plan_exact: {T} tensors on {m} ranks need {n_bin} binaries, more than "
            f"{_MAX_BINARIES}; use plan_buffer (the heuristic) for instances this large"
        )
    lb = lower_bound_shard_size(specs, m, a, [False] * T)
    s_lo, s_hi = (lb // a if assume_lower_bound else 1), heur.shard_size // a
    if s_lo == s_hi:
        return heur, True
    M = m * heur.shard_size + max(s.numel for s in specs)

    # --- variable indices --------------------------------------------------------------
    names: list[str] = []
    lo: list[float] = []
    hi: list[float] = []
    integ: list[int] = []

    def var(name: str, lb_: float, ub_: float) -> int:
        names.append(name)
        lo.append(lb_)
        hi.append(ub_)
        integ.append(1)
        return len(names) - 1

    v_s = var("s", s_lo, s_hi)
    v_u = [var(f"u{t}", 0, (m * heur.shard_size) // a) for t in range(T)]
    v_z = {(t, u): var(f"z{t},{u}", 0, 1) for t in range(T) for u in range(t + 1, T)}
    v_b, v_a, v_c, v_j = {}, {}, {}, {}
    for t, sp in enumerate(specs):
        blocks = -(-sp.numel // sp.block_elems)
        for k in range(1, m):
            v_b[t, k] = var(f"B{t},{k}", 0, 1)
            v_a[t, k] = var(f"A{t},{k}", 0, 1)
            v_c[t, k] = var(f"C{t},{k}", 0, 1 if blocks >= 2 else 0)
            v_j[t, k] = var(f"j{t},{k}", 1, max(1, blocks - 1))
    rows: list[tuple[dict[int, float], float, float]] = []
    inf = math.inf

    def row(coefs: dict[int, float], lb_: float, ub_: float) -> None:
        rows.append((coefs, lb_, ub_))

    for t, sp in enumerate(specs):
        e = sp.numel
        row({v_u[t]: a, v_s: -m * a}, -inf, -e)  # o_t + e_t <= m S
        for k in range(1, m):
            B, A, C, J = v_b[t, k], v_a[t, k], v_c[t, k], v_j[t, k]
            row({B: 1, A: 1, C: 1}, 1, 1)
            row({v_u[t]: a, v_s: -k * a, B: M}, -inf, M - e)  # o + e <= kS + M(1-B)
            row({v_u[t]: a, v_s: -k * a, A: -M}, -M, inf)  # o >= kS - M(1-A)
            g = sp.block_elems
            row({v_s: k * a, v_u[t]: -a, J: -g, C: M}, -inf, M)  # kS - o - gJ <= M(1-C)
            row({v_s: k * a, v_u[t]: -a, J: -g, C: -M}, -M, inf)  # >= -M(1-C)
    for (t, u), z in v_z.items():
        et, eu = specs[t].numel, specs[u].numel
        row({v_u[t]: a, v_u[u]: -a, z: M}, -inf, M - et)  # o_t + e_t <= o_u + M(1-z)
        row({v_u[u]: a, v_u[t]: -a, z: -M}, -inf, -eu)  # o_u + e_u <= o_t + M z

    res = _minimize(v_s, rows, lo, hi, integ, time_limit)
    if res.x is None:  # time limit without a solution: the heuristic stands
        return heur, False
    proven = res.status == 0
    s_val = round(res.x[v_s])
    if s_val >= s_hi:
        return heur, proven
    S = s_val * a
    placements = [
        TensorPlacement(
            name=sp.name,
            shape=sp.shape,
            offset=round(res.x[v_u[t]]) * a,
            block_rows=sp.resolved_block_rows,
            row_elems=sp.row_elems,
        )
        for t, sp in enumerate(specs)
    ]
    placements.sort(key=lambda p: p.offset)
    layout = BufferLayout(
        world_size=m,
        shard_size=S,
        alignment=a,
        dtype=dname,
        tensors=tuple(placements),
        lower_bound=lb,
    )
    return layout, proven


def _minimize(
    objective: int,
    rows: list[tuple[dict[int, float], float, float]],
    lo: list[float],
    hi: list[float],
    integ: list[int],
    time_limit: float,
):
    """HiGHS's ``milp``: minimize variable ``objective`` subject to ``lb <= coefs . x <=
    ub`` for each row and ``lo <= x <= hi``; returns scipy's result."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    A_mat = lil_matrix((len(rows), len(lo)))
    rlo, rhi = np.empty(len(rows)), np.empty(len(rows))
    for i, (coefs, lb_, ub_) in enumerate(rows):
        for j, c in coefs.items():
            A_mat[i, j] = c
        rlo[i], rhi[i] = lb_, ub_
    cost = np.zeros(len(lo))
    cost[objective] = 1.0
    return milp(
        cost,
        constraints=LinearConstraint(A_mat.tocsr(), rlo, rhi),
        integrality=np.array(integ),
        bounds=Bounds(np.array(lo), np.array(hi)),
        options={"time_limit": time_limit, "disp": False},
    )


def plan_buffers_exact(
    tensors: Iterable[TensorSpec],
    world_size: int,
    *,
    max_buffers: int,
    alpha_bytes: int | None = None,
    dtype: Any = "bfloat16",
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    time_limit: float = 60.0,
) -> tuple[tuple[BufferLayout, ...], float, bool]:
    """The exact multi-buffer reference: every partition of the tensors into at most
    ``max_buffers`` buffers, each buffer solved by ``plan_exact``, weighed by the objective
    ``plan_buffers`` minimises (``(bloated, cost)``: no bloated split where another is
    not, then padding bytes plus ``alpha`` per buffer beyond the first; see [Note:
    multi-buffer groups]).

    For small instances only: ``2**T - 1`` buffers are solved (each distinct subset of
    the ``T`` tensors once), and partitions enumerated up to ``max_buffers`` parts.

    Args:
        alpha_bytes: as for ``plan_buffers``. Default (None): ``default_alpha_bytes``
            and the guard against bloated splits.

    Returns:
        ``(layouts, cost, proven)``: the best split found, its cost in bytes, and
        whether every subset's solve was proven optimal (then the split is optimal).

    Raises:
        ValueError: more than 10 tensors, a bad ``max_buffers`` / ``alpha_bytes``, or what
            ``plan_exact`` raises.
    """
    specs = list(tensors)
    m = _check_world(world_size)
    if len(specs) > 10:
        raise ValueError(
            f"plan_buffers_exact: {len(specs)} tensors give {2 ** len(specs) - 1} subsets to "
            "solve; use it on at most 10 (plan_buffers, the heuristic, for larger groups)"
        )
    if isinstance(max_buffers, bool) or not isinstance(max_buffers, int) or max_buffers < 1:
        raise ValueError(
            f"plan_buffers_exact: max_buffers must be an int >= 1, got {max_buffers!r}"
        )
    alpha, guard = _alpha(alpha_bytes, m)
    itemsize = dtype_name_and_itemsize(dtype)[1]
    total = sum(s.numel for s in specs)
    solved: dict[tuple[int, ...], tuple[BufferLayout, bool]] = {}

    def solve(part: tuple[int, ...]) -> tuple[BufferLayout, bool]:
        if part not in solved:
            solved[part] = plan_exact(
                [specs[i] for i in part],
                m,
                dtype=dtype,
                alignment_bytes=alignment_bytes,
                time_limit=time_limit,
            )
        return solved[part]

    best: tuple[tuple[bool, float], tuple[BufferLayout, ...]] | None = None
    for parts in _partitions(tuple(range(len(specs))), max_buffers):
        layouts = tuple(solve(p)[0] for p in parts)
        padding = sum(x.padding for x in layouts)
        key = _objective(padding, len(parts), total, itemsize, alpha, guard)
        if best is None or key < best[0]:
            best = (key, layouts)
    assert best is not None
    return best[1], best[0][1], all(proven for _, proven in solved.values())


def _partitions(items: tuple[int, ...], most: int):
    """Every partition of ``items`` into at most ``most`` non-empty parts (each once)."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for sub in _partitions(rest, most):
        for i in range(len(sub)):  # first joins an existing part
            yield (*sub[:i], (first, *sub[i]), *sub[i + 1 :])
        if len(sub) < most:  # or starts its own
            yield ((first,), *sub)
