"""Zero copy, counted: the copies and collectives of one training step, raggedfsdp vs FSDP2.

One step of a sharded model (each block, then the root; 2 gloo ranks) runs under
``CopyCounter`` and ``CommCounter``. raggedfsdp makes no copy of parameter or gradient
data in fp32, and exactly one cast per all-gather and per reduce-scatter under mixed
precision; FSDP2 copies in and out around every all-gather and copies into every
reduce-scatter input. gloo's own copy into each reduce-scatter output shows in both.
"""

from functools import partial

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import init_device_mesh

from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.profiling import CommCounter, CopyCounter, buffer_storages, storage_key
from tests.harness import run_cases, spawn

MODEL, SEQ, ROWS = "moe-tiny", 8, 2
RS_COPY = "c10d._reduce_scatter_base_.default"  # gloo's copy into the reduce-scatter output


def _counted_step(system: str, bf16: bool, rank: int, world: int):
    """Build, train one step, then count one step; returns (model, copies, comms)."""
    mesh = init_device_mesh("cpu", (world,))
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
    shard, policy = (
        (fully_shard, MixedPrecisionPolicy(**kw))
        if system == "raggedfsdp"
        else (fsdp2_fully_shard, FSDP2Policy(**kw))
    )
    model = Transformer(get_config(MODEL), max_seq_len=SEQ, seed=0)
    for block in model.transformer_blocks():
        shard(block, mesh=mesh, mp_policy=policy)
    shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the first step warms up; the second is counted
        x, y = torch.randint(0, 256, (2, ROWS, SEQ), generator=g)
        with CopyCounter() as copies, CommCounter() as comms:
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return model, copies, comms


def _groups(model):
    return [m._raggedfsdp_state.group for m in model.modules() if "_raggedfsdp_state" in vars(m)]


def _expected_gathers(model) -> int:
    return 2 * len(model.transformer_blocks()) + 1  # blocks in forward and backward, root once


def _check_raggedfsdp_fp32(rank, world):
    model, copies, comms = _counted_step("raggedfsdp", False, rank, world)
    ours = copies.touching(buffer_storages(model))
    assert [e for e in ours if e.within != RS_COPY] == [], copies.summary(ours)
    n_blocks = len(model.transformer_blocks())
    stats = comms.summary()
    assert stats["all_gather"].count == _expected_gathers(model)
    assert stats["reduce_scatter"].count == n_blocks + 1
    groups = _groups(model)
    full = {g: g.layout.world_size * g.layout.shard_size * 4 for g in groups}
    root = model._raggedfsdp_state.group
    assert stats["all_gather"].output_bytes == 2 * sum(full.values()) - full[root]
    assert stats["reduce_scatter"].input_bytes == sum(full.values())
    # gloo's copy into each reduce-scatter output: the shard gradient storages
    backend = [e for e in ours if e.within == RS_COPY]
    assert {k for e in backend for k in e.writes} == {
        storage_key(g.dbuf.shard_grad) for g in groups
    }


def _check_raggedfsdp_bf16(rank, world):
    model, copies, comms = _counted_step("raggedfsdp", True, rank, world)
    ours = [e for e in copies.touching(buffer_storages(model)) if e.within != RS_COPY]
    assert {e.op for e in ours} == {"aten._to_copy.default"}, copies.summary(ours)
    stats = comms.summary()
    for g in _groups(model):
        casts_in = [e for e in ours if storage_key(g.dbuf.shard) in e.reads]
        casts_out = [e for e in ours if storage_key(g.dbuf.global_grads.tensor) in e.reads]
        gathers = 1 if g is model._raggedfsdp_state.group else 2
        assert len(casts_in) == gathers  # one cast of the whole shard per all-gather
        assert len(casts_out) == 1  # one cast of the whole gradient buffer per reduce-scatter
        assert casts_in[0].nbytes == g.layout.shard_size * 2  # bf16
    assert len(ours) == stats["all_gather"].count + stats["reduce_scatter"].count


def _check_fsdp2(bf16, rank, world):
    model, copies, comms = _counted_step("fsdp2", bf16, rank, world)
    stats, top = comms.summary(), copies.summary(copies.top_level())
    gathers, scatters = stats["all_gather"].count, stats["reduce_scatter"].count
    assert gathers == _expected_gathers(model)
    assert top["fsdp.all_gather_copy_in.default"][0] == gathers  # copy-in
    assert top["fsdp.split_with_sizes_copy.default"][0] == gathers  # copy-out
    assert top["fsdp.chunk_cat.default"][0] == scatters  # reduce-scatter copy-in
    inner = copies.summary(
        [e for e in copies.events if e.within == "fsdp.all_gather_copy_in.default"]
    )
    assert inner["aten._foreach_copy_.default"][0] == gathers
    assert sum(e.within == RS_COPY for e in copies.events) == scatters
    # the copy-in writes exactly this rank's part of every all-gather output
    assert top["fsdp.all_gather_copy_in.default"][1] * world == stats["all_gather"].output_bytes


def _grid(rank, world):
    run_cases(
        {
            "raggedfsdp fp32": partial(_check_raggedfsdp_fp32, rank, world),
            "raggedfsdp bf16": partial(_check_raggedfsdp_bf16, rank, world),
            "fsdp2 fp32": partial(_check_fsdp2, False, rank, world),
            "fsdp2 bf16": partial(_check_fsdp2, True, rank, world),
        }
    )


def test_copies_and_collectives_of_a_step_raggedfsdp_vs_fsdp2():
    spawn(2, _grid, timeout=120)
