"""The SPMD mesh (``fully_shard(mesh=<whole mesh>, dp_mesh_dims=...)``) on 4 gloo ranks.

A two-layer MLP whose weights are DTensors on the whole mesh (``Replicate()`` on the
data-parallel dims; column- then row-wise ``Shard`` on ``tp``), its batch a DTensor
``Shard(0)`` over the data-parallel dims, on three meshes: 1-D ``(dp 4)``, HSDP ``(rep 2,
dp 2)`` and ``(dp 2, tp 2)``.

- Against torch's FSDP2 in the same mode (AdamW, 3 steps): losses, gradients and
  parameters bit for bit (both reduce each gradient's local tensor with the same divide
  factor: the same arithmetic); also with the batch replicated over the data-parallel
  dims (gradients arrive ``Replicate()`` there, not ``Partial()``), with gradients written
  over the parameters and in a storage of their own.
- Against raggedfsdp's classic mode on the same model (``mesh=mesh['dp']``, TP DTensors on
  ``mesh['tp']``, each rank its slice of the batch): Muon, AdamW8bit and Shampoo (Shampoo
  refuses TP-cut matrices in both modes) give bit-identical parameters: the SPMD model's
  sharded parameters are the classic model's DTensors (``gradient_divide_factor`` 1: the
  SPMD loss is the mean over the global batch, already the data-parallel average).
- A checkpoint saved in SPMD mode on ``(dp 2, tp 2)`` loads into the classic mode on the
  same ranks, into classic 1-D FSDP over 4 ranks, and (another spawn) into SPMD mode on 2
  ranks: every parameter and AdamW moment equal to what was saved.
- A stack of experts on a ``(dp 2, ep 2, tp 2)`` mesh (8 ranks), placed ``Shard(0)`` on ep
  and ``Shard(1)`` on tp: SGD steps bit for bit with FSDP2 (two model dims, which the
  classic mode refuses).
- Bad input: FSDP2's exception types (a plain parameter, a non-``Replicate`` data-parallel
  placement, an unknown dim name, an int ``reshard_after_forward``), and raggedfsdp's
  named refusal of FSDP2's DDP-only mode.
"""

from __future__ import annotations

import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

import raggedfsdp
from raggedfsdp import RaggedShard, checkpoint
from raggedfsdp.optim import AdamW8bit, Muon, Shampoo, shampoo_block_policy
from raggedfsdp.optim.muon import muon_param_groups
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics
WORLD, D, H, B, STEPS = 4, 32, 64, 8, 3
TP_PLACEMENTS = {"0": Shard(0), "2": Shard(1)}  # column-wise, then row-wise


_MESHES: dict[str, tuple] = {}


def _mesh(kind: str):
    """One mesh per kind per process: ``nn.Parameter(DTensor)`` takes its spec from
    DTensor's sharding cache, which answers an equal mesh made earlier, and FSDP2 requires
    the very mesh object it was given."""
    if kind not in _MESHES:
        _MESHES[kind] = _new_mesh(kind)
    return _MESHES[kind]


def _new_mesh(kind: str):
    if kind == "1d":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        return mesh, torch_fsdp.DataParallelMeshDims(shard="dp")
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
        return mesh, torch_fsdp.DataParallelMeshDims(shard="dp", replicate="rep")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh, torch_fsdp.DataParallelMeshDims(shard="dp")


def _dp_names(mesh) -> list[str]:
    return [n for n in mesh.mesh_dim_names if n != "tp"]


def _model(mesh, mode: str) -> nn.Module:
    """The MLP, its weights placed for ``mode``: "spmd" (DTensors on the whole mesh),
    "classic" (TP DTensors on mesh['tp'] where there is one, else plain)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H, bias=False), nn.ReLU(), nn.Linear(H, D, bias=False))
    names = mesh.mesh_dim_names
    for key, tp in TP_PLACEMENTS.items():
        layer = model.get_submodule(key)
        w = layer.weight.detach()
        if mode == "spmd":
            placements = [tp if n == "tp" else Replicate() for n in names]
            layer.weight = nn.Parameter(distribute_tensor(w, mesh, placements))
        elif "tp" in names:
            layer.weight = nn.Parameter(distribute_tensor(w, mesh["tp"], [tp]))
    return model


def _shard(model, mesh, dims, mode: str, fully_shard=raggedfsdp.fully_shard, **kw):
    if mode == "spmd":
        fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims, **kw)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims, **kw)
    else:
        dp = _dp_names(mesh)
        dp_mesh = mesh[tuple(dp)] if len(dp) > 1 else mesh[dp[0]]
        fully_shard(model[0], mesh=dp_mesh, **kw)
        fully_shard(model, mesh=dp_mesh, **kw)
    return model


def _batches() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(STEPS, B, D)


def _loss(model, mesh, x: torch.Tensor, mode: str, batch_sharded: bool = True) -> torch.Tensor:
    """The step's loss on every rank (a plain scalar), backward already run."""
    names, dp = mesh.mesh_dim_names, _dp_names(mesh)
    if mode == "spmd":
        whole = distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)
        if batch_sharded:
            whole = whole.redistribute(mesh, [Shard(0) if n in dp else Replicate() for n in names])
        loss = (model(whole) ** 2).mean().full_tensor()
    else:
        coord = 0
        for n in dp:
            coord = coord * mesh[n].size() + mesh[n].get_local_rank()
        rows = x.chunk(_dp_size(mesh))[coord]
        if "tp" in names:
            rows = distribute_tensor(rows, mesh["tp"], [Replicate()])
        loss = (model(rows) ** 2).mean()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    loss.backward()
    return loss.detach()


