"""The models and data train under torch's own FSDP2 with single-process losses.

A contract test for the parity tests of ``raggedfsdp.fully_shard``: built on ``meta``,
sharded per block then at the root, initialised by ``init_weights`` and fed each rank's
rows of the global batch, the models reproduce the single-process losses (fp32), within
the bound derived from that process's own sensitivity ([Note: derived tolerances] in
``tests/numerics.py``).
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from raggedfsdp.models import Transformer, get_config, lm_loss
from raggedfsdp.train import DataConfig, get_batch, load_corpus
from tests.harness import run_cases, spawn
from tests.numerics import assert_losses_match, reference

pytestmark = pytest.mark.numerics
STEPS, BATCH, SEQ = 4, 12, 32


def _losses(name: str, rank: int, world: int | None) -> list[float]:
    """Per-step losses; ``world=None``: one process, no sharding."""
    data = load_corpus(DataConfig(max_bytes=1 << 18)).train
    config = get_config(name)
    if world is None:
        model = Transformer(config, max_seq_len=SEQ, seed=1)
    else:
        with torch.device("meta"):
            model = Transformer(config, max_seq_len=SEQ)
        if not config.tie_embeddings:  # a tied weight lives in the root group
            fully_shard(model.tok_embeddings)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        model.init_weights(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    losses = []
    for step in range(STEPS):
        x, y = get_batch(
            data, seed=0, step=step, batch_size=BATCH, seq_len=SEQ, rank=rank,
            world_size=world or 1,
        )  # fmt: skip
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if world is not None:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


NAMES = ("llama-tiny", "moe-tiny", "llama-tiny-tied")


def _check(name: str, rank: int, world: int, want) -> None:
    got = _losses(name, rank, world)
    assert_losses_match(got, want, world=world, tokens=BATCH * SEQ, what=f"{name}: ")


def _grid(rank, world, refs):
    run_cases({n: partial(_check, n, rank, world, refs[n]) for n in NAMES})


def test_models_train_under_fsdp2_with_single_process_losses():
    refs = {n: reference(partial(_losses, n, 0, None)) for n in NAMES}  # once, here
    spawn(3, _grid, refs)
