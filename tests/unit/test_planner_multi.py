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
    # the default cost (128 KiB per rank per buffer) keeps a few bytes of padding in one
    assert len(plan_buffers(specs, 64, max_buffers=2, **kw).layouts) == 1


def test_errors():
    specs = [TensorSpec(name="a", shape=(4, 4))]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"max_buffers must be an int >= 1"):
            plan_buffers(specs, 2, max_buffers=bad)
    with pytest.raises(ValueError, match=r"alpha_bytes must be an int or None, got 0.5"):
        plan_buffers(specs, 2, alpha_bytes=0.5)
