"""fully_shard's policies: BlockPolicy rows per parameter, MixedPrecisionPolicy checks."""

import pytest
import torch
from torch import nn

from raggedfsdp import BlockPolicy, MixedPrecisionPolicy, fully_shard


def _p(*shape):
    return nn.Parameter(torch.empty(shape))


def test_rows_overrides_and_small_tensors():
    policy = BlockPolicy(rows=8, overrides={"experts.w1": "whole", "wq.weight": 4})
    assert policy("layers.0.attention.wk.weight", _p(32, 96)) == 8
    assert policy("layers.0.attention.wq.weight", _p(96, 96)) == 4
    assert policy("layers.1.moe.experts.w1", _p(6, 44, 96)) == "whole"
    assert policy("norm.weight", _p(96)) == 1  # 1-D: cut between elements
    assert BlockPolicy(rows="whole")("norm.weight", _p(96)) == "whole"
    assert BlockPolicy()("w", _p(5, 3)) == 1  # default: 1 row


def test_a_stack_is_judged_by_its_members_rows():
    # 6 experts of 44 rows: a 128-row block is larger than a member, so it is kept whole
    assert BlockPolicy(rows=128)("moe.experts.w1", _p(6, 44, 96)) == "whole"
    assert BlockPolicy(rows=4)("moe.experts.w1", _p(6, 44, 96)) == 4


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: BlockPolicy(rows=0), r"BlockPolicy 'rows': a block must be a positive number"),
        (lambda: BlockPolicy(overrides={"w": -1}), r"BlockPolicy 'w': a block must be"),
        (lambda: MixedPrecisionPolicy(param_dtype=torch.int8), r"param_dtype must be a floating"),
    ],
)
def test_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


class _Stack(nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.w = _p(*shape)


@pytest.fixture
def one_fake_rank():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "policy, shape, match",
    [
        (
            BlockPolicy(rows=8, whole_if_fewer_rows=False),
            (6, 44, 96),
            r"'w' of shape \(6, 44, 96\) has 44 rows, not a multiple of its block of 8 rows",
        ),
        (lambda f, p: 2.5, (4, 4), r"block_policy for parameter 'w': a block must be"),
    ],
)
def test_fully_shard_checks_the_policy_before_touching_the_module(
    one_fake_rank, policy, shape, match
):
    module = _Stack(*shape)
    with pytest.raises(ValueError, match=match):
        fully_shard(module, block_policy=policy)
    assert type(module) is _Stack and type(module.w) is nn.Parameter
