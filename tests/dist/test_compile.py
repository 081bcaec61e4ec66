"""torch.compile with raggedfsdp as with FSDP2: blocks compiled with ``fullgraph=True``
before sharding (torchtitan's order) or after, no graph break, the same losses as
FSDP2's compiled blocks (bit for bit) and as eager (within eager's derived bound,
[Note: derived tolerances] in ``tests/numerics.py``; see [Note: hooks and torch.compile])."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import init_device_mesh

import raggedfsdp
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from tests.harness import spawn
from tests.numerics import assert_losses_match, reference

pytestmark = pytest.mark.numerics
SEQ = 16


def _losses(fully_shard, mesh, rank, compile_when):
    model = Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0)
    blocks = model.transformer_blocks()
    if compile_when == "before":
        for b in blocks:
            b.compile(fullgraph=True)
    if fully_shard is not None:
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if compile_when == "after":
        for b in blocks:
            b.compile(fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        x = torch.randint(0, 1001, (2, SEQ + 1), generator=gen)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _check(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    torch._dynamo.utils.counters.clear()
    ours_before = _losses(raggedfsdp.fully_shard, mesh, rank, "before")
    ours_after = _losses(raggedfsdp.fully_shard, mesh, rank, "after")
    assert not torch._dynamo.utils.counters["graph_break"], dict(
        torch._dynamo.utils.counters["graph_break"]
    )
    theirs = _losses(torch_fsdp.fully_shard, mesh, rank, "before")
    eager = reference(partial(_losses, raggedfsdp.fully_shard, mesh, rank, None))
    assert ours_before == theirs, (ours_before, theirs)
    assert ours_after == theirs, (ours_after, theirs)
    # compiled kernels fuse and reorder the forward's sums: eager's derived bound
    assert_losses_match(ours_before, eager, world=world, tokens=2 * SEQ, what="compiled: ")
    dist.barrier()


def test_compiled_blocks_as_fsdp2():
    spawn(2, _check, timeout=900)
