"""Where train and fully_shard run: ``--device``, the backend per device, the default
precision, fully_shard's default mesh and CPU offload's pinning. The accelerator query is
substituted (``torch.accelerator``), so the accelerator's branches run on the CPU; the fake
process group stands in for the ranks, so no real accelerator is touched."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from raggedfsdp import fully_shard
from raggedfsdp.cli import train as train_cli
from raggedfsdp.tools.simulate import fake_world
from raggedfsdp.train.devices import (
    backend_for,
    default_bf16,
    resolve_device,
    resolve_train_device,
)


def _accelerator(monkeypatch, kind: str | None, count: int = 1) -> None:
    """This process sees an accelerator of type ``kind`` with ``count`` devices (None: none)."""
    present = kind is not None

    def current(check_available: bool = False):
        return torch.device(kind) if present else None

    monkeypatch.setattr(torch.accelerator, "current_accelerator", current)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: present)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count if present else 0)


def _args(*argv: str) -> argparse.Namespace:
    return train_cli.build_parser().parse_args(list(argv))


# ---- --device ------------------------------------------------------------------------------
def test_auto_is_this_machines_accelerator_or_the_cpu(monkeypatch):
    here = torch.accelerator.current_accelerator(check_available=True)
    assert resolve_device("auto") == (here.type if here is not None else "cpu")
    _accelerator(monkeypatch, None)
    assert resolve_device("auto") == "cpu"
    _accelerator(monkeypatch, "cuda")
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda") == "cuda"
    assert resolve_device("cpu") == "cpu"


@pytest.mark.parametrize(
    "device, match",
    [
        ("cuda", r"--device cuda: this machine cannot train on cuda \(it has no accelerator"),
        ("xpu", r"--device xpu: this machine cannot train on xpu"),
        ("cuda:1", r"--device 'cuda:1' names a device index; pass the type alone"),
        ("gpu", r"--device must be auto, cpu or an accelerator's device type"),
    ],
)
def test_an_absent_or_malformed_device_is_refused(monkeypatch, device, match):
    _accelerator(monkeypatch, None)
    with pytest.raises(ValueError, match=match):
        resolve_device(device)


def test_another_accelerator_than_this_machines_is_refused(monkeypatch):
    _accelerator(monkeypatch, "xpu")
    with pytest.raises(ValueError, match=r"--device cuda: .*\(its accelerator is xpu"):
        resolve_device("cuda")


def test_absent_accelerator_is_refused_before_any_rank_starts(monkeypatch, tmp_path, capsys):
    _accelerator(monkeypatch, None)
    out = tmp_path / "run"

    def launch(args):
        raise AssertionError("no rank may start")

    with pytest.raises(SystemExit) as exc:
        train_cli.main(["--device", "cuda", "--out", str(out), "--nproc", "1"], launch=launch)
    assert exc.value.code == 2
    assert "--device cuda: this machine cannot train on cuda" in capsys.readouterr().err
    assert not out.exists()  # nothing written


def test_more_ranks_than_devices_are_refused(monkeypatch):
    _accelerator(monkeypatch, "cuda", count=2)
    with pytest.raises(ValueError, match=r"--nproc 4 on --device cuda: one rank per device, "):
        resolve_train_device(_args("--nproc", "4"))
    args = _args("--nproc", "2")
    resolve_train_device(args)
    assert args.device == "cuda"


# ---- precision -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "accelerator, flags, device, bf16",
    [
        (None, [], "cpu", False),  # the CPU keeps fp32
        (None, ["--bf16"], "cpu", True),
        ("cuda", [], "cuda", True),  # an accelerator trains in bf16, fp32 reduction
        ("cuda", ["--no-bf16"], "cuda", False),  # unless the flag says fp32
        ("cuda", ["--device", "cpu"], "cpu", False),
    ],
)
def test_default_precision_follows_the_device(monkeypatch, accelerator, flags, device, bf16):
    _accelerator(monkeypatch, accelerator)
    args = _args("--nproc", "1", *flags)
    assert args.bf16 is (True if "--bf16" in flags else False if "--no-bf16" in flags else None)
    resolve_train_device(args)
    assert (args.device, args.bf16) == (device, bf16)
    assert default_bf16(device) is (device != "cpu")


# ---- backend -----------------------------------------------------------------------------------
def test_backend_is_torchs_own_for_each_device():
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == "nccl"
    for device, backend in dist.Backend.default_device_backend_map.items():
        assert backend_for(device) == backend
    with pytest.raises(ValueError, match=r"torch pairs no process-group backend with device"):
        backend_for("meta")


# ---- fully_shard's default mesh and offload ----------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


@pytest.mark.parametrize("accelerator", [None, "cuda", "xpu"])
def test_default_mesh_is_on_the_accelerator_as_fsdp2s(monkeypatch, accelerator):
    """FSDP2's default mesh is on ``torch._C._get_accelerator()``: the accelerator torch
    has, whatever device the parameters are on (meta here), else the CPU."""
    with fake_world(4):
        _accelerator(monkeypatch, accelerator)
        with torch.device("meta"):
            model = _mlp()
        fully_shard(model[0])
        fully_shard(model)
        for p in model.parameters():
            assert p.device_mesh.device_type == (accelerator or "cpu")
            assert p.device_mesh.size() == 4


def test_default_mesh_without_accelerator_is_the_cpu_for_cpu_parameters(monkeypatch):
    with fake_world(2):
        _accelerator(monkeypatch, None)
        model = _mlp()
        fully_shard(model)
        assert {p.device_mesh.device_type for p in model.parameters()} == {"cpu"}
        assert {p.device.type for p in model.parameters()} == {"cpu"}


@pytest.mark.parametrize(
    "accelerator, pin, pinned",
    [("cuda", True, True), ("cuda", False, False), (None, True, False)],
)
def test_offload_pins_host_memory_when_an_accelerator_is_present(
    monkeypatch, accelerator, pin, pinned
):
    calls = []

    def pin_memory(self, *args, **kwargs):  # records the call; real pinning needs a device
        calls.append(self.numel())
        return self

    with fake_world(2) as mesh:
        _accelerator(monkeypatch, accelerator)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        model = _mlp()
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
    assert bool(calls) is pinned
    if pinned:  # the shard storage of the group's one buffer: half the padded parameters
        assert sum(calls) >= sum(p.numel() for p in _mlp().parameters()) // 2
