"""raggedfsdp: block-aware fully sharded data parallelism for PyTorch."""

from raggedfsdp import _dtensor_ext
from raggedfsdp.placement import RaggedShard

_dtensor_ext.install()

__all__ = ["RaggedShard"]
