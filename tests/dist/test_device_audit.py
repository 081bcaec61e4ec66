"""Every tensor the library creates names its device: whole training steps (forward,
backward, reduce-scatter, clip, each optimizer, a checkpoint save and load) on 2 gloo
ranks, for both small models, under ``DeviceAudit`` (``tests/device_audit.py``); and
the steady-state step reads no tensor value on the host (``HostReadAudit``)."""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

from raggedfsdp import checkpoint, clip_grad_norm_, fully_shard
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.optim import (
    AdamW,
    AdamW8bit,
    Muon,
    Shampoo,
    adamw8bit_block_policy,
    muon_block_policy,
    muon_param_groups,
    shampoo_block_policy,
)
from tests.device_audit import DeviceAudit, HostReadAudit
from tests.harness import run_cases, spawn

SEQ = 16
OPTIMIZERS = {
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), None),
    "torch-adamw": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), None),
    "adamw": (lambda m: AdamW(m.parameters(), lr=1e-3), None),
    "adamw8bit": (
        lambda m: AdamW8bit(m.parameters(), lr=1e-3, min_8bit_size=256),
        lambda model, world: adamw8bit_block_policy(min_8bit_size=256),
    ),
    "muon": (lambda m: Muon(muon_param_groups(m), lr=1e-3), muon_block_policy),  # (model, m)
    "shampoo": (  # roots every step from the first: both steps run every part of it
        lambda m: Shampoo(
            m.parameters(),
            lr=1e-3,
            block_size=32,
            row_block=4,
            precondition_frequency=1,
            start_preconditioning_step=1,
        ),
        lambda model, world: shampoo_block_policy(32, row_block=4),
    ),
    "shampoo-owner": (  # the default layout: blocks cut across ranks go to owner ranks
        lambda m: Shampoo(
            m.parameters(),
            lr=1e-3,
            block_size=32,
            precondition_frequency=1,
            start_preconditioning_step=1,
        ),
        None,
    ),
}


def _check(model_name, opt_name, root):
    make_opt, policy = OPTIMIZERS[opt_name]
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
    kw = {} if policy is None else {"block_policy": policy(model, world)}
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    opt = make_opt(model)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    with DeviceAudit() as audit:
        for step in (1, 2):  # the second step finds the optimizer's state
            x = torch.randint(0, model.config.vocab_size, (2, SEQ + 1), generator=gen)
            # The optimizers' step counters are CPU tensors by design (as torch's own).
            steps = [st["step"] for st in opt.state.values() if torch.is_tensor(st.get("step"))]
            with HostReadAudit(exempt=steps) as host:
                lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
                clip_grad_norm_(model, 1.0)
                opt.step()
                opt.zero_grad()
            if step == 2:  # steady state: the host never waits for the device
                assert host.reads == [], "\n".join(host.reads)
            checkpoint.save(root / f"{model_name}-{opt_name}", model, opt, step=step)
        checkpoint.load(root / f"{model_name}-{opt_name}", model, opt)
    assert audit.violations == [], "\n".join(sorted(set(audit.violations)))


def _grid(rank, world, root):
    run_cases(
        {
            f"{m} {o}": partial(_check, m, o, Path(root))
            for m in ("llama-tiny", "moe-tiny")
            for o in OPTIMIZERS
        }
    )


def test_a_training_step_creates_every_tensor_on_a_named_device():
    with tempfile.TemporaryDirectory() as root:
        spawn(2, _grid, root)
