"""RaggedShard layout math and input checks (no process group)."""

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedfsdp import RaggedShard
from raggedfsdp.tensor import range_to_boxes


def test_layout_of_a_rank_with_zero_blocks():
    rs = RaggedShard(dims=(0,), local_units=(2, 0, 3))
    shape = (10, 4)
    assert rs.rows_per_block(shape) == 2
    assert [rs.local_row_range(shape, r) for r in range(3)] == [(0, 4), (4, 4), (4, 10)]
    assert [rs.local_shape(shape, r) for r in range(3)] == [(4, 4), (0, 4), (6, 4)]


def test_dims_prefix_merges_rows():
    rs = RaggedShard(dims=(0, 1), local_units=(1, 2))
    shape = (2, 3, 5)  # 6 rows of 5 elements, 3 blocks of 2 rows
    assert rs.local_shape(shape, 0) == (2, 5)
    assert rs.local_shape(shape, 1) == (4, 5)
    full = torch.arange(30.0).view(shape)
    view = rs.local_view(full, 1)
    assert view.data_ptr() == full.data_ptr() + 2 * 5 * full.element_size()
    assert torch.equal(view, full.reshape(6, 5)[2:])


def test_identity_and_pickle():
    a = RaggedShard((0,), (1, 2))
    assert a == RaggedShard((0,), (1, 2))
    assert a != RaggedShard((0,), (2, 1))
    assert hash(a) == hash(RaggedShard((0,), (1, 2)))
    assert pickle.loads(pickle.dumps(a)) == a
    assert not a.is_shard() and not a.is_replicate() and not a.is_partial()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dims=(0,), local_units=(1, -1)), r"local_units must be >= 0, got -1 for rank 1"),
        (dict(dims=(0,), local_units=()), r"one block count per rank"),
        (dict(dims=(0,), local_units=(0, 0)), r"at least one block in total"),
        (dict(dims=(1,), local_units=(1,)), r"dims must be a prefix"),
        (dict(dims=(0, 2), local_units=(1,)), r"dims must be a prefix"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RaggedShard(**kwargs)


def test_bad_shape_for_placement():
    with pytest.raises(ValueError, match=r"the 7 rows of dims \(0,\) .* cannot be cut into 3"):
        RaggedShard((0,), (1, 1, 1)).validate_for((7, 4))
    with pytest.raises(ValueError, match=r"needs at least 2"):
        RaggedShard((0, 1), (1,)).validate_for((4,))
    with pytest.raises(ValueError, match=r"local_units has 2 entries but the mesh axis has 3"):
        RaggedShard((0,), (1, 1)).validate_for((4, 4), world_size=3)


@settings(max_examples=300, deadline=None)
@given(
    dims=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
)
def test_range_to_boxes_tiles_the_range_in_order(dims, data):
    total = math.prod(dims)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    boxes = range_to_boxes(start, end, dims)
    assert len(boxes) <= 2 * len(dims) - 1
    covered = []
    for offsets, sizes in boxes:
        assert all(0 <= o and o + s <= d for o, s, d in zip(offsets, sizes, dims))
        idx = torch.arange(total).view(dims)
        box = idx[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()
        assert box == list(range(box[0], box[0] + len(box)))  # each box is one contiguous run
        covered += box
    assert covered == list(range(start, end))
