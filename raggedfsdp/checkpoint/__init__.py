"""Checkpoints: sharded save / load over torch.distributed.checkpoint, with resharding
to another world size or block policy, crash safety, async save and safetensors export.

    handle = checkpoint.save("ckpt", model, optimizer, step=step, extra={"rng": rng})
    step, extra = checkpoint.load("ckpt", model, optimizer)   # the newest complete one
    checkpoint.export_safetensors(model, "export")

See [Note: commit protocol] in ``files`` and [Note: checkpoint keys] in ``_state``.
"""

from raggedfsdp.checkpoint._api import (
    SaveHandle,
    hold_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load,
    save,
    verify_checkpoint,
)
from raggedfsdp.checkpoint._export import export_safetensors
from raggedfsdp.checkpoint.files import CorruptCheckpointError

__all__ = [
    "CorruptCheckpointError",
    "SaveHandle",
    "export_safetensors",
    "hold_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "save",
    "verify_checkpoint",
]
