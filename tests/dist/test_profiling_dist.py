"""Zero copy, counted: the copies and collectives of one training step, raggedfsdp vs FSDP2.

One step of a sharded model (each block, then the root; 2 gloo ranks) runs under
``CopyCounter`` and ``CommCounter``. raggedfsdp makes no copy of parameter or gradient
data in fp32, and exactly one cast per all-gather and per reduce-scatter under mixed
precision; FSDP2 copies in and out around every all-gather and copies into every
reduce-scatter input. gloo's own copy into each reduce-scatter output shows in both.
``measure_step`` reports the same of a step, with its peak memory.
"""

from functools import partial

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import init_device_mesh

from raggedfsdp import MixedPrecisionPolicy, fully_shard, parallelize
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.tools.profiling import (
    CommCounter,
    CopyCounter,
    buffer_storages,
    measure_step,
    storage_key,
)
from tests.harness import run_cases, spawn

MODEL, SEQ, ROWS = "moe-tiny", 8, 2
RS_COPY = "c10d._reduce_scatter_base_.default"  # gloo's copy into the reduce-scatter output


def _sharded(system: str, bf16: bool, rank: int, world: int):
    """The model sharded by ``system``, and a function that runs one training step."""
    mesh = init_device_mesh("cpu", (world,))
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
    shard, policy = (
        (fully_shard, MixedPrecisionPolicy(**kw))
        if system == "raggedfsdp"
        else (fsdp2_fully_shard, FSDP2Policy(**kw))
    )
    model = Transformer(get_config(MODEL), max_seq_len=SEQ, seed=0)
    parallelize(model, mesh, fully_shard=shard, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        x, y = torch.randint(0, 256, (2, ROWS, SEQ), generator=g)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return model, step


def _counted_step(system: str, bf16: bool, rank: int, world: int):
    """Build, train one step, then count one step; returns (model, copies, comms)."""
    model, step = _sharded(system, bf16, rank, world)
    step()  # warms up
    with CopyCounter() as copies, CommCounter() as comms:
        step()
    return model, copies, comms


def _root_buffers(model) -> set:
    """The buffers of the root's own group (not of its transformer blocks)."""
    blocks = {buf for block in model.transformer_blocks() for buf in buffers_of(block)}
    return set(buffers_of(model)) - blocks


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
    bufs = buffers_of(model)
    assert buffer_storages(model) == {storage_key(t) for b in bufs for t in b.storages()}
    full = {b: b.layout.world_size * b.layout.shard_size * 4 for b in bufs}
    assert all(full[b] == b.unsharded_nbytes for b in bufs)  # fp32
    root = sum(full[b] for b in _root_buffers(model))
    assert stats["all_gather"].output_bytes == 2 * sum(full.values()) - root
    assert stats["reduce_scatter"].input_bytes == sum(full.values())
    # gloo's copy into each reduce-scatter output: the shard gradient storages
    backend = [e for e in ours if e.within == RS_COPY]
    assert {k for e in backend for k in e.writes} == {storage_key(b.shard_grad) for b in bufs}


def _check_raggedfsdp_bf16(rank, world):
    model, copies, comms = _counted_step("raggedfsdp", True, rank, world)
    ours = [e for e in copies.touching(buffer_storages(model)) if e.within != RS_COPY]
    assert {e.op for e in ours} == {"aten._to_copy.default"}, copies.summary(ours)
    stats = comms.summary()
    root = _root_buffers(model)
    for b in buffers_of(model):
        casts_in = [e for e in ours if storage_key(b.shard) in e.reads]
        # the gradients are written over the parameters ([Note: gradients in place])
        casts_out = [e for e in ours if storage_key(b.unsharded) in e.reads]
        gathers = 1 if b in root else 2
        assert len(casts_in) == gathers  # one cast of the whole shard per all-gather
        assert len(casts_out) == 1  # one cast of the whole gradient buffer per reduce-scatter
        assert casts_in[0].nbytes == b.layout.shard_size * 2  # bf16
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


def _check_measure_step(system, rank, world):
    model, step = _sharded(system, False, rank, world)
    step()  # warms up
    out = measure_step(model, step, system)
    assert out["all_gather_count"] == _expected_gathers(model)
    assert out["reduce_scatter_count"] == len(model.transformer_blocks()) + 1
    assert out["all_gather_bytes"] > out["reduce_scatter_bytes"] > 0
    fsdp_ops = sum(b for op, (_, b) in out["copies_by_op"].items() if op.startswith("fsdp."))
    if system == "raggedfsdp":
        assert out["copied_bytes_fsdp"] == fsdp_ops == 0  # fp32: no copy around collectives
    else:
        assert out["copied_bytes_fsdp"] == fsdp_ops > 0
    assert out["copied_bytes_total"] >= out["copied_bytes_fsdp"]
    assert out["peak_memory_bytes"] > 0


def _grid(rank, world):
    run_cases(
        {
            "raggedfsdp fp32": partial(_check_raggedfsdp_fp32, rank, world),
            "raggedfsdp bf16": partial(_check_raggedfsdp_bf16, rank, world),
            "fsdp2 fp32": partial(_check_fsdp2, False, rank, world),
            "fsdp2 bf16": partial(_check_fsdp2, True, rank, world),
            "measure_step raggedfsdp": partial(_check_measure_step, "raggedfsdp", rank, world),
            "measure_step fsdp2": partial(_check_measure_step, "fsdp2", rank, world),
        }
    )


def test_copies_and_collectives_of_a_step_raggedfsdp_vs_fsdp2():
    spawn(2, _grid, timeout=120)
