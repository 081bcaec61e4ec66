"""``plan_buffers``: a group split over several buffers ([Note: multi-buffer groups]).

Every tensor lands in exactly one buffer; a split is kept
only when it saves more padding bytes than ``alpha_bytes`` per added buffer (so the
padding never exceeds one buffer's); the reported bounds are proven (<= the padding).
"""

from __future__ import annotations

import random

import pytest

from raggedfsdp.planner import TensorSpec, plan_buffer, plan_buffers


def _specs(seed: int) -> list[TensorSpec]:
    rng = random.Random(seed)
    out = []
    for i in range(rng.randint(2, 7)):
        rows, cols = rng.choice([7, 16, 48, 96, 130]), rng.choice([8, 24, 64])
        if rng.random() < 0.3:
            out.append(
                TensorSpec(
                    name=f"e{i}",
                    shape=(4, rows, cols),
                    block_rows=rng.choice([1, 8, 16]) if rows % 16 == 0 else 1,
                    stack=True,
                )
            )
        else:
            out.append(
                TensorSpec(name=f"t{i}", shape=(rows, cols), block_rows=rng.choice([1, rows]))
            )
    return out


@pytest.mark.parametrize("seed", range(40))
def test_invariants_on_random_groups(seed):
    specs = _specs(seed)
    world = random.Random(seed).choice([3, 8, 64, 256])
    kw = dict(dtype="float32", alignment_bytes=4)
    for alpha in (-(1 << 30), 0, 1 << 20):
        plan = plan_buffers(specs, world, max_buffers=3, alpha_bytes=alpha, **kw)
        names = [t.name for layout in plan.layouts for t in layout.tensors]
        assert sorted(names) == sorted(s.name for s in specs)  # each tensor once
        assert all(layout.world_size == world for layout in plan.layouts)
        assert 1 <= len(plan.layouts) <= 3
        assert plan.single.padding == plan_buffer(specs, world, **kw).padding
        if alpha >= 0:  # a kept split saves more than it costs
            saved = (plan.single.padding - plan.padding) * 4
            assert saved > alpha * (len(plan.layouts) - 1) or len(plan.layouts) == 1
            assert plan.padding <= plan.single.padding
        assert plan.lower_bound_padding <= plan.padding
        assert plan.searched_lower_bound_padding <= plan.lower_bound_padding
        assert plan.total_numel == sum(s.numel for s in specs)


def test_a_mixed_group_splits_by_block_size():
    """Two classes whose blocks force the one-buffer S to their lcm: split, they pad 0."""
    specs = [
        TensorSpec(name="a", shape=(3 * 64, 7), block_rows=1),  # 7-element blocks
        TensorSpec(name="b", shape=(11 * 64, 13), block_rows=1),  # 13-element blocks
    ]
    kw = dict(dtype="float32", alignment_bytes=4)
    one = plan_buffers(specs, 64, max_buffers=1, **kw)
    two = plan_buffers(specs, 64, max_buffers=2, alpha_bytes=0, **kw)
    assert len(one.layouts) == 1 and one.padding > 0
    assert [[t.name for t in layout.tensors] for layout in two.layouts] == [["a"], ["b"]]
    assert two.padding == 0 == two.lower_bound_padding
    # the default cost (default_alpha_bytes: 0.65 MB at 64 ranks) keeps a few bytes of
    # padding in one buffer
    assert len(plan_buffers(specs, 64, max_buffers=2, **kw).layouts) == 1


def test_errors():
    specs = [TensorSpec(name="a", shape=(4, 4))]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"max_buffers must be an int >= 1"):
            plan_buffers(specs, 2, max_buffers=bad)
    with pytest.raises(ValueError, match=r"alpha_bytes must be an int or None, got 0.5"):
        plan_buffers(specs, 2, alpha_bytes=0.5)


# ---- against the exact multi-buffer reference --------------------------------------------
def _cost(layouts, alpha: int) -> int:
    return sum(x.padding for x in layouts) * 4 + alpha * (len(layouts) - 1)


def test_the_exact_reference_splits_within_a_block_class():
    """Two tensors of one block class apart: the class search cannot, the single-tensor
    moves of a small group can; the exact reference proves it optimal."""
    from raggedfsdp.planner.exact import plan_buffers_exact

    specs = [
        TensorSpec(name="a", shape=(56, 2), block_rows=8),
        TensorSpec(name="b", shape=(39, 4)),
        TensorSpec(name="c", shape=(19, 4)),
    ]
    kw = dict(max_buffers=2, alpha_bytes=64, dtype="float32", alignment_bytes=16)
    layouts, best, proven = plan_buffers_exact(specs, 6, **kw)
    assert proven
    assert sorted(sorted(t.name for t in x.tensors) for x in layouts) == [["a", "c"], ["b"]]
    single = plan_buffer(specs, 6, dtype="float32", alignment_bytes=16)
    assert best == _cost(layouts, 64) == 128 < _cost([single], 0)
    plan = plan_buffers(specs, 6, **kw)
    assert _cost(plan.layouts, 64) == best


@pytest.mark.parametrize("seed", range(3))
def test_planner_against_the_exact_reference(seed):
    """Random small groups: the exact optimum never costs more than the planner's split
    (a check of the reference), every tensor lies in one of its buffers, and the planner
    reaches the optimum on at least 95% of the instances the solver proves."""
    from raggedfsdp.planner.exact import plan_buffers_exact

    rng = random.Random(100 + seed)
    proven = hits = 0
    for _ in range(12):
        m = rng.randint(2, 8)
        specs = []
        for i in range(rng.randint(2, 4)):
            rows = rng.randint(2, 40)
            block = rng.choice([1, 2, 4, 8, "whole"])
            block = 1 if block != "whole" and rows % block else block
            shape = (rows, rng.choice([1, 3, 4]))
            specs.append(TensorSpec(name=f"t{i}", shape=shape, block_rows=block))
        alpha = rng.choice([0, 16, 64])
        kw = dict(max_buffers=rng.choice([2, 3]), alpha_bytes=alpha)
        kw.update(dtype="float32", alignment_bytes=16)
        plan = plan_buffers(specs, m, **kw)
        layouts, best, ok = plan_buffers_exact(specs, m, time_limit=30, **kw)
        assert sorted(t.name for x in layouts for t in x.tensors) == [s.name for s in specs]
        assert best == _cost(layouts, alpha) <= _cost(plan.layouts, alpha)
        proven += ok
        hits += ok and best == _cost(plan.layouts, alpha)
    assert proven >= 10 and hits >= 0.95 * proven, (proven, hits)
