"""FSDP x TP on 4 gloo ranks as a ``(dp 2, tp 2)`` mesh: blocks parallelized with
``parallelize_module`` (column- and row-wise) on ``tp``, then ``fully_shard`` on
``mesh["dp"]``. Per-step losses, gradient norms and final parameters equal one
process's and torch FSDP2's with the same parallelism, within the bound derived from
one process's own sensitivity ([Note: derived tolerances] in ``tests/numerics.py``);
sharded parameters are ``(tp placement, RaggedShard)`` on the ``(tp, dp)`` mesh;
all-gathers carry the TP-local buffers over dp only; ``clip_grad_norm_`` equals torch's;
a checkpoint saved on (dp 2, tp 2) resumes on the same mesh bit for bit and on 4-rank
FSDP within the bound of the uninterrupted run; bad meshes and placements fail with
errors that name the parameter."""

from __future__ import annotations

import dataclasses
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import raggedfsdp
import raggedfsdp.optim
from raggedfsdp import RaggedShard, checkpoint
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.tools.profiling import CommCounter, CopyCounter, buffer_storages
from tests.harness import run_cases, spawn
from tests.numerics import (
    assert_losses_match,
    assert_param_matches,
    assert_runs_agree,
    reference,
)

pytestmark = pytest.mark.numerics
SEQ, STEPS, WORLD = 16, 6, 4
MODELS = ("llama-tiny", "moe-tiny")


def _config(name):
    # 4 query and 2 key/value heads: both split over 2 tp ranks.
    return dataclasses.replace(get_config(name), n_heads=4, n_kv_heads=2)


def _plan(name):
    attention = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    }
    if name.startswith("moe"):  # the experts stay data-parallel only
        return attention
    return attention | {
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def _data():
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, 1001, (STEPS, 4, SEQ + 1), generator=gen)


