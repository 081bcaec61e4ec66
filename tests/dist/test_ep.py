"""FSDP x EP on 4 gloo ranks as a ``(dp_mod_ep 2, ep 2)`` mesh: each MoE layer's stacked
experts sharded ``Shard(0)`` over ``ep`` (``expert_parallel``: tokens exchanged by two
all-to-alls), ``fully_shard(moe.experts, mesh=mesh["dp_mod_ep"])`` with the gradient
divide factor of the whole data-parallel size, the rest of each block and the root over
all 4 data-parallel ranks (as torchtitan does). Per-step losses and SGD parameters equal
one process's and torch FSDP2's with the same parallelism, within the bound derived from
one process's own sensitivity ([Note: derived tolerances] in ``tests/numerics.py``);
with member gaps forced the experts lie gapped on every rank (whole members, strided)
and SGD still equals one process."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import Shard, init_device_mesh

import raggedfsdp
from raggedfsdp import RaggedShard
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, expert_parallel, lm_loss
from tests.harness import run_cases, spawn
from tests.numerics import (
    assert_losses_match,
    assert_param_matches,
    assert_runs_agree,
    reference,
)

pytestmark = pytest.mark.numerics
SEQ, STEPS, WORLD = 16, 10, 4
NAME = "moe-tiny"  # 6 experts: 3 per ep rank


def _data():
    gen = torch.Generator().manual_seed(13)
    return torch.randint(0, 1001, (STEPS, WORLD, SEQ + 1), generator=gen)


def _model(mesh, fully_shard):
    model = Transformer(get_config(NAME), max_seq_len=SEQ, seed=0)
    if mesh is None:
        return model
    dp = mesh._flatten("dp")  # all 4 data-parallel ranks (torchtitan's dp_shard)
    for block in model.transformer_blocks():
        if block.is_moe:
            expert_parallel(block.moe, mesh["ep"])
            fully_shard(block.moe.experts, mesh=mesh["dp_mod_ep"])
            # the experts' gradients sum the tokens of both ep ranks: divide by all 4
            # (a sum, then the division: FSDP2's pre-multiplied sum does not run on gloo)
            block.moe.experts.set_gradient_divide_factor(WORLD)
            block.moe.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp)
    return fully_shard(model, mesh=dp)


def _train(model, rank, opt_name):
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in _data():
        rows = batch if rank is None else batch[rank : rank + 1]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if rank is not None:
            dist.all_reduce(loss)
            loss = loss / WORLD
        losses.append(float(loss))
    return losses


def _full(model):
    return {
        k: (v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v).detach()
        for k, v in model.named_parameters()
    }


def _check_parity(opt_name, rank, refs):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    ref = refs[opt_name]
    ours = _model(mesh, raggedfsdp.fully_shard)
    w = next(b for b in ours.transformer_blocks() if b.is_moe).moe.experts.w1
    assert w.device_mesh.mesh_dim_names == ("ep", "dp_mod_ep")
    assert w.placements[0] == Shard(0) and isinstance(w.placements[1], RaggedShard)
    losses = _train(ours, rank, opt_name)
    fsdp2 = _train(_model(mesh, torch_fsdp.fully_shard), rank, opt_name)
    assert_losses_match(losses, ref, world=WORLD, tokens=WORLD * SEQ)
    assert_runs_agree(losses, fsdp2, ref, world=WORLD, tokens=WORLD * SEQ, what="FSDP2: ")
    if opt_name == "sgd":
        for k, v in _full(ours).items():
            assert_param_matches(k, v, ref, steps=STEPS)


def _check_gaps(rank, refs):
    """Member gaps beside EP: each ep rank's experts lie gapped in their buffer, every rank
    holding whole members as a strided view, and SGD still equals one process."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    ours = _model(mesh, partial(raggedfsdp.fully_shard, member_gaps="always"))
    for n, p in ours.named_parameters():
        if ".experts." in n:
            buf, s = raggedfsdp.fsdp.buffer_of(p)
            placed = buf.layout[s.fqn]
            assert placed.members == p.shape[0] // 2 and placed.member_gap > 0, (n, placed)
            local = p._local_tensor
            assert s.view(buf.shard).data_ptr() == local.data_ptr(), n
            if local.shape[0] > 1:
                assert local.stride(0) == placed.member_stride > local[0].numel(), n
    losses = _train(ours, rank, "sgd")
    assert_losses_match(losses, refs["sgd"], world=WORLD, tokens=WORLD * SEQ, what="gapped: ")
    for k, v in _full(ours).items():
        assert_param_matches(k, v, refs["sgd"], steps=STEPS, what="gapped: ")


def _check_errors(rank):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    moe = next(b for b in _model(None, None).transformer_blocks() if b.is_moe).moe
    with pytest.raises(ValueError, match="6 experts do not split evenly over 4 ep ranks"):
        expert_parallel(moe, mesh)
    assert not isinstance(moe.experts.w1, torch.distributed.tensor.DTensor)


def _grid(rank, world, refs):
    run_cases(
        {
            **{f"parity {o}": partial(_check_parity, o, rank, refs) for o in ("sgd", "adamw")},
            "member gaps": partial(_check_gaps, rank, refs),
            "errors": partial(_check_errors, rank),
        }
    )


def test_fsdp_x_ep():
    def run(opt_name):
        model = _model(None, None)
        return _train(model, None, opt_name), _full(model)

    refs = {o: reference(partial(run, o)) for o in ("sgd", "adamw")}
    spawn(WORLD, _grid, refs, timeout=600)
