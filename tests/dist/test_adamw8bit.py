"""AdamW8bit on fully_shard: given the same gradients, codes, scales, fp32 moments and
parameters are bit-identical to a single-process AdamW8bit at 1-4 ranks; eligibility
by global size, state bytes, checkpoints across layouts, and the errors.

The single-process reference (plain tensors, the per-parameter path) is computed once
in the pytest process and handed to the ranks (as a file they map: it holds every
step's gradients and states), which inject its gradients step by step.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from raggedfsdp import BlockPolicy, fully_shard, parallelize
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.optim import AdamW8bit, adamw8bit_block_policy
from tests.dist.test_fully_shard import SEQ, _micro_batches
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics

STEPS = 10
MODELS = ["llama-tiny", "moe-tiny"]
# "fused": one lr, two weight decays (the whole-buffer path, decay by runs);
# "per-param": two learning rates (each parameter steps alone over the flat views)
VARIANTS = {"fused": (1e-2, 1e-2), "per-param": (1e-2, 5e-3)}
STATE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


def _groups(model, variant):
    lr_matrix, lr_rest = VARIANTS[variant]
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "lr": lr_matrix},
        {"params": [p for _, p in named if p.dim() < 2], "lr": lr_rest, "weight_decay": 0.0},
    ]


def _optimizer(model, variant):
    return AdamW8bit(_groups(model, variant), lr=1e-2, weight_decay=0.1)


def _snapshot(model, opt):
    """name -> {state key: full tensor} of every parameter's state."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state[p]
        out[name] = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in state.items()
            if k != "step"
        }
    return out


def _reference(model_name: str, variant: str):
    """Per-step gradients and states, final parameters, of one process on plain tensors."""
    model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
    opt = _optimizer(model, variant)
    grads, states = [], []
    for step in range(STEPS):
        ((x, y),) = _micro_batches(step, 1)
        lm_loss(model(x), y).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        states.append(_snapshot(model, opt))
    return grads, states, {n: p.detach().clone() for n, p in model.named_parameters()}


def _shard(model_name, mesh, policy):
    model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
    parallelize(model, mesh, fully_shard=fully_shard, block_policy=policy)
    return model


def _local_view(full: torch.Tensor, like: DTensor, rank: int) -> torch.Tensor:
    return like.placements[0].local_view(full, rank)


def _make_grads(model, rank, world):
    """One real backward, so every ``.grad`` is a view of its flat gradient storage."""
    ((x, y),) = _micro_batches(0, 1, rank, world)
    lm_loss(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


def _set_grads(model, grads, rank):
    for name, p in model.named_parameters():
        p.grad._local_tensor.copy_(_local_view(grads[name], p.grad, rank))


def _assert_state_equal(model, opt, ref_state, rank, where):
    for name, p in model.named_parameters():
        state = opt.state[p]
        keys = STATE_KEYS if "exp_avg_codes" in state else ("exp_avg", "exp_avg_sq")
        assert set(state) - {"step"} == set(keys), (where, name, set(state))
        for key in keys:
            ours = state[key]
            theirs = _local_view(ref_state[name][key], ours, rank)
            assert ours.dtype == theirs.dtype, (where, name, key)
            assert torch.equal(ours._local_tensor, theirs), (where, name, key)


# ---------------------------------------------------------------------------------------------
def _check_parity(mesh, rank, world, model_name, variant, ref):
    grads, states, final = ref
    model = _shard(model_name, mesh, adamw8bit_block_policy())
    opt = _optimizer(model, variant)
    fused = []
    step_buffer = opt._step_buffer
    opt._step_buffer = lambda *a: fused.append(step_buffer(*a)) or fused[-1]
    _make_grads(model, rank, world)
    for step in range(STEPS):
        _set_grads(model, grads[step], rank)
        opt.step()
        _assert_state_equal(model, opt, states[step], rank, f"step {step + 1}")
    assert all(fused) if variant == "fused" else not any(fused), fused
    for name, p in model.named_parameters():
        assert torch.equal(p._local_tensor, _local_view(final[name], p, rank)), name
    # eligibility is global: every parameter of >= 4096 elements is 8-bit on every rank,
    # also where this rank holds fewer than 4096 of its elements (or none)
    small_local_8bit = 0
    for name, p in model.named_parameters():
        state = opt.state[p]
        assert ("exp_avg_codes" in state) == (p.numel() >= 4096), name
        if "exp_avg_codes" not in state:
            assert state["exp_avg"].dtype == torch.float32, name
            continue
        small_local_8bit += p._local_tensor.numel() < 4096
        # state bytes per parameter, global: two 1-byte codes + two fp32 scales per block
        nbytes = sum(state[k].numel() * state[k].element_size() for k in STATE_KEYS)
        assert nbytes / p.numel() <= 2.1, (name, nbytes / p.numel())
        blocks = math.ceil(p.numel() / p.shape[0] / 256) * p.shape[0] if p.dim() >= 3 else None
        assert state["exp_avg_scales"].numel() == (blocks or math.ceil(p.numel() / 256)), name
    if world >= 3:
        assert small_local_8bit > 0  # the case torchao gets wrong is covered


def _check_errors(mesh, rank, world):
    # rows-1 blocks cut a (96, 96) matrix every 96 elements: not at 256-element blocks
    model = _shard("llama-tiny", mesh, BlockPolicy(rows=1))
    opt = AdamW8bit(model.parameters())
    _make_grads(model, rank, world)
    with pytest.raises(ValueError, match="quantization block does not divide its RaggedShard"):
        opt.step()
    # FSDP2's Shard(0) placement
    plain = Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0)
    torch_fully_shard(plain, mesh=mesh)
    opt = AdamW8bit(plain.parameters())
    ((x, y),) = _micro_batches(0, 1, rank, world)
    lm_loss(plain(x), y).backward()
    with pytest.raises(NotImplementedError, match=r"placements \(Shard\(dim=0\),\)"):
        opt.step()


