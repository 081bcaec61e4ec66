"""fully_shard parity: per-step losses and final parameters against one process.

The single-process reference is computed once in the pytest process (cached per
configuration) and handed to every rank, so ranks spend their CPU on the run under
test. Global batches are world-size invariant (``raggedfsdp.train.data.get_batch``).
"""

from __future__ import annotations

import functools
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import init_device_mesh

from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.train.data import get_batch
from tests.harness import run_cases, spawn
from tests.numerics import assert_losses_match, assert_param_matches, reference

pytestmark = pytest.mark.numerics
STEPS = 10
BATCH, SEQ = 24, 8  # 24 rows: 2 micro-batches of 12, each divisible by 1, 2, 3 and 4 ranks
MODELS = ["llama-tiny-tied", "moe-tiny"]
LR = 0.2
NO_MP = MixedPrecisionPolicy()


@functools.cache
def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # A fixed synthetic byte stream: the parity does not depend on the text.
    return torch.randint(0, 256, (20_000,), generator=g, dtype=torch.uint8)


def _micro_batches(step, accumulate, rank=0, world=1):
    """This rank's part of each of the ``accumulate`` global micro-batches of ``step``.

    Micro-batch i is rows ``[i * B / a, (i + 1) * B / a)`` of the global batch for any
    world size, so the single-process reference accumulates the very same micro-batches.
    """
    x, y = get_batch(_data(), seed=1, step=step, batch_size=BATCH, seq_len=SEQ)
    rows = BATCH // accumulate // world
    for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate)):
        yield xm[rank * rows : (rank + 1) * rows], ym[rank * rows : (rank + 1) * rows]


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)


@functools.cache
def _reference(model_name: str, optim: str, accumulate: int = 1, steps: int = STEPS):
    """Single-process losses per step and final parameters, and their spread under nudged
    gradients ([Note: derived tolerances] in ``tests/numerics.py``).

    On the ranks' thread count: on tiny models more threads only contend, and on a busy
    2-core machine they wait for each other (60-110 s instead of 2 s measured).
    """

    def run():
        model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
        losses = _train(model, optim, 0, 1, steps=steps, accumulate=accumulate, sync=False)
        return losses, dict(model.named_parameters())

    return reference(run)


def _build(model_name, mesh, *, raf=None, meta=False, mp=None):
    cfg = get_config(model_name)
    if meta:
        with torch.device("meta"):
            model = Transformer(cfg, max_seq_len=SEQ)
    else:
        model = Transformer(cfg, max_seq_len=SEQ, seed=0)
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=mp or NO_MP)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=mp or NO_MP)
    if meta:
        model.to_empty(device="cpu")
        model.init_weights(0)
    return model


def _train(model, optim, rank, world, *, steps=STEPS, accumulate=1, sync=True):
    """Per-step mean loss; ``sync``: a fully_shard model on ``world`` ranks."""
    opt = _optimizer(optim, model.parameters())
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(_micro_batches(step, accumulate, rank, world)):
            if sync:
                model.set_requires_gradient_sync(i == accumulate - 1)
            loss = lm_loss(model(xm), ym)
            (loss / accumulate).backward()
            total += loss.detach() / accumulate
        opt.step()
        opt.zero_grad()
        if sync:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _check_parity(mesh, model_name, rank, world, ref, accumulate=1, **build):
    model = _build(model_name, mesh, **build)
    losses = _train(model, "sgd", rank, world, accumulate=accumulate)
    assert_losses_match(losses, ref, world=world * accumulate, tokens=BATCH * SEQ)
    for name, p in model.named_parameters():
        assert_param_matches(name, p.full_tensor(), ref, steps=STEPS)


def _grid_parity(rank, world, refs):
    mesh = init_device_mesh("cpu", (world,))
    cases = {}
    for model_name in MODELS:
        ref = refs[model_name, 1]
        rafs = [True, False] + ([2] if world in (2, 4) else [])
        for raf in rafs:
            cases[f"{model_name} raf={raf}"] = partial(
                _check_parity, mesh, model_name, rank, world, ref, raf=raf
            )
        cases[f"{model_name} accumulate=2"] = partial(
            _check_parity, mesh, model_name, rank, world, refs[model_name, 2], accumulate=2
        )
        cases[f"{model_name} meta init"] = partial(
            _check_parity, mesh, model_name, rank, world, ref, meta=True
        )
    run_cases(cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sgd_parity_with_one_process(world):
    refs = {(m, a): _reference(m, "sgd", a) for m in MODELS for a in (1, 2)}
    spawn(world, _grid_parity, refs, timeout=600)
