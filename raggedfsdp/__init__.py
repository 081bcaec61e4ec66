"""raggedfsdp: block-aware fully sharded data parallelism for PyTorch.

The public names load on first use, so ``import raggedfsdp.planner`` (pure Python)
does not import torch. Importing ``RaggedShard`` (or anything that needs it)
installs the DTensor hooks of ``raggedfsdp.tensor``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RaggedShard": "raggedfsdp.tensor.placement",
    "BlockPolicy": "raggedfsdp.fsdp",
    "FSDPModule": "raggedfsdp.fsdp",
    "Float8BlockAllGather": "raggedfsdp.fsdp",
    "MixedPrecisionPolicy": "raggedfsdp.fsdp",
    "UnshardHandle": "raggedfsdp.fsdp",
    "fully_shard": "raggedfsdp.fsdp",
    "clip_grad_norm_": "raggedfsdp.fsdp",
    "MeshSpec": "raggedfsdp.models.parallelize",
    "build_mesh": "raggedfsdp.models.parallelize",
    "parallelize": "raggedfsdp.models.parallelize",
    "parse_mesh_spec": "raggedfsdp.models.parallelize",
}

__all__ = sorted(_EXPORTS)


_SUBPACKAGES = {
    "tensor",
    "planner",
    "fsdp",
    "optim",
    "checkpoint",
    "models",
    "tools",
    "train",
    "cli",
}

# Modules that moved into the layer folders: their old paths (``placement.py`` and the
# like, beside this file) import the new module with a DeprecationWarning for one release.
# See docs/architecture.md, "Moved modules".
_MOVED = ("placement", "dbuffer", "profiling", "simulate")


def __getattr__(name: str):
    if name in _SUBPACKAGES or name in _MOVED:
        return importlib.import_module(f"raggedfsdp.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raggedfsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
