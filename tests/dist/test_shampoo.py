"""Distributed Shampoo: given the same gradients, the one-device reference's parameters,
bit for bit, at every world size and under HSDP and EP; no collective in the step;
checkpoints reshard.

The reference is ``tests/unit/test_shampoo.py``'s blocked Shampoo written from the
equations on the full tensors (every hidden matrix and each member of an expert stack,
blocked as ``torch.split(row_block)`` over the rows and ``torch.split(block_size)``
over the columns) plus ``torch.optim.AdamW(foreach=False)`` on the rest, computed once
in the pytest process. Each rank sets its rows of the very same gradients, steps
``raggedfsdp.optim.Shampoo`` on a model sharded with ``shampoo_block_policy`` (4-row
blocks, so matrices span ranks) and compares its rows of every parameter after every
step with ``torch.equal``: every rank holds whole row blocks and runs the reference's
per-block ops in the same order on the same values (see [Note: Shampoo blocks on ranks]).
"""

from __future__ import annotations

import functools
from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, init_device_mesh

from raggedfsdp import fully_shard
from raggedfsdp.models import get_config
from raggedfsdp.models.parallelize import build_mesh, parallelize, parse_mesh_spec
from raggedfsdp.models.transformer import Transformer
from raggedfsdp.optim import Shampoo, shampoo_block_policy
from raggedfsdp.optim.muon import default_use_muon
from raggedfsdp.tensor import ragged_piece
from raggedfsdp.tools.profiling import CommCounter
from tests.harness import run_cases, spawn, train_cli
from tests.unit.test_shampoo import HYPER, gradient, reference_init, reference_step

pytestmark = pytest.mark.numerics
STEPS = 6
SEQ = 8
BLOCK = 32  # columns: llama-tiny's 96 -> 3 blocks, 260 -> 8 of 32 and one of 4
ROW = 4  # rows: 96 -> 24 blocks, 260 -> 65, moe-tiny's experts' 44 -> 11: matrices span ranks
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
ADAMW_ARGS = {f"adamw_{k}": v for k, v in ADAMW.items()}


def _model(name):
    return Transformer(get_config(name), max_seq_len=SEQ, seed=0)


@functools.cache
def _reference(model_name: str, grafting: str) -> list[dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (the same bits either way for these sizes)
    try:
        named = dict(_model(model_name).named_parameters())
        shampoo = {n: p.detach() for n, p in named.items() if default_use_muon(n, p)}
        others = [p for n, p in named.items() if n not in shampoo]
        adamw = torch.optim.AdamW(others, foreach=False, **ADAMW)
        state = reference_init(shampoo, BLOCK, ROW)
        history = []
        for step in range(STEPS):
            grads = {n: gradient(n, p.shape, step) for n, p in named.items()}
            for p in others:
                p.grad = grads[next(n for n, q in named.items() if q is p)]
            with torch.no_grad():
                reference_step(shampoo, grads, state, HYPER, BLOCK, ROW, grafting)
            adamw.step()
            history.append({n: p.detach().clone() for n, p in named.items()})
        return history
    finally:
        torch.set_num_threads(threads)


def _build(model_name, mesh, whole=False, policy=True, block=BLOCK, row=ROW):
    model = _model(model_name)
    block_policy = (
        shampoo_block_policy(block, row_block=row, whole_matrices=whole) if policy else None
    )
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, block_policy=block_policy)
    fully_shard(model, mesh=mesh, block_policy=block_policy)
    return model


def _optimizer(model, grafting="block", row=ROW):
    return Shampoo(
        model.parameters(),
        block_size=BLOCK,
        row_block=row,
        grafting=grafting,
        **HYPER,
        **ADAMW_ARGS,
    )


def _set_grads(model, step, rank):
    for name, p in model.named_parameters():
        local = p.placements[-1].local_view(gradient(name, p.shape, step), rank).clone()
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )


def _compare(model, expected, rank, where):
    for name, p in model.named_parameters():
        want = p.placements[-1].local_view(expected[name], rank)
        assert torch.equal(p._local_tensor, want), f"{where}: {name} differs on rank {rank}"


def _check(mesh, rank, model_name, ref, grafting="block", steps=STEPS):
    """Every step's parameters equal the reference's; the step issues no collective."""
    model = _build(model_name, mesh, whole=grafting == "parameter")
    opt = _optimizer(model, grafting)
    for step in range(steps):
        _set_grads(model, step, rank)
        with CommCounter() as comms:
            opt.step()
        assert comms.summary() == {}, f"step {step}: collectives {comms.summary()}"
        _compare(model, ref[step], rank, f"step {step}")
    spans = 0  # Shampoo matrices whose blocks lie on more than one rank
    for p in model.parameters():  # states are DTensors placed by their own RaggedShard
        if p in opt._layouts:
            assert isinstance(opt.state[p]["left"], DTensor)
            spans += p.dim() == 2 and sum(u > 0 for u in opt._layouts[p].left_units) > 1
    # On 2 and 3 ranks the planner cuts matrices between ranks at 4-row boundaries; on 4
    # it happens to give each rank whole matrices
    if mesh.size() in (2, 3) and grafting == "block":
        assert spans > 0, "no Shampoo matrix spans ranks: the test would not cut one"


