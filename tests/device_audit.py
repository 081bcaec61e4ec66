"""An audit of tensor factories called from library code without naming a device.

The project's rule: every tensor created in library code says where it lives
(``device=``, or ``*_like`` / ``x.new_*``); a CPU constant made on purpose says
``device="cpu"``. ``DeviceAudit`` is a ``TorchFunctionMode`` that records each call
of a factory (``torch.empty``, ``zeros``, ``tensor``, ``arange``, ...) whose direct
caller is a file of the library and that passes neither ``device=`` nor ``out=``.

The library is ``raggedfsdp/`` without the application: ``train/``, ``models/``
(model construction follows ``nn.Module``'s convention: it honours
``with torch.device(...)``), the demo and the walkthrough.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import raggedfsdp

LIBRARY = Path(raggedfsdp.__file__).resolve().parent
APPLICATION = ("train", "models", "_demo.py", "_walkthrough.py", "__main__.py")

FACTORIES = {
    torch.empty,
    torch.empty_strided,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.arange,
    torch.range,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.tril_indices,
    torch.triu_indices,
}


def is_library_file(filename: str) -> bool:
    try:
        rel = Path(filename).resolve().relative_to(LIBRARY)
    except ValueError:
        return False
    return rel.parts[0] not in APPLICATION


class DeviceAudit(TorchFunctionMode):
    """Records ``"path:line name"`` for every factory call of library code with no device."""

    def __init__(self):
        super().__init__()
        self.violations: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs and "out" not in kwargs:
            caller = sys._getframe(1)
            if is_library_file(caller.f_code.co_filename):
                rel = Path(caller.f_code.co_filename).resolve().relative_to(LIBRARY.parent)
                self.violations.append(f"{rel}:{caller.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


# Reading a tensor's value on the host: on an accelerator each waits for the device.
HOST_READS = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class HostReadAudit:
    """Records ``"path:line what"`` for every host read of a tensor value by library code.

    A host read (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ...) or a tensor
    built from Python data on the device (``torch.tensor(list, device=...)``) makes the
    host wait for the device on an accelerator. On this CPU-only machine nothing waits,
    but the calls are the same: a steady-state step of the runtime must make none.
    """

    def __init__(self, exempt: Iterable[torch.Tensor] = ()):
        """``exempt``: tensors whose reads are by design (CPU step counters, say)."""
        self.reads: list[str] = []
        self._exempt = {id(t) for t in exempt}
        self._saved: dict[str, object] = {}

    def _where(self) -> str | None:
        frame = sys._getframe(2)
        if not is_library_file(frame.f_code.co_filename):
            return None
        rel = Path(frame.f_code.co_filename).resolve().relative_to(LIBRARY.parent)
        return f"{rel}:{frame.f_lineno}"

    def _wrap(self, name: str, orig):
        audit = self

        def read(*args, **kwargs):
            where = audit._where()
            if where is not None and not (args and id(args[0]) in audit._exempt):
                audit.reads.append(f"{where} {name}")
            return orig(*args, **kwargs)

        return read

    def __enter__(self) -> HostReadAudit:
        for name in HOST_READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(f"Tensor.{name}", self._saved[name]))
        for name in ("tensor", "as_tensor"):
            self._saved["torch." + name] = getattr(torch, name)
            setattr(torch, name, self._wrap(f"torch.{name}", getattr(torch, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._saved.items():
            if name.startswith("torch."):
                setattr(torch, name.removeprefix("torch."), orig)
            else:
                setattr(torch.Tensor, name, orig)
        self._saved.clear()