def _dp_size(mesh) -> int:
    size = 1
    for n in _dp_names(mesh):
        size *= mesh[n].size()
    return size


def _train(model, mesh, opt, mode: str, batch_sharded: bool = True):
    losses, grads = [], []
    for x in _batches():
        losses.append(_loss(model, mesh, x, mode, batch_sharded))
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return losses, grads, [p.full_tensor() for p in model.parameters()]


def _equal(a, b, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, list):
            _equal(x, y, f"{what}[{i}]")
        else:
            assert torch.equal(x, y), f"{what}[{i}]: largest difference {(x - y).abs().max()}"


# ---- against FSDP2 ---------------------------------------------------------------------------
def _check_against_fsdp2(kind: str, batch_sharded: bool, **ragged_kw) -> None:
    mesh, dims = _mesh(kind)
    runs = []
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        kw = ragged_kw if fully_shard is raggedfsdp.fully_shard else {}
        model = _shard(_model(mesh, "spmd"), mesh, dims, "spmd", fully_shard, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        runs.append(_train(model, mesh, opt, "spmd", batch_sharded))
        if fully_shard is raggedfsdp.fully_shard:
            _check_layout(model, mesh)
    for what, a, b in zip(("losses", "gradients", "parameters"), *runs):
        _equal(a, b, f"{kind} {what}")


def _check_layout(model, mesh) -> None:
    """Sharded: (model dims, [Replicate], RaggedShard); unsharded: the caller's spec."""
    names = mesh.mesh_dim_names
    for key, tp in TP_PLACEMENTS.items():
        w = model.get_submodule(key).weight
        assert isinstance(w.placements[-1], RaggedShard), w.placements
        expected_tp = [tp] if "tp" in names else []
        replicate = [Replicate()] if "rep" in names else []
        assert list(w.placements[:-1]) == expected_tp + replicate, w.placements
    model[0].unshard()
    w = model[0].weight
    assert w.device_mesh == mesh, w.device_mesh
    assert list(w.placements) == [Shard(0) if n == "tp" else Replicate() for n in names]
    model[0].reshard()


# ---- against the classic mode ------------------------------------------------------------------
def _optimizer(name: str, model):
    if name == "muon":
        return Muon(muon_param_groups(model, lr=1e-2), lr=1e-2)
    if name == "adamw8bit":
        return AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1, block_size=32)
    return Shampoo(
        model.parameters(),
        lr=1e-2,
        block_size=16,
        precondition_frequency=1,
        start_preconditioning_step=1,
        use_shampoo=lambda fqn, p: True,
    )


def _check_against_classic(kind: str, optim: str) -> None:
    mesh, dims = _mesh(kind)
    kw = {"block_policy": shampoo_block_policy(16)} if optim == "shampoo" else {}
    runs = []
    for mode in ("spmd", "classic"):
        model = _shard(_model(mesh, mode), mesh, dims, mode, **kw)
        if mode == "spmd":  # the loss is the global batch's mean: see the module docstring
            model.set_gradient_divide_factor(1.0)
        runs.append(_train(model, mesh, _optimizer(optim, model), mode)[1:])
    for what, a, b in zip(("gradients", "parameters"), *runs):
        _equal(a, b, f"{kind} {optim} {what}")


# ---- checkpoints across modes and world sizes ----------------------------------------------------
def _moments(opt) -> list[torch.Tensor]:
    return [
        s[k].full_tensor() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")
    ]


