"""FSDP2's collective and memory settings on 2 gloo ranks, raggedfsdp against FSDP2.

- ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` with comms that change what
  they move (the all-gather doubles every gathered value, the reduce-scatter halves every
  reduced one): the losses and parameters of 3 AdamW steps equal FSDP2's with the same
  comms bit for bit (and differ from a run without them), the comms are called as often
  as FSDP2 calls them, and raggedfsdp's calls receive the buffer's own storages (the
  global storage and the shard gradient storage), never a staging copy.
- ``set_allocate_memory_from_process_group_for_comm(True)`` on gloo (no allocator): a
  no-op in both, the same numbers; after a custom comm, both raise ``AssertionError``.
- ``set_symm_mem_for_comm()`` on the CPU: both raise torch's ``RuntimeError``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

import raggedfsdp
from raggedfsdp.fsdp import buffers_of
from tests.harness import run_cases, spawn

STEPS = 3


class DoublingAllGather(AllGather):
    """Gathers every rank's input, doubled; records each output's storage."""

    def __init__(self):
        self.calls, self.outputs = 0, []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        self.outputs.append(output_tensor.untyped_storage()._cdata)
        dist.all_gather_into_tensor(output_tensor, input_tensor * 2, group=group)
        return None


class HalvingReduceScatter(ReduceScatter):
    """Reduce-scatters with the given op, then halves; records each output's storage."""

    def __init__(self):
        self.calls, self.outputs = 0, []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        self.outputs.append(output_tensor.untyped_storage()._cdata)
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
        output_tensor.mul_(0.5)
        return None


def _model(fully_shard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    fully_shard(model[0])
    fully_shard(model)
    return model


def _train(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.full_tensor() for p in model.parameters()]


def _equal(a, b, what: str) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"{what}: largest difference {(x - y).abs().max()}"


def _check_custom_comms() -> None:
    runs, comms = {}, {}
    for name, fully_shard in (("fsdp2", torch_fsdp.fully_shard), ("ours", raggedfsdp.fully_shard)):
        model = _model(fully_shard)
        gather, reduce = DoublingAllGather(), HalvingReduceScatter()
        for m in (model[0], model):
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(reduce)
        runs[name], comms[name] = _train(model), (gather, reduce)
        if name == "ours":  # the buffers' own storages, never a staging copy
            views = buffers_of(model)
            assert set(gather.outputs) == {v.unsharded.untyped_storage()._cdata for v in views}
            assert set(reduce.outputs) == {v.shard_grad.untyped_storage()._cdata for v in views}
    plain = _train(_model(raggedfsdp.fully_shard))
    _equal(runs["ours"][0], runs["fsdp2"][0], "losses")
    _equal(runs["ours"][1], runs["fsdp2"][1], "parameters")
    assert not torch.equal(runs["ours"][1][0], plain[1][0]), "the comms changed nothing"
    for ours, theirs in zip(comms["ours"], comms["fsdp2"]):
        assert ours.calls == theirs.calls > 0, (ours.calls, theirs.calls)


def _check_memory_settings() -> None:
    runs = []
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        model = _model(fully_shard)
        for m in (model[0], model):
            m.set_allocate_memory_from_process_group_for_comm(True)  # gloo: no allocator
        runs.append(_train(model))
        with pytest.raises(RuntimeError, match="SymmetricMemory"):
            _model(fully_shard).set_symm_mem_for_comm()
        custom = _model(fully_shard)
        custom.set_custom_all_gather(DoublingAllGather())
        with pytest.raises(AssertionError, match="all gather comm is custom"):
            custom.set_allocate_memory_from_process_group_for_comm(True)
    _equal(runs[1][0], runs[0][0], "losses")
    _equal(runs[1][1], runs[0][1], "parameters")


def _grid(rank: int, world: int) -> None:
    run_cases(
        {
            "custom all-gather and reduce-scatter": _check_custom_comms,
            "memory settings": _check_memory_settings,
        }
    )


def test_collective_settings_as_fsdp2():
    spawn(2, partial(_grid))
