"""Meshes as callers build them, on 4 gloo ranks, each against torch's FSDP2 in the same
ranks and one process's reference (bounds derived from its own sensitivity, [Note:
derived tolerances] in ``tests/numerics.py``):

- TP 2 x FSDP 2 where the tp and dp meshes come from two ``_unflatten``s of one 1-D
  world mesh (as torchtitan builds them: neither name is in the world mesh), and from
  unnamed ``DeviceMesh.from_group`` meshes (raggedfsdp only: FSDP2 needs names);
- experts on a mesh of their own through ``shard_placement_fn`` returning torch's
  ``ShardPlacementResult`` (EP 2 on 4 ranks, as torchtitan's ``apply_fsdp``): the block's
  dense parameters over all 4 ranks, its experts over the 2 expert-data-parallel ranks;
- a TP parameter whose TP pieces are uneven: a (27, 9) weight column-parallel over 2 tp
  ranks (pieces of 14 and 13 rows), each rank planning its own piece.
"""

from __future__ import annotations

import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    DDPMeshInfo,
    FSDPMeshInfo,
    ShardPlacementResult,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import raggedfsdp
from raggedfsdp import RaggedShard, checkpoint
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models.transformer import Transformer, expert_parallel, lm_loss
from tests.dist import test_ep, test_tp
from tests.harness import run_cases, spawn
from tests.numerics import (
    assert_losses_match,
    assert_param_matches,
    assert_runs_agree,
    reference,
)

pytestmark = pytest.mark.numerics
WORLD, STEPS = 4, 4


def _full(model):
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in model.named_parameters()
    }


def _dp_losses(model, dp_mesh, batches, loss_fn, lr):
    """SGD steps; each dp rank takes its chunk of every batch; the mean loss over dp."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dp, n = (0, 1) if dp_mesh is None else (dp_mesh.get_local_rank(), dp_mesh.size())
    losses = []
    for batch in batches:
        loss = loss_fn(model, [b.chunk(n)[dp] for b in batch])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if dp_mesh is not None:
            dist.all_reduce(loss, group=dp_mesh.get_group())
            loss = loss / n
        losses.append(float(loss))
    return losses


# ---- (a) TP 2 x FSDP 2 over unflattened (and unnamed) meshes ---------------------------------
SEQ = test_tp.SEQ


def _llama(tp_mesh, dp_mesh, fully_shard):
    model = Transformer(test_tp._config("llama-tiny"), max_seq_len=SEQ, seed=0)
    if dp_mesh is None:
        return model
    for block in model.transformer_blocks():
        parallelize_module(block, tp_mesh, test_tp._plan("llama-tiny"))
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def _llama_batches():
    return [(rows,) for rows in test_tp._data()[:STEPS]]


def _lm(model, batch):
    (rows,) = batch
    return lm_loss(model(rows[:, :-1]), rows[:, 1:])


def _torchtitan_meshes():
    """tp and dp as torchtitan's ParallelDims makes them: two unflattens of one world."""
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    loading = world._unflatten(0, (2, 2), ("batch", "tp"))
    dense = world._unflatten(0, (2, 2), ("fsdp", "tp"))
    return loading["tp"], dense["fsdp"]


def _check_unflattened_tp(rank, ref):
    tp, dp = _torchtitan_meshes()
    assert "tp" not in (tp._get_root_mesh().mesh_dim_names or ())
    ours = _llama(tp, dp, raggedfsdp.fully_shard)
    w = ours.layers[0].attention.wq.weight
    assert w.device_mesh.mesh_dim_names == ("tp", "fsdp")
    assert (
        w.device_mesh.get_group(0) is tp.get_group()
        and w.device_mesh.get_group(1) is dp.get_group()
    )
    assert w.placements[0] == Shard(0) and isinstance(w.placements[1], RaggedShard)
    losses = _dp_losses(ours, dp, _llama_batches(), _lm, 0.3)
    theirs = _dp_losses(_llama(tp, dp, torch_fsdp.fully_shard), dp, _llama_batches(), _lm, 0.3)
    kw = dict(world=WORLD, tokens=4 * SEQ)
    assert_losses_match(losses, ref, **kw)
    assert_runs_agree(losses, theirs, ref, what="FSDP2: ", **kw)
    for k, v in _full(ours).items():
        assert_param_matches(k, v, ref, steps=STEPS)


