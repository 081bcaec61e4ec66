"""PyTorch Lightning 2.6's ``ModelParallelStrategy`` on raggedfsdp, against FSDP2.

Lightning's recipe for FSDP2, as its documentation gives it: the user's parallelize
function (Fabric's ``parallelize_fn``, the Trainer's ``LightningModule.configure_model``)
applies tensor parallelism over the strategy's ``"tensor_parallel"`` mesh dimension and
``fully_shard`` over its ``"data_parallel"`` one, each feed-forward block then the root.
The two runs differ in one line of the user's code, the import of ``fully_shard``: torch's
(``from torch.distributed.fsdp import fully_shard``) or raggedfsdp's (``from raggedfsdp
import fully_shard``); here the parallelize function receives the one it was "imported"
with. Lightning's own defaults otherwise: fp32 (``"32-true"``), the model built on the
CPU before it is parallelized (no ``empty_init``), distributed (sharded) checkpoints.

On 4 gloo ranks, one spawn, for each of FSDP (data parallel 4) and FSDP x TP (data
parallel 2 x tensor parallel 2):

- **Fabric**: ``fabric.setup`` / ``setup_optimizers``, ``fabric.backward`` over two
  micro-batches a step, the first under ``fabric.no_backward_sync`` (the strategy's
  ``set_requires_gradient_sync(False, recurse=False)`` on every FSDP module),
  ``fabric.clip_gradients(max_norm=...)`` (``torch.nn.utils.clip_grad_norm_`` over the
  sharded gradients), SGD with momentum, ``fabric.save`` after step 2 (a distributed
  checkpoint: model, optimizer and a step counter); then a second model, initialised
  from another seed, ``fabric.load``s it and trains steps 3 and 4 again; raggedfsdp's run
  also resumes so from FSDP2's checkpoint.
- **Fabric, meta init**: the same, each model built under
  ``fabric.init_module(empty_init=True)`` (Lightning's ``setup`` materialises it:
  ``to_empty`` on the root, ``reset_parameters`` on every submodule, after
  ``fully_shard``), the first loaded with ``fabric.load_raw`` from a full state dict
  file (``set_model_state_dict`` with ``broadcast_from_rank0``, submodule by submodule).
- **Trainer**: ``Trainer(strategy=ModelParallelStrategy(...), gradient_clip_val=...)``
  for two epochs of two steps, ``ModelCheckpoint`` saving at each epoch's end; then a
  second ``Trainer.fit(ckpt_path=<epoch 0's checkpoint>)`` trains epoch 1 again;
  raggedfsdp's run also from FSDP2's epoch 0 checkpoint.

And **clipping over two meshes** (Fabric, FSDP x TP, a final ``LayerNorm`` outside the
TP plan, so its parameters lie on the data-parallel mesh alone): FSDP2 refuses
``fabric.clip_gradients`` there (RuntimeError "must have the same mesh"); raggedfsdp
must return the true total norm (against the full gradients' norm, as
``assert_close_to_reference`` bounds it), the same on every rank, and scale every
gradient by one factor.

Checked, per configuration: the losses (and Fabric's gradient norms, the values
``clip_gradients`` returns) of the uninterrupted run and of the resumed ones (raggedfsdp's
from its own checkpoint and from FSDP2's), and the final parameters, lie within the bound
derived from FSDP2's own run nudged on the same ranks ([Note: derived tolerances] in
``tests/numerics.py``); each backend's resumed losses equal its uninterrupted ones
bitwise (the checkpoint round trip is exact); clipping bound (FSDP2's first gradient norm
exceeds ``MAX_NORM``) and the loss on the last batch fell from the epoch before.

Set up by hand, and why: Lightning starts its own processes unless the cluster
environment says they exist; the test exports ``LOCAL_RANK`` (and the other variables a
launcher sets), so ``LightningEnvironment`` reports processes created externally, and
Lightning skips its process-group initialisation because the suite's harness
(``tests/harness.py``) has already started gloo (its own branch: "already initialized").
Nothing else is patched.
"""

from __future__ import annotations

import importlib.util
import os
from functools import partial

import pytest

from tests.harness import run_cases, spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="lightning is not installed: `make test-clients` installs the clients extra",
)