def _check_checkpoint_across_modes(root: str) -> None:
    """Save in SPMD mode on (dp 2, tp 2); load in classic modes on the same 4 ranks."""
    mesh, dims = _mesh("tp")
    model = _shard(_model(mesh, "spmd"), mesh, dims, "spmd")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, mesh, opt, "spmd")
    checkpoint.save(f"{root}/ckpt", model, opt, step=STEPS)
    saved = [p.full_tensor() for p in model.parameters()], _moments(opt)
    if dist.get_rank() == 0:
        torch.save(saved, f"{root}/saved.pt")
    dist.barrier()
    classic_tp = _shard(_model(mesh, "classic"), mesh, dims, "classic")
    mesh4 = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    classic_fsdp = _shard(_model(mesh4, "classic"), mesh4, None, "classic")
    for loaded in (classic_tp, classic_fsdp):
        again = torch.optim.AdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1)
        _train(loaded, mesh if loaded is classic_tp else mesh4, again, "classic")  # has state
        checkpoint.load(f"{root}/ckpt", loaded, again)
        _equal([p.full_tensor() for p in loaded.parameters()], saved[0], "parameters")
        _equal(_moments(again), saved[1], "moments")


def _load_on_2_ranks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    dims = torch_fsdp.DataParallelMeshDims(shard="dp")
    model = _shard(_model(mesh, "spmd"), mesh, dims, "spmd")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, mesh, opt, "spmd")
    checkpoint.load(f"{root}/ckpt", model, opt)
    params, moments = torch.load(f"{root}/saved.pt")
    _equal([p.full_tensor() for p in model.parameters()], params, "parameters")
    _equal(_moments(opt), moments, "moments")


# ---- errors ------------------------------------------------------------------------------------
def _check_errors() -> None:
    mesh, dims = _mesh("tp")

    def both(build, exc, match, **kw):
        for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
            with pytest.raises(exc, match=match):
                fully_shard(build(), mesh=mesh, **kw)

    both(lambda: nn.Linear(4, 4), ValueError, "must be DTensors", dp_mesh_dims=dims)
    sharded_on_dp = lambda: _with_weight(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)] * 2))
    both(sharded_on_dp, ValueError, r"Expected Replicate\(\) on DP", dp_mesh_dims=dims)
    unknown = torch_fsdp.DataParallelMeshDims(shard="nope")
    both(lambda: nn.Linear(4, 4), ValueError, "'nope' not found", dp_mesh_dims=unknown)
    replicated = lambda: _model(mesh, "spmd")
    both(replicated, NotImplementedError, "as int", dp_mesh_dims=dims, reshard_after_forward=2)
    ddp = torch_fsdp.DataParallelMeshDims(replicate="dp")
    with pytest.raises(NotImplementedError, match="DDP mode"):
        raggedfsdp.fully_shard(_model(mesh, "spmd"), mesh=mesh, dp_mesh_dims=ddp)


def _with_weight(w: DTensor) -> nn.Module:
    layer = nn.Linear(4, 4, bias=False)
    layer.weight = nn.Parameter(w)
    return layer


# ---- the grid ----------------------------------------------------------------------------------
def _grid(rank: int, world: int, root: str) -> None:
    cases = {}
    for kind in ("1d", "hsdp", "tp"):
        cases[f"{kind} vs FSDP2"] = partial(_check_against_fsdp2, kind, True)
        for optim in ("muon", "adamw8bit", "shampoo"):
            if not (optim == "shampoo" and kind == "tp"):
                cases[f"{kind} {optim} vs classic"] = partial(_check_against_classic, kind, optim)
    for in_params in (True, False):  # the gradient's own storage, or over the parameter
        cases[f"tp, batch replicated over dp, grads_in_params={in_params}, vs FSDP2"] = partial(
            _check_against_fsdp2, "tp", False, grads_in_params=in_params
        )
    cases["checkpoint across modes"] = partial(_check_checkpoint_across_modes, root)
    cases["errors"] = _check_errors
    run_cases(cases)


def test_spmd_mesh():
    with tempfile.TemporaryDirectory() as root:
        spawn(WORLD, _grid, root)
        spawn(2, _load_on_2_ranks, root)


class _Experts(nn.Module):
    def __init__(self, w: DTensor):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x):
        return (self.w * x).sum()


def _ep_x_tp(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    dims = torch_fsdp.DataParallelMeshDims(shard="dp")
    placements = [Replicate(), Shard(0), Shard(1)]
    runs = []
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        torch.manual_seed(0)
        model = _Experts(distribute_tensor(torch.randn(4, 8, 6), mesh, placements))
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            x = distribute_tensor(torch.randn(4, 8, 6) * (step + 1), mesh, placements)
            loss = model(x).full_tensor()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, [model.w.full_tensor()]))
    _equal(runs[1][0], runs[0][0], "losses")
    _equal(runs[1][1], runs[0][1], "parameters")


def test_spmd_mesh_ep_x_tp():
    spawn(8, _ep_x_tp)