def _check_unnamed_tp(rank, ref):
    """Meshes from process groups alone: no names, no root mesh in common."""
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = DeviceMesh.from_group(grid.get_group(1), "cpu")
    dp = DeviceMesh.from_group(grid.get_group(0), "cpu")
    ours = _llama(tp, dp, raggedfsdp.fully_shard)
    w = ours.layers[0].attention.wq.weight
    assert w.device_mesh.mesh.tolist() == grid.mesh.t().tolist()  # (tp, dp): the same ranks
    losses = _dp_losses(ours, dp, _llama_batches(), _lm, 0.3)
    assert_losses_match(losses, ref, world=WORLD, tokens=4 * SEQ, what="unnamed: ")
    for k, v in _full(ours).items():
        assert_param_matches(k, v, ref, steps=STEPS, what="unnamed: ")


# ---- (b) experts on a mesh of their own (ShardPlacementResult) ----------------------------


def _moe(dp_mesh, ep_mesh, edp_mesh, fully_shard):
    """test_ep's model, sharded as torchtitan's apply_fsdp with EP: each MoE block in one
    fully_shard call whose shard_placement_fn gives the experts the edp mesh."""
    model = test_ep._model(None, None)
    if dp_mesh is None:
        return model
    dp_info = FSDPMeshInfo(dp_mesh, shard_mesh_dim=0)
    edp_info = FSDPMeshInfo(edp_mesh, shard_mesh_dim=0)
    for block in model.transformer_blocks():
        if not block.is_moe:
            fully_shard(block, mesh=dp_mesh)
            continue
        expert_parallel(block.moe, ep_mesh)
        experts = set(block.moe.experts.parameters())

        def placement(p, experts=experts):
            info = edp_info if p in experts else dp_info
            return ShardPlacementResult(placement=Shard(0), mesh_info=info)

        fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement)
        # every gradient is a sum over all 4 data-parallel ranks' tokens (a sum, then the
        # division: FSDP2's pre-multiplied sum does not run on gloo)
        block.set_gradient_divide_factor(WORLD)
        block.set_force_sum_reduction_for_comms(True)
    return fully_shard(model, mesh=dp_mesh)


def _ep_meshes():
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    sparse = world._unflatten(0, (2, 2), ("efsdp", "ep"))
    return world, sparse["ep"], sparse["efsdp"]


def _check_per_param_mesh(rank, ref, root):
    dp, ep, edp = _ep_meshes()
    ours = _moe(dp, ep, edp, raggedfsdp.fully_shard)
    block = next(b for b in ours.transformer_blocks() if b.is_moe)
    w = block.moe.experts.w1
    assert w.device_mesh.mesh_dim_names == ("ep", "efsdp")
    assert w.placements[0] == Shard(0) and isinstance(w.placements[1], RaggedShard)
    dense = block.attention.wq.weight
    assert dense.device_mesh is dp and isinstance(dense.placements[0], RaggedShard)
    sizes = sorted(v.world_size for v in buffers_of(block))
    assert sizes[0] == 2 and sizes[-1] == WORLD, sizes  # experts over edp, the rest over dp
    steps = test_ep.STEPS
    losses = test_ep._train(ours, rank, "sgd")
    theirs = test_ep._train(_moe(dp, ep, edp, torch_fsdp.fully_shard), rank, "sgd")
    kw = dict(world=WORLD, tokens=WORLD * test_ep.SEQ)
    assert_losses_match(losses, ref, **kw)
    assert_runs_agree(losses, theirs, ref, what="FSDP2: ", **kw)
    for k, v in _full(ours).items():
        assert_param_matches(k, v, ref, steps=steps)
    # a checkpoint of the two meshes' buffers loads back bit for bit
    checkpoint.save(f"{root}/ep", ours, step=1)
    again = _moe(dp, ep, edp, raggedfsdp.fully_shard)
    checkpoint.load(f"{root}/ep", again)
    for (k, a), b in zip(_full(ours).items(), _full(again).values()):
        assert torch.equal(a, b), k


# ---- (c) uneven TP pieces ---------------------------------------------------------------------