def _check_errors(mesh, rank):
    """A model sharded without the policy: refused by name, with the fix, on every rank."""
    model = _build("llama-tiny", mesh, policy=False)
    fix = (
        r"cut a Shampoo block of 32 rows; shard with "
        r"block_policy=shampoo_block_policy\(32, row_block=32\)"
    )
    with pytest.raises(NotImplementedError, match=r"parameter '[\w.]+' is placed .*" + fix):
        _optimizer(model, row=32)
    model = _build("llama-tiny", mesh, block=1, row=1)  # 1-row blocks: matrices across ranks
    with pytest.raises(NotImplementedError, match=r"grafting='parameter' needs every matrix"):
        Shampoo(model.parameters(), block_size=1, grafting="parameter")


def _save(mesh, rank, ref, path):
    model = _build("moe-tiny", mesh)
    opt = _optimizer(model)
    for step in range(3):
        _set_grads(model, step, rank)
        opt.step()
    _compare(model, ref[2], rank, "before saving")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)


def _resume(mesh, rank, ref, path):
    """Load what 3 ranks saved into 2 (other blocks per rank), finish: the same numbers."""
    model = _build("moe-tiny", mesh)
    opt = _optimizer(model)
    _set_grads(model, 0, rank)
    opt.step()  # makes every state, so the template has the shapes to load into
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    _compare(model, ref[2], rank, "after loading")
    for step in range(3, STEPS):
        _set_grads(model, step, rank)
        opt.step()
        _compare(model, ref[step], rank, f"resumed step {step}")


def _grid(rank, world, refs):
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        "llama-tiny": partial(_check, mesh, rank, "llama-tiny", refs["llama-tiny", "block"]),
        "moe-tiny": partial(_check, mesh, rank, "moe-tiny", refs["moe-tiny", "block"]),
    }
    if world in (1, 3):
        cases["llama-tiny grafting=parameter"] = partial(
            _check, mesh, rank, "llama-tiny", refs["llama-tiny", "parameter"], "parameter"
        )
    if world > 1:
        cases["errors"] = partial(_check_errors, mesh, rank)
    run_cases(cases)


def _refs():
    refs = {(m, "block"): _reference(m, "block") for m in ("llama-tiny", "moe-tiny")}
    refs["llama-tiny", "parameter"] = _reference("llama-tiny", "parameter")
    return refs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shampoo_parity(world):
    spawn(world, _grid, _refs(), timeout=300)


def _one(rank, world, fn, *args):
    fn(init_device_mesh("cpu", (world,)), rank, *args)


def test_shampoo_checkpoint_reshards(tmp_path):
    ref = _reference("moe-tiny", "block")
    spawn(3, _one, _save, ref, str(tmp_path / "ckpt"))
    spawn(2, _one, _resume, ref, str(tmp_path / "ckpt"))


def test_train_shampoo_resumes_bitwise(tmp_path):
    """``train --optim shampoo``: a run split by a checkpoint gives the uninterrupted losses."""
    from tests.dist.test_train import COMMON, _losses

    argv = [*COMMON[: COMMON.index("--optim")], "--optim", "shampoo", "--no-progress", "--no-plot"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train_cli([*argv, "--out", str(whole)])
    train_cli([*argv, "--out", str(split), "--ckpt-every", "100", "--stop-after", "3"])
    train_cli([*argv, "--out", str(split), "--ckpt-every", "100", "--resume"])
    assert _losses(whole) == _losses(split)


def _piece(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` as ``like`` places it (any mesh, any placements)."""
    return ragged_piece(full.shape, like.device_mesh, like.placements).rows(full)


def _check_composed(rank, world, mesh_text, ref):
    """HSDP ``(replicate 2, shard 2)`` and FSDP x EP ``(dp_mod_ep 2, ep 2)``, sharded by
    ``parallelize``: every step equals the reference, with no collective in the step (the
    replicas hold the same rows and step them alike; an expert stack's members split by
    ep are whole matrices)."""
    spec = parse_mesh_spec(mesh_text, world)
    mesh = build_mesh(spec)
    model = _model("moe-tiny")
    parallelize(model, mesh, spec, block_policy=shampoo_block_policy(BLOCK, row_block=ROW))
    opt = _optimizer(model)
    for step in range(STEPS):
        for name, p in model.named_parameters():
            local = _piece(gradient(name, p.shape, step), p).clone()
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        with CommCounter() as comms:
            opt.step()
        assert comms.summary() == {}, f"{mesh_text} step {step}: {comms.summary()}"
        for name, p in model.named_parameters():
            want = _piece(ref[step][name], p)
            assert torch.equal(p._local_tensor, want), f"{mesh_text} step {step}: {name}"


@pytest.mark.parametrize("mesh_text", ["replicate=2,shard=2", "ep=2"])
def test_shampoo_composes_with_hsdp_and_ep(mesh_text):
    spawn(4, _check_composed, mesh_text, _reference("moe-tiny", "block"), timeout=300)
