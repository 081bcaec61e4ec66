"""The device audit (``tests/device_audit.py``) catches a factory call without a device
added to library code, over torch's fake process group at 8 ranks. The audit of whole
training steps runs on gloo ranks: ``tests/dist/test_device_audit.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import raggedfsdp.fsdp.dbuffer as dbuffer_module
from raggedfsdp import fully_shard, parallelize
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from tests.device_audit import DeviceAudit

WORLD, SEQ = 8, 16


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=WORLD)
    yield init_device_mesh("cpu", (WORLD,))
    dist.destroy_process_group()


def _sharded(name, mesh):
    model = Transformer(get_config(name), max_seq_len=SEQ, seed=0)
    parallelize(model, mesh, fully_shard=fully_shard)
    return model


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
    model = _sharded("llama-tiny", fake_world)
    with DeviceAudit() as audit:
        x = torch.randint(0, model.config.vocab_size, (2, SEQ + 1))
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    assert audit.violations, "the audit missed torch.zeros(1) without a device"
    assert set(audit.violations) == {"raggedfsdp/fsdp/dbuffer.py:2 torch.zeros"}