class _Uneven(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.up = nn.Linear(9, 27)  # weight (27, 9): tp pieces of 14 and 13 rows
        self.down = nn.Linear(27, 4)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _uneven(tp_mesh, dp_mesh, fully_shard):
    model = _Uneven()
    if dp_mesh is None:
        return model
    parallelize_module(model, tp_mesh, {"up": ColwiseParallel(output_layouts=Replicate())})
    return fully_shard(model, mesh=dp_mesh)


def _uneven_batches():
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(4, 9, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(STEPS)
    ]


def _mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _check_uneven_tp(rank, ref, root):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    ours = _uneven(tp, dp, raggedfsdp.fully_shard)
    w = ours.up.weight
    assert w.shape == (27, 9) and w.placements[0] == Shard(0)
    piece = 14 if tp.get_local_rank() == 0 else 13
    (buf,) = [v for v in buffers_of(ours) if v.tensor_parallel]
    assert buf.layout["up.weight"].shape == (piece, 9)
    assert w.to_local().shape[0] == len(
        range(*w.placements[1].local_row_range((piece, 9), dp.get_local_rank()))
    )
    losses = _dp_losses(ours, dp, _uneven_batches(), _mse, 0.1)
    theirs = _dp_losses(_uneven(tp, dp, torch_fsdp.fully_shard), dp, _uneven_batches(), _mse, 0.1)
    kw = dict(world=WORLD, tokens=4 * 4)
    assert_losses_match(losses, ref, **kw)
    assert_runs_agree(losses, theirs, ref, what="FSDP2: ", **kw)
    full = _full(ours)
    for k, v in full.items():
        assert_param_matches(k, v, ref, steps=STEPS)
    # saved on (dp 2, tp 2), loaded on 4-rank FSDP: the same full tensors
    checkpoint.save(f"{root}/uneven", ours, step=1)
    plain = raggedfsdp.fully_shard(_Uneven(), mesh=init_device_mesh("cpu", (WORLD,)))
    checkpoint.load(f"{root}/uneven", plain)
    for k, v in _full(plain).items():
        assert torch.equal(v, full[k]), k


def _check_errors(rank):
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world = init_device_mesh("cpu", (WORLD,))
    # a tp mesh inside the data-parallel ranks: their grid would repeat ranks
    model = _Uneven()
    parallelize_module(model, grid["tp"], {"up": ColwiseParallel(output_layouts=Replicate())})
    with pytest.raises(ValueError, match=r"'up.weight'.*overlaps the fully_shard mesh"):
        raggedfsdp.fully_shard(model, mesh=world)
    # mesh info without a shard dim (DDP's)
    info = DDPMeshInfo(world, replicate_mesh_dim=0)
    with pytest.raises(ValueError, match=r"'up.weight' mesh info without a shard dim"):
        raggedfsdp.fully_shard(
            _Uneven(),
            mesh=world,
            shard_placement_fn=lambda p: ShardPlacementResult(placement=None, mesh_info=info),
        )


def _grid(rank, world, refs, root):
    run_cases(
        {
            "tp x fsdp, unflattened meshes": partial(_check_unflattened_tp, rank, refs["llama"]),
            "tp x fsdp, unnamed meshes": partial(_check_unnamed_tp, rank, refs["llama"]),
            "ep, a mesh per parameter": partial(_check_per_param_mesh, rank, refs["moe"], root),
            "uneven tp pieces": partial(_check_uneven_tp, rank, refs["uneven"], root),
            "errors": partial(_check_errors, rank),
        }
    )


def _references():
    def llama():
        model = _llama(None, None, None)
        return _dp_losses(model, None, _llama_batches(), _lm, 0.3), _full(model)

    def moe():
        model = _moe(None, None, None, None)
        return test_ep._train(model, None, "sgd"), _full(model)

    def uneven():
        model = _uneven(None, None, None)
        return _dp_losses(model, None, _uneven_batches(), _mse, 0.1), _full(model)

    return {"llama": reference(llama), "moe": reference(moe), "uneven": reference(uneven)}


def test_meshes():
    with tempfile.TemporaryDirectory() as root:
        spawn(WORLD, _grid, _references(), root, timeout=600)
