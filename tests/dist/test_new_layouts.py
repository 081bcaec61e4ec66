"""Muon, AdamW8bit, checkpoints and gradient clipping on the layouts ``fully_shard`` makes
beyond one buffer of one dtype on one mesh, each against one process given the same
gradients (bit for bit: the same element-wise ops and the same Newton-Schulz on the same
whole matrices, [Note: derived tolerances] rule 1 in ``tests/numerics.py``):

- **mixed**: a group holding a frozen bf16 layer beside fp32 ones (one buffer per dtype);
- **ep**: experts on an expert-data-parallel mesh of their own through
  ``shard_placement_fn`` returning torch's ``ShardPlacementResult`` (EP 2 on 4 ranks);
- **uneven tp**: a (27, 9) weight column-parallel over 2 tp ranks (pieces of 14 and 13
  rows) on a ``(dp 2, tp 2)`` mesh. Muon refuses that matrix by name (its tp stage
  gathers equal pieces), so here its AdamW part steps it and Muon the other matrix;
- **shard1**: ``Shard(1)`` and ``Shard(-1)`` from ``shard_placement_fn`` (laid out as
  dim-0 rows).

For each layout and each optimizer, three spawns:

    spawn(4)   the layout: ``STEPS`` steps given one process's gradients, parameters and
               every optimizer state equal to that process's after each step; save
    spawn(2)   a plain 1-D FSDP layout at 2 ranks loads it (every tensor equal), steps
               once more (equal), saves
    spawn(4)   the layout loads that back (every tensor equal) and steps once more (equal)

The first spawn also clips a group of bf16 and fp32 gradients with
``raggedfsdp.fsdp.clip_grad_norm_``: the total norm and the clipped gradients lie no
further from the float64 value than ``MULTIPLE`` times torch's ``clip_grad_norm_`` on one
process (rule 4 of the Note).
"""

from __future__ import annotations

import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import raggedfsdp
from raggedfsdp import checkpoint
from raggedfsdp.tensor import ragged_piece
from raggedfsdp.fsdp import buffers_of, clip_grad_norm_
from raggedfsdp.models.transformer import expert_parallel, lm_loss
from raggedfsdp.optim import AdamW8bit, Muon, adamw8bit_block_policy, muon_param_groups
from raggedfsdp.optim.muon import default_use_muon
from tests.dist import test_ep, test_meshes
from tests.dist import test_muon as tm
from tests.harness import run_cases, spawn
from tests.numerics import assert_close_to_reference, reference_threads

pytestmark = pytest.mark.numerics
WORLD, PLAIN_WORLD = 4, 2
STEPS = 2  # in the layout before saving; then one in the plain layout, one back
TOTAL = STEPS + 2
LAYOUTS = ("mixed", "ep", "uneven tp", "shard1")
OPTIMS = ("muon", "adamw8bit")
# AdamW8bit's (block_size, min_8bit_size) per layout: small enough that the small models'
# matrices are 8-bit, and whole quantization blocks in every tp piece (rows of 9 and 27)
EIGHT_BIT = {"mixed": (16, 256), "ep": (256, 4096), "uneven tp": (9, 100), "shard1": (16, 256)}


# ---- the models --------------------------------------------------------------------------------
class _Mlp(nn.Module):
    """A bf16 input layer (frozen, or trainable) beside two fp32 layers."""

    def __init__(self, base_dtype=torch.bfloat16, frozen=True):
        super().__init__()
        torch.manual_seed(7)
        self.base = nn.Linear(16, 32).to(base_dtype)
        self.base.requires_grad_(not frozen)
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(48, 16)

    def forward(self, x):
        h = self.base(x.to(self.base.weight.dtype)).float()
        return self.b(torch.tanh(self.a(h)))


def _unsharded(layout):
    if layout == "mixed":
        return _Mlp()
    if layout == "shard1":
        return _Mlp(torch.float32, frozen=False)
    if layout == "ep":
        return test_ep._model(None, None)
    return test_meshes._Uneven()


def _policy(layout, optim):
    if optim != "adamw8bit":
        return None
    block, smallest = EIGHT_BIT[layout]
    return adamw8bit_block_policy(block, min_8bit_size=smallest)


