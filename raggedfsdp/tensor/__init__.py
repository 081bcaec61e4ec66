"""The tensor layer: the RaggedShard placement and what DTensor needs to carry it.

``RaggedShard`` (``placement.py``) cuts a tensor's rows into equal blocks and gives each
rank a whole number of them. DTensor has no registry for new placements, so importing
this package installs, once, the patches of ``_dtensor_ext`` (redistribution,
element-wise, row-wise and reduction ops, checkpoints and torch's state-dict helpers)
and ``_dtensor_init.py`` (random init, ``any`` / ``all`` / ``select``); see
[Note: DTensor patches]. ``collectives.py`` holds the two in-place collectives every
layer above uses.
"""

from raggedfsdp.tensor import _dtensor_ext, _dtensor_init
from raggedfsdp.tensor._dtensor_ext import (
    UNTESTED_TORCH_ENV,
    RaggedPiece,
    ragged_axis,
    ragged_piece,
    range_to_boxes,
)
from raggedfsdp.tensor.placement import RaggedShard

_dtensor_ext.install()
_dtensor_init.install()

__all__ = [
    "UNTESTED_TORCH_ENV",
    "RaggedPiece",
    "RaggedShard",
    "ragged_axis",
    "ragged_piece",
    "range_to_boxes",
]
