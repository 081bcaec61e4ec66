"""Muon and AdamW8bit beside tensor and expert parallelism, on 4 gloo ranks.

- Muon, FSDP x TP on a ``(dp 2, tp 2)`` mesh (both catalogue models; the MoE model's
  attention is TP, its experts data-parallel only) and FSDP x EP on ``(dp_mod_ep 2,
  ep 2)``: given one process's gradients, every step's parameters over 6 steps equal
  ``torch.optim.Muon`` on whole matrices (+ ``torch.optim.AdamW``) bit for bit; TP
  matrices cross tp for their Newton-Schulz ([Note: Muon under TP and EP]). Trained on
  data, per-step losses equal one process's for 3 steps within the bound derived from
  that process's own sensitivity ([Note: derived tolerances] in ``tests/numerics.py``):
  TP sums gradients in another order, and the bf16 Newton-Schulz turns those last-bit
  differences into bf16-rounding flips of the update, in the reference too when its
  gradients are nudged; the given-gradient check shows the optimizer itself exact.
- AdamW8bit, FSDP x TP with 32-element blocks: given one process's gradients, codes,
  scales, fp32 moments and parameters are bit-identical to that process's AdamW8bit
  ([Note: 8-bit states under TP and EP]).
- The errors: a tp cut inside a quantization block, and the replicated Muon baseline
  on TP matrices.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

import raggedfsdp
from raggedfsdp.tensor import ragged_piece
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.optim import AdamW8bit, Muon, adamw8bit_block_policy
from raggedfsdp.optim.muon import muon_param_groups
from tests.dist import test_ep as tep
from tests.dist import test_muon as tm
from tests.dist import test_tp as ttp
from tests.dist.test_hsdp_optim import muon_reference_losses
from tests.dist.test_multi_buffer import given_grads_run
from tests.harness import run_cases, spawn
from tests.numerics import assert_losses_match, reference, reference_threads

pytestmark = pytest.mark.numerics
WORLD = 4
LOSS_STEPS = 3  # trained on data
MUON_STEPS = 6  # given the reference's gradients
CASES = [("tp", "llama-tiny"), ("tp", "moe-tiny"), ("ep", "moe-tiny")]
BLOCK = 64  # the row-wise TP pieces below have rows of 64 and 128 elements
ADAM8_STEPS = 3


def _muon(model):
    return Muon(muon_param_groups(model, **tm.ADAMW), **tm.VARIANTS["default"])


def _tp_mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


# ---------------------------------------------------------------------------------------------
# Muon
# ---------------------------------------------------------------------------------------------
def _ep_mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))


def _build(kind, name, mesh):
    if kind == "tp":
        return ttp._model(name, mesh, raggedfsdp.fully_shard)
    return tep._model(mesh, raggedfsdp.fully_shard)


def _check_muon_given_grads(kind, name, history):
    """Step with the reference's gradients; every step's parameters match torch's Muon."""
    mesh = _tp_mesh() if kind == "tp" else _ep_mesh()
    model = _build(kind, name, mesh)
    opt = _muon(model)
    for step, expected in enumerate(history):
        for n, p in model.named_parameters():
            local = _piece(tm._grad(n, p.shape, step), p).clone()
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        opt.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            want = _piece(expected[n], p)
            assert torch.equal(p._local_tensor, want), f"step {step}: {n} differs"
    stats = opt.last_step
    if kind == "tp":  # whole TP matrices crossed tp: every rank rooted some
        assert stats.rooted > 0 and stats.collectives > 0, stats


def _check_muon_losses(kind, name, ref):
    """Trained on data: per-step losses equal one process's."""
    mesh = _tp_mesh() if kind == "tp" else _ep_mesh()
    model = _build(kind, name, mesh)
    opt, losses = _muon(model), []
    for step in range(LOSS_STEPS):
        if kind == "tp":
            batch = ttp._data()[step]
            rows = batch[2 * mesh["dp"].get_local_rank() :][:2]
        else:
            rows = tep._data()[step][dist.get_rank() :][:1]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(float(loss) / WORLD)  # tp ranks hold their dp rank's loss
    tokens = 4 * (rows.shape[1] - 1)  # 4 rows a step: one per dp rank pair (tp), per rank (ep)
    assert_losses_match(losses, ref, world=WORLD, tokens=tokens, what=f"{kind} {name}: ")


# ---------------------------------------------------------------------------------------------
# AdamW8bit, given one process's gradients
# ---------------------------------------------------------------------------------------------
def _adamw8bit(model):
    return AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1, block_size=BLOCK)


