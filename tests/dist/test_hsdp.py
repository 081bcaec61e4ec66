"""HSDP: ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh of 4 gloo ranks (2 x 2).
Parameters are ``(Replicate(), RaggedShard)``; all-gathers and reduce-scatters cross
the shard dim only, one all-reduce per group crosses the replicate dim; per-step
losses and final parameters equal one process's, and FSDP2's HSDP on the same mesh,
within the bound derived from one process's own sensitivity ([Note: derived tolerances]
in ``tests/numerics.py``); ``set_requires_all_reduce(False)`` accumulates as FSDP2 does
(within the bound derived from FSDP2's own run, nudged on the same ranks); a checkpoint saved on it
with member gaps loads into 4-rank FSDP without them."""

from __future__ import annotations

import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import Replicate, init_device_mesh

import raggedfsdp
import raggedfsdp.optim
from raggedfsdp import RaggedShard, parallelize
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from tests.harness import run_cases, spawn
from tests.numerics import assert_losses_match, assert_param_matches, reference

pytestmark = pytest.mark.numerics
SEQ, STEPS, WORLD = 16, 10, 4


def _data():
    gen = torch.Generator().manual_seed(9)
    return torch.randint(0, 1001, (STEPS, 2 * WORLD, SEQ + 1), generator=gen)


def _train(model, rank, world, *, microbatches=1, setup=lambda m, i: None):
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    losses = []
    for batch in _data():
        rows = batch[2 * rank : 2 * rank + 2] if world > 1 else batch
        total = torch.zeros(())
        for i in range(microbatches):
            setup(model, i)
            x = rows.roll(i, dims=1)
            loss = lm_loss(model(x[:, :-1]), x[:, 1:]) / microbatches
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _sharded(fully_shard, name, mesh, **kw):
    model = Transformer(get_config(name), max_seq_len=SEQ, seed=0)
    parallelize(model, mesh, fully_shard=fully_shard, **kw)
    return model


def _check_parity(name, rank, ref):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours = _sharded(raggedfsdp.fully_shard, name, mesh)
    p = next(ours.parameters())
    assert isinstance(p.placements[0], Replicate) and isinstance(p.placements[1], RaggedShard)
    assert p.placements[1].world_size == 2  # planned for the shard dim
    losses, params = _train(ours, rank, WORLD)
    theirs, _ = _train(_sharded(torch_fsdp.fully_shard, name, mesh), rank, WORLD)
    tokens = 2 * WORLD * SEQ
    assert_losses_match(losses, ref, world=WORLD, tokens=tokens)
    assert_losses_match(theirs, ref, world=WORLD, tokens=tokens, what="FSDP2: ")
    for k, v in params.items():
        assert_param_matches(k, v.full_tensor(), ref, steps=STEPS)


def _skip_all_reduce_but_last(model, i):
    model.set_requires_all_reduce(i == 1)


def _check_accumulation(rank):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def run(fully_shard):
        model = _sharded(fully_shard, "llama-tiny", mesh)
        losses, params = _train(model, rank, WORLD, microbatches=2, setup=_skip_all_reduce_but_last)
        return losses, {k: v.full_tensor() for k, v in params.items()}

    fsdp2 = reference(partial(run, torch_fsdp.fully_shard))  # nudged in every rank
    ours, our_params = run(raggedfsdp.fully_shard)
    kw = dict(world=2 * WORLD, tokens=2 * WORLD * SEQ, what="against FSDP2: ")
    assert_losses_match(ours, fsdp2, **kw)
    for k, v in our_params.items():
        assert_param_matches(k, v, fsdp2, steps=STEPS, what="against FSDP2: ")


def _check_checkpoint_to_fsdp(rank, root):
    """Save on the 2x2 HSDP mesh, its experts laid out with member gaps, load on 4-rank
    FSDP without gaps: the same values."""
    from raggedfsdp import checkpoint

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (WORLD,))
    model = _sharded(raggedfsdp.fully_shard, "moe-tiny", hsdp, member_gaps="always")
    stacks = [p for n, p in model.named_parameters() if ".experts." in n]
    assert stacks and all(
        (found := raggedfsdp.fsdp.buffer_of(p))[0].layout[found[1].fqn].member_gap > 0
        for p in stacks
    )
    opt = raggedfsdp.optim.AdamW(model.parameters(), lr=1e-2)
    x = _data()[0][2 * rank : 2 * rank + 2]
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    checkpoint.save(f"{root}/hsdp", model, opt, step=1)
    saved = {k: v.full_tensor() for k, v in model.named_parameters()}
    other = Transformer(get_config("moe-tiny"), max_seq_len=SEQ, seed=1)
    for block in other.transformer_blocks():
        raggedfsdp.fully_shard(block, mesh=flat)
    raggedfsdp.fully_shard(other, mesh=flat)
    other_opt = raggedfsdp.optim.AdamW(other.parameters(), lr=1e-2)
    checkpoint.load(f"{root}/hsdp", other, other_opt)
    for k, v in other.named_parameters():
        assert torch.equal(v.full_tensor(), saved[k]), k
    for p, q in zip(model.parameters(), other.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                opt.state[p][key].full_tensor(), other_opt.state[q][key].full_tensor()
            ), key


def _grid(rank, world, refs, root):
    cases = {f"{n}": partial(_check_parity, n, rank, refs[n]) for n in refs}
    cases["set_requires_all_reduce(False) accumulation"] = partial(_check_accumulation, rank)
    cases["checkpoint: HSDP 2x2 -> FSDP 4"] = partial(_check_checkpoint_to_fsdp, rank, root)
    run_cases(cases)
    dist.barrier()


def test_hsdp_parity_with_one_process_and_fsdp2():
    def run(name):
        model = Transformer(get_config(name), max_seq_len=SEQ, seed=0)
        return _train(model, 0, 1)

    refs = {name: reference(partial(run, name)) for name in ("llama-tiny", "moe-tiny")}
    with tempfile.TemporaryDirectory() as root:
        spawn(WORLD, _grid, refs, root, timeout=600)
