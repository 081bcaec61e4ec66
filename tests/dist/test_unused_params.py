"""Parameters that get no gradient, against torch's FSDP2 on 2 gloo ranks.

FSDP2's rule: by default a parameter that got no gradient on a rank keeps ``.grad``
None there and stays out of the reduce-scatter (ranks that used different parameters
then mismatch); ``set_reduce_scatter_unused_params(True)`` reduces zeros for it, so every
parameter of a group that ran backward gets the reduced gradient (zeros where no rank
used it). raggedfsdp follows both rules with FSDP2's collectives and no others: a step
issues the same all-gathers and reduce-scatters as FSDP2's and nothing else (no
all-reduce for ranks to agree on which parameters got gradients). Where ranks used
different parameters without the setting, FSDP2's reduce-scatters mismatch; raggedfsdp
reduces whole buffers, so a rank that holds rows of a parameter it did not use sees the
other ranks' gradient arrive and raises, naming the parameter and the setting.

Bitwise on 2 ranks: each rank runs the same kernels on the same gathered values, and a
reduction of two addends is one sum in either order (the average's halving is exact).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import raggedfsdp
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics


class _Branches(nn.Module):
    """``trunk`` always; ``left`` on even ranks, ``right`` on odd ones (``split``) or
    ``left`` everywhere; ``never`` on no rank."""

    def __init__(self, split: bool):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 8)
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.split = split

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        odd = self.split and dist.get_rank() % 2 == 1
        return (self.right if odd else self.left)(h)


def _shard(fully_shard, model, mesh, unused: bool | None):
    fully_shard(model.trunk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if unused is not None:
        model.set_reduce_scatter_unused_params(unused)
    return model


def _grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g)
    return out


def _step(model, rank):
    torch.manual_seed(1 + rank)
    model(torch.randn(4, 8)).sum().backward()
    return _grads(model)


def _equal_fsdp2(rank, world, *, split: bool, unused: bool | None):
    mesh = init_device_mesh("cpu", (world,))
    want = _step(_shard(torch_fsdp.fully_shard, _Branches(split), mesh, unused), rank)
    got = _step(_shard(raggedfsdp.fully_shard, _Branches(split), mesh, unused), rank)
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert (g is None) == (w is None), (name, g, w)
        if w is not None:
            assert torch.equal(g, w), (name, (g - w).abs().max())
    if unused:  # FSDP2 reduces zeros for what no rank used
        assert torch.equal(got["never.weight"], torch.zeros(8, 8))
    else:
        assert got["never.weight"] is None


def _same_collectives(rank, world):
    """One forward and backward issue FSDP2's collectives, per kind and count."""
    mesh = init_device_mesh("cpu", (world,))
    counts = []
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        model = _shard(fully_shard, _Branches(False), mesh, None)
        torch.manual_seed(rank)
        with CommDebugMode() as fwd:
            loss = model(torch.randn(4, 8)).sum()
        with CommDebugMode() as bwd:
            loss.backward()
        counts.append(
            (
                {str(k): v for k, v in fwd.get_comm_counts().items()},
                {str(k): v for k, v in bwd.get_comm_counts().items()},
            )
        )
    assert counts[1] == counts[0], counts
    assert not any("all_reduce" in k or "allreduce" in k for k in counts[1][1]), counts[1]


def _mismatch_raises(rank, world):
    """Without the setting, a rank that holds rows of a parameter another rank used
    (and it did not) raises, naming the parameter and the fix; values never diverge
    silently."""
    mesh = init_device_mesh("cpu", (world,))
    model = _shard(raggedfsdp.fully_shard, _Branches(True), mesh, None)
    lacking = "left" if rank % 2 else "right"
    rows = {n: p.to_local().numel() for n, p in model.named_parameters()}
    torch.manual_seed(1 + rank)
    try:
        model(torch.randn(4, 8)).sum().backward()
        raised = None
    except RuntimeError as e:
        raised = str(e)
    if rows[f"{lacking}.weight"] + rows[f"{lacking}.bias"] > 0:
        assert raised is not None, "a rank holding rows of a parameter it did not use"
        assert f"{lacking}.weight" in raised or f"{lacking}.bias" in raised, raised
        assert "set_reduce_scatter_unused_params(True)" in raised, raised
    # the layout puts rows of a parameter some rank did not use on that rank
    checked = torch.tensor([int(rows[f"{lacking}.weight"] + rows[f"{lacking}.bias"] > 0)])
    dist.all_reduce(checked)
    assert checked.item() >= 1, "no rank holds rows of the parameter it did not use"


def _cases(rank, world):
    run_cases(
        {
            "same parameters everywhere, default": lambda: _equal_fsdp2(
                rank, world, split=False, unused=None
            ),
            "same parameters everywhere, unused reduced": lambda: _equal_fsdp2(
                rank, world, split=False, unused=True
            ),
            "ranks use different parameters, unused reduced": lambda: _equal_fsdp2(
                rank, world, split=True, unused=True
            ),
            "collectives: FSDP2's, no all-reduce": lambda: _same_collectives(rank, world),
            "ranks use different parameters, default: raises": lambda: _mismatch_raises(
                rank, world
            ),
        }
    )


def test_unused_parameters_as_fsdp2():
    spawn(2, _cases)
