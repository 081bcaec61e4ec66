"""The gradient path of a parameter group, from its pre-backward to its sharded
``.grad``s, as functions over explicit inputs (as FSDP2's ``foreach_reduce`` is apart from
its unshard path): where the gradients are stored ([Note: gradients in place], [Note:
gradient storage]), the reduce-scatter (``start_reduce``), the HSDP all-reduce and
setting the sharded gradients (``finalize_grads``).

What a group keeps of its gradients between a pre-backward and its sharded ``.grad``s is
one ``GradState``, which ``ParamGroup`` owns. Every function here takes that state, the
group's parameters (``refs``, module order) and ``DBuffer``, and where it reduces, a
``ReduceSpec`` (process groups, dtypes, device, streams) and the call's ``CommSettings``;
none reads the group itself.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._divide import DivideFactors, divide_factors
from raggedfsdp.fsdp._hooks import may_read_parameters, reads_no_parameters
from raggedfsdp.fsdp._records import CommSettings, ParamRef, PendingReduce
from raggedfsdp.fsdp._subclass import is_plain
from raggedfsdp.fsdp._trace import logger

if TYPE_CHECKING:
    from raggedfsdp.fsdp._device import DeviceStreams
    from raggedfsdp.fsdp.dbuffer import DBuffer

__all__ = [
    "DivideFactors",
    "GradState",
    "ReduceSpec",
    "divide_factors",
    "finalize_grads",
    "finish_backward",
    "first_grad",
    "holds_unreduced_grads",
    "mark_got_grad",
    "prepare_grads",
    "release_dropped_grads",
    "reset_grads",
    "start_reduce",
    "wait_reduce",
]


@dataclass(eq=False)
class GradState:
    """What a group keeps of its gradients from a pre-backward to its sharded ``.grad``s
    (``ParamGroup.grads``; the functions of this module read and write it)."""

    needs_post_backward: bool = False  # a pre-backward ran; its post_backward has not
    in_place: bool = False  # this backward writes gradients over the parameters
    in_params_ran: bool | None = None  # the last backward's mode (BufferView reports it)
    storage_reason: str | None = None  # why it kept a gradient storage of its own
    holds_params: bool = False  # the global parameter storage holds gradients
    reduce: PendingReduce | None = None  # from start_reduce to finalize_grads
    accumulated: torch.Tensor | None = None  # 1D, m*S, reduce dtype: _accumulate_in_reduce_dtype
    partial_reduce: torch.Tensor | None = None  # 1D, S: reduced, not all-reduced (HSDP)

    @property
    def reduce_pending(self) -> bool:
        """A reduce-scatter was started and its gradients are not yet set."""
        return self.reduce is not None

    @property
    def reduce_in_flight(self) -> bool:
        """A reduce-scatter was started and not yet waited."""
        return self.reduce is not None and self.reduce.work is not None


class ReduceSpec(NamedTuple):
    """Where and in which dtypes a group's gradients are reduced (what FSDP2's
    ``foreach_reduce`` takes as arguments); ``ParamGroup.reduce_spec`` makes it at each
    use (its device and dtypes follow ``Module._apply``, its process group
    ``set_separate_reduce_scatter_group``)."""

    process_group: dist.ProcessGroup  # the reduce-scatter's: the shard group, or a copy
    world: int  # its size
    replicate_group: dist.ProcessGroup | None  # HSDP: the all-reduce's (replicate dim)
    replicate_size: int  # 1 without HSDP
    dtype: torch.dtype  # the parameters' (the sharded gradients')
    compute_dtype: torch.dtype  # the unsharded gradients'
    reduce_dtype: torch.dtype
    device: torch.device  # the compute device (the global storages')
    streams: DeviceStreams
    offload: bool  # see [Note: CPU offload] in ``_param_group.py``


# ---- pre-backward: where the gradients go ----------------------------------------------------
def release_dropped_grads(grads: GradState, refs: list[ParamRef], dbuf: DBuffer) -> None:
    """Free the shard gradient storage if every sharded ``.grad`` was dropped."""
    if grads.reduce is None and all(ref.param.grad is None for ref in refs):
        dbuf.shard_grads.free()


def prepare_grads(
    grads: GradState,
    refs: list[ParamRef],
    dbuf: DBuffer,
    name: str,
    settings: CommSettings,
    *,
    grads_in_params: bool,
    subclass: bool,
    unsharded: bool,
    reshard: bool,
    module_hooks: str | None,
) -> None:
    """Get ready for the group's gradients (pre-backward); see [Note: gradient storage].

    Args:
        grads_in_params: ``fully_shard(..., grads_in_params=)``.
        subclass: the group gathers tensor subclasses ([Note: tensor-subclass all-gather]).
        unsharded, reshard, module_hooks: see ``ParamGroup.prepare_grads``.
    """
    grads.needs_post_backward = True
    # A module called twice in forward whose first call's inputs need no gradient
    # reduces after its last call's backward, and may then run backward again:
    # finish that reduce and gather the rest in fresh gradient storage.
    wait_reduce(grads, refs, dbuf)
    if not grads_in_params:
        reason: str | None = "fully_shard(..., grads_in_params=False)"
    elif subclass:  # see [Note: tensor-subclass all-gather]
        reason = "tensor-subclass all-gather (the parameters are not views of the buffer)"
    else:
        sync = settings.requires_gradient_sync and grads.accumulated is None
        reason = _separate_storage_reason(refs, dbuf, sync, unsharded, reshard, module_hooks)
    grads.storage_reason = reason
    grads.in_place = reason is None
    grads.in_params_ran = grads.in_place
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "fully_shard group %s: gradients %s",
            name,
            "written over the parameters"
            if grads.in_place
            else f"in a storage of their own ({reason})",
        )


def _separate_storage_reason(
    refs: list[ParamRef],
    dbuf: DBuffer,
    sync: bool,
    unsharded: bool,
    reshard: bool,
    module_hooks: str | None,
) -> str | None:
    """Why this backward's gradients cannot be written over the parameters ([Note:
    gradients in place]), or None when they can. ``sync``: the gradients are reduced at
    this backward's end (none accumulated without sync)."""
    if not unsharded:
        return "set_unshard_in_backward(False)"
    if not reshard:
        return "set_reshard_after_backward(False)"
    if not sync:
        return "gradient accumulation without sync"
    if dbuf.global_grads.allocated:
        return "a second backward before the gradients were reduced"
    if torch.is_grad_enabled():
        return "backward with create_graph=True (the gradients are differentiable)"
    if module_hooks is not None:
        return module_hooks
    for ref in refs:
        p = ref.unsharded
        if p is None or not ref.requires_grad:
            continue
        if may_read_parameters((p._backward_hooks or {}).values()):
            return f"a tensor hook on parameter {ref.fqn!r}"
        if may_read_parameters((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
            return f"a post-accumulate-grad hook on the unsharded parameter {ref.fqn!r}"
    return None


# ---- backward: each gradient into its storage ------------------------------------------------
def first_grad(
    grads: GradState,
    refs: list[ParamRef],
    dbuf: DBuffer,
    name: str,
    ref: ParamRef,
    grad: torch.Tensor,
) -> torch.Tensor:
    """The tensor hook of every unsharded parameter (``ref``'s): runs before autograd
    accumulates ``grad`` (the parameter's whole gradient of this backward). A tensor
    subclass's gradient (one that flowed from a subclass parameter, torch's TwoTensor's,
    say) continues as its copy into a plain tensor, as FSDP2 copies every gradient into
    its reduce-scatter input (the subclass's own ``copy_`` decides the values)."""
    if not (is_plain(grad) or isinstance(grad, DTensor)):
        grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device).copy_(grad)
    if not grads.needs_post_backward:
        return grad
    if grads.in_place:
        _grad_over_param(dbuf, name, ref, grad)
    else:
        if not dbuf.global_grads.allocated:
            _alloc_grads(refs, dbuf)
        tp, p, view = ref.tp, ref.unsharded, ref.assigned_grad
        if tp is not None and tp.dp_axes and p is not None and p.grad is view:
            # the data-parallel dims keep the gradient's placements: [Note: the SPMD mesh]
            if cast(DTensor, view).placements != tp.grad_placements(grad):
                _point_at_storage(dbuf, ref, grad)
                p.grad = ref.assigned_grad
    return grad


def _grad_over_param(
    dbuf: DBuffer, name: str, ref: ParamRef, like: torch.Tensor | None = None
) -> None:
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
            f"fully_shard group {name}: parameter {ref.fqn!r} received a second "
            "gradient in one backward (reentrant activation checkpointing around several "
            "uses of it?) after the first had replaced its unsharded value; pass "
            "fully_shard(..., grads_in_params=False) for this module, or use "
            "non-reentrant checkpointing (use_reentrant=False)"
        )
    ref.grad_in_place = True
    grad = dbuf.global_grad_view(ref.fqn, in_params=True)
    grad.zero_()
    ref.assigned_grad = grad if ref.tp is None else ref.tp.grad_view(grad, like)
    assert ref.unsharded is not None  # its tensor hook called this
    ref.unsharded.grad = ref.assigned_grad