def _piece(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local tensor of ``full`` placed like ``like``."""
    return ragged_piece(full.shape, like.device_mesh, like.placements).rows(full)


def _8bit_config(name):
    # ffn 256: w2's row-wise TP pieces have rows of 128 elements, whole 64-element blocks
    return dataclasses.replace(ttp._config(name), ffn_dim=256)


def _8bit_reference(name):
    """One process's AdamW8bit given random gradients (``given_grads_run``)."""
    model = Transformer(_8bit_config(name), max_seq_len=ttp.SEQ, seed=0)
    return given_grads_run(model, _adamw8bit(model), ADAM8_STEPS, seed=3)


def _check_8bit_tp(name, ref):
    grads, states, final = ref
    mesh = _tp_mesh()
    model = Transformer(_8bit_config(name), max_seq_len=ttp.SEQ, seed=0)
    policy = adamw8bit_block_policy(BLOCK)
    for block in model.transformer_blocks():
        ttp.parallelize_module(block, mesh["tp"], ttp._plan(name))
        raggedfsdp.fully_shard(block, mesh=mesh["dp"], block_policy=policy)
    raggedfsdp.fully_shard(model, mesh=mesh["dp"], block_policy=policy)
    opt = _adamw8bit(model)
    rows = ttp._data()[0][:2]
    lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()  # every .grad a view of its storage
    wo = model.layers[0].attention.wo.weight
    assert wo.placements[0] == Shard(1) and opt.is_8bit(wo)
    for step in range(ADAM8_STEPS):
        for n, p in model.named_parameters():
            p.grad._local_tensor.copy_(_piece(grads[step][n], p))
        opt.step()
        for n, p in model.named_parameters():
            for key, theirs in states[step][n].items():
                if key == "step":
                    continue
                ours = opt.state[p][key]
                assert ours.shape == theirs.shape, (n, key, ours.shape, theirs.shape)
                assert torch.equal(ours._local_tensor, _piece(theirs, ours)), (step, n, key)
    assert tuple(opt.state[wo]["exp_avg_scales"].placements[:1]) == (Shard(1),)
    for n, p in model.named_parameters():
        assert torch.equal(p._local_tensor, _piece(final[n], p)), n


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def _check_errors():
    mesh = _tp_mesh()
    model = ttp._model("llama-tiny", mesh, raggedfsdp.fully_shard)
    opt = AdamW8bit(model.parameters(), block_size=256)
    rows = ttp._data()[0][:2]
    lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
    before = [p._local_tensor.clone() for p in model.parameters()]
    runs = r"'attention.wo.weight' of shape \(96, 128\) is placed S\(1\) on mesh dim 'tp'"
    with pytest.raises(ValueError, match=runs + r".*runs of 64.*block_size that divides 64"):
        opt.step()
    assert all(torch.equal(a, p._local_tensor) for a, p in zip(before, model.parameters()))
    wq = model.layers[0].attention.wq.weight
    with pytest.raises(NotImplementedError, match=r"'attention.wq.weight'.*distributed='root'"):
        Muon([{"params": [wq], "use_muon": True}], distributed="replicated")


# ---------------------------------------------------------------------------------------------
def _grid(rank, world, refs):
    cases = {}
    for kind, name in CASES:
        cases[f"muon {kind} {name}"] = partial(
            _check_muon_given_grads, kind, name, refs[kind, name]
        )
        cases[f"muon losses {kind} {name}"] = partial(
            _check_muon_losses, kind, name, refs["losses", kind, name]
        )
    for m in ttp.MODELS:
        cases[f"adamw8bit tp {m}"] = partial(_check_8bit_tp, m, refs["8bit", m])
    cases["errors"] = partial(_check_errors)
    run_cases(cases)


def test_optimizers_beside_tp_and_ep():
    with reference_threads():  # tiny models: one thread is faster
        refs = {}
        for kind, name in CASES:
            unsharded = _build(kind, name, None) if kind == "tp" else tep._model(None, None)
            refs[kind, name] = tm.reference_history(unsharded, "default")[:MUON_STEPS]
            data = (ttp._data() if kind == "tp" else tep._data())[:LOSS_STEPS]

            def run(kind=kind, name=name, data=data):
                unsharded = _build(kind, name, None) if kind == "tp" else tep._model(None, None)
                return muon_reference_losses(unsharded, data)

            refs["losses", kind, name] = reference(run)
        for m in ttp.MODELS:
            refs["8bit", m] = _8bit_reference(m)
    spawn(WORLD, _grid, refs, timeout=600)
