"""An audit of tensor factories called from library code without naming a device.

CONVENTIONS.md rule 18: every tensor created in library code says where it lives
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
