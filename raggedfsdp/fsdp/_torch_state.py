"""What torch code that reads FSDP2's own state finds on a raggedfsdp module.

[Note: FSDP2's state, as torch reads it]
``torch.distributed.pipelining`` ends a pipeline step by reaching into FSDP2's state
through ``torch.distributed.fsdp.fully_shard.state(module)`` (torch 2.13's
``_PipelineStageBase.perform_reduce_grad``): for every state of the model,
``post_backward()`` on each of its ``_fsdp_param_groups`` (reduce the gradients its
microbatches accumulated without sync), then the root's
``_root_post_backward_final_callback()`` (wait, set the sharded gradients). A
raggedfsdp module registers a ``TorchStateView`` under the key torch reads, which
answers exactly those calls with raggedfsdp's own: ``FSDPState.reduce_held_grads`` and
``FSDPState._final_callback``. It also answers what code (torch's own FSDP2 tests among
it) reads to find the root: ``_lazy_init()`` (a no-op once initialized, as FSDP2's) and
``_is_root``; a state has one view, so ``_state_ctx.all_states`` lists the views
``fully_shard.state`` returns. Anything else read through it raises AttributeError,
naming the attribute, as a missing attribute of FSDP2's state would.
``raggedfsdp.fully_shard.state(module)`` is the same lookup (``torch_state_of``), so code
written against FSDP2's ``fully_shard.state`` reads the same view after the import
switch.
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING

import torch.distributed.fsdp as torch_fsdp
from torch import nn

if TYPE_CHECKING:
    from raggedfsdp.fsdp._state import FSDPState

__all__ = ["TorchStateView", "register_torch_state", "torch_state_of"]


class TorchStateView:
    """A raggedfsdp ``FSDPState`` as ``fully_shard.state(module)`` callers read FSDP2's.
    Holds its state weakly: the modules hold both (see [Note: freed without the garbage
    collector] in ``_weak.py``)."""

    def __init__(self, state: FSDPState):
        self._ref = weakref.ref(state)

    @property
    def _state(self) -> FSDPState:
        state = self._ref()
        if state is None:
            raise RuntimeError("fully_shard.state: the module this state belonged to was freed")
        return state

    @property
    def _is_root(self) -> bool | None:
        return self._state.is_root

    def _lazy_init(self) -> None:
        if self._state.is_root is None:  # as FSDP2's: a no-op once initialized
            self._state._lazy_init()

    @property
    def _state_ctx(self) -> _StateContext:
        return _StateContext(self._state)

    @property
    def _fsdp_param_groups(self) -> list[_ParamGroupView]:
        return [] if self._state.group is None else [_ParamGroupView(self._state)]

    def _root_post_backward_final_callback(self) -> None:
        (self._state.root or self._state)._final_callback()


# The one view of each live state (weak-keyed; a view holds its state weakly too).
_VIEWS: weakref.WeakKeyDictionary[FSDPState, TorchStateView] = weakref.WeakKeyDictionary()


def _view_of(state: FSDPState) -> TorchStateView:
    view = _VIEWS.get(state)
    if view is None:
        view = _VIEWS[state] = TorchStateView(state)
    return view


class _StateContext:
    def __init__(self, state: FSDPState):
        self._state = state

    @property
    def all_states(self) -> list[TorchStateView]:
        root = self._state.root or self._state
        return [_view_of(s) for s in (root._states or [root])]


class _ParamGroupView:
    def __init__(self, state: FSDPState):
        self._state = state

    def post_backward(self) -> None:
        self._state.reduce_held_grads()


# torch's own fully_shard, taken when raggedfsdp is imported: code that later rebinds
# ``torch.distributed.fsdp.fully_shard`` to raggedfsdp's must not hide its state key.
_TORCH_FULLY_SHARD = torch_fsdp.fully_shard


def _contract_key():
    """The key torch's ``fully_shard.state`` looks a module's state up by, or None."""
    func = getattr(_TORCH_FULLY_SHARD, "__wrapped__", None)
    contract = importlib.import_module("torch.distributed._composable.contract")
    state_key = getattr(contract, "STATE_KEY", None)
    return None if func is None or state_key is None else (state_key, func)


def register_torch_state(module: nn.Module, state: FSDPState) -> None:
    """Make ``torch.distributed.fsdp.fully_shard.state(module)`` answer ``state``."""
    key = _contract_key()
    if key is not None:
        state_key, func = key
        module.__dict__.setdefault(state_key, {})[func] = _view_of(state)


def torch_state_of(module: nn.Module):
    """``fully_shard.state(module)``, as torch's: the state registered for ``module`` by a
    ``fully_shard`` call (a ``TorchStateView`` for raggedfsdp's, FSDP2's own for FSDP2's),
    else None."""
    key = _contract_key()
    if key is None:
        return None
    state_key, func = key
    return module.__dict__.get(state_key, {}).get(func)
