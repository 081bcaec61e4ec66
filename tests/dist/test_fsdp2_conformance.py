"""Where raggedfsdp and torch 2.13's FSDP2 must behave alike, checked in the same ranks
with the same inputs and the same assertion for both:

- ``torch.nn.utils.clip_grad_norm_`` over FSDP x TP parameters (dp 2 x tp 2 on 4 gloo
  ranks): the parameters live on two meshes, the ``(tp, dp)`` mesh and the ``dp`` mesh.
  FSDP2 refuses the call (DTensor's cross-mesh error); raggedfsdp returns the true norm,
  the same on every rank, in either parameter order, equal to one process's and to
  ``raggedfsdp.clip_grad_norm_``'s, and clips by it. Likewise over FSDP x EP (the
  experts on ``(ep, dp_mod_ep)``, the rest on the flattened ``dp`` of both).
- Errors both refuse: FSDP2's exception type, at FSDP2's moment (``fully_shard`` or the
  first forward), matched by the pattern torch's own tests use for FSDP2 (our message
  may add the fix after it); and ``set_all_reduce_hook(stream=)`` on the CPU, where FSDP2
  runs the hook with that stream current.
- ``fully_shard.state(module)``: ``_lazy_init``, ``_is_root`` and the states in order, as
  code written for FSDP2 reads them.
- A composed ``(tp, dp)`` mesh after ``destroy_process_group`` and a new process group in
  the same process (torch reuses the group names): the new groups' ranks, not the old.
"""

from __future__ import annotations

import math
import os
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import raggedfsdp
from raggedfsdp.models.transformer import lm_loss
from tests.harness import run_cases, spawn
from tests.numerics import U, assert_close_to_reference

pytestmark = pytest.mark.numerics
BOTH = {"FSDP2": torch_fsdp.fully_shard, "raggedfsdp": raggedfsdp.fully_shard}
MAX_NORM = 0.05  # below every total here: the gradients are scaled


