"""The planner: invariants (checked independently of BufferLayout), bounds, errors, views."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from raggedfsdp.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    WHOLE,
    BufferLayout,
    TensorPlacement,
    TensorSpec,
    plan_buffer,
    plan_groups,
    with_block_rows,
)
from raggedfsdp.planner.search import lower_bound_shard_size, next_admissible


# --- an independent checker: element by element -----------------------------------------
def brute_check(layout: BufferLayout, specs: list[TensorSpec]) -> None:
    """Check every rule by walking every element; share no code with BufferLayout."""
    m, S, a = layout.world_size, layout.shard_size, layout.alignment
    assert S % a == 0
    owner = np.full(m * S, -1, dtype=np.int64)
    by_name = {s.name: s for s in specs}
    assert sorted(layout.names) == sorted(by_name)
    for ti, t in enumerate(layout.tensors):
        spec = by_name[t.name]
        assert t.shape == spec.shape and t.offset % a == 0
        # a stack laid out with member gaps is cut only between members: its block is one
        # whole member ([Note: member gaps])
        k = spec.member_rows if t.members > 1 else spec.resolved_block_rows
        assert t.block_rows == k
        # buffer position and block id of every element of the flattened tensor
        idx = np.arange(spec.numel)
        row = idx // spec.row_elems
        if t.members == 1:
            pos = t.offset + idx
            block = row // k
        else:
            member, within = np.divmod(idx, spec.member_numel)
            pos = t.offset + member * t.member_stride + within
            block = member * 10**6 + (row % spec.member_rows) // k
            assert t.member_stride % a == 0
        assert pos.max() < m * S, "tensor runs past the buffer"
        assert (owner[pos] == -1).all(), f"{t.name} overlaps another tensor"
        owner[pos] = ti
        rank = pos // S
        for b in np.unique(block):  # a block lives on one rank
            assert len(np.unique(rank[block == b])) == 1, f"{t.name}: block {b} split"
        # local ranges tile the flattened tensor in rank order, consistent with pos
        cursor = 0
        for r in range(m):
            lo, hi = layout.local_range(t.name, r)
            assert lo == cursor and hi >= lo
            assert (rank[lo:hi] == r).all()
            cursor = hi
        assert cursor == spec.numel
        units = layout.local_units(t.name)
        unit = t.unit_rows * spec.row_elems
        assert len(units) == m and sum(units) * unit == spec.numel
    assert layout.padding == m * S - sum(s.numel for s in specs) >= 0
    assert layout.lower_bound <= S


@st.composite
def instances(draw, max_world: int = 8, max_tensors: int = 8, gaps: bool = True):
    m = draw(st.integers(1, max_world))
    n = draw(st.integers(1, max_tensors))
    specs = []
    for i in range(n):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
        stack = ndim == 3 and draw(st.booleans())
        spec = TensorSpec(name=f"t{i}", shape=shape, stack=stack)
        rows = spec.member_rows if stack else spec.rows
        block = draw(st.one_of(st.integers(1, rows), st.just("whole")))
        specs.append(TensorSpec(name=f"t{i}", shape=shape, stack=stack, block_rows=block))
    align_bytes = draw(st.sampled_from([4, 8, 16]))
    member_gaps = gaps and draw(st.booleans())
    return specs, m, align_bytes, member_gaps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
@example(  # found by a random run: a gapped stack's block is one whole member
    (
        [
            TensorSpec(name="t0", shape=(2, 3, 3), block_rows=1, stack=True),
            TensorSpec(name="t1", shape=(1,), block_rows=WHOLE),
            TensorSpec(name="t2", shape=(1,), block_rows=WHOLE),
        ],
        3,
        8,
        True,
    )
)
def test_every_layout_satisfies_its_invariants(inst):
    specs, m, align_bytes, gaps = inst
    layout = plan_buffer(specs, m, dtype="float32", alignment_bytes=align_bytes, member_gaps=gaps)
    brute_check(layout, specs)
    # the bound: ceil(total / m) rounded to the alignment, and the biggest block
    a = align_bytes // 4
    total = sum(s.numel for s in specs)
    per_rank = -(-total // m)
    assert layout.lower_bound >= -(-per_rank // a) * a
    assert layout.lower_bound >= max(min(s.block_elems, s.member_numel) for s in specs)
    assert layout.padding >= layout.lower_bound_padding


@settings(max_examples=60, deadline=None)
@given(instances(max_world=64, max_tensors=12, gaps=True))
def test_invariants_on_more_ranks(inst):
    specs, m, align_bytes, gaps = inst
    layout = plan_buffer(specs, m, dtype="float32", alignment_bytes=align_bytes, member_gaps=gaps)
    brute_check(layout, specs)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 200), st.integers(1, 50)), min_size=1, max_size=6),
    st.integers(1, 400),
    st.sampled_from([1, 2, 8]),
)
def test_next_admissible_is_the_smallest_admissible_size(runs, start, a):
    runs = [(length, g) for length, g in runs]

    def admissible(S):
        return S % a == 0 and all(S % g == 0 for length, g in runs if length >= 2 * S)

    got = next_admissible(start, runs, a)
    assert admissible(got)
    assert not any(admissible(S) for S in range(start, got))


def test_docstring_example():
    specs = [
        TensorSpec(name="A", shape=(6, 4)),
        TensorSpec(name="B", shape=(5,), block_rows="whole"),
        TensorSpec(name="C", shape=(3, 2)),
        TensorSpec(name="D", shape=(3,), block_rows="whole"),
    ]
    layout = plan_buffer(specs, 5, dtype="float32", alignment_bytes=4)
    assert layout.shard_size == 8 and layout.padding == 2
    assert [layout[n].offset for n in "ABCD"] == [0, 24, 30, 36]
    assert layout.local_units("C") == (0, 0, 0, 1, 2)
    assert layout.ragged_shard_args("A") == ((0,), (2, 2, 2, 0, 0))
    assert layout.ragged_shard_args("B") == ((0,), (0, 0, 0, 1, 0))
    assert layout.rank_tensors(3) == ("B", "C")


def test_one_rank_holds_everything():
    specs = [TensorSpec(name="w", shape=(7, 3)), TensorSpec(name="b", shape=(7,))]
    layout = plan_buffer(specs, 1, dtype="float32", alignment_bytes=4)
    assert layout.shard_size == 28 and layout.padding == 0
    assert layout.local_units("w") == (7,)


def test_rank_with_empty_shard_uses_the_main_path():
    # one whole block of 12 elements on 3 ranks: S = 12, two ranks hold only padding
    layout = plan_buffer(
        [TensorSpec(name="w", shape=(3, 4), block_rows="whole")],
        3,
        dtype="float32",
        alignment_bytes=4,
    )
    assert layout.shard_size == 12
    assert layout.local_units("w") == (1, 0, 0)
    assert layout.local_range("w", 2) == (0, 0) or layout.local_range("w", 2)[0] == 12
    assert layout.rank_tensors(1) == ()


def test_partial_last_block_uses_gcd_units():
    # 10 rows, blocks of 4 rows: blocks 4, 4, 2; RaggedShard units of gcd(4, 10) = 2 rows
    layout = plan_buffer(
        [TensorSpec(name="w", shape=(10, 8), block_rows=4)],
        3,
        dtype="float32",
        alignment_bytes=4,
    )
    assert layout["w"].unit_rows == 2
    dims, units = layout.ragged_shard_args("w")
    assert dims == (0,) and sum(units) == 5
    brute_check(layout, [TensorSpec(name="w", shape=(10, 8), block_rows=4)])


def test_alignment_default_and_elements():
    assert DEFAULT_ALIGNMENT_BYTES == 128
    layout = plan_buffer([TensorSpec(name="w", shape=(100, 3))], 4)  # bf16: 64 elements
    assert layout.alignment == 64 and layout.shard_size % 64 == 0
    layout32 = plan_buffer([TensorSpec(name="w", shape=(100, 3))], 4, dtype="float32")
    assert layout32.alignment == 32


def test_torch_dtype_accepted():
    torch = pytest.importorskip("torch")
    layout = plan_buffer([TensorSpec(name="w", shape=(100, 3))], 4, dtype=torch.float32)
    assert layout.dtype == "float32" and layout.alignment == 32


def test_lower_bound_forces_block_multiple_for_long_tensors():
    # one 64-row tensor, blocks of 3 rows (6 elements): on 4 ranks ceil(128/4) = 32,
    # but the tensor holds whole shards, so S must be a multiple of 6: 36.
    specs = [TensorSpec(name="w", shape=(64, 2), block_rows=3)]
    assert lower_bound_shard_size(specs, 4, 1, [False]) == 36
    layout = plan_buffer(specs, 4, dtype="float32", alignment_bytes=4)
    assert layout.shard_size == 36 == layout.lower_bound


def test_identical_groups_share_one_plan_and_keep_their_names():
    g0 = [TensorSpec(name="layers.0.w", shape=(40, 8)), TensorSpec(name="layers.0.b", shape=(8,))]
    g1 = [TensorSpec(name="layers.1.w", shape=(40, 8)), TensorSpec(name="layers.1.b", shape=(8,))]
    plans = plan_groups([("layers.0", "dense", g0), ("layers.1", "dense", g1)], 4)
    assert plans[0].layout.names == ("layers.0.w", "layers.0.b")
    assert plans[1].layout.names == ("layers.1.w", "layers.1.b")
    assert plans[0].layout.shard_size == plans[1].layout.shard_size


# --- member gaps ----------------------------------------------------------------------------
def _gapped_specs() -> list[TensorSpec]:
    # 12 one-row members of 5 elements (blocks of 5) and a 16x4 matrix (blocks of 4)
    # on 6 ranks. Without gaps, below S = 30 both hold whole shards and S would have
    # to be a multiple of lcm(5, 4) = 20: the planner needs S = 32. With gaps the
    # stack's boundaries can sit between members, and only the matrix forces S: 24.
    return [
        TensorSpec(name="experts", shape=(12, 1, 5), stack=True),
        TensorSpec(name="w", shape=(16, 4)),
    ]


def _gapped_example() -> tuple[BufferLayout, list[TensorSpec]]:
    specs = _gapped_specs()
    return plan_buffer(specs, 6, dtype="float32", alignment_bytes=4, member_gaps=True), specs


def test_member_gaps_lower_padding_where_lcm_rounding_bites():
    plain = plan_buffer(_gapped_specs(), 6, dtype="float32", alignment_bytes=4)
    gapped, specs = _gapped_example()
    assert plain.shard_size == 32
    assert gapped.shard_size == 24 == gapped.lower_bound
    assert gapped["experts"].members == 12 and gapped["experts"].member_gap > 0
    brute_check(gapped, specs)


def test_member_gaps_never_worse_than_none():
    spec = TensorSpec(name="w", shape=(8, 16, 4), block_rows=16, stack=True)
    for m in (1, 2, 3, 4, 7):
        plain = plan_buffer([spec], m, dtype="float32", alignment_bytes=4)
        gapped = plan_buffer([spec], m, dtype="float32", alignment_bytes=4, member_gaps=True)
        assert gapped.shard_size <= plain.shard_size


def test_gapped_strided_view_matches_local_ranges():
    layout, _ = _gapped_example()
    t = layout["experts"]
    size, stride, offset = layout.unsharded_view_args("experts")
    assert stride[0] == t.member_stride == t.member_numel + t.member_gap
    buf = np.zeros(layout.global_size, dtype=np.float32)
    view = np.lib.stride_tricks.as_strided(
        buf[offset:], shape=size, strides=tuple(4 * s for s in stride)
    )
    value = np.arange(math.prod(size), dtype=np.float32).reshape(size) + 1
    view[...] = value  # writes through the view into the buffer
    flat = value.reshape(-1)
    S = layout.shard_size
    for r in range(layout.world_size):
        lo, hi = layout.shard_range("experts", r)
        shard = buf[r * S + lo : r * S + hi]
        got = shard[shard != 0]  # gaps stay zero
        a, b = layout.local_range("experts", r)
        assert np.array_equal(got, flat[a:b])


@pytest.mark.parametrize("world, gaps", [(6, True), (2, "always"), (3, "always"), (6, "always")])
def test_gapped_stacks_are_cut_between_members_and_viewed_whole(world, gaps):
    """A gapped stack's ranks hold whole members (RaggedShard over dim 0, one unit per
    member); ``local_view_args`` views them in the rank's shard with the member stride."""
    specs = _gapped_specs()
    layout = plan_buffer(specs, world, dtype="float32", alignment_bytes=4, member_gaps=gaps)
    t = layout["experts"]
    assert t.members == 12 and t.member_gap > 0 and t.block_rows == 1  # a member is 1 row
    dims, units = layout.ragged_shard_args("experts")
    assert dims == (0,) and sum(units) == 12
    S = layout.shard_size
    buf = np.zeros(layout.global_size, dtype=np.float32)
    size, stride, offset = layout.unsharded_view_args("experts")
    full = np.arange(math.prod(size), dtype=np.float32).reshape(size) + 1
    np.lib.stride_tricks.as_strided(buf[offset:], size, tuple(4 * d for d in stride))[...] = full
    first = 0
    for r in range(world):
        size, stride, offset = layout.local_view_args("experts", r)
        assert size == (units[r], 1, 5)
        shard = buf[r * S : (r + 1) * S]
        local = np.lib.stride_tricks.as_strided(shard[offset:], size, tuple(4 * d for d in stride))
        assert np.array_equal(local, full[first : first + units[r]])
        assert np.count_nonzero(shard) == local.size  # nothing else of it on this rank
        first += units[r]