WORLD = 4
DIM, HIDDEN, BLOCKS = 16, 32, 2
ROWS = 4  # per data-parallel rank and step
STEPS = 4  # two epochs of two steps; the checkpoint after step 2
SAVE_AT = 2
LR = 0.2
MAX_NORM = 0.5
MESHES = {"fsdp": (4, 1), "fsdp_x_tp": (2, 2)}  # (data parallel, tensor parallel)


# ---- the user's model and parallelize function ----------------------------------------------
def _model(seed: int, final_norm: bool = False):
    """Lightning's tensor-parallel example (a SwiGLU feed-forward), two blocks with
    residuals, built on the CPU from ``seed``; with ``final_norm``, a ``LayerNorm`` after
    them (outside the TP plan: its parameters stay on the data-parallel mesh alone)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
            self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
            self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(FeedForward() for _ in range(BLOCKS))
            self.norm = nn.LayerNorm(DIM) if final_norm else nn.Identity()

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return self.norm(x)

    torch.manual_seed(seed)
    return Model()


def _parallelize(model, device_mesh, fully_shard):
    """The user's function: TP over ``"tensor_parallel"``, then FSDP over
    ``"data_parallel"`` (``fully_shard`` is the one the user imported)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    if tp_mesh.size() > 1:
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, tp_mesh, plan)
    if dp_mesh.size() > 1:
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def _data():
    """(x, y): STEPS // 2 batches per epoch of ``dp * ROWS`` rows, the same each epoch."""
    import torch

    gen = torch.Generator().manual_seed(5)
    rows = 4 * ROWS * (STEPS // 2)  # the largest data-parallel size, 4
    x = torch.randn(rows, DIM, generator=gen)
    y = -x  # learnable: each block learns to take x away
    return x, y


def _global_mean(value) -> float:
    import torch.distributed as dist

    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _full_params(model) -> dict:
    return {k: v.detach().full_tensor() for k, v in model.named_parameters()}


# ---- Fabric ---------------------------------------------------------------------------------
def _fabric(
    fully_shard, dp: int, tp: int, folder: str, other: str | None = None, empty_init=False
) -> dict:
    """Train, save after ``SAVE_AT`` steps, resume from there; with ``other`` (a folder of
    another backend's run), resume from its checkpoint too (``"resumed_from_other"``).
    With ``empty_init``, every model is built on ``meta`` (``init_module(empty_init=True)``),
    materialised by ``fabric.setup`` and the first one loaded from a full state dict file
    (``fabric.load_raw``)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    strategy = ModelParallelStrategy(
        parallelize_fn=partial(_parallelize, fully_shard=fully_shard),
        data_parallel_size=dp,
        tensor_parallel_size=tp,
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    dp_rank = strategy.device_mesh["data_parallel"].get_local_rank()
    x, y = _data()
    x, y = (t.view(STEPS // 2, 4, ROWS, DIM)[:, dp_rank] for t in (x, y))
    batches = list(zip(x, y)) * 2  # two epochs of the same batches

    raw = os.path.join(folder, "model.pt")  # the full initial weights, for load_raw
    if empty_init and dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        torch.save(_model(0).state_dict(), raw)
    dist.barrier()

    def setup(seed):
        with fabric.init_module(empty_init=empty_init):
            model = _model(seed)
        assert all(p.is_meta for p in model.parameters()) == empty_init
        model = fabric.setup(model)
        if empty_init and seed == 0:
            fabric.load_raw(raw, model)
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        return model, opt

    def train(model, opt, steps, save=None):
        losses, norms = [], []
        for step in steps:
            bx, by = batches[step]
            half = ROWS // 2  # two micro-batches, the first without gradient sync
            with fabric.no_backward_sync(model):
                first = F.mse_loss(model(bx[:half]), by[:half]) / 2
                fabric.backward(first)
            second = F.mse_loss(model(bx[half:]), by[half:]) / 2
            fabric.backward(second)
            loss = first.detach() + second.detach()
            norm = fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
            opt.step()
            opt.zero_grad()
            losses.append(_global_mean(loss))
            norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
            if save is not None and step + 1 == SAVE_AT:
                fabric.save(save, {"model": model, "optimizer": opt, "step": step + 1})
        return losses, norms

    path = os.path.join(folder, "fabric.ckpt")
    model, opt = setup(seed=0)
    losses, norms = train(model, opt, range(STEPS), save=path)
    params = _full_params(model)

    def resume(path):
        model, opt = setup(seed=1)  # other weights: the load must replace them
        state = {"model": model, "optimizer": opt, "step": 0}
        fabric.load(path, state)
        assert state["step"] == SAVE_AT, state["step"]
        return train(model, opt, range(SAVE_AT, STEPS))[0]

    out = {"loss": losses, "grad_norm": norms, "resumed": resume(path), "params": params}
    if other is not None:
        out["resumed_from_other"] = resume(os.path.join(other, "fabric.ckpt"))
    return out


# ---- Trainer --------------------------------------------------------------------------------
def _trainer(fully_shard, dp: int, tp: int, folder: str, other: str | None = None) -> dict:
    """As ``_fabric``, through ``Trainer.fit`` and its ``ModelCheckpoint``."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class LitModel(L.LightningModule):
        def __init__(self, seed):
            super().__init__()
            self.model = _model(seed)
            self.losses: list[float] = []

        def configure_model(self):
            _parallelize(self.model, self.device_mesh, fully_shard)

        def training_step(self, batch, batch_idx):
            bx, by = batch
            loss = F.mse_loss(self.model(bx), by)
            self.losses.append(_global_mean(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    x, y = _data()
    rows = dp * ROWS * (STEPS // 2)
    data = DataLoader(TensorDataset(x[:rows], y[:rows]), batch_size=ROWS)

    def fit(seed, ckpt_path=None):
        checkpoints = ModelCheckpoint(
            dirpath=folder, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
            max_epochs=STEPS // 2,
            gradient_clip_val=MAX_NORM,
            callbacks=[checkpoints],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=folder,
        )
        lit = LitModel(seed)
        trainer.fit(lit, train_dataloaders=data, ckpt_path=ckpt_path)
        assert trainer.global_step == STEPS, trainer.global_step
        return lit

    lit = fit(seed=0)
    params = _full_params(lit.model)
    first_epoch = f"epoch=0-step={SAVE_AT}.ckpt"  # distributed: a folder
    assert os.path.isdir(os.path.join(folder, first_epoch)), sorted(os.listdir(folder))
    resumed = fit(seed=1, ckpt_path=os.path.join(folder, first_epoch))
    out = {"loss": lit.losses, "resumed": resumed.losses, "params": params}
    if other is not None:
        out["resumed_from_other"] = fit(seed=1, ckpt_path=os.path.join(other, first_epoch)).losses
    return out


# ---- clipping over two meshes ---------------------------------------------------------------
def _fabric_clip_two_meshes(folder: str) -> None:
    """FSDP x TP with a final norm outside the TP plan: the blocks' parameters live on the
    (data parallel, tensor parallel) mesh, the norm's on the data-parallel one alone.
    FSDP2 refuses ``fabric.clip_gradients`` there (``torch.nn.utils.clip_grad_norm_``
    stacks the per-parameter norms: "must have the same mesh"); raggedfsdp returns the
    true total norm, the same on every rank, and scales every gradient by one factor."""
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp as torch_fsdp
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    import raggedfsdp
    from tests.numerics import U, assert_close_to_reference

    dp, tp = MESHES["fsdp_x_tp"]
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        strategy = ModelParallelStrategy(
            parallelize_fn=partial(_parallelize, fully_shard=fully_shard),
            data_parallel_size=dp,
            tensor_parallel_size=tp,
        )
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
        fabric.launch()
        model = fabric.setup(_model(0, final_norm=True))
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
        meshes = {p.device_mesh.ndim for p in model.parameters()}
        assert meshes == {1, 2}, meshes
        x, y = _data()
        dp_rank = strategy.device_mesh["data_parallel"].get_local_rank()
        rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
        fabric.backward(F.mse_loss(model(x[rows]), y[rows]))
        before = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if fully_shard is torch_fsdp.fully_shard:
            with pytest.raises(RuntimeError, match="must have the same mesh"):
                fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
            continue
        norm = fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares = [(g.double() ** 2).sum() for g in before.values()]
        true64 = torch.stack(squares).sum().sqrt()
        true32 = torch.stack([(g**2).sum() for g in before.values()]).sum().sqrt()
        terms = sum(g.numel() for g in before.values())
        assert_close_to_reference(norm, true32, true64, what="total norm: ", terms=terms)
        norms = [torch.zeros(()) for _ in range(WORLD)]
        dist.all_gather(norms, norm.detach().reshape(()))
        assert all(torch.equal(n, norms[0]) for n in norms), f"ranks disagree: {norms}"
        assert true64 > MAX_NORM, "clipping never bound"
        scale = MAX_NORM / (true64 + 1e-6)
        # one factor for every gradient: off the true one by the norm's own error
        rel = (norm.double() - true64).abs() / true64 + 4 * U
        for n, p in model.named_parameters():
            want = before[n].double() * scale
            got = p.grad.full_tensor().double()
            worst = ((got - want).abs() - rel * want.abs()).max().item()
            assert worst <= 0, f"{n}: not scaled by the one clipping factor ({worst:.3g})"


# ---- the grid -------------------------------------------------------------------------------
def _launcher_env(rank: int, world: int) -> None:
    """What a launcher exports; ``LOCAL_RANK`` tells Lightning the processes exist."""
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # unused: the process group exists
    )


def _against_fsdp2(api: str, dp: int, tp: int, folder: str) -> None:
    """``api``: "fabric", "fabric_empty_init" or "trainer"."""
    import torch.distributed.fsdp as torch_fsdp

    import raggedfsdp
    from tests.numerics import assert_losses_match, assert_param_matches, reference

    runs = iter(range(100))

    def run(fully_shard, other=None):  # a fresh folder for every run, the same on every rank
        sub = os.path.join(folder, f"{api}_{dp}x{tp}_{next(runs)}")
        if api == "trainer":
            return _trainer(fully_shard, dp, tp, sub, other)
        return _fabric(fully_shard, dp, tp, sub, other, empty_init=api == "fabric_empty_init")

    ref = reference(partial(run, torch_fsdp.fully_shard))
    fsdp2_plain = os.path.join(folder, f"{api}_{dp}x{tp}_0")  # FSDP2's un-nudged run
    ours = run(raggedfsdp.fully_shard, other=fsdp2_plain)
    tokens = dp * ROWS * DIM  # the terms of one step's mean loss
    world = dp if api == "trainer" else 2 * dp  # partial sums: ranks (x micro-batches)
    what = f"{api} dp {dp} x tp {tp}, against FSDP2: "
    for series in ref.series:
        terms = tokens if series != "grad_norm" else BLOCKS * 3 * DIM * HIDDEN
        assert_losses_match(ours[series], ref, world=world, tokens=terms, what=what, series=series)
    got, other = ours["resumed_from_other"], what + "resumed from FSDP2's checkpoint: "
    assert_losses_match(got, ref, world=world, tokens=tokens, what=other, series="resumed")
    for name, p in ours["params"].items():
        assert_param_matches(name, p, ref, steps=STEPS, what=what)
    for backend, got in (("FSDP2", ref.series), ("raggedfsdp", ours)):
        assert got["resumed"] == got["loss"][SAVE_AT:], (
            f"{what}{backend}'s resumed losses {got['resumed']} are not its uninterrupted "
            f"steps {got['loss'][SAVE_AT:]}"
        )
    last = ref.losses[SAVE_AT - 1]  # the same batch, one epoch earlier
    assert ref.losses[-1] < last, f"{what}FSDP2's loss did not fall: {ref.losses}"
    if "grad_norm" in ref.series:
        assert ref.series["grad_norm"][0] > MAX_NORM, f"{what}clipping never bound"


def _grid(rank: int, world: int, folder: str) -> None:
    _launcher_env(rank, world)
    cases = {
        f"{api} {name}": partial(_against_fsdp2, api, dp, tp, folder)
        for api in ("fabric", "fabric_empty_init", "trainer")
        for name, (dp, tp) in MESHES.items()
    }
    cases["fabric fsdp_x_tp clipping over two meshes"] = partial(_fabric_clip_two_meshes, folder)
    run_cases(cases)


def test_lightning_model_parallel_against_fsdp2(tmp_path):
    spawn(WORLD, _grid, str(tmp_path), timeout=600)
