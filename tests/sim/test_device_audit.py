"""The device audit (``tests/device_audit.py``) catches a factory call without a device
added to library code, over torch's fake process group at 8 ranks. The audit of whole
training steps runs on gloo ranks: ``tests/dist/test_device_audit.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import raggedfsdp.dbuffer as dbuffer_module
from raggedfsdp import checkpoint, clip_grad_norm_, fully_shard
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.optim import (
    AdamW,
    AdamW8bit,
    Muon,
    adamw8bit_block_policy,
    muon_block_policy,
    muon_param_groups,
)
from tests.device_audit import DeviceAudit

WORLD, SEQ = 8, 16
OPTIMIZERS = {
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), None),
    "torch-adamw": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), None),
    "adamw": (lambda m: AdamW(m.parameters(), lr=1e-3), None),
    "adamw8bit": (
        lambda m: AdamW8bit(m.parameters(), lr=1e-3, min_8bit_size=256),
        lambda: adamw8bit_block_policy(min_8bit_size=256),
    ),
    "muon": (lambda m: Muon(muon_param_groups(m), lr=1e-3), lambda: muon_block_policy()),
}


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=WORLD)
    yield init_device_mesh("cpu", (WORLD,))
    dist.destroy_process_group()


def _sharded(name, mesh, policy):
    model = Transformer(get_config(name), max_seq_len=SEQ, seed=0)
    kw = {} if policy is None else {"block_policy": policy()}
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _train_step(model, opt, tmp_path):
    x = torch.randint(0, model.config.vocab_size, (2, SEQ + 1))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
    checkpoint.save(tmp_path, model, opt, step=1)
    checkpoint.load(tmp_path, model, opt)


def test_the_audit_catches_a_factory_without_a_device(fake_world, monkeypatch):
    # Library code that forgets the device: compiled as if it stood in dbuffer.py.
    source = (
        "def alloc(self, *, zero=False):\n"
        "    torch.zeros(1)\n"
        "    return original(self, zero=zero)\n"
    )
    scope = {"torch": torch, "original": dbuffer_module.FlatStorage.alloc}
    exec(compile(source, dbuffer_module.__file__, "exec"), scope)
    monkeypatch.setattr(dbuffer_module.FlatStorage, "alloc", scope["alloc"])
    model = _sharded("llama-tiny", fake_world, None)
    with DeviceAudit() as audit:
        x = torch.randint(0, model.config.vocab_size, (2, SEQ + 1))
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    assert audit.violations, "the audit missed torch.zeros(1) without a device"
    assert set(audit.violations) == {"raggedfsdp/dbuffer.py:2 torch.zeros"}
