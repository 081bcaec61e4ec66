"""The records of a parameter group: where its parameters are (``ShardedState``), each
parameter and the module attributes holding it (``ParamRef``), and the collectives in
flight (``PendingGather``, ``PendingReduce``). See [Note: group states] in
``_param_group.py``."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._tp import TPSpec
from raggedfsdp.fsdp._weak import WeakPairs
from raggedfsdp.tensor.placement import RaggedShard

__all__ = [
    "CommSettings",
    "OWNER_ATTR",
    "ParamRef",
    "PendingGather",
    "PendingReduce",
    "ShardedState",
]

# A sharded parameter knows its (weak reference to its group, index): how ``buffer_of``
# finds its buffer. Weak, so that the group (which holds the parameter) and its storages
# go with the model's last reference, not at a garbage collection: see
# [Note: freed without the garbage collector] in ``_weak.py``. An attribute, not a
# weak-keyed registry: Module._apply swaps tensors (swap_tensors), which refuses tensors
# that have weak references.
OWNER_ATTR = "_raggedfsdp_owner"


class ShardedState(enum.Enum):
    """Where a group's parameters are (see [Note: group states])."""

    SHARDED = "sharded"  # modules hold the RaggedShard parameters; global storage freed
    SHARDED_POST_FORWARD = "sharded_post_forward"  # sharded, plus a piece kept for backward
    UNSHARDED = "unsharded"  # modules hold views of the global storage


class PendingGather(NamedTuple):
    """An all-gather in flight (``unshard`` issued it, ``wait_for_unshard`` ends it)."""

    work: dist.Work
    version: int  # version counter of the global storage before the gather (see [Note])
    input: torch.Tensor  # 1D: the shard, its cast, or the post-forward piece; alive until wait
    received: torch.Tensor | None = None  # FP8: the gathered codes and scales (1D uint8)


class PendingReduce(NamedTuple):
    """A reduce-scatter issued by ``post_backward``, until ``finalize_grads`` consumes it."""

    work: dist.Work | None  # None once waited
    output: torch.Tensor  # 1D, S elements, reduce dtype: the shard gradient storage if direct
    direct: bool  # output is the shard gradient storage itself (nothing to add or cast)
    input: torch.Tensor | None  # the cast gradients (reduce dtype != compute dtype); alive
    earlier: torch.Tensor | None  # a finished reduce of this backward to add (see post_backward)


@dataclass(eq=False)
class ParamRef:
    """One parameter of a group and every module attribute that holds it."""

    fqn: str
    uses: list[tuple[nn.Module, str]]  # (module, attribute); tied parameters have several
    shape: torch.Size
    requires_grad: bool
    placement: RaggedShard | None = None
    tp: TPSpec | None = None  # placed by tensor parallelism too: see [Note: FSDP x TP]
    sharded: nn.Parameter | None = None  # DTensor(RaggedShard) over a shard-storage view
    unsharded: nn.Parameter | None = None  # over a global-storage view (plain, or TP DTensor)
    sharded_grad: DTensor | None = None  # DTensor over a shard-gradient view (cached)
    got_grad: bool = False  # this rank accumulated a gradient into it this backward
    grad_in_place: bool = False  # its gradient replaced its unsharded value this backward
    assigned_grad: torch.Tensor | None = None  # the unsharded .grad we set (a storage view)
    hooks: list = field(default_factory=list)
    origin: int = -1  # the parameter fully_shard got, by uid (FSDP2's _orig_param_uid)
    resharded: bool = False  # an earlier fully_shard call sharded that parameter too

    def __post_init__(self) -> None:
        # the modules hold the group that holds this record: weak back, see
        # [Note: freed without the garbage collector] in ``_weak.py``
        self.uses = WeakPairs(self.uses)

    @property
    def param(self) -> nn.Parameter:
        """``sharded``, which the group sets when it is built (None only while it remakes it)."""
        if self.sharded is None:
            raise AssertionError(f"parameter {self.fqn!r} has no sharded parameter")
        return self.sharded

    def register(self, param: nn.Parameter) -> None:
        for module, name in self.uses:
            module._parameters[name] = param


@dataclass(eq=False)
class CommSettings:
    """The communication settings of one ``fully_shard`` call: one object, made by
    ``fully_shard`` and shared by reference by the call's ``FSDPState`` and every buffer's
    ``ParamGroup`` (a re-plan hands it to the new groups, [Note: re-tied parameters] in
    ``_group_set.py``). Each ``FSDPModule.set_*`` method writes its field here once."""

    requires_gradient_sync: bool = True  # False: accumulate unsharded gradients locally
    requires_all_reduce: bool = True  # HSDP: False keeps the reduced part (accumulation)
    gradient_divide_factor: float | None = None  # see [Note: divide factors] in ``_divide.py``
    force_sum_reduction: bool = False  # SUM, then divide (set_force_sum_reduction_for_comms)
    reduce_scatter_unused_params: bool = False  # see [Note: unused parameters] in ``_state.py``
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # on the reduced output
    # set_custom_all_gather / set_custom_reduce_scatter (FSDP2's AllGather, ReduceScatter),
    # or None: see [Note: custom collectives] in ``_api.py``
    all_gather_comm: Any = None
    reduce_scatter_comm: Any = None