def _alloc_grads(refs: list[ParamRef], dbuf: DBuffer) -> None:
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
    dbuf.global_grads.alloc(zero=True)
    for ref in refs:
        if ref.requires_grad and ref.unsharded is not None and ref.unsharded.grad is None:
            _point_at_storage(dbuf, ref)
            ref.unsharded.grad = ref.assigned_grad


def _point_at_storage(dbuf: DBuffer, ref: ParamRef, like: torch.Tensor | None = None) -> None:
    grad = dbuf.global_grad_view(ref.fqn)
    ref.assigned_grad = grad if ref.tp is None else ref.tp.grad_view(grad, like)


# ---- post-backward: the reduce-scatter -------------------------------------------------------
def finish_backward(
    grads: GradState, refs: list[ParamRef], dbuf: DBuffer, name: str
) -> torch.Tensor | None:
    """The group's gradients are complete: gather every ``.grad`` into the storage. Returns
    the global parameter storage when it holds the gradients ([Note: gradients in place]:
    the caller reshards keeping it, then sets ``grads.holds_params``), else None."""
    grads.needs_post_backward = False
    _adopt_replaced_grads(grads, refs, dbuf, name)
    if not grads.in_place:
        return None
    flat = dbuf.global_params.alias  # 1D, m*S
    taken = sorted(span for ref in refs if ref.grad_in_place for span in dbuf.global_spans(ref.fqn))
    at = 0
    for start, stop in [*taken, (flat.numel(), flat.numel())]:
        if start > at:
            flat[at:start].zero_()  # padding, and parameters without a gradient
        at = max(at, stop)
    for ref in refs:
        ref.grad_in_place = False
    grads.in_place = False
    return flat


