"""Distributed Shampoo: given the same gradients, the one-device reference's parameters,
bit for bit, at every world size, in both modes and under HSDP and EP; the
communication-free mode issues no collective, the owner mode exactly its plan's two
all-to-alls; checkpoints reshard across world sizes and modes.

The reference is ``tests/unit/test_shampoo.py``'s blocked Shampoo written from the
equations on the full tensors (every hidden matrix and each member of an expert stack,
blocked as ``torch.split(row_block)`` over the rows and ``torch.split(block_size)``
over the columns) plus ``torch.optim.AdamW(foreach=False)`` on the rest, computed once
in the pytest process. Each rank sets its rows of the very same gradients, steps
``raggedfsdp.optim.Shampoo`` and compares its rows of every parameter after every step
with ``torch.equal``. Two layouts: ``shampoo_block_policy`` (4-row blocks, so matrices
span ranks but blocks do not: the communication-free mode), and ``fully_shard``'s
default 1-row blocks with square 16 or 32 blocks, which cut blocks across ranks (the
owner mode: see [Note: Shampoo block owners]). Either way the block's owner runs the
reference's per-block ops on the same values (see [Note: Shampoo blocks on ranks]).
"""

from __future__ import annotations

import functools
import json
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
from raggedfsdp.optim.shampoo import blocks_of
from raggedfsdp.tensor import ragged_piece
from raggedfsdp.tools.profiling import CommCounter, CommStats
from tests.harness import run_cases, spawn, train_cli
from tests.unit.test_shampoo import HYPER, gradient, reference_init, reference_step

pytestmark = pytest.mark.numerics
STEPS = 6
SEQ = 8
BLOCK = 32  # columns: llama-tiny's 96 -> 3 blocks, 260 -> 8 of 32 and one of 4
ROW = 4  # rows: 96 -> 24 blocks, 260 -> 65, moe-tiny's experts' 44 -> 11: matrices span ranks
SQUARE = 32  # the checkpoint test's square blocks
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
ADAMW_ARGS = {f"adamw_{k}": v for k, v in ADAMW.items()}


def _model(name):
    return Transformer(get_config(name), max_seq_len=SEQ, seed=0)


def _use_shampoo(only: str | None):
    """Shampoo's parameters: the hidden matrices, or those whose name ends in ``only``."""
    return lambda n, p: default_use_muon(n, p) and (only is None or n.endswith(only))