# ---- clip_grad_norm_ over FSDP x TP ----------------------------------------------------------
def _clip_model(dtype=torch.float32) -> nn.Sequential:
    """A dp-only LayerNorm first (its parameters on the dp mesh), then a column- and a
    row-wise linear (on the (tp, dp) mesh once parallelized)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with torch.no_grad():  # LayerNorm's init is ones and zeros: give it gradients of its own
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.uniform_(-0.5, 0.5)
    return model.to(dtype)


def _clip_input(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(dtype)


def _reference_norm(dtype) -> torch.Tensor:
    model = _clip_model(dtype)
    model(_clip_input(dtype)).square().sum().backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def _sharded_clip_model(fully_shard, mesh) -> nn.Sequential:
    model = _clip_model()
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    for part in (model[1], model[3], model):
        fully_shard(part, mesh=mesh["dp"])
    model(_clip_input()).square().sum().backward()  # every rank the same input
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_clip(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs = _sharded_clip_model(torch_fsdp.fully_shard, mesh)
    for foreach in (None, False):  # FSDP2: the norms' two meshes
        with pytest.raises(RuntimeError, match="must have the same mesh"):
            torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM, foreach=foreach)
    model = _sharded_clip_model(raggedfsdp.fully_shard, mesh)
    for got, want in zip(model.parameters(), theirs.parameters()):
        assert torch.equal(_full(got.grad), _full(want.grad))  # FSDP2's gradients, bit for bit
    one_process = (_reference_norm(torch.float32), _reference_norm(torch.float64))
    _check_torch_clip(model, world, {("dp",), ("tp", "dp")}, one_process)
    # foreach=False takes one norm per tensor, each on its own mesh: torch.stack refuses
    # them, for both, before any gradient changes
    with pytest.raises(RuntimeError, match="must have the same mesh"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=False)


def _check_clip_ep(rank, world):
    """FSDP x EP as torchtitan lays it out: the experts on ``(ep, dp_mod_ep)``, the rest
    on the flattened ``dp`` of all 4 ranks, which spans both of those dims."""
    from tests.dist.test_ep import _data, _model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    model = _model(mesh, raggedfsdp.fully_shard)
    rows = _data()[0][rank : rank + 1]
    lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
    _check_torch_clip(model, world, {("dp",), ("ep", "dp_mod_ep")})


def _check_torch_clip(model, world, meshes, one_process=None):
    """torch's ``clip_grad_norm_`` over ``model``'s parameters, which live on ``meshes``
    (their dim names): in model order and reversed, the total is the same on every
    rank, within its summation's rounding of the float64 norm of the gathered gradients
    (and of ``one_process``'s fp32 and float64 norms, rule 4 of the derived tolerances),
    as ``raggedfsdp.clip_grad_norm_``'s; every gradient is scaled by torch's factor."""
    params = list(model.parameters())
    assert {p.device_mesh.mesh_dim_names for p in params} == meshes
    grads = [_full(p.grad) for p in params]  # gathered before any clipping
    locals_ = [p.grad.to_local().clone() for p in params]
    # The true norm of these gradients: float64 of the gathered values; an fp32 norm of
    # n terms lies within its reduction depth of roundings of it.
    exact = torch.stack([g.double().norm() for g in grads]).norm()
    terms = sum(g.numel() for g in grads)
    floor = 2 * (math.ceil(math.log2(terms)) + world) * U * exact.item()
    totals = {}
    clips = {
        "torch, model order": lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM),
        "torch, reversed": lambda: torch.nn.utils.clip_grad_norm_(params[::-1], MAX_NORM),
        "raggedfsdp": lambda: raggedfsdp.clip_grad_norm_(params, MAX_NORM),
    }
    for name, clip in clips.items():
        with torch.no_grad():
            for p, g in zip(params, locals_):
                p.grad.to_local().copy_(g)
        total = _full(clip()).detach()
        every = [None] * world
        dist.all_gather_object(every, total.item())
        assert len(set(every)) == 1, f"{name}: totals differ between ranks: {every}"
        assert abs(total.item() - exact.item()) <= floor, (name, total.item(), exact.item())
        if one_process is not None:
            assert_close_to_reference(total, *one_process, what=f"{name}: ", terms=terms)
        coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)  # torch's clip, as it computes
        for p, g in zip(params, grads):
            assert torch.equal(_full(p.grad), g * coef), f"{name}: a gradient clipped otherwise"
        totals[name] = total.item()
    assert max(totals.values()) - min(totals.values()) <= 2 * floor, totals


# ---- errors both refuse ----------------------------------------------------------------------
class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scalar_p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.lin(x) * self.scalar_p


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def _meta_nested(fully_shard):
    with torch.device("meta"):
        model = nn.Sequential(_mlp(), _mlp())
    for part in (model[0], model[1], model):
        fully_shard(part)
    return model


def _shared_by_two_groups(fully_shard):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight
    for part in (model[0], model[1], model):
        fully_shard(part)
    return model


def _child_ran_first(fully_shard):
    model = nn.Sequential(_mlp(), _mlp())
    for part in (model[0], model[1], model):
        fully_shard(part)
    model[0](torch.randn(2, 8))  # a child's forward first: it initializes as a root
    return model


def _error_cases(world):
    """(what, shard: fully_shard -> module, the forward's input or None, the moment,
    FSDP2's exception type, the pattern torch's tests match FSDP2's message with)."""
    return [
        (
            "invalid mesh ndim",
            lambda fs: fs(_mlp(), mesh=init_device_mesh("cpu", (world, 1, 1))),
            None,
            "fully_shard",
            ValueError,
            r"fully\_shard expects a 1D or 2D DeviceMesh but got DeviceMesh",
        ),
        (
            "2-D mesh without names",
            lambda fs: fs(_mlp(), mesh=init_device_mesh("cpu", (world // 2, 2))),
            None,
            "fully_shard",
            AssertionError,
            "Please init the 2D mesh for HSDP with mesh_dim_names specified",
        ),
        (
            "non-contiguous parameter",
            lambda fs: fs(nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)),
            None,
            "fully_shard",
            NotImplementedError,
            "FSDP does not support non-contiguous parameters",
        ),
        (
            "scalar parameter",
            lambda fs: fs(_Scalar()),
            None,
            "fully_shard",
            ValueError,
            "Change scalar_p to a 1D tensor with numel equal to 1.",
        ),
        (
            "meta-device init, no to_empty",
            _meta_nested,
            torch.randn(4, 8),
            "forward",
            RuntimeError,
            "FSDP parameters should be materialized from meta device before training, "
            "but the following were still on meta device: "
            r"\['0.0.weight', '0.0.bias', '0.2.weight', '0.2.bias'\]",
        ),
        (
            "invalid shard dim",
            lambda fs: fs(
                nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)),
                shard_placement_fn=lambda p: Shard(1),
            ),
            None,
            "fully_shard",
            AssertionError,
            "Shard dim 1 is invalid for 1D tensor",
        ),
        (
            "a parameter shared by two groups",
            _shared_by_two_groups,
            torch.randn(2, 8),
            "forward",
            ValueError,
            r"Parameter '1.weight' is shared with a parameter already managed by another "
            r"FSDP group. For shared/tied parameters, use fully_shard\(\[module_a, module_b\]\)",
        ),
        (
            "a child ran forward before its root",
            _child_ran_first,
            torch.randn(2, 8),
            "forward",
            RuntimeError,
            "FSDP state has already been lazily initialized for 0\n"
            "FSDP requires running forward through the root module first",
        ),
        (
            "a list of modules as the root",
            lambda fs: (lambda m: (fs([m[0], m[1]]), m)[1])(nn.Sequential(_mlp(), _mlp())),
            torch.randn(2, 8),
            "forward",
            RuntimeError,
            "FSDP requires a single root module but got ",
        ),
        (
            "set_all_reduce_hook(stream=) with HSDP",
            lambda fs: fs(
                _mlp(),
                mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("r", "s")),
            ).set_all_reduce_hook(lambda out: None, stream=torch.cpu.Stream()),
            None,
            "fully_shard",
            ValueError,
            "stream cannot be set when using native HSDP",
        ),
    ]


def _check_error(shard, x, moment, error, pattern):
    """The same assertion for both: ``error`` matching ``pattern``, at ``moment``."""
    for fully_shard in BOTH.values():
        if moment == "fully_shard":
            with pytest.raises(error, match=pattern):
                shard(fully_shard)
            continue
        model = shard(fully_shard)  # accepted: the refusal comes at the first forward
        with pytest.raises(error, match=pattern):
            model(x)


def _check_hook_stream(rank, world):
    """``set_all_reduce_hook(hook, stream=)`` on the CPU: the hook runs with ``stream``
    current (``torch.cpu.current_stream()``), as FSDP2 runs it."""
    for name, fully_shard in BOTH.items():
        model = fully_shard(_mlp())
        stream, seen = torch.cpu.Stream(), []
        model.set_all_reduce_hook(
            lambda out, seen=seen: seen.append(torch.cpu.current_stream()), stream=stream
        )
        model(torch.randn(2, 8)).sum().backward()
        assert seen and all(s is stream for s in seen), (name, seen, stream)
        assert torch.cpu.current_stream() is not stream, name  # only while the hook ran


def _check_state_lookup(rank, world):
    """``fully_shard.state(module)`` as code written for FSDP2 reads it: ``_lazy_init()``
    picks the root, ``_is_root`` says which, ``_state_ctx.all_states`` lists the states in
    module order as the same objects ``fully_shard.state`` returns; a child initialized
    first makes the root's ``_lazy_init()`` raise FSDP2's error."""
    for name, fully_shard in BOTH.items():
        model = nn.Sequential(_mlp(), _mlp())
        for part in (model[0], model[1], model):
            fully_shard(part)
        root, first, second = (fully_shard.state(m) for m in (model, model[0], model[1]))
        assert root._is_root is None, name  # not initialized before the first forward
        root._lazy_init()
        root._lazy_init()  # a no-op once initialized
        assert (root._is_root, first._is_root, second._is_root) == (True, False, False), name
        assert root._state_ctx.all_states == [root, first, second], name
        model(torch.randn(2, 8)).sum().backward()  # trains after an explicit lazy init

        model = nn.Sequential(_mlp(), _mlp())
        for part in (model[0], model[1], model):
            fully_shard(part)
        fully_shard.state(model[0])._lazy_init()
        with pytest.raises(RuntimeError, match="already been lazily initialized for 0\n"):
            fully_shard.state(model)._lazy_init()


def _grid(rank, world):
    cases = {
        "clip_grad_norm_ over FSDP x TP": partial(_check_clip, rank, world),
        "clip_grad_norm_ over FSDP x EP": partial(_check_clip_ep, rank, world),
    }
    for what, shard, x, moment, error, pattern in _error_cases(world):
        cases[f"error: {what}"] = partial(_check_error, shard, x, moment, error, pattern)
    cases["set_all_reduce_hook(stream=) on the CPU"] = partial(_check_hook_stream, rank, world)
    cases["fully_shard.state(module)"] = partial(_check_state_lookup, rank, world)
    run_cases(cases)
    dist.barrier()


def test_against_fsdp2_on_4_ranks():
    spawn(4, _grid, timeout=300)


# ---- composed meshes after a new process group ----------------------------------------------
def _session(rank, world, init_file, grid):
    """One process group: a (dp, tp) mesh laid out as ``grid``, a TP model sharded on it.
    The composed mesh of its parameters is the (tp, dp) grid of this group's ranks, over
    this group's process groups, and gathers the parameters as they were."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=("dp", "tp"))
        model = _clip_model()
        want = [p.detach().clone() for p in model.parameters()]
        parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
        raggedfsdp.fully_shard(model, mesh=mesh["dp"])
        composed = model[1].weight.device_mesh
        assert composed.mesh.tolist() == torch.tensor(grid).T.tolist(), (composed.mesh, grid)
        for dim, name in enumerate(("tp", "dp")):
            assert composed.get_group(dim) is mesh[name].get_group(), name
        for p, w in zip(model.parameters(), want):
            assert torch.equal(p.full_tensor(), w)
    finally:
        dist.destroy_process_group()


def _reinit(rank, world, root):
    _session(rank, world, os.path.join(root, "first"), [[0, 1], [2, 3]])
    _session(rank, world, os.path.join(root, "second"), [[0, 2], [1, 3]])


def test_composed_mesh_after_a_new_process_group():
    with tempfile.TemporaryDirectory() as root:
        spawn(4, _reinit, root, init=False, timeout=120)
