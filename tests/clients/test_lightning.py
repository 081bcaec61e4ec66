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

- **Fabric**: ``fabric.setup`` / ``setup_optimizers``, ``fabric.backward``,
  ``fabric.clip_gradients(max_norm=...)`` (``torch.nn.utils.clip_grad_norm_`` over the
  sharded gradients), SGD with momentum, ``fabric.save`` after step 2 (a distributed
  checkpoint: model, optimizer and a step counter); then a second model, initialised
  from another seed, ``fabric.load``s it and trains steps 3 and 4 again.
- **Trainer**: ``Trainer(strategy=ModelParallelStrategy(...), gradient_clip_val=...)``
  for two epochs of two steps, ``ModelCheckpoint`` saving at each epoch's end; then a
  second ``Trainer.fit(ckpt_path=<epoch 0's checkpoint>)`` trains epoch 1 again.

Checked, per configuration: the losses (and Fabric's gradient norms, the values
``clip_gradients`` returns) of the uninterrupted run and of the resumed one, and the final
parameters, lie within the bound derived from FSDP2's own run nudged on the same ranks
([Note: derived tolerances] in ``tests/numerics.py``); each backend's resumed losses
equal its uninterrupted ones bitwise (the checkpoint round trip is exact); clipping
bound (FSDP2's first gradient norm exceeds ``MAX_NORM``) and the loss on the last batch
fell from the epoch before.

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
def _model(seed: int):
    """Lightning's tensor-parallel example (a SwiGLU feed-forward), two blocks with
    residuals, built on the CPU from ``seed``."""
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

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

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
def _fabric(fully_shard, dp: int, tp: int, folder: str) -> dict:
    import torch
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

    def setup(seed):
        model = fabric.setup(_model(seed))
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        return model, opt

    def train(model, opt, steps, save=None):
        losses, norms = [], []
        for step in steps:
            bx, by = batches[step]
            loss = F.mse_loss(model(bx), by)
            fabric.backward(loss)
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

    model, opt = setup(seed=1)  # other weights: the load must replace them
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(path, state)
    assert state["step"] == SAVE_AT, state["step"]
    resumed, _ = train(model, opt, range(SAVE_AT, STEPS))
    return {"loss": losses, "grad_norm": norms, "resumed": resumed, "params": params}


# ---- Trainer --------------------------------------------------------------------------------
def _trainer(fully_shard, dp: int, tp: int, folder: str) -> dict:
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
    first_epoch = os.path.join(folder, f"epoch=0-step={SAVE_AT}.ckpt")
    assert os.path.isdir(first_epoch), sorted(os.listdir(folder))  # distributed: a folder
    resumed = fit(seed=1, ckpt_path=first_epoch)
    return {"loss": lit.losses, "resumed": resumed.losses, "params": params}


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
    import torch.distributed.fsdp as torch_fsdp

    import raggedfsdp
    from tests.numerics import assert_losses_match, assert_param_matches, reference

    runs = iter(range(100))

    def run(fully_shard):  # a fresh checkpoint folder for every run, the same on every rank
        sub = os.path.join(folder, f"{api}_{dp}x{tp}_{next(runs)}")
        return (_fabric if api == "fabric" else _trainer)(fully_shard, dp, tp, sub)

    ref = reference(partial(run, torch_fsdp.fully_shard))
    ours = run(raggedfsdp.fully_shard)
    tokens = dp * ROWS * DIM  # the terms of one step's mean loss
    what = f"{api} dp {dp} x tp {tp}, against FSDP2: "
    for series in ref.series:
        terms = tokens if series != "grad_norm" else BLOCKS * 3 * DIM * HIDDEN
        assert_losses_match(ours[series], ref, world=dp, tokens=terms, what=what, series=series)
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
    run_cases(
        {
            f"{api} {name}": partial(_against_fsdp2, api, dp, tp, folder)
            for api in ("fabric", "trainer")
            for name, (dp, tp) in MESHES.items()
        }
    )


def test_lightning_model_parallel_against_fsdp2(tmp_path):
    spawn(WORLD, _grid, str(tmp_path), timeout=600)