def _shard1_placement(p, names):
    """``Shard(1)`` / ``Shard(-1)`` for the two fp32 matrices, FSDP2's default otherwise."""
    return {"a.weight": Shard(1), "b.weight": Shard(-1)}.get(names[p])


def _layout(layout, optim):
    """The model in ``layout`` on ``WORLD`` ranks."""
    model = _unsharded(layout)
    policy = _policy(layout, optim)
    if layout == "mixed":
        raggedfsdp.fully_shard(model, block_policy=policy)
        dtypes = sorted(str(v.dtype) for v in buffers_of(model))
        assert dtypes == ["torch.bfloat16", "torch.float32"], dtypes
    elif layout == "shard1":
        names = {p: n for n, p in model.named_parameters()}
        raggedfsdp.fully_shard(
            model, block_policy=policy, shard_placement_fn=partial(_shard1_placement, names=names)
        )
    elif layout == "ep":
        world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
        sparse = world._unflatten(0, (2, 2), ("efsdp", "ep"))
        dp_info = FSDPMeshInfo(world, shard_mesh_dim=0)
        edp_info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
        for block in model.transformer_blocks():
            if not block.is_moe:
                raggedfsdp.fully_shard(block, mesh=world, block_policy=policy)
                continue
            expert_parallel(block.moe, sparse["ep"])
            experts = set(block.moe.experts.parameters())

            def placement(p, experts=experts):
                info = edp_info if p in experts else dp_info
                return ShardPlacementResult(placement=Shard(0), mesh_info=info)

            raggedfsdp.fully_shard(
                block, mesh=world, block_policy=policy, shard_placement_fn=placement
            )
            sizes = sorted(v.world_size for v in buffers_of(block))
            assert sizes[0] == 2 and sizes[-1] == WORLD, sizes
        raggedfsdp.fully_shard(model, mesh=world, block_policy=policy)
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"up": ColwiseParallel(output_layouts=Replicate())}
        parallelize_module(model, mesh["tp"], plan)
        raggedfsdp.fully_shard(model, mesh=mesh["dp"], block_policy=policy)
        w = model.up.weight
        assert w.placements[0] == Shard(0) and w.device_mesh.size(0) == 2
    return model


def _plain(layout, optim):
    """The same parameters in a plain 1-D FSDP layout on ``PLAIN_WORLD`` ranks: every group
    one dtype on one mesh, no tp, no ep, no ``shard_placement_fn``."""
    model = _unsharded(layout)
    policy = _policy(layout, optim)
    mesh = init_device_mesh("cpu", (PLAIN_WORLD,))
    if layout == "ep":
        for block in model.transformer_blocks():
            raggedfsdp.fully_shard(block, mesh=mesh, block_policy=policy)
    elif layout == "mixed":
        for part in (model.base, model.a, model.b):
            raggedfsdp.fully_shard(part, mesh=mesh, block_policy=policy)
    return raggedfsdp.fully_shard(model, mesh=mesh, block_policy=policy)


def _backward(layout, model, rank, world):
    """One backward, so every trainable ``.grad`` is its view of the gradient storage."""
    if layout == "ep":
        rows = test_ep._data()[0][rank:][:1]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
    else:
        x = torch.randn(world, 9 if layout == "uneven tp" else 16)
        loss = model(x[rank : rank + 1]).square().mean()
    loss.backward()


def _use_muon(layout):
    """Muon's matrices: the default split, less the unevenly tp-cut matrix, which Muon
    refuses (``_check_uneven_tp_refused``) and its AdamW part steps here."""
    if layout == "uneven tp":
        return lambda n, p: default_use_muon(n, p) and n != "up.weight"
    return default_use_muon


def _optimizer(optim, model, layout):
    if optim == "muon":
        groups = muon_param_groups(model, use_muon=_use_muon(layout), **tm.ADAMW)
        return Muon(groups, **tm.VARIANTS["default"])
    block, smallest = EIGHT_BIT[layout]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return AdamW8bit(trainable, lr=1e-2, weight_decay=0.1, block_size=block, min_8bit_size=smallest)