def _adopt_replaced_grads(grads: GradState, refs: list[ParamRef], dbuf: DBuffer, name: str) -> None:
    """Copy into the gradient storage every unsharded ``.grad`` that is not the view
    we set: autograd replaces a ``.grad`` out of place when grad mode is on in
    backward (``create_graph=True``), and a user's hook may assign one. One copy per
    such parameter, only then; the common step has none."""
    for ref in refs:
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
            if grads.in_place:
                _grad_over_param(dbuf, name, ref)
            else:
                if not dbuf.global_grads.allocated:
                    _alloc_grads(refs, dbuf)
                _point_at_storage(dbuf, ref)
        assert ref.assigned_grad is not None  # made just above if it was not there
        assigned = ref.assigned_grad
        target = cast(DTensor, assigned).to_local() if ref.tp is not None else assigned
        grad = grad.detach()
        target.copy_(ref.tp.grad_local(grad) if ref.tp is not None else grad)
        p.grad = ref.assigned_grad
        ref.got_grad = True


def start_reduce(
    grads: GradState,
    refs: list[ParamRef],
    dbuf: DBuffer,
    name: str,
    spec: ReduceSpec,
    settings: CommSettings,
    in_place: torch.Tensor | None,
) -> None:
    """Start the reduce-scatter of the group's gradients (the global gradient storage, or
    ``in_place``: the parameter storage holding them), or keep them (no gradient sync)."""
    if in_place is None and not dbuf.global_grads.allocated:
        _alloc_grads(refs, dbuf)  # no gradient reached the group on this rank
    if not settings.requires_gradient_sync:  # the unsharded gradients accumulate
        if spec.reduce_dtype != spec.compute_dtype:
            _accumulate_in_reduce_dtype(grads, refs, dbuf, spec.reduce_dtype)
        return
    source = in_place  # None: the global gradient storage
    if grads.accumulated is not None:  # earlier microbatches' gradients, reduce dtype
        _accumulate_in_reduce_dtype(grads, refs, dbuf, spec.reduce_dtype)
        source, grads.accumulated = grads.accumulated, None
    earlier = grads.reduce  # waited by prepare_grads: its sum is added at finalize
    if earlier is not None and earlier.work is not None:
        raise AssertionError(
            f"fully_shard group {name}: a reduce-scatter was started while an earlier "
            "one was still in flight"
        )
    accumulate = earlier is not None or any(ref.param.grad is not None for ref in refs)
    direct = (
        not accumulate
        and spec.reduce_dtype == spec.dtype
        and not spec.offload
        and (spec.replicate_group is None or settings.requires_all_reduce)
    )
    # The reduce-scatter writes every element (padding too) on the direct path;
    # otherwise only parameters' parts are written: start from zeros.
    dbuf.shard_grads.alloc(zero=not direct)
    if (source is None or source is in_place) and spec.reduce_dtype != spec.compute_dtype:
        # One cast of the whole buffer, on the stream that made the gradients (as
        # FSDP2's copy-in): the cast is the reduce-scatter input, so the gradients'
        # storage goes at once instead of living until the reduce-scatter is waited.
        unreduced = dbuf.global_grads.tensor if source is None else source
        source = unreduced.to(spec.reduce_dtype)
        _free_unsharded_grads(grads, refs, dbuf)
    factors = _divide_factors(spec, settings)
    with spec.streams.reducing():  # see [Note: streams]
        output = (
            dbuf.shard_grad
            if direct
            else torch.empty(dbuf.layout.shard_size, dtype=spec.reduce_dtype, device=spec.device)
        )
        work, inp = dbuf.reduce_scatter_grads(
            output,
            spec.process_group,
            factors.reduce_scatter_op,
            spec.reduce_dtype,
            async_op=True,
            source=source,
            before=factors.scale_input,
            comm=settings.reduce_scatter_comm,
        )
    grads.reduce = PendingReduce(
        work, output, direct, inp, earlier.output if earlier is not None else None
    )


