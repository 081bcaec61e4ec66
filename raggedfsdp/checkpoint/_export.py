"""``export_safetensors``: the full model as Hugging Face style safetensors files.

One file per ``fully_shard`` group (the group's own parameters and buffers), written
by rank 0 in the model's order, plus ``model.safetensors.index.json`` mapping every
name to its file. A group is gathered one tensor at a time and dropped once written,
so no rank ever holds more than one group unsharded.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import raggedfsdp.checkpoint._state as _state
import raggedfsdp.checkpoint.files as _files
from raggedfsdp.checkpoint._api import _wait_pending
from raggedfsdp.checkpoint._ranks import Ranks, default_group

__all__ = ["INDEX", "export_safetensors"]

INDEX = "model.safetensors.index.json"


def _groups(model: nn.Module, names: list[str]) -> list[list[str]]:
    """``names`` (state-dict FQNs) split by the fully_shard module that owns each, in order."""
    from raggedfsdp.fsdp import FSDPModule

    owners = {"": ""}  # module FQN -> FQN of the nearest enclosing fully_shard module
    for fqn, module in model.named_modules():
        if fqn:
            parent = owners[fqn.rpartition(".")[0]]
            owners[fqn] = fqn if isinstance(module, FSDPModule) else parent
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(owners[name.rpartition(".")[0]], []).append(name)
    return list(groups.values())


def export_safetensors(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    name_map: Callable[[str], str] | None = None,
    process_group=None,
) -> Path:
    """Write the full model to ``path`` as safetensors files, group by group.

    A tied parameter is written once, under its first FQN; the index records the
    other names in its metadata (``"aliases"``). Collective over the model's mesh.

    Args:
        model: the model (sharded by ``fully_shard`` or not).
        path: a directory that does not exist yet.
        dtype: cast floating-point tensors to this dtype. Default: as they are.
        name_map: maps each FQN to the name written (e.g. to Hugging Face names).
            Default: the FQN.
        process_group: the ranks that hold the model. Default: its mesh's group.

    Returns:
        ``path``.

    Raises:
        ValueError: ``path`` exists, or ``name_map`` maps two tensors to one name.
        ImportError: the ``safetensors`` package is not installed.
    """
    from safetensors.torch import save_file

    _wait_pending()
    ranks = Ranks(default_group(model, process_group))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    error = None
    live = None
    try:
        if path.exists():
            raise ValueError(f"export_safetensors: '{path}' exists; pass a new directory")
        live = _state.collect(model, None, "export_safetensors")
        rename = name_map or (lambda fqn: fqn)
        written = [rename(fqn) for fqn in live.model]
        if len(set(written)) != len(written):
            dup = next(n for n in written if written.count(n) > 1)
            raise ValueError(f"export_safetensors: name_map gives {dup!r} to two tensors")
    except Exception as err:  # every rank raises it: see [Note: errors reach every rank]
        error = err
    ranks.agree(error)
    assert live is not None  # agree() raised otherwise
    if ranks.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    groups = _groups(model, list(live.model))
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        filename = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors: dict[str, Tensor] = {}
        for fqn in names:
            full = _full(live.model[fqn], dtype)  # collective: every rank takes part
            if ranks.rank == 0:
                tensors[rename(fqn)] = full
                weight_map[rename(fqn)] = filename
                total += full.numel() * full.element_size()
            del full
        if ranks.rank == 0:
            save_file(tensors, str(tmp / filename), metadata={"format": "pt"})
        del tensors  # one group at a time
    if ranks.rank == 0:
        aliases = {rename(a): rename(t) for a, t in live.aliases.items()}
        index = {"metadata": {"total_size": total, "aliases": aliases}, "weight_map": weight_map}
        _files.write_file(tmp / INDEX, json.dumps(index, indent=1).encode())
        _files.commit(tmp, path)
    ranks.barrier()
    return path


@torch.no_grad()
def _full(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    if dtype is not None and full.is_floating_point():
        full = full.to(dtype)
    return full.cpu().contiguous()
