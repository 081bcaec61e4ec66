"""RaggedShard DTensors under model-init and checkpoint-loading code: ``nn.init``'s
random functions give the unsharded tensor at any world size and block policy (the
contract of [Note: random init of RaggedShard]), the meta-device recipe
(``to_empty`` then ``reset_parameters()``) equals building on the CPU, and element-wise
ops between a RaggedShard and a Replicate DTensor run on local slices with no
communication; ``t[i]`` is a view of the rows where they live (writes go through)."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from raggedfsdp import BlockPolicy, fully_shard
from tests.harness import run_cases, spawn

INITS = {
    "normal_": lambda t: nn.init.normal_(t, 0.0, 0.02),
    "uniform_": lambda t: nn.init.uniform_(t, -0.1, 0.1),
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "trunc_normal_ narrow": lambda t: nn.init.trunc_normal_(t, std=1.0, a=-0.2, b=0.2),
    "kaiming_uniform_": lambda t: (
        nn.init.kaiming_uniform_(t, a=5**0.5) if t.dim() > 1 else t.zero_()
    ),
    "xavier_normal_": lambda t: nn.init.xavier_normal_(t) if t.dim() > 1 else t.zero_(),
    "generator": lambda t: t.normal_(generator=torch.Generator().manual_seed(5)),
}


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 40)
        self.experts = nn.Parameter(torch.empty(3, 16, 24))
        self.b = nn.Linear(40, 5)


def _check_init(init, rows, mesh):
    torch.manual_seed(0)
    ref = _Net()
    torch.manual_seed(11)
    for p in ref.parameters():
        init(p.data)
    after_ref = torch.rand(())  # the generator advanced as on one device
    model = _Net()
    fully_shard(model, mesh=mesh, block_policy=BlockPolicy(rows=rows))
    torch.manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            init(p)
    assert torch.equal(torch.rand(()), after_ref)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(q.full_tensor(), p.detach()), name


def _check_meta_recipe(mesh):
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 7))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 7))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(q.full_tensor(), p.detach()), name


def _check_replicate_meets_ragged(mesh):
    torch.manual_seed(4)
    lin = nn.Linear(9, 30)
    full = lin.weight.detach().clone()
    fully_shard(lin, mesh=mesh, block_policy=BlockPolicy(rows=3))
    other = torch.randn(30, 9)
    rep = distribute_tensor(other, mesh, [Replicate()])
    with CommDebugMode() as comm, torch.no_grad():
        lin.weight.add_(rep)
        lin.weight.lerp_(rep, 0.25)
        lin.weight.mul_(rep)
        summed = lin.weight + rep
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    expect = (full + other).lerp(other, 0.25) * other
    assert torch.equal(lin.weight.full_tensor(), expect)
    assert summed.placements == lin.weight.placements
    assert torch.equal(summed.full_tensor(), expect + other)
    with CommDebugMode() as comm, torch.no_grad():
        lin.weight.copy_(rep)  # what a loader of a replicated state dict does
    assert comm.get_total_counts() == 0
    assert torch.equal(lin.weight.full_tensor(), other)


def _check_select_writes_through(mesh):
    """``zeros_(weight[padding_idx])`` (Hugging Face's init) and member writes of a stack."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    stack = _Net()
    nn.init.normal_(stack.experts)
    ref_emb, ref_stack = emb.weight.detach().clone(), stack.experts.detach().clone()
    fully_shard(emb, mesh=mesh)
    fully_shard(stack, mesh=mesh, block_policy=BlockPolicy(rows=8))
    with torch.no_grad(), CommDebugMode() as comm:
        nn.init.zeros_(emb.weight[3])
        emb.weight[-1].fill_(2.0)
        stack.experts[1].zero_()
        nn.init.ones_(stack.experts[-1])
    assert comm.get_total_counts() == 0
    ref_emb[3], ref_emb[-1], ref_stack[1], ref_stack[2] = 0.0, 2.0, 0.0, 1.0
    assert torch.equal(emb.weight.full_tensor(), ref_emb)
    assert torch.equal(stack.experts.full_tensor(), ref_stack)
    fresh = emb.weight.new_empty((3, 4))  # torch's rule: a Replicate DTensor, as FSDP2
    assert fresh.shape == (3, 4) and fresh.placements == (Replicate(),)


def _grid(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        f"{name} rows={rows}": partial(_check_init, init, rows, mesh)
        for name, init in INITS.items()
        for rows in (1, 8)
    }
    cases["meta recipe"] = partial(_check_meta_recipe, mesh)
    cases["Replicate meets RaggedShard"] = partial(_check_replicate_meets_ragged, mesh)
    cases["select writes through, new_empty"] = partial(_check_select_writes_through, mesh)
    run_cases(cases)
    dist.barrier()


def test_init_and_replicate_ops_at_2_and_3_ranks():
    spawn(2, _grid)
    spawn(3, _grid)