def holds_unreduced_grads(grads: GradState, dbuf: DBuffer) -> bool:
    """Gradients accumulated without sync wait for a reduce-scatter."""
    return not grads.needs_post_backward and (
        dbuf.global_grads.allocated or grads.accumulated is not None
    )


def _divide_factors(spec: ReduceSpec, settings: CommSettings) -> DivideFactors:
    """How the group's reduction divides its gradients: see [Note: divide factors]."""
    return divide_factors(
        spec.world,
        spec.replicate_size if spec.replicate_group is not None else None,
        spec.reduce_dtype,
        settings.gradient_divide_factor,
        settings.force_sum_reduction,
        premul_sum=dist.get_backend(spec.process_group) != "gloo",
    )


def _accumulate_in_reduce_dtype(
    grads: GradState, refs: list[ParamRef], dbuf: DBuffer, reduce_dtype: torch.dtype
) -> None:
    """Move this microbatch's unsharded gradients into the reduce-dtype accumulator.

    As FSDP2: without gradient sync, gradients accumulate in ``reduce_dtype`` (fp32
    under bf16 compute), not in the compute dtype. The compute-dtype storage is freed,
    so the next backward starts from zeros, and each microbatch's gradient is added
    to the accumulator once, upcast element by element (``acc += grad``).
    """
    unreduced = dbuf.global_grads.tensor  # 1D, m*S, compute dtype
    if grads.accumulated is None:
        grads.accumulated = unreduced.to(reduce_dtype)  # 1D, m*S, reduce dtype
    else:
        grads.accumulated.add_(unreduced)
    for ref in refs:
        if ref.unsharded is not None:
            ref.unsharded.grad = None
        ref.assigned_grad = None
    dbuf.global_grads.free()


def reset_grads(grads: GradState, refs: list[ParamRef], dbuf: DBuffer) -> None:
    """Drop the iteration's gradients: wait for a reduce-scatter in flight, discard its
    result, the accumulated and the unsharded gradients."""
    if grads.reduce is not None and grads.reduce.work is not None:
        grads.reduce.work.wait()
    grads.reduce = None
    grads.accumulated = None
    grads.partial_reduce = None
    grads.needs_post_backward = False
    grads.in_place = False
    for ref in refs:
        ref.got_grad = False
        ref.grad_in_place = False
    _free_unsharded_grads(grads, refs, dbuf)


def wait_reduce(grads: GradState, refs: list[ParamRef], dbuf: DBuffer) -> None:
    """Wait for the reduce-scatter and free the unsharded gradients (the whole buffer)."""
    if grads.reduce is None or grads.reduce.work is None:
        return
    grads.reduce.work.wait()
    grads.reduce = grads.reduce._replace(work=None, input=None)
    _free_unsharded_grads(grads, refs, dbuf)


def _free_unsharded_grads(grads: GradState, refs: list[ParamRef], dbuf: DBuffer) -> None:
    """Drop the unsharded ``.grad``s and free their storage (the parameter storage, when
    it held them: see [Note: gradients in place])."""
    for ref in refs:
        if ref.unsharded is not None:
            ref.unsharded.grad = None
        ref.assigned_grad = None
    dbuf.global_grads.free()
    if grads.holds_params:
        grads.holds_params = False
        dbuf.global_params.free()


