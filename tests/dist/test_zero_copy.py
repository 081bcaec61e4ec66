"""Zero copy, counted: the copy-like ops that touch parameter data in a training step.

raggedfsdp in fp32 makes no copy around its collectives (the shard storage is the
all-gather input, the global storage its output, the flat gradient storage the
reduce-scatter input). Under bf16 / fp32-reduce it makes exactly one cast per
collective: the shard -> bf16 all-gather input, and the bf16 gradients -> fp32
reduce-scatter input. The same counter on torch's FSDP2 shows its copy-in / copy-out.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import init_device_mesh

from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.tools.profiling import CommCounter, CopyCounter, buffer_storages
from tests.dist.test_fully_shard import SEQ, _micro_batches
from tests.harness import spawn


def _model(mesh, shard, **kw):
    model = Transformer(get_config("moe-tiny"), max_seq_len=SEQ, seed=0)
    for block in model.transformer_blocks():
        shard(block, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    return model


def _counted_step(model, opt, rank, world, step):
    ((x, y),) = _micro_batches(step, 1, rank, world)
    with CopyCounter() as copies, CommCounter() as comms:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return copies, comms


def _check(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for mp in (None, bf16):
        ours = _model(
            mesh, fully_shard, **({"mp_policy": MixedPrecisionPolicy(**mp)} if mp else {})
        )
        opt = torch.optim.SGD(ours.parameters(), lr=0.1)
        _counted_step(ours, opt, rank, world, 0)  # first step: optimizer state, forward order
        copies, comms = _counted_step(ours, opt, rank, world, 1)
        near = [e for e in copies.touching(buffer_storages(ours)) if e.within is None]
        collectives = sum(s.count for k, s in comms.summary().items() if k != "all_reduce")
        assert collectives >= 2 * 3, comms.summary()  # 3 groups: all-gathers + reduce-scatters
        if mp is None:
            assert near == [], f"fp32: copies around the collectives: {copies.summary(near)}"
        else:
            assert {e.op for e in near} == {"aten._to_copy.default"}, copies.summary(near)
            assert len(near) == collectives, (copies.summary(near), comms.summary())
    # torch's FSDP2 under the same counter: copy-in and copy-out around every collective
    for mp in (None, bf16):
        theirs = _model(mesh, torch_fully_shard, **({"mp_policy": TorchMP(**mp)} if mp else {}))
        opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
        _counted_step(theirs, opt, rank, world, 0)
        copies, _ = _counted_step(theirs, opt, rank, world, 1)
        fsdp_ops = {e.op for e in copies.top_level() if e.op.startswith("fsdp.")}
        assert {"fsdp.all_gather_copy_in.default", "fsdp.split_with_sizes_copy.default"} <= fsdp_ops
        assert "fsdp.chunk_cat.default" in fsdp_ops


def test_copies_around_collectives():
    spawn(2, _check)