# ---- the one-process reference -----------------------------------------------------------------
def _reference(layout, optim):
    """Every step's full parameters and optimizer states (fqn -> {key: tensor}) of one
    process given ``tm._grad``'s gradients: torch's Muon on every matrix (each member of a
    stack apart) and torch's AdamW on the rest, or AdamW8bit on plain tensors."""
    model = _unsharded(layout)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if optim == "adamw8bit":
        opt = _optimizer(optim, model, layout)
        matrices = {}
    else:
        matrices = {
            n: [nn.Parameter(m.detach().clone()) for m in (p.unbind(0) if p.dim() == 3 else [p])]
            for n, p in named.items()
            if _use_muon(layout)(n, p)
        }
        muon = torch.optim.Muon(
            [m for ms in matrices.values() for m in ms], **tm.VARIANTS["default"]
        )
        others = [p for n, p in named.items() if n not in matrices]
        adamw = torch.optim.AdamW(others, foreach=False, **tm.ADAMW)
    history = []
    for step in range(TOTAL):
        for n, p in named.items():
            g = tm._grad(n, p.shape, step)
            if n in matrices:
                for m, gm in zip(matrices[n], g if p.dim() == 3 else [g]):
                    m.grad = gm.clone()
            else:
                p.grad = g
        if optim == "adamw8bit":
            opt.step()
        else:
            muon.step()
            adamw.step()
        states = {}
        with torch.no_grad():
            for n, ms in matrices.items():
                named[n].copy_(torch.stack([m.detach() for m in ms]).view(named[n].shape))
                mom = torch.stack([muon.state[m]["momentum_buffer"] for m in ms])
                states[n] = {"momentum_buffer": mom.view(named[n].shape).clone()}
        state_of = opt.state if optim == "adamw8bit" else adamw.state
        for n, p in named.items():
            if n not in matrices:
                states[n] = {k: v.clone() for k, v in state_of[p].items() if k != "step"}
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        history.append({"params": params, "states": states})
    return history