def test_member_gaps_always_gaps_what_plain_packs_tightly():
    spec = TensorSpec(name="e", shape=(8, 4, 8), block_rows=4, stack=True)
    plain = plan_buffer([spec], 4, dtype="float32", alignment_bytes=16, member_gaps=True)
    assert plain["e"].members == 1 and plain.padding == 0  # a gap would only cost
    forced = plan_buffer([spec], 4, dtype="float32", alignment_bytes=16, member_gaps="always")
    assert forced["e"].members == 8 and forced["e"].member_gap == 4  # one alignment unit
    # members far smaller than an alignment unit: the gapped layout is many times the plain
    # one, and "always" still finds it (a search capped near the plain size did not)
    for shape, m in (((16, 1, 1), 3), ((7, 1, 4), 1)):
        tiny = TensorSpec(name="t", shape=shape, block_rows=1, stack=True)
        gapped = plan_buffer([tiny], m, dtype="float32", member_gaps="always")
        assert gapped["t"].members == shape[0] and gapped["t"].member_gap > 0, gapped
        brute_check(gapped, [tiny])
    assert forced.padding >= forced.lower_bound_padding
    with pytest.raises(ValueError, match=r"member_gaps must be False, True or 'always', got 'y'"):
        plan_buffer([spec], 4, member_gaps="y")