# ---- end of backward: the sharded gradients --------------------------------------------------
def finalize_grads(
    grads: GradState,
    refs: list[ParamRef],
    dbuf: DBuffer,
    name: str,
    spec: ReduceSpec,
    settings: CommSettings,
    got_grad: list[bool],
    sharded_grad: Callable[[ParamRef, torch.Tensor], DTensor],
) -> list[str]:
    """Wait for the reduce-scatter and set the sharded ``.grad``s (views of shard grads).

    Args:
        got_grad: per parameter (``refs``' order), whether it gets the reduced gradient on
            this rank (see [Note: unused parameters] in ``_state.py``).
        sharded_grad: ``(ref, its local rows)`` -> the sharded gradient (a DTensor with
            the sharded parameter's mesh and placements), made once per parameter.

    Returns the parameters another rank's gradient arrived for while this rank had
    none (see ``_gradients_arrived``); then no gradient of the group is set."""
    wait_reduce(grads, refs, dbuf)
    if grads.reduce is None:
        raise AssertionError(f"fully_shard group {name}: finalize_grads without a reduce-scatter")
    output, direct, earlier = grads.reduce.output, grads.reduce.direct, grads.reduce.earlier
    grads.reduce = None
    if earlier is not None:
        output.add_(earlier)
    if not _all_reduce(grads, spec, settings, output):
        return []
    if not direct and all(ref.param.grad is None for ref in refs):
        # only a dtype differs (reduce_dtype != param dtype): one cast of the buffer
        dbuf.shard_grad.copy_(output)
        direct = True
    arrived = _gradients_arrived(refs, dbuf, got_grad, output, direct)
    if arrived:
        for ref in refs:
            ref.got_grad = False
        return arrived
    for ref, gets_grad in zip(refs, got_grad):
        ref.got_grad = False
        if not ref.requires_grad or not gets_grad:
            if not direct and ref.param.grad is None:
                # keep the buffer's norm exact: no stale values where .grad is None
                dbuf.shard_grad_view(ref.fqn).zero_()
            continue
        if ref.sharded_grad is None:
            ref.sharded_grad = sharded_grad(ref, dbuf.shard_grad_view(ref.fqn))
        existing = ref.param.grad
        if not direct:
            part = dbuf.local_view(output, ref.fqn)
            if existing is None:
                ref.sharded_grad._local_tensor.copy_(part)
            else:
                cast(DTensor, existing)._local_tensor.add_(part)
        if direct or existing is None:
            ref.param.grad = ref.sharded_grad
        _run_post_accumulate_grad_hooks(ref.param)
    return []


def _all_reduce(
    grads: GradState, spec: ReduceSpec, settings: CommSettings, output: torch.Tensor
) -> bool:
    """The reduce-scattered ``output`` (1D, S) made whole: the HSDP all-reduce ([Note:
    HSDP] in ``_param_group.py``), the all-reduce hook, the division after it. False
    when ``set_requires_all_reduce(False)`` keeps it for a later backward instead (no
    gradient is set yet)."""
    if spec.replicate_group is not None:
        if not settings.requires_all_reduce:  # keep the reduced part; set no gradient yet
            if grads.partial_reduce is None:
                grads.partial_reduce = output
            else:
                grads.partial_reduce.add_(output)
            return False
        if grads.partial_reduce is not None:
            output.add_(grads.partial_reduce)
            grads.partial_reduce = None
        if spec.replicate_size > 1:
            op = _divide_factors(spec, settings).all_reduce_op
            dist.all_reduce(output, op=op, group=spec.replicate_group)
    if settings.all_reduce_hook is not None:  # before the post-division, as FSDP2
        settings.all_reduce_hook(output)
    post = _divide_factors(spec, settings).post
    if post is not None and post != 1:
        output.div_(post)
    return True


def _gradients_arrived(
    refs: list[ParamRef], dbuf: DBuffer, gets_grad: list[bool], output, direct
) -> list[str]:
    """The parameters another rank's gradient arrived for where this rank leaves them
    without one: ranks used different parameters, and FSDP2's rule (see [Note: unused
    parameters] in ``_state.py``) would leave this rank's rows unstepped. Reads the host
    only for parameters this rank had no gradient for; fake tensors (the simulator) hold
    no values to read."""
    arrived = []
    for ref, gets in zip(refs, gets_grad):
        if gets or not ref.requires_grad:
            continue
        rows = dbuf.shard_grad_view(ref.fqn) if direct else dbuf.local_view(output, ref.fqn)
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
