"""FSDPState: the hooks of one ``fully_shard`` call, and the root's per-step bookkeeping.

[Note: execution]
Same shape as FSDP2. Forward pre-hook: unshard this group (one all-gather into the
global storage), then start the next group's all-gather (prefetch, in the order
recorded on the first step). Forward post-hook: reshard (free the global storage)
per ``reshard_after_forward`` (by default, all but the root). Backward: a hook on
the module's outputs unshards again and prefetches the previous group (as FSDP2:
at most two blocks unsharded at once); each gradient is written over its own
unsharded parameter (see [Note: gradients in place]); an
autograd function on the module's inputs fires once its backward is done and
starts the group's reduce-scatter (asynchronous). The root queues a final callback that reduces any
group whose inputs needed no gradient (embeddings, the root itself), waits for
every reduce-scatter, and sets the sharded ``.grad``s, with one small all-reduce
that tells every rank which parameters received a gradient on any rank.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.utils import _apply_to_tensors
from torch.nn.modules.module import _global_backward_hooks, _global_backward_pre_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten

from raggedfsdp.fsdp._hooks import may_read_parameters
from raggedfsdp.fsdp._policy import MixedPrecisionPolicy
from raggedfsdp.fsdp._records import CommSettings
from raggedfsdp.fsdp._reshard import (
    PostForwardGroup,
    _post_forward_group,
    resolve_reshard_after_forward,
)
from raggedfsdp.fsdp._trace import phase
from raggedfsdp.fsdp._training_state import _MOVES, TrainingState
from raggedfsdp.fsdp._weak import WeakList

if TYPE_CHECKING:
    from raggedfsdp.fsdp._group_set import GroupSet
    from raggedfsdp.fsdp._param_group import ParamGroup

__all__ = ["FSDPState", "state_of"]

_STATE_ATTR = "_raggedfsdp_state"


_HOOKS = ("_pre_forward", "_post_forward", "_pre_backward", "_post_backward", "_final_callback")


def _run_hooks_eagerly(cls: type[FSDPState]) -> None:
    """Make the state's hooks run eagerly under ``torch.compile`` (as FSDP2 does its hooks).

    [Note: hooks and torch.compile]
    A block compiled with ``fullgraph=True`` (torchtitan compiles each block, then
    shards it) calls these hooks from its compiled ``_call_impl``: they manage storages
    (``untyped_storage().resize_``), collectives and Python state that dynamo cannot
    trace, so dynamo skips them and the compiled region is the module's own compute.
    Done once for the class, when ``fully_shard`` first runs: ``torch._dynamo`` is not
    imported by ``import raggedfsdp``; and a state holding wrapped bound methods of its
    own would be a reference cycle (see [Note: freed without the garbage collector]).
    """
    if cls._hooks_run_eagerly:
        return
    for name in _HOOKS:
        hook = cls.__dict__[name]
        setattr(cls, name, torch._dynamo.disable(hook, recursive=True, reason="raggedfsdp"))
    cls._hooks_run_eagerly = True


def _reshard_hook(group: GroupSet):
    """A state-dict pre-hook that reshards ``group``, holding it weakly (see [Note: freed
    without the garbage collector] in ``_weak.py``)."""
    held = weakref.ref(group)

    def hook(*args, **kwargs) -> None:
        alive = held()
        if alive is not None:
            alive.reshard()

    return hook


def state_of(module: nn.Module) -> FSDPState | None:
    """The ``FSDPState`` of a module passed to ``fully_shard``, else None."""
    return module.__dict__.get(_STATE_ATTR)


class FSDPState:
    """The hooks and settings of one ``fully_shard`` call (one module, or a list of modules
    forming one group: the group unshards before the first of them runs forward and
    reshards after the last). ``settings``: the call's communication settings, which
    its buffers' groups share (the ``set_*`` methods write them)."""

    _hooks_run_eagerly: ClassVar[bool] = False  # see _run_hooks_eagerly

    def __init__(
        self,
        modules: Sequence[nn.Module],
        group: GroupSet | None,
        mesh,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | int | None,
        settings: CommSettings,
    ):
        self._modules = tuple(weakref.ref(m) for m in modules)  # they hold this state
        self.group = group
        self.name = group.name if group is not None else type(modules[0]).__name__
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.settings = settings
        self.reshard_after_backward = True
        self.set_reshard_after_forward(reshard_after_forward)
        self.training_state = TrainingState.IDLE
        self.is_root: bool | None = None
        self._root: weakref.ref[FSDPState] | None = None
        # explicit, else recorded order; held weakly, as every list of states below (see
        # [Note: freed without the garbage collector] in ``_weak.py``)
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self._pending_post_backward = 0
        self._forward_pending: set[int] = set()  # ids of this group's modules yet to run
        self.unshard_in_backward = True
        self.max_reduces_in_flight = 1
        self.post_optim_event = None  # set_post_optim_event: the next gathers wait on it
        # root only
        self._states: list[FSDPState] = WeakList()
        self._forward_order: list[FSDPState] = WeakList()
        self._recording = True
        # This iteration's post-forwards, in order and with multiplicity: a group's
        # pre-backward prefetches the group that finished forward just before its own
        # matching post-forward (as FSDP2's post_forward_order)
        self._post_forward_order: list[FSDPState] = WeakList()
        self._post_forward_indices: list[int] = []  # this group's places in the root's
        self._callback_queued = False
        self._reduce_order: list[FSDPState] = WeakList()  # in the order they started reducing
        self._state_dict_hooked = False  # see lazy_init_group
        _run_hooks_eagerly(type(self))
        for module in self.modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, with_kwargs=True)

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The modules passed to ``fully_shard`` (held weakly: each holds this state)."""
        return tuple(m for m in (ref() for ref in self._modules) if m is not None)

    @property
    def root(self) -> FSDPState | None:
        """The root's state once lazily initialized (held weakly: the root holds this
        state in its ``_states``)."""
        return None if self._root is None else self._root()

    @root.setter
    def root(self, state: FSDPState | None) -> None:
        self._root = None if state is None else weakref.ref(state)

    # ---- settings (FSDPModule's set_* methods call these) ---------------------------------
    def set_reshard_after_forward(self, value: bool | int | None) -> None:
        """What the forward post-hook does with the unsharded parameters (as FSDP2).

        ``None``: True, except for the root, whose parameters backward needs first.
        ``True`` / ``False``: free them / keep them until backward. An int ``k`` that
        divides the mesh size: keep them sharded over groups of ``k`` consecutive
        ranks; ``k == 1`` means False (with FSDP2's warning: 1 is not True) and
        ``k ==`` the mesh size means True.

        Raises:
            ValueError: not a bool, an int or None; an int that is not a factor.
        """
        self._auto_reshard = value is None
        resolved, size = resolve_reshard_after_forward(value, self.mesh.size(-1), warn=True)
        self.reshard_after_forward: bool = resolved
        made: dict[int, PostForwardGroup | None] = {}  # one per shard group
        for g in _buffers(self.group):  # a buffer of its own mesh sizes its own group
            key = id(g.process_group)
            if key not in made:
                if g.mesh is self.mesh:
                    k = size
                else:
                    k = resolve_reshard_after_forward(value, g.world)[1]
                made[key] = _post_forward_group(g.mesh, k) if k is not None else None
            g.post_forward_group = made[key]

    def set_reshard_after_backward(self, value: bool) -> None:
        self.reshard_after_backward = value

    def set_requires_gradient_sync(self, value: bool) -> None:
        self.settings.requires_gradient_sync = value

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.settings.gradient_divide_factor = float(factor)

    def set_requires_all_reduce(self, value: bool) -> None:
        self.settings.requires_all_reduce = value

    def set_force_sum_reduction(self, value: bool) -> None:
        self.settings.force_sum_reduction = value

    def set_reduce_scatter_unused_params(self, value: bool) -> None:
        self.settings.reduce_scatter_unused_params = value

    def set_all_reduce_hook(self, hook) -> None:
        self.settings.all_reduce_hook = hook

    def set_max_reduces_in_flight(self, value: int) -> None:
        self.max_reduces_in_flight = value

    def set_separate_reduce_scatter_group(self, value: bool) -> None:
        if self.group is not None:
            self.group.use_separate_reduce_scatter_group(value)

    def set_unshard_in_backward(self, value: bool) -> None:
        self.unshard_in_backward = value

    def set_post_optim_event(self, event) -> None:
        self.post_optim_event = event

    def set_prefetch(self, *, forward: list[FSDPState] | None = None, backward=None) -> None:
        """Groups to all-gather at the start of this module's forward / backward."""
        if forward is not None:
            self.forward_prefetch = WeakList(forward)
        if backward is not None:
            self.backward_prefetch = WeakList(backward)

    # ---- root -----------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if len(self.modules) > 1:  # FSDP2's words first: see [Note: FSDP2's exception types]
            raise RuntimeError(
                f"FSDP requires a single root module but got {list(self.modules)} (fully_shard: "
                "a list of modules is one group, never the root; fully_shard their common "
                "parent too, and run forward through it)"
            )
        self.is_root = True
        self.root = self
        name_of: dict[FSDPState, str] = {}  # each state, in module order: its first module's
        for top in self.modules:
            for name, m in top.named_modules():
                if (s := state_of(m)) is not None:
                    name_of.setdefault(s, name)
        self._states = WeakList(name_of)
        for s in self._states:
            if s is not self:
                if s.is_root:  # FSDP2's words first: see [Note: FSDP2's exception types]
                    raise RuntimeError(
                        f"FSDP state has already been lazily initialized for {name_of[s]}\n"
                        "FSDP requires running forward through the root module first "
                        f"(fully_shard: {name_of[s]!r} ran forward before its root, so it "
                        "initialized as a root of its own; run the first forward through the "
                        "root module)"
                    )
                s.is_root, s.root = False, self
        try:
            for s in self._states:  # adoption first: the checks below see what it took
                s.lazy_init_group()
            self._validate_params()
        except Exception:  # the next forward, once the model is fixed, initializes again
            for s in self._states:
                s.is_root, s.root = None, None
            raise

    def lazy_init_group(self) -> None:
        """At the root's lazy init (or a ``module.unshard()`` before it), for each group, once
        (as FSDP2's ``FSDPParamGroup.lazy_init``):
        adopt what the modules hold in place of its parameters (see [Note: parameters
        registered after fully_shard]), and make ``state_dict()`` see the sharded
        parameters (a forward with ``reshard_after_forward=False`` leaves them unsharded:
        the module's state-dict pre-hook reshards, as FSDP2's)."""
        if self.group is None or self._state_dict_hooked:
            return
        self.group.adopt_registered()
        holders = {id(ref.uses[0][0]): ref.uses[0][0] for ref in self.group.refs}
        for module in holders.values():  # the group is held weakly: modules are held by it
            module.register_state_dict_pre_hook(_reshard_hook(self.group))
        self._state_dict_hooked = True

    def _validate_params(self) -> None:
        """FSDP2's checks at the root's first forward, with its exception types and its
        words (then ours): a parameter that two groups shard, a parameter still on meta.

        Raises:
            ValueError: two groups shard one parameter (FSDP2 accepts both calls).
            RuntimeError: a group's parameters are still on the meta device.
        """
        order: dict[int, tuple[int, str]] = {}  # id(param) -> (position, fqn from the root)
        for top in self.modules:
            for name, p in top.named_parameters(remove_duplicate=False):
                order.setdefault(id(p), (len(order), name))

        def fqn(ref) -> str:
            return order.get(id(ref.sharded), (0, ref.fqn))[1]

        seen: set[int] = set()
        for s in self._states:
            for ref in s.group.refs if s.group is not None else ():
                if ref.origin < 0:  # not from fully_shard's own collection: no uid
                    continue
                if ref.origin in seen:
                    raise ValueError(
                        f"Parameter '{fqn(ref)}' is shared with a parameter already managed by "
                        "another FSDP group. For shared/tied parameters, use "
                        "fully_shard([module_a, module_b]) to place them in the same FSDP group. "
                        "(raggedfsdp: two groups would hold two copies that drift apart; "
                        "fully_shard the modules' common parent, or the list of them)"
                    )
                seen.add(ref.origin)
        for s in self._states:  # the other copy is under another root: FSDP2 trains both
            for ref in s.group.refs if s.group is not None else ():
                if ref.resharded:
                    raise ValueError(
                        f"fully_shard: parameter '{fqn(ref)}' is also sharded by a fully_shard "
                        "call outside this model, which holds a copy of its own; the two would "
                        "drift apart: fully_shard the modules' common parent, or the list of them"
                    )
        for s in self._states:  # FSDP2 reads hooks set on a local shard after fully_shard
            for g in s.group.groups if s.group is not None else ():
                for ref in g.refs if g.subclass is None else ():
                    local = getattr(ref.sharded, "_local_tensor", None)
                    if "fsdp_pre_all_gather" in getattr(local, "__dict__", {}):
                        raise NotImplementedError(
                            f"fully_shard: parameter '{fqn(ref)}' got FSDP2's all-gather hooks "
                            "on its local tensor after fully_shard; raggedfsdp gathers a plain "
                            "parameter as a view of its buffer and reads the hooks of tensor "
                            "subclasses only: make the parameter a tensor subclass before "
                            "fully_shard (the hooks may then be set on its local tensor)"
                        )
        for s in self._states:
            on_meta = s.group.on_meta() if s.group is not None else []
            if on_meta:
                names = [
                    fqn(r) for r in sorted(on_meta, key=lambda r: order.get(id(r.sharded), (0,))[0])
                ]
                raise RuntimeError(
                    "FSDP parameters should be materialized from meta device before training, "
                    f"but the following were still on meta device: {names}\n"
                    "For example, call module.to_empty(device) to materialize to device and "
                    "call module.reset_parameters() on each module to initialize values "
                    "(or load them: load_state_dict(..., assign=True), set_model_state_dict)."
                )

    def _enter(self, event: str) -> None:
        """Move ``training_state`` by ``event``; see [Note: training states]."""
        starts, to = _MOVES[event]
        if self.training_state not in starts:
            allowed = " or ".join(sorted(s.value for s in starts))
            raise RuntimeError(
                f"fully_shard module {self.name}: {event} expects the module's state to be "
                f"{allowed}, but it is {self.training_state.value}; the FSDP hooks ran out "
                "of order (a forward hook called without its pre-forward hook, or a "
                "gradient without its backward). After an exception in forward or "
                "backward, call reset_iter_state() on the root module."
            )
        self.training_state = to

    def _next_in_order(self, step: int) -> FSDPState | None:
        assert self.root is not None  # set by _lazy_init, before the first forward
        order = self.root._forward_order
        if self.root._recording or self not in order:
            return None
        i = order.index(self) + step
        return order[i] if 0 <= i < len(order) else None

    # ---- forward --------------------------------------------------------------------------
    @phase("pre_forward")
    def _pre_forward(self, module, args, kwargs):
        if _in_backward():
            return self._rerun_in_backward(args, kwargs)
        if not self._forward_pending:  # the first of the group's modules: unshard
            self._group_pre_forward()
            self._forward_pending = {id(m) for m in self.modules}
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _group_pre_forward(self) -> None:
        if self.is_root is None:
            self._lazy_init()
        if self.is_root:  # a new forward: a group whose last module ran several times, or
            for s in self._states:  # not at all, starts afresh (FSDP2 resets it the same way)
                s._forward_pending = set()
                s._post_forward_indices = []
            self._post_forward_order = WeakList()
        root = self.root
        assert root is not None  # set by _lazy_init above
        if root._recording and self not in root._forward_order:
            root._forward_order.append(self)
        elif self.is_root:
            root._recording = False
        self._enter("pre_forward")
        if self.group is not None:
            self.group.release_dropped_grads()
            if root.post_optim_event is not None:
                self.group.streams.wait_event(root.post_optim_event)
                root.post_optim_event = None
            self.group.unshard()
            self.group.wait_for_unshard()
        for nxt in self._prefetch_targets(forward=True):
            assert nxt.group is not None  # _prefetch_targets keeps states with a group
            nxt.group.unshard(async_op=True)

    def _rerun_in_backward(self, args, kwargs):
        """Activation checkpointing reruns the module's forward inside a backward: the
        parameters are gathered if they are not unsharded, and stay so for the backward
        that follows (the post-forward hook does not reshard); nothing is prefetched (the
        next module in forward order has had its backward) and the group's state is left
        to its backward hooks, as FSDP2 does (``is_bw()`` in its post-forward). The
        gradient hooks are still added: reentrant checkpointing backpropagates through
        the rerun's graph."""
        if self.group is not None and not self.group.is_unsharded:
            self.group.unshard()
            self.group.wait_for_unshard()
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    @phase("post_forward")
    def _post_forward(self, module, args, *kwargs_and_output):
        """Forward hook ``(module, args, kwargs, output)``; torch's
        ``register_fsdp_forward_method`` calls it as ``(module, args, output)``."""
        output = kwargs_and_output[-1]
        if _in_backward():  # a rerun: see _rerun_in_backward
            if torch.is_grad_enabled():
                output = self._register_pre_backward(output)
            if self.mp_policy.output_dtype is not None:
                output = _cast_floats(output, self.mp_policy.output_dtype)
            return output
        self._forward_pending.discard(id(module))
        if not self._forward_pending:  # the last of the group's modules: reshard
            self._group_post_forward()
        if torch.is_grad_enabled():
            output = self._register_pre_backward(output)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _group_post_forward(self) -> None:
        if self.group is not None:
            if not torch.is_grad_enabled():  # no backward will need them (eval, validation)
                self.group.reshard()
            elif self.reshard_after_forward and not (self.is_root and self._auto_reshard):
                self.group.reshard(post_forward=True)
        if torch.is_grad_enabled() and self.root is not None:
            self._post_forward_indices.append(len(self.root._post_forward_order))
            self.root._post_forward_order.append(self)
        self._enter("post_forward")

    def _prefetch_targets(self, forward: bool) -> list[FSDPState]:
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            targets = explicit
        elif forward:
            nxt = self._next_in_order(1)
            targets = [nxt] if nxt is not None else []
        else:
            targets = self._backward_prefetch_target()
        return [t for t in targets if t.group is not None]

    def _backward_prefetch_target(self) -> list[FSDPState]:
        """The group whose forward finished just before this backward's matching one (each
        pre-backward consumes one of the group's post-forwards, latest first). A backward
        that reaches only part of the forward (the chunked loss backpropagates each chunk
        through the head alone) consumes only its own groups' post-forwards, so it
        prefetches no group that only a later backward needs."""
        if not self._post_forward_indices:
            return []
        index = self._post_forward_indices.pop()
        assert self.root is not None  # a post-forward ran under it
        target = self.root._post_forward_order[index - 1] if index > 0 else None
        return [target] if target is not None and target is not self else []

    # ---- backward -------------------------------------------------------------------------
    def _register_pre_backward(self, output):
        flat, spec = tree_flatten(output)
        hooked = False
        for t in flat:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                if t._base is not None:  # as FSDP2 warns
                    names = ", ".join(type(m).__name__ for m in self.modules)
                    warnings.warn(
                        f"fully_shard-wrapped module ({names}) returned a view tensor. An "
                        "in-place op on this view (e.g., `x += y`) will silently drop the "
                        "pre-backward hook and skip the all-gather, which can cause backward "
                        "to fail or produce wrong gradients. Use out-of-place ops (`out = out "
                        "+ y`, not `out += y`) or `.clone()` the output before any in-place op.",
                        UserWarning,
                        stacklevel=2,
                    )
                t.register_hook(self._pre_backward)
                hooked = True
        if not hooked:
            return output
        return tree_unflatten(flat, spec)

    @phase("pre_backward")
    def _pre_backward(self, grad):
        root = self.root
        if not root._callback_queued:
            root._callback_queued = True
            Variable._execution_engine.queue_callback(root._final_callback)
        if self.training_state is not TrainingState.PRE_BACKWARD:
            self._enter("pre_backward")
            if self.group is not None:
                if self.unshard_in_backward:
                    self.group.unshard()
                    self.group.wait_for_unshard()
                self.group.prepare_grads(
                    unsharded=self.unshard_in_backward,
                    reshard=self.reshard_after_backward,
                    module_hooks=self._module_backward_hook(),
                )
            for prev in self._prefetch_targets(forward=False):
                prev.group.unshard(async_op=True)
        return grad

    def _module_backward_hook(self) -> str | None:
        """A module backward hook that may read this group's parameters in backward (named),
        or None: such a hook runs after the gradients of the module's parameters, so they
        must not be written over the parameters ([Note: gradients in place])."""
        if may_read_parameters(
            [*_global_backward_hooks.values(), *_global_backward_pre_hooks.values()]
        ):
            return "a global module backward hook (register_module_full_backward_hook)"
        for top in self.modules:
            for m in top.modules():  # every backward: no names built unless one is found
                if (m._backward_hooks or m._backward_pre_hooks) and may_read_parameters(
                    [*m._backward_hooks.values(), *m._backward_pre_hooks.values()]
                ):
                    name = next(n for n, sub in top.named_modules() if sub is m)
                    where = f"{type(top).__name__}.{name}" if name else type(m).__name__
                    return f"a backward hook on module {where}"
        return None

    def _register_post_backward(self, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = _PostBackward.apply(self, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
        self._pending_post_backward += 1
        return tree_unflatten(flat, spec)

    @phase("post_backward")
    def _post_backward(self) -> None:
        self._pending_post_backward -= 1
        if self._pending_post_backward == 0 and self.group is not None:
            if self.group.needs_post_backward:
                self._enter("post_backward")
                assert self.root is not None  # set by _lazy_init, before the first forward
                self.root._wait_earlier_reduces(self)
                self.group.post_backward(reshard=self.reshard_after_backward)
                self.root._reduce_order.append(self)

    def reduce_held_grads(self) -> None:
        """Start the reduce-scatter of gradients this group's backwards accumulated
        without sync, outside a backward (a pipeline schedule's end of step: see [Note:
        FSDP2's state, as torch reads it]); the root's ``_final_callback`` then waits
        for it and sets the sharded gradients. Nothing when no gradient is held."""
        if self.group is None or not self.group.holds_unreduced_grads:
            return
        root = self.root or self
        root._wait_earlier_reduces(self)
        self.group.reduce_held_grads(reshard=self.reshard_after_backward)
        root._reduce_order.append(self)

    def _wait_earlier_reduces(self, starting: FSDPState) -> None:
        """Keep at most ``max_reduces_in_flight`` (of the group about to reduce) reduce-
        scatters in flight: finish the oldest and free their unsharded gradients, so a
        backward never holds every group's at once."""
        in_flight = [
            s.group for s in self._reduce_order if s.group is not None and s.group.reduce_in_flight
        ]  # a state with a group is all _reduce_order holds
        for group in in_flight[: max(0, len(in_flight) - starting.max_reduces_in_flight + 1)]:
            group.wait_reduce()

    @phase("root_post_backward_callback")
    def _final_callback(self) -> None:
        """End of backward (root only): reduce the rest, wait, set the sharded grads."""
        for s in self._states:
            if s.training_state is not TrainingState.IDLE:
                # Its backward ran in this one. A group this backward did not reach keeps
                # its count: its forward's graph still waits for a later backward (the
                # chunked loss backpropagates each chunk through the head alone, then the
                # trunk once).
                s._pending_post_backward = 0
            # A group some of whose modules did not run (the chunked loss runs the head of
            # a [norm, head] group alone, once per chunk): the next forward starts afresh.
            s._forward_pending = set()
            if s.group is not None and s.group.needs_post_backward:
                self._wait_earlier_reduces(s)  # as in _post_backward: bounded in flight
                s.group.post_backward(reshard=s.reshard_after_backward)
                self._reduce_order.append(s)
            elif s.group is not None and s.reshard_after_backward:
                s.group.reshard()
            s._enter("end_backward")
        pending = [g for s in self._states for g in _buffers(s.group) if g.grads.reduce_pending]
        if pending:
            got_grad, arrived = _local_grad_flags(pending), []
            for g in pending:  # every group's collectives complete, then any error
                n = len(g.refs)
                arrived += g.finalize_grads(got_grad[:n])
                got_grad = got_grad[n:]
        self._callback_queued = False
        self._reduce_order = WeakList()
        if pending and arrived:
            raise RuntimeError(
                f"fully_shard: parameter(s) {arrived} got no gradient on rank "
                f"{dist.get_rank()} but another rank's gradient arrived for them: ranks "
                "used different parameters in this backward, and their groups' gradients "
                "were not set. Call model.set_reduce_scatter_unused_params(True) (as with "
                "FSDP2) so that every rank counts an unused parameter as a zero gradient."
            )

    def reset_iter_state(self) -> None:
        """Root: after an exception mid-iteration, reshard everything, drop collectives in
        flight (waited, their results discarded) and the iteration's gradients."""
        for s in self._states:
            s._pending_post_backward = 0
            s._forward_pending = set()
            s._enter("reset")
            if s.group is not None:
                s.group.reset_iter_state()
        self._callback_queued = False
        self._reduce_order = WeakList()


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a forward run
    now is activation checkpointing's rerun)."""
    return torch._C._current_graph_task_id() != -1


def _local_grad_flags(pending: list[ParamGroup]) -> list[bool]:
    """Per parameter of ``pending``: does it get the reduced gradient on this rank?

    [Note: unused parameters] As FSDP2, decided by each rank alone, with no collective
    beyond the reduce-scatters: a parameter gets the reduced gradient if this rank's
    backward gave it one, or if its group reduces unused parameters
    (``set_reduce_scatter_unused_params(True)``: a zero gradient, as FSDP2 and DDP's
    ``find_unused_parameters``). Otherwise its ``.grad`` stays None. Each group
    reduce-scatters its whole buffer either way (zeros where this rank has no gradient),
    so ranks that used different parameters never mismatch a collective, and the rank
    that lacks a gradient another rank produced sees it arrive in its rows: it raises
    (``ParamGroup.finalize_grads``), naming the parameter and the setting, where FSDP2's
    reduce-scatters would mismatch. An earlier design let ranks agree through one MAX
    all-reduce of a flag per parameter every backward; FSDP2's rule needs none.
    """
    return [
        ref.got_grad or g.settings.reduce_scatter_unused_params for g in pending for ref in g.refs
    ]


def _buffers(group: GroupSet | None) -> list[ParamGroup]:
    """The ``ParamGroup``s of a state's group (its buffers), none for None."""
    return [] if group is None else group.groups


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward is done."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.state._post_backward()
        return (None, *grads)


def _cast_floats(tree, dtype: torch.dtype):
    """Cast the floating-point tensors in ``tree`` to ``dtype``, through the containers
    FSDP2 reaches (torch's ``_apply_to_tensors``: dataclasses, named tuples, dicts,
    lists, tuples, sets, ``PackedSequence``), as FSDP2 casts inputs and outputs."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return _apply_to_tensors(cast, tree)
