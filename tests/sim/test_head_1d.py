"""``fully_shard`` of a language model head at 1,024 and 16,384 fake ranks: its bias is cut.

The head's bias (32,000 elements) used to be one block, so each rank's shard held at
least 32,000 elements; it is now cut between elements like FSDP2's ``Shard(0)``.
"""

import pytest
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from raggedfsdp import BlockPolicy, fully_shard
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.tensor.placement import RaggedShard
from raggedfsdp.tools.simulate import fake_world

VOCAB, DIM = 32_000, 64


def _shard_head(world, policy=None):
    with fake_world(world) as mesh, FakeTensorMode():
        head = nn.Linear(DIM, VOCAB)
        fully_shard(head, mesh=mesh, block_policy=policy)
        (buf,) = buffers_of(head)
        placement = head.bias.placements[0]
        return buf.layout.shard_size, placement, tuple(head.bias.to_local().shape)


@pytest.mark.parametrize("world", [1_024, 16_384])
def test_the_head_shards_its_bias_element_wise(world):
    S, placement, local = _shard_head(world)
    total = DIM * VOCAB + VOCAB
    assert S <= 2 * total // world  # far below 32,000
    assert isinstance(placement, RaggedShard) and placement.dims == (0,)
    assert sum(placement.local_units) == VOCAB
    assert local[0] <= S


def test_a_policy_can_keep_the_bias_whole():
    S, placement, _ = _shard_head(1_024, BlockPolicy(overrides={"bias": "whole"}))
    assert S >= VOCAB
    assert sum(placement.local_units) == 1
