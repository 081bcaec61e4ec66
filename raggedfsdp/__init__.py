"""raggedfsdp: block-aware fully sharded data parallelism for PyTorch."""

from raggedfsdp import _dtensor_ext
from raggedfsdp.placement import RaggedShard

_dtensor_ext.install()

from raggedfsdp.fsdp import (  # noqa: E402  (after the DTensor hooks are in place)
    BlockPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    UnshardHandle,
    fully_shard,
)

__all__ = [
    "BlockPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "RaggedShard",
    "UnshardHandle",
    "fully_shard",
]
