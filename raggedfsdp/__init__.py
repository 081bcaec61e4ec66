"""raggedfsdp: block-aware fully sharded data parallelism for PyTorch.

The public names load on first use, so ``import raggedfsdp.planner`` (pure Python)
does not import torch. Importing ``RaggedShard`` (or anything that needs it)
installs the DTensor hooks of ``raggedfsdp.tensor``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

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

# Modules that moved into the layer folders: their old paths import the new module
# (with a DeprecationWarning) for one release. See docs/architecture.md, "Moved modules".
_MOVED = {
    "raggedfsdp.placement": "raggedfsdp.tensor.placement",
    "raggedfsdp.dbuffer": "raggedfsdp.fsdp.dbuffer",
    "raggedfsdp.profiling": "raggedfsdp.tools.profiling",
    "raggedfsdp.simulate": "raggedfsdp.tools.simulate",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import raggedfsdp.placement`` and the like: the moved module itself."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {_MOVED[spec.name]}; import it from there (the old path "
            "goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # the new module ran when create_module imported it


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str):
    if name in _SUBPACKAGES or f"raggedfsdp.{name}" in _MOVED:
        return importlib.import_module(f"raggedfsdp.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raggedfsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