@functools.cache
def _reference(
    model_name: str, grafting: str, block: int = BLOCK, row: int = ROW, only: str | None = None
) -> list[dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (the same bits either way for these sizes)
    try:
        named = dict(_model(model_name).named_parameters())
        shampoo = {n: p.detach() for n, p in named.items() if _use_shampoo(only)(n, p)}
        others = [p for n, p in named.items() if n not in shampoo]
        adamw = torch.optim.AdamW(others, foreach=False, **ADAMW)
        state = reference_init(shampoo, block, row)
        history = []
        for step in range(STEPS):
            grads = {n: gradient(n, p.shape, step) for n, p in named.items()}
            for p in others:
                p.grad = grads[next(n for n, q in named.items() if q is p)]
            with torch.no_grad():
                reference_step(shampoo, grads, state, HYPER, block, row, grafting)
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


def _optimizer(model, grafting="block", row=ROW, block=BLOCK, only=None):
    return Shampoo(
        model.parameters(),
        block_size=block,
        row_block=row,
        grafting=grafting,
        use_shampoo=_use_shampoo(only),
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
    assert set(opt.modes().values()) == {"communication-free"}
    spans = 0  # Shampoo matrices whose blocks lie on more than one rank
    for p in model.parameters():  # states are DTensors placed by their own RaggedShard
        if p in opt._cuts:
            assert isinstance(opt.state[p]["left"], DTensor)
            spans += p.dim() == 2 and len(opt._cuts[p].segments) > 1
    # On 2 and 3 ranks the planner cuts matrices between ranks at 4-row boundaries; on 4
    # it happens to give each rank whole matrices
    if mesh.size() in (2, 3) and grafting == "block":
        assert spans > 0, "no Shampoo matrix spans ranks: the test would not cut one"


def _sent_bytes(opt, rank, block):
    """Bytes ``rank`` sends in one owner-mode step, from the layout and the owners alone:
    the rows of each block held by a rank other than its owner go to the owner once (the
    gather) and their direction comes back once (the scatter); fp32 on the wire."""
    sent = spans = 0
    for key in opt.modes():
        owners = opt.plan_of(key)
        for k, p in enumerate(opt._plans[key].params):
            rs, shape = p.placements[-1], tuple(p.shape)
            rows, cols = shape[-2], shape[-1]
            members = shape[0] if len(shape) == 3 else 1
            held = []  # per rank: rows [g0, g1) of (members * rows, cols)
            for r in range(rs.world_size):
                lo, hi = rs.local_row_range(shape, r)
                held.append((lo * rs.row_numel(shape) // cols, hi * rs.row_numel(shape) // cols))
            for i, (e, r0, r1, c0, c1) in enumerate(blocks_of(members, rows, cols, block)):
                owner = owners.params[k][i].owner
                G0, G1 = e * rows + r0, e * rows + r1
                overlap = [max(0, min(g1, G1) - max(g0, G0)) * (c1 - c0) for g0, g1 in held]
                spans += sum(n > 0 for n in overlap) > 1
                for r, n in enumerate(overlap):
                    if r != owner and rank in (r, owner):
                        sent += 4 * n
    assert spans > 0, "no Shampoo block spans ranks: the test would not cut one"
    return sent


def _check_owner(mesh, rank, model_name, block, ref, only=None):
    """Owner mode (``fully_shard``'s default 1-row blocks, square blocks cut across ranks):
    every step equals the reference, with exactly the plan's two all-to-alls. With Shampoo
    on the ``only`` matrices alone, some ranks hold none of their rows: owners beyond the
    holders."""
    model = _build(model_name, mesh, policy=False)
    opt = _optimizer(model, row=block, block=block, only=only)
    assert set(opt.modes().values()) == {"owner"}
    beyond = sum(
        place.owner not in {r for r, _, _ in place.pieces}
        for key in opt.modes()
        for blocks in opt.plan_of(key).params
        for place in blocks
    )
    assert (beyond > 0) == (only is not None), f"{beyond} blocks owned beyond their holders"
    sent = _sent_bytes(opt, rank, block)
    want = CommStats(2, sent, sent)  # a rank receives what it sends (see the docstring)
    for step in range(STEPS):
        _set_grads(model, step, rank)
        if step in (0, 1):  # before and at the first preconditioned step (counting is slow)
            with CommCounter() as comms:
                opt.step()
            assert comms.summary() == {"all_to_all": want}, f"step {step}: {comms.summary()}"
        else:
            opt.step()
        assert opt.last_step.collectives == 2 and opt.last_step.bytes_sent == want.input_bytes
        _compare(model, ref[step], rank, f"{model_name} square {block}, step {step}")


def _check_errors(mesh, rank):
    """grafting='parameter' with matrices across ranks: refused by name, with the fix."""
    model = _build("llama-tiny", mesh, block=1, row=1)  # 1-row blocks: matrices across ranks
    with pytest.raises(NotImplementedError, match=r"grafting='parameter' needs every matrix"):
        Shampoo(model.parameters(), block_size=1, grafting="parameter")


def _template(model_name, mesh, rank, policy, block):
    """A model and optimizer with every state made (a step), to load a checkpoint into."""
    model = _build(model_name, mesh, policy=policy, block=block, row=block)
    opt = _optimizer(model, row=block, block=block)
    _set_grads(model, 0, rank)
    opt.step()
    return model, opt


def _load(model, opt, path):
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


def _owner_save(mesh, rank, ref, path):
    """4 ranks, owner mode: steps 0-2, saved."""
    model, opt = _template("moe-tiny", mesh, rank, False, SQUARE)
    assert set(opt.modes().values()) == {"owner"}
    for step in range(1, 3):
        _set_grads(model, step, rank)
        opt.step()
    _compare(model, ref[2], rank, "before saving")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)


def _owner_reshard(mesh, rank, ref, path, out):
    """3 ranks, owner mode (other owners, other state runs): loads 4's, steps 3-4, saves."""
    model, opt = _template("moe-tiny", mesh, rank, False, SQUARE)
    _load(model, opt, path)
    _compare(model, ref[2], rank, "after loading on 3 ranks")
    for step in range(3, 5):
        _set_grads(model, step, rank)
        opt.step()
        _compare(model, ref[step], rank, f"3 ranks, step {step}")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=out)


def _free_resume(mesh, rank, ref, path):
    """2 ranks, communication-free (``shampoo_block_policy``): loads 3's, steps 5 on."""
    model, opt = _template("moe-tiny", mesh, rank, True, SQUARE)
    assert set(opt.modes().values()) == {"communication-free"}
    _load(model, opt, path)
    _compare(model, ref[4], rank, "after loading on 2 ranks")
    for step in range(5, STEPS):
        _set_grads(model, step, rank)
        opt.step()
        _compare(model, ref[step], rank, f"2 ranks, step {step}")


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
        # square 16 and 32 on both models, two of the four at each world size
        swap = world == 3
        for model_name, block in (
            ("llama-tiny", 32 if swap else 16),
            ("moe-tiny", 16 if swap else 32),
        ):
            ref = refs[model_name, "block", block]
            cases[f"owner {model_name} {block}"] = partial(
                _check_owner, mesh, rank, model_name, block, ref
            )
    if world == 3:  # Shampoo on w1 alone: ranks without its rows own blocks
        ref = refs["llama-tiny", "block", 32, "w1.weight"]
        cases["owner llama-tiny 32, w1 only"] = partial(
            _check_owner, mesh, rank, "llama-tiny", 32, ref, "w1.weight"
        )
    run_cases(cases)


def _refs():
    refs = {(m, "block"): _reference(m, "block") for m in ("llama-tiny", "moe-tiny")}
    refs["llama-tiny", "parameter"] = _reference("llama-tiny", "parameter")
    for m in ("llama-tiny", "moe-tiny"):
        for block in (16, 32):
            refs[m, "block", block] = _reference(m, "block", block, block)
    refs["llama-tiny", "block", 32, "w1.weight"] = _reference(
        "llama-tiny", "block", 32, 32, "w1.weight"
    )
    return refs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shampoo_parity(world):
    spawn(world, _grid, _refs(), timeout=300)


def _one(rank, world, fn, *args):
    fn(init_device_mesh("cpu", (world,)), rank, *args)


def test_shampoo_checkpoint_reshards(tmp_path):
    """Saved on 4 ranks in the owner mode, loaded on 3 (owner), then on 2 in the
    communication-free mode: the reference's numbers throughout."""
    ref = _reference("moe-tiny", "block", SQUARE, SQUARE)
    four, three = str(tmp_path / "four"), str(tmp_path / "three")
    spawn(4, _one, _owner_save, ref, four)
    spawn(3, _one, _owner_reshard, ref, four, three)
    spawn(2, _one, _free_resume, ref, three)


def test_train_shampoo_resumes_bitwise(tmp_path):
    """``train --optim shampoo`` with its flags: a run split by a checkpoint gives the
    uninterrupted losses, preconditioning from step 2 with roots every 2 steps; the
    summary names the mode (moe-tiny's square 16 blocks are whole on 2 ranks at no cost)."""
    from tests.dist.test_train import COMMON, _losses

    argv = [*COMMON[: COMMON.index("--optim")], "--optim", "shampoo", "--no-progress", "--no-plot"]
    argv += ["--shampoo-block-size", "16", "--start-preconditioning-step", "2"]
    argv += ["--precondition-frequency", "2", "--shampoo-root-dtype", "float64"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train_cli([*argv, "--out", str(whole)])
    train_cli([*argv, "--out", str(split), "--ckpt-every", "100", "--stop-after", "3"])
    train_cli([*argv, "--out", str(split), "--ckpt-every", "100", "--resume"])
    assert _losses(whole) == _losses(split)
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["shampoo_mode"] == "communication-free"


def _piece(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` as ``like`` places it (any mesh, any placements)."""
    return ragged_piece(full.shape, like.device_mesh, like.placements).rows(full)


def _check_composed(rank, world, mesh_text, refs):
    """HSDP ``(replicate 2, shard 2)`` and FSDP x EP ``(dp_mod_ep 2, ep 2)``, sharded by
    ``parallelize``: every step equals the reference. Under ``shampoo_block_policy`` with
    no collective in the step (the replicas hold the same rows and step them alike; an
    expert stack's members split by ep are whole matrices); under the default layout in
    the owner mode, with two all-to-alls per shard group (the experts' and the rest's
    under ep), none across the replicate dim."""
    spec = parse_mesh_spec(mesh_text, world)
    mesh = build_mesh(spec)
    for mode, ref in refs.items():
        model = _model("moe-tiny")
        if mode == "communication-free":
            policy = shampoo_block_policy(BLOCK, row_block=ROW)
            parallelize(model, mesh, spec, block_policy=policy)
            opt = _optimizer(model)
        else:
            parallelize(model, mesh, spec)
            opt = _optimizer(model, row=SQUARE, block=SQUARE)
        modes = opt.modes()
        assert set(modes.values()) == {mode}, modes
        for step in range(STEPS):
            for name, p in model.named_parameters():
                local = _piece(gradient(name, p.shape, step), p).clone()
                p.grad = DTensor.from_local(
                    local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            with CommCounter() as comms:
                opt.step()
            got = {k: v.count for k, v in comms.summary().items()}
            want = {} if mode == "communication-free" else {"all_to_all": 2 * len(modes)}
            assert got == want, f"{mesh_text} {mode} step {step}: {comms.summary()}"
            for name, p in model.named_parameters():
                want_p = _piece(ref[step][name], p)
                assert torch.equal(p._local_tensor, want_p), f"{mesh_text} {mode} {step}: {name}"


@pytest.mark.parametrize("mesh_text", ["replicate=2,shard=2", "ep=2"])
def test_shampoo_composes_with_hsdp_and_ep(mesh_text):
    refs = {
        "communication-free": _reference("moe-tiny", "block"),
        "owner": _reference("moe-tiny", "block", SQUARE, SQUARE),
    }
    spawn(4, _check_composed, mesh_text, refs, timeout=300)
