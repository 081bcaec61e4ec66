"""Every hook that makes ``RaggedShard`` a working DTensor placement in torch 2.13.

[Note: DTensor patches]
DTensor 2.13 has no registry for new placements (its sharding propagation, redistribute
and ``full_tensor`` know only its own placements). This package is the one place that
patches it; each patch handles a DTensor only when a ``RaggedShard`` is among its
placements and hands every other DTensor to torch's original code unchanged:

=====================================  ==============================================
patched                                what it does for RaggedShard
=====================================  ==============================================
``DTensor.from_local``                 validates placements, shape and local size
``distribute_tensor``                  broadcast as Replicate, keep the rank's rows
``redistribute_local_tensor`` (x3)     RS<->R, RS<->Shard(0), RS<->RS (one
                                       all-to-all), Partial->RS (one reduce-scatter)
``ShardingPropagator`` (instance)      element-wise / foreach ops keep RS (a Replicate
                                       argument of the same rows is sliced locally;
                                       broadcasts within rows allowed); norms and sums
                                       give a Partial; row-wise reductions, softmax and
                                       views keep RS, no communication; ``t``,
                                       ``transpose`` / ``permute`` moving rows and
                                       ``addmm`` gather RS to Replicate (one all-gather):
                                       [Note: row-wise ops]; others raise, naming the op
                                       and the placements
custom op handlers                     norms, amax, amin safe on empty shards;
                                       in-place random ops, any/all, select:
                                       ``_dtensor_init``
``DTensor.__create_write_items__``,    DCP boxes of a ragged row range
``__create_chunk_list__``,
``__get_tensor_shard__``
``compute_local_shape_and_global_offset``  the box of the rank's rows
``_state_dict_utils._distribute_tensors``  broadcast_from_rank0 keeps the rank's rows
=====================================  ==============================================

One module per kind of patch, each importing only those before it: ``checks.py``
(where a RaggedShard cuts), ``creation.py`` (``from_local``, ``distribute_tensor``),
``redistribute.py``, ``rowwise.py`` (the row-wise rules), ``propagation.py`` (which ops
keep a RaggedShard), ``handlers.py`` (the custom op handlers and the propagation's
install), ``dcp.py`` (checkpoint boxes and torch's state-dict helpers); this file
installs them.

The patches are installed once, by ``install()``, when the package ``raggedfsdp.tensor``
is imported (as it is by anything that uses a RaggedShard: ``from raggedfsdp import
RaggedShard`` or ``fully_shard``),
and only on the torch versions in ``_SUPPORTED_TORCH``; anything else refuses to
import rather than risk silently wrong results, unless ``RAGGEDFSDP_UNTESTED_TORCH=1``
asks to try it (with a warning). Torch's
``distribute_tensor`` keeps its function object (names bound before ``import
raggedfsdp`` see the change) and gets a trampoline as its code.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.tensor._api as dtensor_api
import torch.distributed.tensor._dispatch as dtensor_dispatch
import torch.distributed.tensor._redistribute as dtensor_redistribute
from torch.distributed.tensor import DTensor

from raggedfsdp.tensor._dtensor_ext.checks import (
    RaggedPiece,
    _is_ragged,
    ragged_axis,
    ragged_piece,
)
from raggedfsdp.tensor._dtensor_ext.creation import (
    _copy_of,
    _distribute_tensor,
    _distribute_tensor_trampoline,
    _from_local,
    _torch_distribute_tensor,
)
from raggedfsdp.tensor._dtensor_ext.dcp import (
    _create_chunk_list,
    _create_write_items,
    _get_tensor_shard,
    install_state_dict_helpers,
    range_to_boxes,
)
from raggedfsdp.tensor._dtensor_ext.handlers import _install_propagation, _to_torch
from raggedfsdp.tensor._dtensor_ext.redistribute import _redistribute_local_tensor

# The names the package's other modules import from here.
__all__ = [
    "UNTESTED_TORCH_ENV",
    "RaggedPiece",
    "_copy_of",
    "_is_ragged",
    "_to_torch",
    "install",
    "ragged_axis",
    "ragged_piece",
    "range_to_boxes",
]

_SUPPORTED_TORCH = ("2.13.",)
# Set to "1" to import on another torch anyway, with a warning (how the GPU check ran on
# the accelerator machine's own torch); the tests here run on the supported one only.
UNTESTED_TORCH_ENV = "RAGGEDFSDP_UNTESTED_TORCH"
_installed = False


def install() -> None:
    """Install every patch of this package once. Raises ImportError on an untested torch."""
    global _installed
    if _installed:
        return
    if not torch.__version__.startswith(_SUPPORTED_TORCH):
        found = (
            f"raggedfsdp patches DTensor internals tested on torch {_SUPPORTED_TORCH}, "
            f"found torch {torch.__version__}"
        )
        if os.environ.get(UNTESTED_TORCH_ENV) != "1":
            raise ImportError(
                f"{found}; install torch==2.13.0, or set {UNTESTED_TORCH_ENV}=1 to try this "
                f"torch at your own risk (a patched internal may be missing or differ)"
            )
        warnings.warn(f"{found}; going on because {UNTESTED_TORCH_ENV}=1", stacklevel=2)
    # Deliberate patches of torch's DTensor and modules (mypy forbids assigning to a method
    # or setting an attribute a module does not declare).
    DTensor.from_local = staticmethod(_from_local)  # type: ignore[method-assign]
    # `from torch.distributed.tensor import distribute_tensor` may have bound torch's
    # function before raggedfsdp was imported: give that very function object our code.
    dtensor_api._raggedfsdp_distribute_tensor = _distribute_tensor  # type: ignore[attr-defined]
    _torch_distribute_tensor.__code__ = _distribute_tensor_trampoline.__code__
    for module in (dtensor_redistribute, dtensor_dispatch, dtensor_api):
        module.redistribute_local_tensor = _redistribute_local_tensor  # type: ignore[attr-defined]
    _install_propagation()
    DTensor.__create_write_items__ = _create_write_items  # type: ignore[method-assign]
    DTensor.__create_chunk_list__ = _create_chunk_list  # type: ignore[method-assign]
    DTensor.__get_tensor_shard__ = _get_tensor_shard  # type: ignore[method-assign]
    install_state_dict_helpers()
    _installed = True