def _model(name, mesh, fully_shard):
    model = Transformer(_config(name), max_seq_len=SEQ, seed=0)
    if mesh is None:
        return model
    for block in model.transformer_blocks():
        parallelize_module(block, mesh["tp"], _plan(name))
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _train(model, mesh, opt_name, clip, steps=range(STEPS), opt=None):
    """Per-step mean losses (all dp ranks), the norms clip returned, and the optimizer."""
    if opt is None:
        opt = (
            torch.optim.SGD(model.parameters(), lr=0.3)
            if opt_name == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        )
    dp = mesh["dp"].get_local_rank() if mesh is not None else 0
    losses, norms = [], []
    for step in steps:
        batch = _data()[step]
        rows = batch if mesh is None else batch[2 * dp : 2 * dp + 2]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        if clip is not None:
            norms.append(float(clip(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if mesh is not None:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss = loss / 2
        losses.append(float(loss))
    return losses, norms, opt


def _full(model):
    return {
        k: (v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v).detach()
        for k, v in model.named_parameters()
    }


@torch.no_grad()
def _fsdp2_clip(params, max_norm):
    """Clip for FSDP2 x TP: torch's clip_grad_norm_ refuses DTensors on different meshes
    (the blocks' (dp, tp) against the root's dp), so the norm goes through full tensors."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.stack([g.full_tensor().norm() for g in grads]).norm()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def _check_parity(name, opt_name, rank, refs):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = refs[(name, opt_name)]
    ours = _model(name, mesh, raggedfsdp.fully_shard)
    theirs = _model(name, mesh, torch_fsdp.fully_shard)
    w = ours.layers[0].attention.wq.weight
    assert w.device_mesh.mesh_dim_names == ("tp", "dp")
    assert w.placements[0] == Shard(0) and isinstance(w.placements[1], RaggedShard)
    assert w.to_local().shape[1] == w.shape[1]
    assert ours.layers[0].attention.wo.weight.placements[0] == Shard(1)
    clip = raggedfsdp.clip_grad_norm_ if opt_name == "adamw" else None
    losses, norms, _ = _train(ours, mesh, opt_name, clip)
    fsdp2_losses, fsdp2_norms, _ = _train(theirs, mesh, opt_name, _fsdp2_clip if clip else None)
    tokens, elements = 4 * SEQ, sum(p.numel() for p in ours.parameters())
    assert_losses_match(losses, ref, world=WORLD, tokens=tokens)
    assert_runs_agree(losses, fsdp2_losses, ref, world=WORLD, tokens=tokens, what="FSDP2: ")
    if clip is not None:
        kw = dict(world=WORLD, tokens=elements, series="grad_norm")
        assert_losses_match(norms, ref, **kw)
        assert_runs_agree(norms, fsdp2_norms, ref, what="FSDP2: ", **kw)
    if opt_name == "sgd":
        for k, v in _full(ours).items():
            assert_param_matches(k, v, ref, steps=STEPS)


def _check_bytes(name, rank):
    """All-gathers carry each group's TP-local buffer over the 2 dp ranks, as many bytes
    as FSDP2's with the same parallelism give or take 1% (padding); reduce-scatters too."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    counted, nbytes = {}, {}
    for system, fully_shard in (
        ("ours", raggedfsdp.fully_shard),
        ("fsdp2", torch_fsdp.fully_shard),
    ):
        model = _model(name, mesh, fully_shard)
        x = _data()[0][:2]
        with CommCounter() as comms:
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        counted[system] = comms.summary()
        if system == "ours":
            assert all(v.world_size == 2 and v.tensor_parallel for v in buffers_of(model.layers))
            for part, modules in (("blocks", model.layers), ("all", model)):
                views = buffers_of(modules)
                nbytes[part] = sum(v.layout.global_size * v.dtype.itemsize for v in views)
    # Each block's buffer (its TP-local tensors, over the 2 dp ranks) is gathered in
    # forward and again in backward; the root's once (it stays unsharded).
    root = nbytes["all"] - nbytes["blocks"]
    assert counted["ours"]["all_gather"].output_bytes == 2 * nbytes["blocks"] + root
    ratio = counted["ours"]["all_gather"].output_bytes / counted["fsdp2"]["all_gather"].output_bytes
    assert 0.99 <= ratio <= 1.01, ratio
    rs = counted["ours"]["reduce_scatter"].input_bytes
    assert abs(rs / counted["fsdp2"]["reduce_scatter"].input_bytes - 1) <= 0.01


def _check_zero_copy(name, rank):
    """fp32 FSDP x TP: no copy reads or writes the buffers around the collectives (the
    gradients of the TP DTensors accumulate into their views in place)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model(name, mesh, raggedfsdp.fully_shard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):  # the second step: forward order recorded, state made
        x = _data()[step][:2]
        with CopyCounter() as copies:
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
    near = [e for e in copies.touching(buffer_storages(model)) if e.within is None]
    assert near == [], copies.summary(near)


def _check_checkpoint(name, rank, root):
    """Save on (dp 2, tp 2) after 3 steps; load on 4-rank FSDP; the next steps' losses
    equal the uninterrupted (dp 2, tp 2) run's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model(name, mesh, raggedfsdp.fully_shard)
    _, _, opt = _train(model, mesh, "adamw", None, steps=range(3))
    checkpoint.save(f"{root}/{name}", model, opt, step=3)
    uninterrupted, _, _ = _train(model, mesh, "adamw", None, steps=range(3, STEPS), opt=opt)

    def on_the_same_mesh():  # the uninterrupted run, resumed where it was saved
        again = _model(name, mesh, raggedfsdp.fully_shard)
        again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2, weight_decay=0.1)
        checkpoint.load(f"{root}/{name}", again, again_opt)
        return _train(again, mesh, "adamw", None, steps=range(3, STEPS), opt=again_opt)[0]

    ref = reference(on_the_same_mesh)
    assert ref.losses == uninterrupted, (ref.losses, uninterrupted)  # bitwise

    mesh4 = init_device_mesh("cpu", (4,))
    resumed = Transformer(_config(name), max_seq_len=SEQ, seed=5)
    for block in resumed.transformer_blocks():
        raggedfsdp.fully_shard(block, mesh=mesh4)
    raggedfsdp.fully_shard(resumed, mesh=mesh4)
    opt4 = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    checkpoint.load(f"{root}/{name}", resumed, opt4)
    losses = []
    for step in range(3, STEPS):
        rows = _data()[step][rank : rank + 1]
        loss = lm_loss(resumed(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt4.step()
        opt4.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(float(loss) / 4)
    assert_losses_match(losses, ref, world=WORLD, tokens=4 * SEQ, what="resumed on 4 ranks: ")


def _check_errors(rank):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # 3 query heads, 1 key/value head: tp 2 cuts heads apart; the model says so
    model = Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0)
    for block in model.transformer_blocks():
        parallelize_module(block, mesh["tp"], _plan("llama-tiny"))
    with pytest.raises(ValueError, match=r"tp size must divide n_heads \(3\) and n_kv_heads \(1\)"):
        model(_data()[0][:1, :-1])
    # another device mesh whose tp runs over the ranks that are dp in ``mesh``
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    block = Transformer(_config("llama-tiny"), max_seq_len=SEQ, seed=0).layers[0]
    parallelize_module(block, other["tp"], _plan("llama-tiny"))
    with pytest.raises(ValueError, match=r"'attention.wq.weight'.*is one of the fully_shard"):
        raggedfsdp.fully_shard(block, mesh=mesh["dp"])
    # a tp mesh over the dp ranks of an unnamed mesh: compared by ranks, not names
    unnamed = init_device_mesh("cpu", (2, 2))
    block = Transformer(_config("llama-tiny"), max_seq_len=SEQ, seed=0).layers[0]
    parallelize_module(block, _dp_of(unnamed), _plan("llama-tiny"))
    with pytest.raises(ValueError, match=r"'attention.wq.weight'.*is one of the fully_shard"):
        raggedfsdp.fully_shard(block, mesh=_dp_of(unnamed))
    block = Transformer(_config("llama-tiny"), max_seq_len=SEQ, seed=0).layers[0]
    parallelize_module(block, mesh["tp"], _plan("llama-tiny"))
    with pytest.raises(ValueError, match=r"'attention.wq.weight'.*is one of the fully_shard"):
        raggedfsdp.fully_shard(block, mesh=mesh["tp"])
    assert all(not isinstance(p, RaggedShard) for p in block.parameters())
    # member gaps: a stack of experts that TP shards inside its members (Shard(1)) is
    # refused before anything changes (sharded over its members, as by EP: test_ep.py).
    experts = nn.Module()
    full = torch.randn(4, 8, 6)
    experts.w1 = nn.Parameter(distribute_tensor(full, mesh["tp"], [Shard(1)]))
    with pytest.raises(
        NotImplementedError,
        match=r"member_gaps=True with 'w1', a stack of 4 members that tensor parallelism "
        r"shards inside its members \(Shard\(dim=1\)\), is not supported yet; pass "
        r"member_gaps=False",
    ):
        raggedfsdp.fully_shard(experts, mesh=mesh["dp"], member_gaps=True)
    assert raggedfsdp.fsdp.buffer_of(experts.w1) is None  # untouched
    assert torch.equal(experts.w1.full_tensor(), full)


def _dp_of(mesh):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(mesh.get_group(0), "cpu")


def _grid(rank, world, refs, root):
    run_cases(
        {
            **{
                f"parity {m} {o}": partial(_check_parity, m, o, rank, refs)
                for m in MODELS
                for o in ("sgd", "adamw")
            },
            "bytes llama": partial(_check_bytes, "llama-tiny", rank),
            "zero copies llama": partial(_check_zero_copy, "llama-tiny", rank),
            "checkpoint (dp2, tp2) -> dp4": partial(_check_checkpoint, "llama-tiny", rank, root),
            "errors": partial(_check_errors, rank),
        }
    )


def _references():
    refs = {}
    for name in MODELS:
        for opt_name in ("sgd", "adamw"):

            def run(name=name, opt_name=opt_name):
                model = _model(name, None, None)
                clip = torch.nn.utils.clip_grad_norm_ if opt_name == "adamw" else None
                losses, norms, _ = _train(model, None, opt_name, clip)
                series = dict(loss=losses, params=_full(model))
                return series | ({"grad_norm": norms} if clip else {})

            refs[(name, opt_name)] = reference(run)
    return refs


def test_fsdp_x_tp():
    with tempfile.TemporaryDirectory() as root:
        spawn(WORLD, _grid, _references(), root, timeout=600)


def _check_hsdp_x_tp(rank, world, ref):
    """HSDP x TP: (replicate 2, shard 2, tp 2) on 8 ranks, the sharded parameters on the
    (tp, replicate, shard) mesh; losses and parameters equal one process's."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh = mesh["replicate", "shard"]
    model = Transformer(_config("llama-tiny"), max_seq_len=SEQ, seed=0)
    for block in model.transformer_blocks():
        parallelize_module(block, mesh["tp"], _plan("llama-tiny"))
        raggedfsdp.fully_shard(block, mesh=dp_mesh)
    raggedfsdp.fully_shard(model, mesh=dp_mesh)
    w = model.layers[0].feed_forward.w2.weight
    assert w.device_mesh.mesh_dim_names == ("tp", "replicate", "shard")
    assert w.placements[:2] == (Shard(1), Replicate())
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    dp = dp_mesh.get_local_rank(0) * 2 + dp_mesh.get_local_rank(1)
    losses = []
    for step in range(2):
        rows = _data()[step][dp : dp + 1]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        for i in range(2):
            dist.all_reduce(loss, group=dp_mesh.get_group(i))
        losses.append(float(loss) / 4)
    assert_losses_match(losses, ref, world=world, tokens=4 * SEQ)
    for k, v in _full(model).items():
        assert_param_matches(k, v, ref, steps=2)


def test_hsdp_x_tp_on_8_ranks():
    def run():
        model = _model("llama-tiny", None, None)
        losses, _, _ = _train(model, None, "sgd", None, steps=range(2))
        return losses, _full(model)

    spawn(8, _check_hsdp_x_tp, reference(run), timeout=600)
