"""A module that returns a view of a tensor: raggedfsdp warns as FSDP2 does (an in-place
op on that view would drop the pre-backward hook), and both run backward alike."""

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from raggedfsdp import fully_shard
from raggedfsdp.tools.simulate import fake_world


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)

    def forward(self, x):
        return self.lin(x)[:, :4]  # a view


def _warnings(shard) -> list[str]:
    with fake_world(2) as mesh:
        torch.manual_seed(0)
        model = _Head()
        shard(model, mesh=mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(torch.randn(3, 8))
        out.sum().backward()
        assert model.lin.weight.grad is not None
    return [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


@pytest.mark.parametrize("shard", [torch_fully_shard, fully_shard], ids=["fsdp2", "raggedfsdp"])
def test_a_view_output_warns_as_fsdp2(shard):
    found = _warnings(shard)
    assert len(found) == 1, found
    assert "_Head) returned a view tensor. An in-place op on this view" in found[0]