def test_plain_view_is_contiguous():
    layout = plan_buffer(
        [TensorSpec(name="w", shape=(4, 3, 2))], 2, dtype="float32", alignment_bytes=4
    )
    assert layout.unsharded_view_args("w") == ((4, 3, 2), (6, 2, 1), 0)


# --- errors a user can act on ---------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="", shape=(2,)), "empty name"),
        (dict(name="w", shape=(0, 3)), "every dim must be >= 1"),
        (dict(name="w", shape=(4,), stack=True), "declared a stack"),
        (dict(name="w", shape=(4, 2), block_rows=0), "block_rows must be >= 1"),
        (dict(name="w", shape=(4, 2), block_rows=2.5), "positive int or 'whole'"),
        (dict(name="w", shape=(4, 2), block_rows=8), "fewer than its block of 8 rows"),
    ],
)
def test_tensor_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorSpec(**kwargs)


def test_plan_buffer_errors():
    w = TensorSpec(name="w", shape=(4, 2))
    with pytest.raises(ValueError, match="at least one tensor"):
        plan_buffer([], 2)
    with pytest.raises(ValueError, match=r"repeated: \['w'\]"):
        plan_buffer([w, w], 2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        plan_buffer([w], 0)
    with pytest.raises(ValueError, match="dtype 'float13' is unknown"):
        plan_buffer([w], 2, dtype="float13")
    with pytest.raises(ValueError, match="not a positive multiple of float32's 4 bytes"):
        plan_buffer([w], 2, dtype="float32", alignment_bytes=6)
    with pytest.raises(ValueError, match="max_orders must be >= 1"):
        plan_buffer([w], 2, max_orders=0)
    with pytest.raises(ValueError, match="expected TensorSpec objects, got tuple"):
        plan_buffer([("w", (4, 2))], 2)


def test_model_wide_block_is_clamped_but_per_tensor_block_is_strict():
    norm = TensorSpec(name="norm", shape=(4096,))
    assert with_block_rows(norm, 128).block_rows == 1  # rows count matrix rows: 1-D stays cut
    stack = TensorSpec(name="e", shape=(4, 100, 8), stack=True)
    assert with_block_rows(stack, 128).block_rows == 100  # a member's rows
    with pytest.raises(ValueError, match="pass block_rows<=4"):
        TensorSpec(name="e", shape=(4, 8), block_rows=128)


def _layout(**overrides) -> BufferLayout:
    t = TensorPlacement(name="w", shape=(4, 4), offset=0, block_rows=2, row_elems=4)
    fields = dict(
        world_size=2, shard_size=8, alignment=1, dtype="float32", tensors=(t,), lower_bound=8
    )
    fields.update(overrides)
    return BufferLayout(**fields)


def test_layout_checks_its_invariants():
    _layout()  # valid
    ok = TensorPlacement(name="w", shape=(4, 4), offset=0, block_rows=2, row_elems=4)
    with pytest.raises(AssertionError, match="splits a block"):
        _layout(
            tensors=(TensorPlacement(name="w", shape=(4, 4), offset=2, block_rows=2, row_elems=4),),
            shard_size=12,
            lower_bound=8,
        )
    with pytest.raises(AssertionError, match="overlaps"):
        _layout(
            tensors=(
                ok,
                TensorPlacement(name="v", shape=(2,), offset=14, block_rows=1, row_elems=2),
            ),
            shard_size=16,
            lower_bound=8,
        )
    with pytest.raises(AssertionError, match="not a multiple of the alignment"):
        _layout(alignment=3)
    with pytest.raises(AssertionError, match="past the buffer"):
        _layout(
            tensors=(TensorPlacement(name="w", shape=(4, 4), offset=8, block_rows=2, row_elems=4),)
        )
    with pytest.raises(AssertionError, match="lower bound"):
        _layout(lower_bound=9)
    with pytest.raises(AssertionError, match="duplicate"):
        _layout(tensors=(ok, ok), shard_size=16, lower_bound=8)


def test_layout_lookup_errors():
    layout = _layout()
    with pytest.raises(KeyError, match="no tensor 'v'; it holds \\['w'\\]"):
        layout["v"]
    with pytest.raises(ValueError, match="rank 2 out of range"):
        layout.local_range("w", 2)
    scalar = _layout(
        tensors=(TensorPlacement(name="s", shape=(), offset=0, block_rows=1, row_elems=1),)
    )
    with pytest.raises(NotImplementedError, match="is 0-d"):
        scalar.ragged_shard_args("s")


def test_ragged_shard_placement_from_the_layout():
    pytest.importorskip("torch")
    from raggedfsdp.tensor.placement import (
        RaggedShard,  # the runtime's conversion; the planner has none
    )

    specs = [TensorSpec(name="w", shape=(6, 4)), TensorSpec(name="e", shape=(2, 3, 4), stack=True)]
    layout = plan_buffer(specs, 3, dtype="float32", alignment_bytes=4)
    placement = RaggedShard.from_layout(layout, "e")
    assert tuple(placement.dims) == (0, 1)
    assert tuple(placement.local_units) == layout.local_units("e")
    assert sum(placement.local_units) == 6  # 2 members x 3 rows, one-row blocks


@pytest.mark.parametrize("member_gaps", [False, True])
@pytest.mark.parametrize("world", [1, 3, 8, 64])
def test_local_units_equal_the_per_rank_ranges(world, member_gaps):
    """``local_units`` (all ranks in one vector operation, so that 16,384 ranks cost no
    Python loop) gives each rank's ``local_range`` in units, gaps between members too."""
    specs = [
        TensorSpec(name="experts", shape=(6, 40, 16), block_rows=8, stack=True),
        TensorSpec(name="w", shape=(96, 32), block_rows=16),
        TensorSpec(name="norm", shape=(32,), block_rows=1),
    ]
    layout = plan_buffer(specs, world, dtype="float32", member_gaps=member_gaps)
    for t in layout.tensors:
        unit = t.unit_rows * t.row_elems
        expected = []
        for r in range(world):
            lo, hi = layout.local_range(t.name, r)
            assert (hi - lo) % unit == 0
            expected.append((hi - lo) // unit)
        assert layout.local_units(t.name) == tuple(expected), t.name
        assert sum(expected) * unit == t.numel