def _doubled_rows(fqn, param):
    """A different layout with the same alignment: twice the rows where they divide."""
    rows = adamw8bit_block_policy()(fqn, param)
    member_rows = param.numel() // param.shape[-1] // (param.shape[0] if param.dim() >= 3 else 1)
    if rows != "whole" and param.dim() >= 2 and member_rows % (2 * rows) == 0:
        return 2 * rows
    return rows


def _check_checkpoint(mesh, rank, world, path, ref):
    """Save at one layout, load into another (DCP reshards codes and scales), step on."""
    grads, states, _ = ref
    saved = _shard("moe-tiny", mesh, adamw8bit_block_policy())
    opt = _optimizer(saved, "fused")
    _make_grads(saved, rank, world)
    for step in range(3):
        _set_grads(saved, grads[step], rank)
        opt.step()
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)

    loaded = _shard("moe-tiny", mesh, _doubled_rows)
    for name, p in saved.named_parameters():  # the same parameters, another layout
        q = loaded.get_parameter(name)
        q._local_tensor.copy_(_local_view(p.full_tensor(), q, rank))
    opt2 = _optimizer(loaded, "fused")
    _make_grads(loaded, rank, world)
    for g in opt2.param_groups:  # create the states as torch's DCP helpers do: lr 0
        g["lr"], g["saved_lr"] = 0.0, g["lr"]
    opt2.step()
    for g in opt2.param_groups:
        g["lr"] = g.pop("saved_lr")
    template = {"optim": opt2.state_dict()}
    dcp.load(template, checkpoint_id=path)
    opt2.load_state_dict(template["optim"])
    assert any(
        p.placements != loaded.get_parameter(n).placements for n, p in saved.named_parameters()
    ), "the second layout should differ"
    _assert_state_equal(loaded, opt2, states[2], rank, "loaded")
    _set_grads(loaded, grads[3], rank)
    opt2.step()
    _assert_state_equal(loaded, opt2, states[3], rank, "a step after loading")


def _grid(rank, world, ref_file, path):
    refs = torch.load(ref_file, mmap=True)
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        f"{m} {v}": partial(_check_parity, mesh, rank, world, m, v, refs[m, v])
        for m in MODELS
        for v in VARIANTS
    }
    if world in (2, 3):
        cases["errors"] = partial(_check_errors, mesh, rank, world)
        cases["checkpoint"] = partial(
            _check_checkpoint, mesh, rank, world, path, refs["moe-tiny", "fused"]
        )
    run_cases(cases)
    dist.barrier()


@pytest.fixture(scope="module")
def ref_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("adamw8bit") / "reference.pt"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and immune to a busy machine
    try:
        refs = {(m, v): _reference(m, v) for m in MODELS for v in VARIANTS}
    finally:
        torch.set_num_threads(threads)
    torch.save(refs, path)
    return str(path)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_adamw8bit_parity(world, ref_file, tmp_path):
    spawn(world, _grid, ref_file, str(tmp_path / "ckpt"), timeout=300)
