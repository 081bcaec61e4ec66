"""A 1-D tensor is cut between elements, not kept whole, unless a block policy says so.

A language model head's bias of 32,000 elements used to be one indivisible block, so
every rank's shard held at least 32,000 elements: at 16,384 ranks the head group padded
to over a hundred times its size. FSDP2 shards a 1-D tensor element-wise; so does the
planner now, and a block policy can still ask for the whole tensor.
"""

import pytest
import torch
from torch import nn

from raggedfsdp import BlockPolicy
from raggedfsdp.planner import WHOLE, TensorSpec, plan_buffer, plan_buffers, with_block_rows

VOCAB, DIM = 32_000, 64


def _head(bias_block=1):
    return [
        TensorSpec(name="w", shape=(VOCAB, DIM)),  # nn.Linear(DIM, VOCAB).weight
        TensorSpec(name="b", shape=(VOCAB,), block_rows=bias_block),
    ]


@pytest.mark.parametrize("m", [1_024, 16_384])
def test_a_1d_tensor_no_longer_forces_its_size_on_every_shard(m):
    total = DIM * VOCAB + VOCAB
    for dtype in ("float32", "bfloat16"):
        layout = plan_buffer(_head(), m, dtype=dtype)
        assert layout.shard_size < VOCAB
        assert layout.shard_size == layout.lower_bound  # the bound is met
        units = layout.local_units("b")
        assert sum(units) == VOCAB and sum(u > 0 for u in units) > 1  # cut between ranks
        multi = plan_buffers(_head(), m, dtype=dtype, max_buffers=4)
        assert max(b.shard_size for b in multi.layouts) < VOCAB
    assert plan_buffer(_head(), 1_024, dtype="float32").global_size < 2 * total


@pytest.mark.parametrize("m", [1_024, 16_384])
def test_a_whole_bias_stays_whole(m):
    layout = plan_buffer(_head(WHOLE), m, dtype="float32")
    assert layout.shard_size >= VOCAB
    assert sorted(layout.local_units("b"))[-2:] == [0, 1]  # one unit, on one rank


def test_rows_of_a_1d_tensor_are_its_elements():
    b = TensorSpec(name="b", shape=(10,))
    assert (b.rows, b.row_elems, b.block_elems) == (10, 1, 1)
    assert TensorSpec(name="b", shape=(10,), block_rows=WHOLE).block_elems == 10
    assert TensorSpec(name="b", shape=(10,), block_rows=5).block_elems == 5
    # a model-wide row count is for matrices; "whole" is for every tensor
    assert with_block_rows(b, 128).block_rows == 1
    assert with_block_rows(b, WHOLE).block_rows == WHOLE
    with pytest.raises(ValueError, match="has 10 rows, fewer than its block of 32 rows"):
        TensorSpec(name="b", shape=(10,), block_rows=32)


@pytest.mark.parametrize("n", [10, 33, 32_000, 32_001])
def test_a_1d_tensor_of_any_length_is_laid_out(n):
    # the alignment (32 fp32 elements) need not divide n; a tensor shorter than one
    # alignment unit still lies in one rank's shard
    specs = [TensorSpec(name="a", shape=(5,)), TensorSpec(name="b", shape=(n,))]
    for m in (1, 2, 3, 7, 64):
        layout = plan_buffer(specs, m, dtype="float32")
        for name, size in (("a", 5), ("b", n)):
            units = layout.local_units(name)
            assert sum(units) == size
            spans = [layout.local_range(name, r) for r in range(m)]
            assert [hi - lo for lo, hi in spans] == list(units)
            assert all(lo % 32 == 0 for lo, hi in spans if hi > lo)  # cuts on alignment units
        if n < 32:
            assert max(layout.local_units("b")) == n


def test_block_policy_keeps_1d_parameters_element_wise_unless_asked():
    bias = nn.Parameter(torch.empty(VOCAB))
    assert BlockPolicy()("output.bias", bias) == 1
    assert BlockPolicy(rows=8)("output.bias", bias) == 1  # model-wide rows: matrices only
    assert BlockPolicy(rows=WHOLE)("output.bias", bias) == WHOLE
    assert BlockPolicy(overrides={"output.bias": WHOLE})("output.bias", bias) == WHOLE
    assert BlockPolicy(overrides={"output.bias": 64})("output.bias", bias) == 64
    assert BlockPolicy(overrides={"output.bias": 64_000})("output.bias", bias) == WHOLE
