"""``fully_shard``: FSDP2's API over RaggedShard buffers (see DESIGN.md, "Execution")."""

from raggedfsdp.fsdp._api import FSDPModule, UnshardHandle, fully_shard
from raggedfsdp.fsdp._group_ops import clip_grad_norm_
from raggedfsdp.fsdp._policy import BlockPolicy, MixedPrecisionPolicy

__all__ = [
    "BlockPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "clip_grad_norm_",
    "fully_shard",
]
