"""Checkpoints across HSDP mesh shapes: save on a (2, 2) ``(replicate, shard)`` mesh of 4
gloo ranks, load on a (1, 3) mesh of 3 ranks and train on. The loaded state equals the
saved one bit for bit, and the losses before the save and after the resume lie within
the bound derived from the uninterrupted run's (one process) own sensitivity ([Note:
derived tolerances] in ``tests/numerics.py``). (Save on (2, 2), load on 4-rank FSDP:
tests/dist/test_hsdp.py.)

Spawns, in order::

    pytest process   world 1: the uninterrupted losses, plain and with nudged gradients
    spawn(4)         (2, 2) HSDP: SAVE_AT steps, save, record the whole state
    spawn(3)         (1, 3) HSDP: load, check the state, train to STEPS
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import init_device_mesh

from raggedfsdp import checkpoint
from tests.dist.test_checkpoint import (
    _check_losses,
    _full_state,
    _model,
    _optimizer,
    _train,
    _uninterrupted,
)
from tests.harness import run_cases, spawn
from tests.numerics import reference

pytestmark = pytest.mark.numerics

STEPS, SAVE_AT = 5, 3
CONFIGS = [("llama-tiny", "adamw"), ("moe-tiny", "flat")]  # torch's AdamW; raggedfsdp's


def _hsdp(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _save(root, name, optim, rank, world, ref):
    model = _model(name, _hsdp((2, 2)))
    opt = _optimizer(optim, model)
    losses = _train(model, opt, range(SAVE_AT), rank, world)
    _check_losses(losses, ref, 0, world, f"(2, 2) HSDP {name} {optim}: ")
    checkpoint.save(root / f"{name}-{optim}", model, opt, step=SAVE_AT)
    state = _full_state(model, opt)  # collective: every rank gathers
    if rank == 0:
        torch.save(state, root / f"{name}-{optim}.pt")


def _resume(root, name, optim, rank, world, ref):
    model = _model(name, _hsdp((1, 3)))
    opt = _optimizer(optim, model)
    step, _ = checkpoint.load(root / f"{name}-{optim}", model, opt)
    assert step == SAVE_AT
    saved = torch.load(root / f"{name}-{optim}.pt", weights_only=False)
    got = _full_state(model, opt)
    assert got.keys() == saved.keys(), sorted(got.keys() ^ saved.keys())[:5]
    for key, value in saved.items():
        same = torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value
        assert same, f"{key} differs after load"
    losses = _train(model, opt, range(SAVE_AT, STEPS), rank, world)
    _check_losses(losses, ref, SAVE_AT, world, f"(1, 3) HSDP {name} {optim}: ")


def _grid(rank, world, fn, root, refs):
    run_cases({f"{n}-{o}": partial(fn, root, n, o, rank, world, refs[n, o]) for n, o in CONFIGS})
    dist.barrier()


def test_save_on_2x2_hsdp_resume_on_1x3_hsdp():
    refs = {(n, o): reference(partial(_uninterrupted, n, o, STEPS)) for n, o in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spawn(4, _grid, _save, root, refs, timeout=300)
        spawn(3, _grid, _resume, root, refs, timeout=300)
