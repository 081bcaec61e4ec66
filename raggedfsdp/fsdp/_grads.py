"""The gradient path of a parameter group, from its pre-backward to its sharded
``.grad``s, as FSDP2's ``foreach_reduce`` is apart from its unshard path: where the
gradients are stored ([Note: gradients in place], [Note: gradient storage]), the
reduce-scatter (``post_backward``), the HSDP all-reduce and setting the sharded
gradients (``finalize_grads``).

``GradientPath`` is a part of ``ParamGroup`` (its base class): its methods use the
group's buffers, references and settings, defined in ``_param_group.py``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._device import DeviceStreams, new_group_like
from raggedfsdp.fsdp._hooks import may_read_parameters, reads_no_parameters
from raggedfsdp.fsdp._records import ParamRef, PendingGather, PendingReduce, ShardedState
from raggedfsdp.fsdp._subclass import is_plain
from raggedfsdp.fsdp._trace import logger, phase

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from raggedfsdp.fsdp._subclass import SubclassGather
    from raggedfsdp.fsdp.dbuffer import DBuffer
    from raggedfsdp.planner import BufferLayout

__all__ = ["DivideFactors", "GradientPath", "divide_factors", "mark_got_grad"]


class GradientPath:
    """The gradient methods of ``ParamGroup``."""

    # What the methods read of ``ParamGroup`` (set in its ``__init__``; see there).
    refs: list[ParamRef]
    name: str
    mesh: DeviceMesh
    process_group: dist.ProcessGroup
    world: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    requires_all_reduce: bool
    _partial_reduce: torch.Tensor | None  # 1D, S
    dtype: torch.dtype
    device: torch.device
    offload: bool
    streams: DeviceStreams
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    layout: BufferLayout
    subclass: SubclassGather | None
    dbuf: DBuffer
    state: ShardedState
    _gather: PendingGather | None
    needs_post_backward: bool
    grads_in_params: bool
    _in_place: bool
    grads_in_params_ran: bool | None
    grad_storage_reason: str | None
    _grads_hold_params: bool
    _reduce: PendingReduce | None
    requires_gradient_sync: bool
    gradient_divide_factor: float | None
    _accumulated: torch.Tensor | None  # 1D, m*S, reduce dtype
    force_sum_reduction: bool
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    reduce_scatter_comm: Any  # FSDP2's ReduceScatter, or None: see [Note: custom collectives]
    reduce_process_group: dist.ProcessGroup

    if TYPE_CHECKING:  # ParamGroup's methods

        def _expect(self, action: str, *states: ShardedState) -> None: ...
        def placements(self, ref: ParamRef) -> list: ...
        def param_mesh(self, ref: ParamRef) -> DeviceMesh: ...
        def wait_for_unshard(self) -> None: ...
        def reshard(self, post_forward: bool = False, free: bool = True) -> None: ...

    def release_dropped_grads(self) -> None:
        """Free the shard gradient storage if every sharded ``.grad`` was dropped."""
        if self._reduce is None and all(ref.param.grad is None for ref in self.refs):
            self.dbuf.shard_grads.free()

    def prepare_grads(
        self, unsharded: bool = True, reshard: bool = True, module_hooks: str | None = None
    ) -> None:
        """Get ready for the group's gradients (pre-backward); see [Note: gradient storage].

        Args:
            unsharded: the parameters were unsharded for backward (False after
                ``set_unshard_in_backward(False)``: backward needs only their gradients).
            reshard: ``post_backward`` will reshard (``reshard_after_backward``).
            module_hooks: a module backward hook that may read the group's parameters
                in backward (named), or None.
        """
        if unsharded:
            self._expect("prepare_grads (pre-backward)", ShardedState.UNSHARDED)
        self.needs_post_backward = True
        # A module called twice in forward whose first call's inputs need no gradient
        # reduces after its last call's backward, and may then run backward again:
        # finish that reduce and gather the rest in fresh gradient storage.
        self.wait_reduce()
        self.grad_storage_reason = self._separate_storage_reason(unsharded, reshard, module_hooks)
        self._in_place = self.grad_storage_reason is None
        self.grads_in_params_ran = self._in_place
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "fully_shard group %s: gradients %s",
                self.name,
                "written over the parameters"
                if self._in_place
                else f"in a storage of their own ({self.grad_storage_reason})",
            )

    def _separate_storage_reason(
        self, unsharded: bool, reshard: bool, module_hooks: str | None
    ) -> str | None:
        """Why this backward's gradients cannot be written over the parameters ([Note:
        gradients in place]), or None when they can."""
        if not self.grads_in_params:
            return "fully_shard(..., grads_in_params=False)"
        if self.subclass is not None:  # see [Note: tensor-subclass all-gather]
            return "tensor-subclass all-gather (the parameters are not views of the buffer)"
        if not unsharded:
            return "set_unshard_in_backward(False)"
        if not reshard:
            return "set_reshard_after_backward(False)"
        if not self.requires_gradient_sync or self._accumulated is not None:
            return "gradient accumulation without sync"
        if self.dbuf.global_grads.allocated:
            return "a second backward before the gradients were reduced"
        if torch.is_grad_enabled():
            return "backward with create_graph=True (the gradients are differentiable)"
        if module_hooks is not None:
            return module_hooks
        for ref in self.refs:
            p = ref.unsharded
            if p is None or not ref.requires_grad:
                continue
            if may_read_parameters((p._backward_hooks or {}).values()):
                return f"a tensor hook on parameter {ref.fqn!r}"
            if may_read_parameters(
                (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()
            ):
                return f"a post-accumulate-grad hook on the unsharded parameter {ref.fqn!r}"
        return None

    def _first_grad_hook(self, ref: ParamRef, grad: torch.Tensor) -> torch.Tensor:
        """Tensor hook of every unsharded parameter: runs before autograd accumulates
        ``grad`` (the parameter's whole gradient of this backward). A tensor subclass's
        gradient (one that flowed from a subclass parameter, torch's TwoTensor's, say)
        continues as its copy into a plain tensor, as FSDP2 copies every gradient into
        its reduce-scatter input (the subclass's own ``copy_`` decides the values)."""
        if not (is_plain(grad) or isinstance(grad, DTensor)):
            grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device).copy_(grad)
        if not self.needs_post_backward:
            return grad
        if self._in_place:
            self._grad_over_param(ref, grad)
        else:
            if not self.dbuf.global_grads.allocated:
                self._alloc_grads()
            tp, p, view = ref.tp, ref.unsharded, ref.assigned_grad
            if tp is not None and tp.dp_axes and p is not None and p.grad is view:
                # the data-parallel dims keep the gradient's placements: [Note: the SPMD mesh]
                if cast(DTensor, view).placements != tp.grad_placements(grad):
                    self._point_at_storage(ref, grad)
                    p.grad = ref.assigned_grad
        return grad

    def _grad_over_param(self, ref: ParamRef, like: torch.Tensor | None = None) -> None:
        """Point ``ref``'s unsharded ``.grad`` at its own parameter's storage, zeroed.

        [Note: gradients in place]
        A parameter's tensor hook runs when autograd has summed its whole gradient of
        this backward: every node that reads the parameter to compute a gradient of it
        has run. Its unsharded value is not needed again before the next all-gather, so
        its gradient takes its place in the global parameter storage: the hook zeroes
        the parameter's span and makes it ``.grad``, and ``AccumulateGrad`` adds the
        gradient into it (in place, as into a gradient storage). ``post_backward`` zeroes
        the spans that got no gradient (and the padding), reshards without freeing, and
        reduce-scatters the parameter storage; waiting the reduce-scatter frees it. A
        group so holds no gradient memory beside its unsharded parameters, where FSDP2
        holds each gradient from its creation to the reduce-scatter, and then a copy of
        them all as the reduce-scatter input.

        The writes go through the storage's ``alias`` (a version counter of its own):
        autograd still holds the group's other parameters, saved in forward and checked
        for in-place changes when their nodes run.

        When it does not apply, decided per group at each pre-backward (the group keeps a
        gradient storage of its own, [Note: gradient storage]; ``BufferView`` reports
        which ran and why): ``fully_shard(..., grads_in_params=False)``; gradients
        accumulated without sync (the parameters are gathered again for the next
        microbatch); ``reshard_after_backward=False``; ``unshard_in_backward=False``;
        and wherever something may read a parameter after its gradient is complete:
        grad mode on in backward (``create_graph=True``: the gradients' own graph reads
        the parameters), a user's tensor hook or post-accumulate-grad hook on an
        unsharded parameter, a module backward hook (or pre-hook) on any module of the
        group's subtree, or a global one. A ``.grad`` that autograd or a hook replaced
        out of place is copied into the storage at ``post_backward``.
        What is left to the model: nothing else reads a parameter's value in backward
        after its gradient is complete (a ``detach()``-ed use saved for a later node). A
        parameter whose gradient arrives twice in one backward (reentrant activation
        checkpointing of a parameter used in two checkpointed regions) raises.
        """
        if ref.grad_in_place:
            raise RuntimeError(
                f"fully_shard group {self.name}: parameter {ref.fqn!r} received a second "
                "gradient in one backward (reentrant activation checkpointing around several "
                "uses of it?) after the first had replaced its unsharded value; pass "
                "fully_shard(..., grads_in_params=False) for this module, or use "
                "non-reentrant checkpointing (use_reentrant=False)"
            )
        ref.grad_in_place = True
        grad = self.dbuf.global_grad_view(ref.fqn, in_params=True)
        grad.zero_()
        ref.assigned_grad = grad if ref.tp is None else ref.tp.grad_view(grad, like)
        assert ref.unsharded is not None  # its tensor hook called this
        ref.unsharded.grad = ref.assigned_grad

    def _take_param_storage(self) -> torch.Tensor:
        """``post_backward`` under [Note: gradients in place]: zero what is not a gradient,
        reshard keeping the storage; returns it (1D, m*S, compute dtype)."""
        flat = self.dbuf.global_params.alias  # 1D, m*S
        taken = sorted(
            span
            for ref in self.refs
            if ref.grad_in_place
            for span in self.dbuf.global_spans(ref.fqn)
        )
        at = 0
        for start, stop in [*taken, (flat.numel(), flat.numel())]:
            if start > at:
                flat[at:start].zero_()  # padding, and parameters without a gradient
            at = max(at, stop)
        for ref in self.refs:
            ref.grad_in_place = False
        self._in_place = False
        self.reshard(free=False)
        self._grads_hold_params = True
        return flat

    def _alloc_grads(self) -> None:
        """Allocate the flat global gradient storage (zeros) and point every unsharded
        ``.grad`` at its view.

        [Note: gradient storage]
        The group's unsharded gradients are views of one flat storage (the reduce-scatter
        input: no copy-in), allocated whole. It is allocated when the first gradient
        reaches the group, not at its pre-backward: a tensor hook on each unsharded
        parameter runs before autograd's ``AccumulateGrad``, which then adds the gradient
        into the view (in place; no copy). Until then the group holds no gradient memory:
        an embedding in a group of its own (torchtitan's grouping) from the start of
        backward to its very end. A group that got no gradient on this rank still reduces
        (zeros) in ``post_backward``, as every rank's does. Under a ``reduce_dtype`` the
        storage is freed as soon as it is cast (the cast is the reduce-scatter input).

        What this costs against FSDP2, which allocates each ``.grad`` as autograd makes
        it: from a group's first gradient to its reduce-scatter, the whole group's
        gradient bytes, where FSDP2 holds only the gradients made so far (and then a
        copy of all of them for its reduce-scatter). A group's first gradient comes early
        in its backward, where activations are at their largest; and a group holding an
        embedding and a head (``fully_shard`` of the root) holds the embedding's gradient
        bytes from the head's backward on.
        """
        self.dbuf.global_grads.alloc(zero=True)
        for ref in self.refs:
            if ref.requires_grad and ref.unsharded is not None and ref.unsharded.grad is None:
                self._point_at_storage(ref)
                ref.unsharded.grad = ref.assigned_grad

    def _point_at_storage(self, ref: ParamRef, like: torch.Tensor | None = None) -> None:
        grad = self.dbuf.global_grad_view(ref.fqn)
        ref.assigned_grad = grad if ref.tp is None else ref.tp.grad_view(grad, like)

    def _adopt_replaced_grads(self) -> None:
        """Copy into the gradient storage every unsharded ``.grad`` that is not the view
        we set: autograd replaces a ``.grad`` out of place when grad mode is on in
        backward (``create_graph=True``), and a user's hook may assign one. One copy per
        such parameter, only then; the common step has none."""
        for ref in self.refs:
            p = ref.unsharded
            if p is None or not ref.requires_grad or p.grad is ref.assigned_grad:
                continue
            grad = p.grad
            if grad is None:  # cleared after it was pointed at the storage: no gradient
                assert ref.assigned_grad is not None  # p.grad (None) is not it
                assigned = ref.assigned_grad
                local = cast(DTensor, assigned).to_local() if ref.tp is not None else assigned
                local.zero_()
                ref.got_grad = False
                continue
            if ref.assigned_grad is None:  # no storage view yet: make one
                if self._in_place:
                    self._grad_over_param(ref)
                else:
                    if not self.dbuf.global_grads.allocated:
                        self._alloc_grads()
                    self._point_at_storage(ref)
            assert ref.assigned_grad is not None  # made just above if it was not there
            assigned = ref.assigned_grad
            target = cast(DTensor, assigned).to_local() if ref.tp is not None else assigned
            grad = grad.detach()
            target.copy_(ref.tp.grad_local(grad) if ref.tp is not None else grad)
            p.grad = ref.assigned_grad
            ref.got_grad = True

    @phase("post_backward_reduce")
    def post_backward(self, reshard: bool) -> None:
        """The group's gradients are complete: start the reduce-scatter (or keep them)."""
        if not self.needs_post_backward:
            raise AssertionError(
                f"fully_shard group {self.name}: post_backward without a pre-backward "
                f"(state {self.state.value})"
            )
        self.needs_post_backward = False
        self._adopt_replaced_grads()
        in_place = None  # the parameter storage, holding the gradients
        if self._in_place:
            in_place = self._take_param_storage()
        elif reshard:
            self.reshard()
        if in_place is None and not self.dbuf.global_grads.allocated:
            self._alloc_grads()  # no gradient reached the group on this rank
        if not self.requires_gradient_sync:  # the unsharded gradients accumulate
            if self.reduce_dtype != self.compute_dtype:
                self._accumulate_in_reduce_dtype()
            return
        source = in_place  # None: the global gradient storage
        if self._accumulated is not None:  # earlier microbatches' gradients, reduce dtype
            self._accumulate_in_reduce_dtype()
            source, self._accumulated = self._accumulated, None
        earlier = self._reduce  # waited by prepare_grads: its sum is added at finalize
        if earlier is not None and earlier.work is not None:
            raise AssertionError(
                f"fully_shard group {self.name}: a reduce-scatter was started while an earlier "
                "one was still in flight"
            )
        accumulate = earlier is not None or any(ref.param.grad is not None for ref in self.refs)
        direct = (
            not accumulate
            and self.reduce_dtype == self.dtype
            and not self.offload
            and (self.replicate_group is None or self.requires_all_reduce)
        )
        # The reduce-scatter writes every element (padding too) on the direct path;
        # otherwise only parameters' parts are written: start from zeros.
        self.dbuf.shard_grads.alloc(zero=not direct)
        if (source is None or source is in_place) and self.reduce_dtype != self.compute_dtype:
            # One cast of the whole buffer, on the stream that made the gradients (as
            # FSDP2's copy-in): the cast is the reduce-scatter input, so the gradients'
            # storage goes at once instead of living until the reduce-scatter is waited.
            grads = self.dbuf.global_grads.tensor if source is None else source
            source = grads.to(self.reduce_dtype)
            self._free_unsharded_grads()
        factors = self._divide_factors()
        with self.streams.reducing():  # see [Note: streams]
            output = (
                self.dbuf.shard_grad
                if direct
                else torch.empty(
                    self.layout.shard_size, dtype=self.reduce_dtype, device=self.device
                )
            )
            work, inp = self.dbuf.reduce_scatter_grads(
                output,
                self.reduce_process_group,
                factors.reduce_scatter_op,
                self.reduce_dtype,
                async_op=True,
                source=source,
                before=factors.scale_input,
                comm=self.reduce_scatter_comm,
            )
        self._reduce = PendingReduce(
            work, output, direct, inp, earlier.output if earlier is not None else None
        )

    @property
    def holds_unreduced_grads(self) -> bool:
        """Gradients accumulated without sync wait for a reduce-scatter."""
        return not self.needs_post_backward and (
            self.dbuf.global_grads.allocated or self._accumulated is not None
        )

    def reduce_held_grads(self, reshard: bool) -> None:
        """``post_backward`` outside a backward, for gradients accumulated without sync
        (``FSDPState.reduce_held_grads``)."""
        self.needs_post_backward = True
        self.post_backward(reshard=reshard)

    def _divide_factors(self) -> DivideFactors:
        """How this group's reduction divides its gradients: see [Note: divide factors]."""
        return divide_factors(
            self.world,
            self.replicate_size if self.replicate_group is not None else None,
            self.reduce_dtype,
            self.gradient_divide_factor,
            self.force_sum_reduction,
            premul_sum=dist.get_backend(self.reduce_process_group) != "gloo",
        )

    def _accumulate_in_reduce_dtype(self) -> None:
        """Move this microbatch's unsharded gradients into the reduce-dtype accumulator.

        As FSDP2: without gradient sync, gradients accumulate in ``reduce_dtype`` (fp32
        under bf16 compute), not in the compute dtype. The compute-dtype storage is freed,
        so the next backward starts from zeros, and each microbatch's gradient is added
        to the accumulator once, upcast element by element (``acc += grad``).
        """
        grads = self.dbuf.global_grads.tensor  # 1D, m*S, compute dtype
        if self._accumulated is None:
            self._accumulated = grads.to(self.reduce_dtype)  # 1D, m*S, reduce dtype
        else:
            self._accumulated.add_(grads)
        for ref in self.refs:
            if ref.unsharded is not None:
                ref.unsharded.grad = None
            ref.assigned_grad = None
        self.dbuf.global_grads.free()

    @property
    def reduce_pending(self) -> bool:
        """A reduce-scatter was started and its gradients are not yet set."""
        return self._reduce is not None

    @property
    def reduce_in_flight(self) -> bool:
        """A reduce-scatter was started and not yet waited."""
        return self._reduce is not None and self._reduce.work is not None

    def use_separate_reduce_scatter_group(self, enable: bool) -> None:
        """Reduce-scatter over a process group of its own (the same ranks), or the shared one."""
        if enable and self.reduce_process_group is self.process_group:
            ranks = dist.get_process_group_ranks(self.process_group)
            self.reduce_process_group = new_group_like(ranks, self.process_group)
        elif not enable:
            self.reduce_process_group = self.process_group

    def reset_iter_state(self) -> None:
        """Drop the iteration: wait for collectives in flight, discard their results and the
        unsharded gradients, reshard."""
        if self._gather is not None:
            self.wait_for_unshard()
        if self._reduce is not None and self._reduce.work is not None:
            self._reduce.work.wait()
        self._reduce = None
        self._accumulated = None
        self._partial_reduce = None
        self.needs_post_backward = False
        self._in_place = False
        for ref in self.refs:
            ref.got_grad = False
            ref.grad_in_place = False
        self._free_unsharded_grads()
        self.reshard()

    def wait_reduce(self) -> None:
        """Wait for the reduce-scatter and free the unsharded gradients (the whole buffer)."""
        if self._reduce is None or self._reduce.work is None:
            return
        self._reduce.work.wait()
        self._reduce = self._reduce._replace(work=None, input=None)
        self._free_unsharded_grads()

    def _free_unsharded_grads(self) -> None:
        for ref in self.refs:
            if ref.unsharded is not None:
                ref.unsharded.grad = None
            ref.assigned_grad = None
        self.dbuf.global_grads.free()
        if self._grads_hold_params:  # see [Note: gradients in place]
            self._grads_hold_params = False
            self.dbuf.global_params.free()

    @phase("post_backward_set_grads")
    def finalize_grads(self, got_grad: list[bool]) -> list[str]:
        """Wait for the reduce-scatter and set the sharded ``.grad``s (views of shard grads).

        Returns the parameters another rank's gradient arrived for while this rank had
        none (see ``_gradients_arrived``); then no gradient of the group is set."""
        self.wait_reduce()
        if self._reduce is None:
            raise AssertionError(
                f"fully_shard group {self.name}: finalize_grads without a reduce-scatter"
            )
        output, direct, earlier = self._reduce.output, self._reduce.direct, self._reduce.earlier
        self._reduce = None
        if earlier is not None:
            output.add_(earlier)
        if self.replicate_group is not None:  # HSDP, see [Note: HSDP]
            if not self.requires_all_reduce:  # keep the reduced part; set no gradient yet
                if self._partial_reduce is None:
                    self._partial_reduce = output
                else:
                    self._partial_reduce.add_(output)
                return []
            if self._partial_reduce is not None:
                output.add_(self._partial_reduce)
                self._partial_reduce = None
            if self.replicate_size > 1:
                op = self._divide_factors().all_reduce_op
                dist.all_reduce(output, op=op, group=self.replicate_group)
        if self.all_reduce_hook is not None:  # before the post-division, as FSDP2
            self.all_reduce_hook(output)
        post = self._divide_factors().post
        if post is not None and post != 1:
            output.div_(post)
        if not direct and all(ref.param.grad is None for ref in self.refs):
            # only a dtype differs (reduce_dtype != param dtype): one cast of the buffer
            self.dbuf.shard_grad.copy_(output)
            direct = True
        arrived = _gradients_arrived(self, got_grad, output, direct)
        if arrived:
            for ref in self.refs:
                ref.got_grad = False
            return arrived
        for ref, gets_grad in zip(self.refs, got_grad):
            ref.got_grad = False
            if not ref.requires_grad or not gets_grad:
                if not direct and ref.param.grad is None:
                    # keep the buffer's norm exact: no stale values where .grad is None
                    self.dbuf.shard_grad_view(ref.fqn).zero_()
                continue
            if ref.sharded_grad is None:
                ref.sharded_grad = DTensor.from_local(
                    self.dbuf.shard_grad_view(ref.fqn),
                    self.param_mesh(ref),
                    self.placements(ref),
                    shape=ref.shape,
                    stride=ref.param.stride(),
                )
            existing = ref.param.grad
            if not direct:
                part = self.dbuf.local_view(output, ref.fqn)
                if existing is None:
                    ref.sharded_grad._local_tensor.copy_(part)
                else:
                    cast(DTensor, existing)._local_tensor.add_(part)
            if direct or existing is None:
                ref.param.grad = ref.sharded_grad
            _run_post_accumulate_grad_hooks(ref.param)
        return []


def _gradients_arrived(group: GradientPath, gets_grad: list[bool], output, direct) -> list[str]:
    """The parameters another rank's gradient arrived for where this rank leaves them
    without one: ranks used different parameters, and FSDP2's rule (see [Note: unused
    parameters] in ``_state.py``) would leave this rank's rows unstepped. Reads the host
    only for parameters this rank had no gradient for; fake tensors (the simulator) hold
    no values to read."""
    arrived = []
    for ref, gets in zip(group.refs, gets_grad):
        if gets or not ref.requires_grad:
            continue
        rows = (
            group.dbuf.shard_grad_view(ref.fqn)
            if direct
            else group.dbuf.local_view(output, ref.fqn)
        )
        if rows.numel() and not is_fake(rows) and bool(rows.any()):
            arrived.append(ref.fqn)
    return arrived


def _run_post_accumulate_grad_hooks(param: nn.Parameter) -> None:
    """As FSDP2: a sharded parameter's post-accumulate-grad hooks run once its reduced
    gradient is set (optimizer in backward steps it there). Autograd never runs them:
    the sharded parameter is not in the graph."""
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def mark_got_grad(ref: ParamRef):
    held = weakref.ref(ref)  # the hook is on ref's own parameter: weak back

    def hook(_param):
        alive = held()
        if alive is not None:
            alive.got_grad = True

    return reads_no_parameters(hook)


class DivideFactors(NamedTuple):
    """How a group's gradients are divided by the data-parallel size (FSDP2's
    ``_get_gradient_divide_factors``): see [Note: divide factors]."""

    scale_input: Callable[[torch.Tensor], None] | None  # in place, on the reduce-scatter input
    reduce_scatter_op: dist.ReduceOp | dist.ReduceOp.RedOpType
    all_reduce_op: dist.ReduceOp | dist.ReduceOp.RedOpType  # HSDP, over the replicate dim
    post: float | None  # divide the reduced gradients by it, after the all-reduce hook


def divide_factors(
    world: int,
    replicate: int | None,
    reduce_dtype: torch.dtype,
    factor: float | None,
    force_sum: bool,
    *,
    premul_sum: bool = True,
) -> DivideFactors:
    """FSDP2's division of the gradients, for a reduce-scatter over ``world`` ranks and
    (HSDP) an all-reduce over ``replicate`` ranks.

    [Note: divide factors]
    As FSDP2 (torch 2.13's ``_get_gradient_divide_factors`` and ``foreach_reduce``):

    - fp32 / bf16, no factor, no force-sum: ``AVG`` (``SUM`` over one rank in all).
    - fp32 / bf16 with ``set_gradient_divide_factor(f)``: the reduce-scatter is ``AVG``
      when ``f`` is its size, else ``PREMUL_SUM(1 / f)``; the all-reduce ``SUM``. gloo
      has no ``PREMUL_SUM`` (FSDP2 fails there): the input is multiplied by ``1 / f``,
      then summed, which is what ``PREMUL_SUM`` computes.
    - any other dtype (fp16, fp64), or ``set_force_sum_reduction_for_comms(True)``:
      ``SUM`` both ways, the factor ``f`` (default: the data-parallel size) split for
      fp16 / fp64 into a division of the input by ``pre`` (the first power of two whose
      square reaches ``f``, or where ``f`` stops dividing) and of the result by
      ``f / pre``, so that a sum of large fp16 gradients does not overflow (40,000 on
      each of 2 ranks sums to 40,000, not to inf); fp32 / bf16 under force-sum divide
      the result by ``f`` only.
    - over one rank the reduce-scatter is a copy; a factor it would have applied is a
      division of the input (FSDP2's ``input / factor``).

    The all-reduce hook (``set_all_reduce_hook``) sees the reduced gradients before the
    division of the result.
    """
    size = world * (replicate or 1)
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    if not overflow_risk and not force_sum:
        if factor is None:
            op = SUM if size == 1 else AVG
            return DivideFactors(None, op, op, None)
        if world == 1:
            return DivideFactors(_div(factor), SUM, SUM, None)
        if factor == world:
            return DivideFactors(None, AVG, SUM, None)
        if premul_sum:
            return DivideFactors(None, dist._make_nccl_premul_sum(1 / factor), SUM, None)
        return DivideFactors(_mul(1 / factor), SUM, SUM, None)
    if factor is None:
        factor = float(size)
    if not overflow_risk:
        return DivideFactors(None, SUM, SUM, factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return DivideFactors(_div(pre) if pre != 1 else None, SUM, SUM, factor / pre)


def _div(by: float) -> Callable[[torch.Tensor], None]:
    def scale(t: torch.Tensor) -> None:
        t.div_(by)

    return scale


def _mul(by: float) -> Callable[[torch.Tensor], None]:
    def scale(t: torch.Tensor) -> None:
        t.mul_(by)

    return scale
