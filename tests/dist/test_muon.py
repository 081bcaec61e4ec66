"""Distributed Muon parity: given the same gradients, the same parameters as one process.

The single-process reference is ``torch.optim.Muon`` on every hidden matrix (each
member of a stacked ``[E, out, in]`` expert tensor as its own 2-D parameter) plus
``torch.optim.AdamW(foreach=False)`` on the rest, computed once in the pytest process
(every step's parameters) and handed to the ranks. Each rank sets its rows of the
very same gradients, steps ``raggedfsdp.optim.Muon`` and compares every parameter
after every step, bit for bit: the Newton-Schulz runs torch's ops in torch's order on
the whole matrix, and the rest is element-wise. One spawn per world size runs the whole
grid.
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

pytestmark = pytest.mark.numerics
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


def _grad(name: str, shape, step: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{name}/{step}".encode()).digest()[:4], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@functools.cache
def _reference(model_name: str, variant: str) -> list[dict[str, torch.Tensor]]:
    """Every step's full parameters under torch.optim.Muon + torch.optim.AdamW."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small bf16 matmuls: threads only contend (same bits either way)
    try:
        return _reference_run(model_name, variant)
    finally:
        torch.set_num_threads(threads)


def _reference_run(model_name: str, variant: str) -> list[dict[str, torch.Tensor]]:
    return reference_history(Transformer(get_config(model_name), max_seq_len=SEQ, seed=0), variant)


def reference_history(model, variant: str) -> list[dict[str, torch.Tensor]]:
    """Every step's full parameters of ``model`` under torch.optim.Muon + torch.optim.AdamW,
    given the gradients of ``_grad``."""
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


def _compare(model, expected, rank, where):
    """Each rank checks its own rows against the reference: no communication."""
    for name, p in model.named_parameters():
        want = p.placements[0].local_view(expected[name], rank)
        assert torch.equal(p._local_tensor, want), f"{where}: {name} differs on rank {rank}"


def _optimizer(model, variant, **kw):
    return Muon(muon_param_groups(model, **ADAMW), **VARIANTS[variant], **kw)


def _check(mesh, rank, model_name, variant, ref, policy="base", steps=STEPS, **kw):
    """Step with the reference's gradients; every step's parameters must match it."""
    model = _build(model_name, mesh, policy)
    opt = _optimizer(model, variant, **kw)
    for step in range(steps):
        _set_grads(model, step, rank)
        opt.step()
        opt.zero_grad()
        _compare(model, ref[step], rank, f"step {step}")
    return opt.last_step


def _check_policy(mesh, rank, model_name, ref):
    """The whole-matrix policy: same numbers; its report is what the runtime sees."""
    base = _check(mesh, rank, model_name, "default", ref, steps=2)
    whole = _check(mesh, rank, model_name, "default", ref, policy="whole")
    summary = _policy_summary(model_name, mesh.size(0))
    assert whole.matrices == base.matrices == summary["matrices"]
    assert (base.comm_free, whole.comm_free) == (
        summary["comm_free_before"],
        summary["comm_free_after"],
    )
    if mesh.size(0) in (2, 4):  # where the planner can keep every matrix whole cheaply
        assert whole.comm_free == whole.matrices > base.comm_free


@functools.cache
def _policy_summary(model_name, world):
    model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
    return muon_block_policy(model, world).summary()


def _check_stats(mesh, rank, model_name, ref):
    """Bytes moved: the root scheme sends each non-root piece there and back (bf16)."""
    root = _check(mesh, rank, model_name, "default", ref, steps=1)
    sent = torch.tensor([root.bytes_sent, root.bytes_received, root.ns_flops], dtype=torch.float64)
    dist.all_reduce(sent)
    assert sent[0] == sent[1], "every byte sent is received"
    assert sent[2] == sum(root.ns_flops_per_rank), "each matrix orthogonalised once"


def _check_errors(mesh, rank):
    model = _build("llama-tiny", mesh, "base")
    norm = model.layers[0].attention_norm.weight
    with pytest.raises(ValueError, match=r"parameter 'attention_norm.weight' has shape \(96,\)"):
        Muon([{"params": [norm], "use_muon": True}])
    from torch.distributed.tensor import Shard, distribute_tensor

    shard0 = nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))
    with pytest.raises(NotImplementedError, match=r"sharded as Shard\(dim=0\)"):
        Muon([{"params": [shard0], "use_muon": True}])


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
        _compare(model, ref[step], rank, f"resumed step {step}")


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
    llama, moe = refs["llama-tiny", "default"], refs["moe-tiny", "default"]
    cases = {
        "llama-tiny": partial(_check, mesh, rank, "llama-tiny", "default", llama),
        "moe-tiny": partial(_check, mesh, rank, "moe-tiny", "default", moe),
        "errors": partial(_check_errors, mesh, rank),
    }
    if world in (1, 3):  # element-wise options: any world size shows them
        cases["llama-tiny nesterov=False, match_rms_adamw"] = partial(
            _check, mesh, rank, "llama-tiny", "plain-momentum", refs["llama-tiny", "plain-momentum"]
        )
    if world in (2, 3):
        cases["checkpoint"] = partial(_check_checkpoint, mesh, rank, "moe-tiny", moe, ckpt_dir)
    if world > 1:
        cases["moe-tiny whole-matrix policy"] = partial(_check_policy, mesh, rank, "moe-tiny", moe)
        cases["llama-tiny 3 matrices per round"] = partial(
            _check, mesh, rank, "llama-tiny", "default", llama, steps=4, matrices_per_round=3
        )
        cases["llama-tiny replicated baseline"] = partial(
            _check, mesh, rank, "llama-tiny", "default", llama, steps=3, distributed="replicated"
        )
        cases["stats"] = partial(_check_stats, mesh, rank, "moe-tiny", moe)
    run_cases(cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_muon_parity_with_torch(world, tmp_path):
    refs = {(m, "default"): _reference(m, "default") for m in MODELS}
    refs["llama-tiny", "plain-momentum"] = _reference("llama-tiny", "plain-momentum")
    spawn(world, _grid, refs, str(tmp_path / "ckpt"), timeout=300)
