"""Distributed Muon parity: given the same gradients, the same parameters as one process.

The single-process reference is ``torch.optim.Muon`` on every hidden matrix (each
member of a stacked ``[E, out, in]`` expert tensor as its own 2-D parameter) plus
``torch.optim.AdamW(foreach=False)`` on the rest, computed once in the pytest process
(every step's parameters) and handed to the ranks. Each rank sets its rows of the
very same gradients, steps ``raggedfsdp.optim.Muon`` and compares every parameter
after every step. One spawn per world size runs the whole grid.
"""

from __future__ import annotations

import functools
import hashlib
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

from raggedfsdp import fully_shard
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer
from raggedfsdp.optim import Muon, muon_block_policy, muon_param_groups
from raggedfsdp.optim.muon import default_use_muon
from tests.harness import run_cases, spawn

STEPS = 10
SEQ = 8
MODELS = ["llama-tiny", "moe-tiny"]
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
VARIANTS = {
    "default": dict(lr=0.02, weight_decay=0.1, momentum=0.95),
    "plain-momentum": dict(
        lr=0.01, weight_decay=0.0, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"
    ),
}
TOL = 1e-5


def _grad(name: str, shape, step: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{name}/{step}".encode()).digest()[:4], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@functools.cache
def _reference(model_name: str, variant: str) -> list[dict[str, torch.Tensor]]:
    """Every step's full parameters under torch.optim.Muon + torch.optim.AdamW."""
    model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
    named = dict(model.named_parameters())
    matrices: dict[str, list[nn.Parameter]] = {}  # fqn -> its 2-D members
    others = []
    for name, p in named.items():
        if default_use_muon(name, p):
            members = [p.detach()] if p.dim() == 2 else list(p.detach().unbind(0))
            matrices[name] = [nn.Parameter(m.clone()) for m in members]
        else:
            others.append(p)
    muon = torch.optim.Muon([m for ms in matrices.values() for m in ms], **VARIANTS[variant])
    adamw = torch.optim.AdamW(others, foreach=False, **ADAMW)
    history = []
    for step in range(STEPS):
        for name, p in named.items():
            g = _grad(name, p.shape, step)
            if name in matrices:
                for m, gm in zip(matrices[name], g if p.dim() == 3 else [g]):
                    m.grad = gm.clone()
            else:
                p.grad = g
        muon.step()
        adamw.step()
        with torch.no_grad():
            for name, ms in matrices.items():
                named[name].copy_(torch.stack([m.detach() for m in ms]).view(named[name].shape))
        history.append({k: v.detach().clone() for k, v in named.items()})
    return history


def _build(model_name, mesh, policy):
    model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
    block_policy = muon_block_policy(model, mesh.size(0)) if policy == "whole" else None
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, block_policy=block_policy)
    fully_shard(model, mesh=mesh, block_policy=block_policy)
    return model


def _set_grads(model, step, rank):
    for name, p in model.named_parameters():
        full = _grad(name, p.shape, step)
        rs = p.placements[0]
        local = rs.local_view(full, rank).clone()
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )


def _compare(model, expected, where):
    for name, p in model.named_parameters():
        diff = (p.full_tensor() - expected[name]).abs().max().item()
        assert diff <= TOL, f"{where}: {name} differs by {diff:.3g}"


def _optimizer(model, variant, **kw):
    return Muon(muon_param_groups(model, **ADAMW), **VARIANTS[variant], **kw)


def _check(mesh, rank, model_name, variant, ref, policy="base", **kw):
    model = _build(model_name, mesh, policy)
    opt = _optimizer(model, variant, **kw)
    for step in range(STEPS):
        _set_grads(model, step, rank)
        opt.step()
        opt.zero_grad()
        _compare(model, ref[step], f"step {step}")
    stats = opt.last_step
    if mesh.size(0) == 1 or kw.get("distributed") == "replicated":
        return
    assert stats.matrices > 0 and stats.comm_free <= stats.matrices
    if policy == "whole":  # the policy is what makes matrices communication-free
        summary = _build_policy_summary(model_name, mesh.size(0))
        assert summary["comm_free_after"] >= summary["comm_free_before"]


@functools.cache
def _build_policy_summary(model_name, world):
    model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
    return muon_block_policy(model, world).summary()


def _check_checkpoint(mesh, rank, model_name, ref, path):
    """Save after 5 steps with DCP, load into a fresh optimizer, finish: same parameters."""
    model = _build(model_name, mesh, "base")
    opt = _optimizer(model, "default")
    for step in range(5):
        _set_grads(model, step, rank)
        opt.step()
    saved = opt.state_dict()
    for state in saved["state"].values():
        assert isinstance(state.get("momentum_buffer", state.get("exp_avg")), DTensor)
    dcp.save({"optim": saved}, checkpoint_id=path)
    fresh = _optimizer(model, "default")
    template = fresh.state_dict()
    template["state"] = {k: {n: _zeros(v) for n, v in s.items()} for k, s in saved["state"].items()}
    dcp.load({"optim": template}, checkpoint_id=path)
    fresh.load_state_dict(template)
    for step in range(5, STEPS):
        _set_grads(model, step, rank)
        fresh.step()
        _compare(model, ref[step], f"resumed step {step}")


def _zeros(v):
    if isinstance(v, DTensor):
        return DTensor.from_local(
            torch.zeros_like(v._local_tensor),
            v.device_mesh,
            v.placements,
            shape=v.shape,
            stride=v.stride(),
        )
    return torch.zeros_like(v)


def _grid(rank, world, refs, ckpt_dir):
    mesh = init_device_mesh("cpu", (world,))
    cases = {}
    for model_name in MODELS:
        ref = refs[model_name, "default"]
        cases[f"{model_name}"] = partial(_check, mesh, rank, model_name, "default", ref)
        cases[f"{model_name} whole-matrix policy"] = partial(
            _check, mesh, rank, model_name, "default", ref, policy="whole"
        )
        cases[f"{model_name} 3 per round"] = partial(
            _check, mesh, rank, model_name, "default", ref, matrices_per_round=3
        )
        cases[f"{model_name} replicated baseline"] = partial(
            _check, mesh, rank, model_name, "default", ref, distributed="replicated"
        )
        cases[f"{model_name} plain momentum"] = partial(
            _check, mesh, rank, model_name, "plain-momentum", refs[model_name, "plain-momentum"]
        )
    cases["checkpoint"] = partial(
        _check_checkpoint, mesh, rank, "moe-tiny", refs["moe-tiny", "default"], ckpt_dir
    )
    run_cases(cases)
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_muon_parity_with_torch(world, tmp_path):
    refs = {(m, v): _reference(m, v) for m in MODELS for v in VARIANTS}
    spawn(world, _grid, refs, str(tmp_path / "ckpt"), timeout=300)
