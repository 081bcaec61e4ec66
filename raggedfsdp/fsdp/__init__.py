"""``fully_shard``: FSDP2's API over RaggedShard buffers (see docs/fully_shard.md).

``buffers_of`` / ``buffer_of`` are the one way into a sharded model's flat buffers
(optimizers, profiling, tools): see ``raggedfsdp.fsdp._buffers``.
"""

from raggedfsdp.fsdp._api import FSDP2_SURFACE, FSDPModule, UnshardHandle, fully_shard
from raggedfsdp.fsdp._buffers import BufferView, ParamSlice, buffer_of, buffers_of
from raggedfsdp.fsdp._fp8 import Float8BlockAllGather, Fp8Layout
from raggedfsdp.fsdp._group_ops import clip_grad_norm_
from raggedfsdp.fsdp._hooks import reads_no_parameters
from raggedfsdp.fsdp._policy import BlockPolicy, BlockRows, MixedPrecisionPolicy

__all__ = [
    "FSDP2_SURFACE",
    "BlockPolicy",
    "BlockRows",
    "BufferView",
    "FSDPModule",
    "Float8BlockAllGather",
    "Fp8Layout",
    "MixedPrecisionPolicy",
    "ParamSlice",
    "UnshardHandle",
    "buffer_of",
    "buffers_of",
    "clip_grad_norm_",
    "fully_shard",
    "reads_no_parameters",
]