# ---- the checks --------------------------------------------------------------------------------
def _piece(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's local tensor of ``full`` placed like ``like`` (a DTensor)."""
    return ragged_piece(full.shape, like.device_mesh, like.placements).rows(full)


def _assert_equal(model, opt, expected, where):
    """Every parameter and optimizer state equals the reference's, bit for bit."""
    for n, p in model.named_parameters():
        want = expected["params"][n]
        assert p.dtype == want.dtype and torch.equal(p._local_tensor, _piece(want, p)), (where, n)
        state = {k: v for k, v in opt.state.get(p, {}).items() if k != "step"}
        theirs = expected["states"].get(n, {})
        assert state.keys() == theirs.keys(), (where, n, sorted(state), sorted(theirs))
        for key, ours in state.items():
            assert ours.shape == theirs[key].shape, (where, n, key, ours.shape)
            got = ours._local_tensor if isinstance(ours, DTensor) else ours
            want = _piece(theirs[key], ours) if isinstance(ours, DTensor) else theirs[key]
            assert got.dtype == want.dtype and torch.equal(got, want), (where, n, key)


def _step(model, opt, step, where, ref):
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.grad._local_tensor.copy_(_piece(tm._grad(n, p.shape, step), p))
    opt.step()
    _assert_equal(model, opt, ref[step], f"{where} step {step}")


def _check_layout(layout, optim, ref, root, rank):
    """STEPS steps in the layout, each equal to one process's; save."""
    model = _layout(layout, optim)
    opt = _optimizer(optim, model, layout)
    _backward(layout, model, rank, WORLD)
    if optim == "adamw8bit":
        assert any(opt.is_8bit(p) for p in model.parameters() if p.requires_grad)
    if layout == "uneven tp" and optim == "muon":
        _check_uneven_tp_refused(model)
    for step in range(STEPS):
        _step(model, opt, step, layout, ref)
    checkpoint.save(f"{root}/{layout}-{optim}", model, opt, step=STEPS)


def _check_uneven_tp_refused(model):
    """Muon's tp stage gathers equal pieces: a matrix cut unevenly by tp is refused."""
    with pytest.raises(NotImplementedError, match=r"'up.weight'.*dim 0 of size 27 is cut unev"):
        Muon(muon_param_groups(model), **tm.VARIANTS["default"])


def _check_plain(layout, optim, ref, root, rank):
    """The layout's checkpoint into a plain 1-D layout at another world size; one step."""
    model = _plain(layout, optim)
    opt = _optimizer(optim, model, layout)
    step, _ = checkpoint.load(f"{root}/{layout}-{optim}", model, opt)
    assert step == STEPS
    _assert_equal(model, opt, ref[STEPS - 1], f"{layout} -> plain")
    _backward(layout, model, rank, PLAIN_WORLD)
    _step(model, opt, STEPS, f"{layout} -> plain", ref)
    checkpoint.save(f"{root}/{layout}-{optim}-plain", model, opt, step=STEPS + 1)


def _check_back(layout, optim, ref, root, rank):
    """The plain layout's checkpoint back into the layout; one step."""
    model = _layout(layout, optim)
    opt = _optimizer(optim, model, layout)
    step, _ = checkpoint.load(f"{root}/{layout}-{optim}-plain", model, opt)
    assert step == STEPS + 1
    _assert_equal(model, opt, ref[STEPS], f"plain -> {layout}")
    _backward(layout, model, rank, WORLD)
    _step(model, opt, STEPS + 1, f"plain -> {layout}", ref)


# ---- clip_grad_norm_ on a group of two dtypes --------------------------------------------------
MAX_NORM = 1.0


def _clip_grads(model):
    return {n: tm._grad(n, p.shape, 0).to(p.dtype) for n, p in model.named_parameters()}


def _clip_reference():
    """torch's ``clip_grad_norm_`` on one process: as the model is (fp32 and bf16), and
    every tensor in float64 (the exact value, to fp32's eyes)."""
    out = {}
    for name, dtype in (("fp", None), ("64", torch.float64)):
        model = _Mlp(frozen=False)
        if dtype is not None:
            model = model.to(dtype)
        for n, p in model.named_parameters():
            p.grad = _clip_grads(_Mlp(frozen=False))[n].to(p.dtype)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        out[name] = (total, {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def _check_clip(ref, rank):
    model = _Mlp(frozen=False)
    raggedfsdp.fully_shard(model)
    assert len({v.dtype for v in buffers_of(model)}) == 2
    _backward("mixed", model, rank, WORLD)
    grads = _clip_grads(model)
    for n, p in model.named_parameters():
        p.grad._local_tensor.copy_(_piece(grads[n], p))
    total = clip_grad_norm_(model.parameters(), MAX_NORM)
    (want, want_grads), (want64, want64_grads) = ref["fp"], ref["64"]
    terms = sum(p.numel() for p in model.parameters())
    assert_close_to_reference(total, want, want64, "total norm: ", terms=terms)
    assert want > 2 * MAX_NORM  # the gradients are scaled
    for dtype in (torch.bfloat16, torch.float32):
        names = [n for n, p in model.named_parameters() if p.dtype == dtype]
        got = torch.cat([model.get_parameter(n).grad.full_tensor().flatten() for n in names])
        fp = torch.cat([want_grads[n].flatten() for n in names])
        f64 = torch.cat([want64_grads[n].flatten() for n in names])
        assert_close_to_reference(got, fp, f64, f"clipped {dtype} grads: ")


# ---- the spawns --------------------------------------------------------------------------------
def _cases(check, refs, root, rank, extra=None):
    cases = {
        f"{layout} {optim}": partial(check, layout, optim, refs[layout, optim], root, rank)
        for layout in LAYOUTS
        for optim in OPTIMS
    }
    run_cases({**cases, **(extra or {})})
    dist.barrier()


def _layouts(rank, world, refs, root):
    _cases(_check_layout, refs, root, rank, {"clip": partial(_check_clip, refs["clip"], rank)})


def _plains(rank, world, refs, root):
    _cases(_check_plain, refs, root, rank)


def _backs(rank, world, refs, root):
    _cases(_check_back, refs, root, rank)


def test_optimizers_and_checkpoints_on_new_layouts():
    with reference_threads():
        refs = {(lo, o): _reference(lo, o) for lo in LAYOUTS for o in OPTIMS}
        refs["clip"] = _clip_reference()
    with tempfile.TemporaryDirectory() as root:
        spawn(WORLD, _layouts, refs, root, timeout=150)
        spawn(PLAIN_WORLD, _plains, refs, root, timeout=150)
        spawn(WORLD, _backs, refs, root, timeout=150)
