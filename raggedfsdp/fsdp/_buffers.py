"""The one public way into a sharded model's buffers: ``buffers_of`` and ``buffer_of``.

Optimizers, clipping, profiling, checkpoints and benchmarks that want to work on
whole buffers (one kernel per buffer instead of one per parameter) read them here,
never through ``ParamGroup`` or ``DBuffer`` directly::

    for buf in buffers_of(model):            # every buffer under fully_shard'd modules
        buf.shard                            # 1D, S elements: this rank's shard storage
        buf.shard_grad                       # 1D, S (0 elements while freed)
        for s in buf.params:                 # ParamSlice: fqn, param, [start, stop)
            s.view(buf.shard)                # == s.param.to_local(), a view of shard
            buf.shard[s.start : s.stop]      # its span (with a gapped stack's gaps)

    found = buffer_of(p)                     # (BufferView, ParamSlice) or None

A ``BufferView`` is live: it reads the buffer as it is now, so it stays right
after ``to_empty`` / ``Module.to`` rebuild the storages. There is one view per
buffer (the same object each time), so views can key dictionaries.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from raggedfsdp.fsdp._records import OWNER_ATTR
from raggedfsdp.fsdp._state import state_of
from raggedfsdp.planner import BufferLayout

if TYPE_CHECKING:
    from raggedfsdp.fsdp._param_group import ParamGroup

__all__ = ["BufferView", "ParamSlice", "buffer_of", "buffers_of"]

# The one BufferView of each live group (weak-keyed: the view holds its group weakly too).
_VIEWS: weakref.WeakKeyDictionary[ParamGroup, BufferView] = weakref.WeakKeyDictionary()


def _owner(param: torch.Tensor) -> tuple[ParamGroup, int] | None:
    """The (group, index) of a sharded parameter whose group is alive, else None."""
    owner = getattr(param, OWNER_ATTR, None)
    if owner is None:
        return None
    group_ref, index = owner
    group = group_ref()
    return None if group is None else (group, index)


@dataclass(frozen=True)
class ParamSlice:
    """One parameter of a buffer, as this rank holds it.

    Args:
        fqn: the parameter's name, relative to the module passed to ``fully_shard``.
        param: the sharded parameter (an ``nn.Parameter`` holding a RaggedShard DTensor).
        start: first element of this rank's part in the shard storage.
        stop: one past its last (``start == stop`` when this rank holds none of it).
        requires_grad: whether the parameter is trainable.
        size, stride: the local tensor's, as a view of the shard storage from ``start``:
            contiguous, except a stack planned with member gaps, whose whole members
            lie ``stride[0]`` apart with padding between them (``member_gaps=True``).
    """

    fqn: str
    param: nn.Parameter
    start: int
    stop: int
    requires_grad: bool
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of this parameter on this rank (gaps excluded)."""
        return math.prod(self.size)

    @property
    def contiguous(self) -> bool:
        """Whether the part is one run ``[start, stop)`` of the storage (no member gaps)."""
        return self.numel == self.stop - self.start

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This part as a view of ``flat``, a 1D tensor laid out as the shard storage
        (the shard, its gradient, an optimizer's flat state): the local tensor's shape."""
        if self.contiguous:
            return flat[self.start : self.stop].view(self.size)
        return flat[self.start :].as_strided(self.size, self.stride)

    def positions(self, device: torch.device) -> torch.Tensor:
        """The shard-storage positions of this part's elements, in the local tensor's
        order (1D int64, ``numel`` long): an index into any flat state laid out as the
        shard, which skips member gaps."""
        idx = torch.arange(self.start, self.stop, device=device)
        return idx if self.contiguous else idx.as_strided(self.size, self.stride).reshape(-1)


class BufferView:
    """One flat buffer of a ``fully_shard`` group, read through (see the module docstring).

    Storages (all 1-D): ``shard`` (S elements, the sharded parameters' data),
    ``shard_grad`` (S, the sharded ``.grad``s' data; 0 elements while freed),
    ``unsharded`` and ``unsharded_grad`` (m * S in the compute dtype; 0 elements
    while freed: between forward and backward when resharded, and outside backward).
    In backward the gradients are written over the parameters in ``unsharded`` (see
    [Note: gradients in place]); ``unsharded_grad`` is allocated only when they are not
    (``grads_in_params=False``, accumulation without sync, no reshard after backward).
    """

    __slots__ = ("_group_ref",)

    def __init__(self, group: ParamGroup):
        self._group_ref = weakref.ref(group)  # _VIEWS holds the view for its group: weak

    @property
    def _group(self) -> ParamGroup:
        group = self._group_ref()
        if group is None:
            raise RuntimeError(
                "BufferView: its model was freed (the view outlived the last reference to "
                "the fully_shard module); take views from buffers_of(model) while it lives"
            )
        return group

    def __repr__(self) -> str:
        return f"BufferView({len(self.params)} params, {self.layout.describe()})"

    # ---- layout and placement -------------------------------------------------------------
    @property
    def layout(self) -> BufferLayout:
        """The planner's layout of this buffer (identical on every rank)."""
        return self._group.layout

    @property
    def rank(self) -> int:
        """This rank's index on the mesh dim the buffer is sharded over."""
        return self._group.rank

    @property
    def world_size(self) -> int:
        """Ranks the buffer is sharded over."""
        return self._group.world

    @property
    def mesh(self):
        """The ``DeviceMesh`` of the sharded parameters."""
        return self._group.mesh

    @property
    def process_group(self):
        """The process group the buffer's collectives run over."""
        return self._group.process_group

    @property
    def device(self) -> torch.device:
        """The compute device (the global storages'; the shard's too unless offloaded)."""
        return self._group.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the sharded parameters and their gradients."""
        return self._group.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the unsharded parameters and gradients (``param_dtype``)."""
        return self._group.compute_dtype

    @property
    def fp8(self):
        """The buffer's ``Fp8Layout`` when it gathers in FP8 (its tile, scale dtype, where
        each rank's scales lie in the all-gather: [Note: FP8 all-gather]), else None."""
        return self._group.fp8

    @property
    def subclass_all_gather(self) -> bool:
        """Whether the buffer's parameters are tensor subclasses gathered through FSDP2's
        ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` ([Note: tensor-subclass
        all-gather]); ``unsharded`` then stays empty: the hooks make the unsharded values."""
        return self._group.subclass is not None

    # ---- storages -------------------------------------------------------------------------
    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard storage: 1D, S elements."""
        return self._group.dbuf.shard

    @property
    def shard_grad(self) -> torch.Tensor:
        """This rank's shard gradient storage: 1D, S elements (0 while freed)."""
        return self._group.dbuf.shard_grad

    @property
    def unsharded(self) -> torch.Tensor:
        """The global parameter storage: 1D, m * S elements (0 while freed)."""
        return self._group.dbuf.global_params.tensor

    @property
    def unsharded_grad(self) -> torch.Tensor:
        """The global gradient storage: 1D, m * S elements (0 while freed, and while the
        gradients are in ``unsharded``: see ``unsharded_holds_grads``)."""
        return self._group.dbuf.global_grads.tensor

    @property
    def unsharded_holds_grads(self) -> bool:
        """``unsharded`` holds gradients (some written over their parameters in this
        backward, or all of them, until the reduce-scatter is waited)."""
        group = self._group
        return group.grads.holds_params or any(ref.grad_in_place for ref in group.refs)

    @property
    def grads_in_params_ran(self) -> bool | None:
        """Whether the last backward wrote the gradients over the parameters ([Note:
        gradients in place]); False: it used ``unsharded_grad``; None before any backward."""
        return self._group.grads.in_params_ran

    @property
    def grad_storage_reason(self) -> str | None:
        """Why the last backward used ``unsharded_grad`` (``grads_in_params=False``,
        ``create_graph=True``, a hook that may read the parameters...), else None."""
        return self._group.grads.storage_reason

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes of ``unsharded`` (and of ``unsharded_grad``) while allocated."""
        return self.layout.global_size * self.compute_dtype.itemsize

    def storages(self) -> tuple[torch.Tensor, ...]:
        """``(shard, shard_grad, unsharded, unsharded_grad)``."""
        return (self.shard, self.shard_grad, self.unsharded, self.unsharded_grad)

    # ---- parameters -----------------------------------------------------------------------
    @property
    def params(self) -> tuple[ParamSlice, ...]:
        """Every parameter of the buffer, in the order of the module's parameters."""
        return tuple(self.slice_at(i) for i in range(len(self._group.refs)))

    def slice_at(self, index: int) -> ParamSlice:
        """The ``ParamSlice`` of the buffer's ``index``-th parameter: O(1), so a lookup per
        parameter (``buffer_of``, the optimizers) costs O(P) per buffer, not O(P^2)."""
        group = self._group
        ref = group.refs[index]
        size, stride, start = group.layout.local_view_args(ref.fqn, group.rank)
        n = math.prod(size)  # the last element's offset + 1 (every stride positive)
        stop = start + sum((k - 1) * d for k, d in zip(size, stride)) + 1 if n else start
        return ParamSlice(ref.fqn, ref.param, start, stop, ref.requires_grad, size, stride)

    def slice_of(self, param: torch.Tensor) -> ParamSlice:
        """The ``ParamSlice`` of ``param``, a sharded parameter of this buffer.

        Raises:
            ValueError: ``param`` is not a parameter of this buffer.
        """
        owner = _owner(param)
        if owner is None or owner[0] is not self._group:
            raise ValueError(
                "BufferView.slice_of: the tensor is not a sharded parameter of this buffer; "
                "use buffer_of(param) to find its buffer"
            )
        return self.slice_at(owner[1])

    @property
    def tensor_parallel(self) -> bool:
        """Whether some parameter is also placed by tensor parallelism: its sharded DTensor
        lives on the ``(tp, *mesh)`` mesh (see [Note: FSDP x TP] in ``_tp.py``)."""
        return any(ref.tp is not None and ref.tp.model_parallel for ref in self._group.refs)

    def grads_are_views(self) -> bool:
        """Whether every trainable parameter's ``.grad`` is its view of ``shard_grad``.

        Then stepping ``shard`` with ``shard_grad`` as whole tensors updates exactly
        what stepping each parameter with its ``.grad`` would (frozen parameters and
        padding hold zero gradients).
        """
        return all(
            ref.param.grad is not None and ref.param.grad is ref.sharded_grad
            for ref in self._group.refs
            if ref.requires_grad
        )


def _view_of(group: ParamGroup) -> BufferView:
    view = _VIEWS.get(group)
    if view is None:
        view = _VIEWS[group] = BufferView(group)
    return view


def buffer_of(param: torch.Tensor) -> tuple[BufferView, ParamSlice] | None:
    """``(its buffer, its slice)`` for a parameter sharded by ``fully_shard``, else None."""
    owner = _owner(param)
    if owner is None:
        return None
    group, index = owner
    view = _view_of(group)
    return view, view.slice_at(index)


def buffers_of(obj: nn.Module | Iterable[torch.Tensor]) -> list[BufferView]:
    """The buffers of a sharded model, or the buffers holding some parameters.

    Args:
        obj: a module (every buffer of the ``fully_shard`` groups in its tree, in
            module order) or tensors (the buffers holding any of them, in first-seen
            order; tensors that ``fully_shard`` did not shard are skipped).

    Returns:
        A list of ``BufferView``s, each buffer once.
    """
    views: dict[int, BufferView] = {}
    if isinstance(obj, nn.Module):
        for m in obj.modules():
            state = state_of(m)
            if state is not None and state.group is not None:
                for g in state.group.groups:
                    views.setdefault(id(g), _view_of(g))
        return list(views.values())
    for t in obj:
        found = buffer_of(t)
        if found is not None:
            views.setdefault(id(found[0]), found[0])
    return list(views.values())
