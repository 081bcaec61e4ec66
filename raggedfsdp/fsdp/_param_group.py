"""ParamGroup: the parameters of one buffer (of a ``fully_shard`` call), one DBuffer, one
collective each way."""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate

from raggedfsdp._collectives import all_gather_single, completed_work
from raggedfsdp.dbuffer import DBuffer
from raggedfsdp.fsdp._buffers import OWNER_ATTR, BufferView
from raggedfsdp.fsdp._device import new_group_like, streams_for
from raggedfsdp.fsdp._fp8 import Float8BlockAllGather, Fp8Layout
from raggedfsdp.fsdp._hooks import may_read_parameters, reads_no_parameters
from raggedfsdp.fsdp._policy import MixedPrecisionPolicy, resolve_block_rows
from raggedfsdp.fsdp._state import PostForwardGroup
from raggedfsdp.fsdp._subclass import SubclassGather, values_of
from raggedfsdp.fsdp._tp import TPSpec, tp_spec_of
from raggedfsdp.fsdp._trace import logger, phase
from raggedfsdp.placement import RaggedShard
from raggedfsdp.planner import BufferLayout, TensorSpec

__all__ = [
    "ParamGroup",
    "group_specs",
    "ParamRef",
    "PendingGather",
    "PendingReduce",
    "ShardedState",
    "owner_of",
]


def owner_of(param: torch.Tensor) -> tuple[ParamGroup, ParamRef] | None:
    """The ``(ParamGroup, ParamRef)`` of a sharded parameter, or None for other tensors."""
    owner = getattr(param, OWNER_ATTR, None)
    if owner is None:
        return None
    group, index = owner
    return group, group.refs[index]


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

    def register(self, param: nn.Parameter) -> None:
        for module, name in self.uses:
            module._parameters[name] = param


def _laid_out(refs, originals, mesh) -> list[torch.Tensor]:
    """What a group lays out: each parameter's local tensor (its TP piece, if any); sets
    each ``ref.tp`` (see [Note: FSDP x TP] in ``_tp.py``)."""
    for ref, p in zip(refs, originals):
        ref.tp = tp_spec_of(ref.fqn, p, mesh)
    return [p.to_local() if ref.tp is not None else p for ref, p in zip(refs, originals)]


def group_specs(refs, originals, mesh, block_policy) -> tuple[list[TensorSpec], list]:
    """The planner's view of a group's parameters, and each one's dtype (a buffer holds
    one dtype: a group of several is planned into one buffer per dtype).

    Raises:
        NotImplementedError: a 0-d parameter.
    """
    local = _laid_out(refs, originals, mesh)
    specs = []
    for ref, p, as_held in zip(refs, local, originals):  # block policies see them as held
        if p.dim() == 0:
            raise NotImplementedError(
                f"fully_shard: parameter {ref.fqn!r} is 0-d; RaggedShard cuts dims: pass it "
                "in ignored_params or make it shape (1,)"
            )
        rows = resolve_block_rows(block_policy, ref.fqn, as_held)
        specs.append(
            TensorSpec(name=ref.fqn, shape=tuple(p.shape), block_rows=rows, stack=p.dim() >= 3)
        )
    return specs, [p.dtype for p in local]


class ParamGroup:
    """One buffer's worth of parameters: shard, unshard, reshard, reduce gradients.

    [Note: group states]
    ``state`` is one of ``ShardedState``; every transition checks the state it
    starts from and fails at once, naming the group and both states, when hooks run
    in a wrong order::

        SHARDED --unshard/wait--> UNSHARDED --reshard()--> SHARDED
                                  UNSHARDED --reshard(post_forward)--> SHARDED_POST_FORWARD
        SHARDED_POST_FORWARD --unshard/wait--> UNSHARDED  (a gather over the smaller group)
        SHARDED_POST_FORWARD --reshard()--> SHARDED       (the kept piece is dropped)

    Collectives in flight are records: ``PendingGather`` between ``unshard`` and
    ``wait_for_unshard``, ``PendingReduce`` between ``post_backward`` and
    ``finalize_grads``. Streams: see [Note: streams] in ``_device.py``.

    Args:
        refs: the group's parameters (module order), their ``tp`` set by ``group_specs``.
        originals: the parameters as the module held them (same order).
        mesh: a 1-D DeviceMesh, or 2-D (replicate, shard) for HSDP.
        mp_policy: mixed precision.
        layout: the buffer's layout, planned by the caller (``plan_buffers``): of all the
            call's parameters, or of one buffer's of a ``GroupSet``.
        name: how messages name the group (the module's class).
        offload: CPU offload (torch's ``CPUOffloadPolicy``): see [Note: CPU offload].
        pin_memory: pin the offloaded shard storages (with an accelerator).
        grads_in_params: write each gradient over its unsharded parameter (see [Note:
            gradients in place]); False: a global gradient storage of its own.
        fp8: gather this buffer (every tensor in it selected) as FP8 codes and tile
            scales: see [Note: FP8 all-gather] in ``_fp8.py``. Default None.
        subclass: gather this buffer's parameters (every one a tensor subclass with
            FSDP2's hooks) through the protocol: see [Note: tensor-subclass all-gather]
            in ``_subclass.py``. Default False.

    [Note: CPU offload]
    The shard and shard gradient storages (the sharded parameters, their ``.grad``s,
    hence the optimizer step) live on the CPU; the global storages (unsharded
    parameters and gradients) on the mesh's device. The all-gather input is one
    host-to-device copy of the whole shard (then one cast under mixed precision); the
    reduce-scatter writes a device buffer, copied into the CPU shard gradients when
    the gradients are finalized. On a CPU mesh both sides are the CPU: nothing moves.
    """

    def __init__(
        self,
        refs,
        originals,
        mesh,
        mp_policy: MixedPrecisionPolicy,
        layout: BufferLayout,
        name: str = "",
        offload: bool = False,
        pin_memory: bool = True,
        grads_in_params: bool = True,
        fp8: Float8BlockAllGather | None = None,
        subclass: bool = False,
    ):
        self.refs: list[ParamRef] = refs
        self.view = BufferView(self)  # the public handle (raggedfsdp.fsdp.buffers_of)
        self.name = (
            f"{name}({', '.join(r.fqn for r in refs[:3])}{', ...' if len(refs) > 3 else ''})"
        )
        self.mesh = mesh
        # [Note: HSDP] a 2-D mesh is (replicate, shard): the planner lays the buffer out
        # for the shard dim; all-gathers and reduce-scatters run over it, then one
        # all-reduce of the reduced shard gradients over the replicate dim.
        shard_dim = mesh.ndim - 1
        self.process_group = mesh.get_group(shard_dim)
        self.rank, self.world = mesh.get_local_rank(shard_dim), mesh.size(shard_dim)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_size = mesh.size(0) if mesh.ndim == 2 else 1
        self.requires_all_reduce = True  # HSDP: False skips the all-reduce (accumulation)
        self._partial_reduce: torch.Tensor | None = None  # 1D, S: reduced, not all-reduced
        # What the buffer lays out: each local tensor (``ref.tp`` set by ``group_specs``).
        originals = [p.to_local() if ref.tp is not None else p for ref, p in zip(refs, originals)]
        self.dtype = originals[0].dtype  # one dtype: checked by group_specs
        self.device = originals[0].device  # the compute device: the global storages'
        self.offload = offload
        shard_device = None
        if offload and self.device.type != "meta":  # on meta until to_empty / a load
            self.device = _mesh_device(mesh)
            shard_device = torch.device("cpu")
        self.pin_memory = offload and pin_memory and mesh.device_type != "cpu"
        self.streams = streams_for(self.device)
        self.mp_policy = mp_policy
        self.compute_dtype = mp_policy.param_dtype or self.dtype
        self.reduce_dtype = mp_policy.reduce_dtype or self.compute_dtype
        if sorted(t.name for t in layout.tensors) != sorted(r.fqn for r in refs):
            raise AssertionError(f"fully_shard group {self.name}: its layout holds other tensors")
        self.layout = layout
        self.fp8 = None if fp8 is None else Fp8Layout(layout, fp8)
        self.subclass = SubclassGather(self, originals) if subclass else None
        self.dbuf = self._new_dbuf(shard_device)
        for ref, p in zip(refs, originals):
            ref.placement = RaggedShard.from_layout(self.layout, ref.fqn)
            if self.device.type != "meta":
                full = values_of(p).contiguous()  # a subclass's inner tensor
                self.dbuf.shard_view(ref.fqn).copy_(ref.placement.local_view(full, self.rank))
            self._make_sharded(ref)
            ref.register(ref.sharded)
        self.state = ShardedState.SHARDED
        self._gather: PendingGather | None = None
        self._post_forward_piece: torch.Tensor | None = None  # 1D, m*S/k (SHARDED_POST_FORWARD)
        self.post_forward_group: PostForwardGroup | None = None  # reshard_after_forward=int
        self.needs_post_backward = False
        self.grads_in_params = grads_in_params
        self._in_place = False  # this backward writes gradients over the parameters
        self.grads_in_params_ran: bool | None = None  # the last backward's mode (reported)
        self.grad_storage_reason: str | None = None  # why it kept a gradient storage
        self._grads_hold_params = False  # the global parameter storage holds gradients
        self._reduce: PendingReduce | None = None
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float | None = None
        self._accumulated: torch.Tensor | None = None  # see _accumulate_in_reduce_dtype
        self.force_sum_reduction = False  # SUM, then divide (set_force_sum_reduction_for_comms)
        self.all_reduce_hook = None  # called on the reduce-scatter output (set_all_reduce_hook)
        # set_reduce_scatter_unused_params: see [Note: unused parameters]
        self.reduce_scatter_unused_params = False
        self.reduce_process_group = self.process_group  # or its own (separate RS group)
        self.unloaded: dict[str, str] = {}  # fqn -> key, on meta after a partial load

    @property
    def is_unsharded(self) -> bool:
        """The modules hold the unsharded parameters (the all-gather waited)."""
        return self.state is ShardedState.UNSHARDED and self._gather is None

    def placements(self, ref: ParamRef) -> list:
        """The sharded parameter's placements: its TP placement (FSDP x TP), ``[Replicate()]``
        on the replicate dim (HSDP), then its RaggedShard."""
        tp = list(ref.tp.placements) if ref.tp is not None else []
        return tp + [Replicate()] * (self.mesh.ndim - 1) + [ref.placement]

    def param_mesh(self, ref: ParamRef):
        """The sharded parameter's mesh: the group's, or ``(tp, *group dims)``."""
        return ref.tp.composed_mesh if ref.tp is not None else self.mesh

    def _expect(self, action: str, *states: ShardedState) -> None:
        if self.state not in states:
            raise AssertionError(
                f"fully_shard group {self.name}: {action} expects the group "
                f"{' or '.join(s.value for s in states)}, but it is {self.state.value}"
            )

    # ---- construction ---------------------------------------------------------------------
    def _new_dbuf(self, shard_device: torch.device | None) -> DBuffer:
        return DBuffer(
            self.layout,
            self.rank,
            self.dtype,
            self.device,
            self.compute_dtype,
            shard_device=shard_device,
            pin_memory=self.pin_memory,
        )

    def _make_sharded(self, ref: ParamRef) -> None:
        local = self.dbuf.shard_view(ref.fqn)
        if self.subclass is not None:  # see [Note: tensor-subclass all-gather]
            local = self.subclass.wrap(ref, local)
        stride = torch.empty(ref.shape, device="meta").stride()
        dt = DTensor.from_local(
            local, self.param_mesh(ref), self.placements(ref), shape=ref.shape, stride=stride
        )
        if ref.sharded is None:
            ref.sharded = nn.Parameter(dt, requires_grad=ref.requires_grad)
        else:  # re-point an existing parameter (after to_empty / _apply), keeping its identity
            ref.sharded._local_tensor = dt._local_tensor
        setattr(ref.sharded, OWNER_ATTR, (self, self.refs.index(ref)))

    def reset_after_apply(self) -> None:
        """Rebuild the storages after ``Module._apply`` (``to_empty``, ``to``, ``float``).

        ``_apply`` gives each parameter new local data; copy it into fresh shard
        storage on its device and make the parameters views again.
        """
        self._expect("Module._apply (to, to_empty)", ShardedState.SHARDED)
        current = {ref.fqn: ref.uses[0][0]._parameters[ref.uses[0][1]] for ref in self.refs}
        first = next(iter(current.values()))
        local0 = first._local_tensor if isinstance(first, DTensor) else first
        shard_device = torch.device("cpu") if self.offload else local0.device
        storage = self.dbuf.shard.untyped_storage().data_ptr()
        views = all(  # to_empty on the same device gives new tensors too
            values_of(p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            == storage
            for p in current.values()
        )
        if views and (shard_device, local0.dtype) == (self.dbuf.shard.device, self.dtype):
            return
        self.unloaded = {}  # every parameter now holds what _apply gave it
        self.device = _mesh_device(self.mesh) if self.offload else local0.device
        self.dtype = local0.dtype
        self.streams = streams_for(self.device)
        self.compute_dtype = self.mp_policy.param_dtype or self.dtype
        self.reduce_dtype = self.mp_policy.reduce_dtype or self.compute_dtype
        self.dbuf = self._new_dbuf(shard_device)
        for ref in self.refs:
            new = current[ref.fqn]
            self.dbuf.shard_view(ref.fqn).copy_(
                values_of(new._local_tensor if isinstance(new, DTensor) else new)
            )
            if ref.sharded is not new:
                ref.sharded = None  # _apply made a new Parameter: adopt a fresh one
            self._make_sharded(ref)
            ref.unsharded, ref.sharded_grad = None, None
            ref.register(ref.sharded)

    def adopt_assigned(self, prefix: str = "") -> None:
        """Adopt what ``load_state_dict(..., assign=True)`` put in the modules' place.

        [Note: assigned parameters]
        An assigning load (Hugging Face accelerate's ``cpu_ram_efficient_loading``, torch's
        ``set_model_state_dict`` on a meta model) replaces each module's sharded parameter
        with the state dict's tensor, outside the buffer. Each one is taken here (the
        module's load_state_dict post-hook): a DTensor on the parameter's own mesh with its
        own placements gives its local tensor; a plain tensor of the full shape gives this
        rank's rows. The values are copied into the shard storage (rebuilt on their device,
        as ``reset_after_apply`` does, when the group was on meta or on another device), and
        every parameter is again a view of it: the assigned DTensor parameter keeps its
        identity, its local tensor now the view. A parameter a partial load (``strict=False``)
        left on meta is listed in ``unloaded`` until a later load assigns it; a forward
        before then raises, naming it.

        Args:
            prefix: the group's module's prefix in the state dict (how messages name the
                parameters). Default: none.

        Raises:
            ValueError: an assigned tensor of another dtype, mesh or placement, or of a kind
                that is neither (the parameter named, with the fix).
        """
        current = {ref.fqn: ref.uses[0][0]._parameters[ref.uses[0][1]] for ref in self.refs}
        assigned = [ref for ref in self.refs if current[ref.fqn] is not ref.sharded]
        if not assigned:
            if self.dbuf.shard.is_meta:  # a load that left the group on meta: name them
                self.unloaded = {r.fqn: prefix + r.fqn for r in self.refs}
            return
        self._expect("load_state_dict(assign=True)", ShardedState.SHARDED)
        try:
            pieces = {r.fqn: self._assigned_piece(r, current[r.fqn], prefix) for r in assigned}
            devices = {t.device for t in pieces.values() if t.device.type != "meta"}
            if len(devices) > 1:
                raise ValueError(
                    f"load_state_dict(assign=True): the parameters of {self.name} were "
                    f"assigned tensors on several devices {sorted(map(str, devices))}; a "
                    "group's parameters live on one device: move them to one device"
                )
        except ValueError:
            for ref in assigned:  # the modules hold the sharded parameters as before
                ref.register(ref.sharded)
            raise
        old = self.dbuf
        shard_device = old.shard.device
        if devices:
            device = devices.pop()
            shard_device = torch.device("cpu") if self.offload else device
            self.device = _mesh_device(self.mesh) if self.offload else device
        rebuild = shard_device != old.shard.device
        if rebuild:  # a new shard storage on the new device; see [Note: assigned parameters]
            self.streams = streams_for(self.device)
            self.dbuf = self._new_dbuf(shard_device)
        unloaded = dict(self.unloaded)
        for ref in self.refs:
            piece = pieces.get(ref.fqn)
            if piece is not None and not piece.is_meta:
                self.dbuf.shard_view(ref.fqn).copy_(piece)
                unloaded.pop(ref.fqn, None)
            elif piece is not None or (rebuild and old.shard.is_meta):
                unloaded[ref.fqn] = prefix + ref.fqn  # assigned a meta tensor, or not loaded
            elif rebuild:  # kept: its values move to the new storage
                self.dbuf.shard_view(ref.fqn).copy_(old.shard_view(ref.fqn))
            if piece is None and not rebuild:
                continue
            new = current[ref.fqn]
            adopt = isinstance(new, nn.Parameter) and isinstance(new, DTensor)
            ref.sharded = new if adopt else (ref.sharded if piece is None else None)
            self._make_sharded(ref)
            self._forget_unsharded(ref)
            ref.register(ref.sharded)
        self.unloaded = {r.fqn: unloaded[r.fqn] for r in self.refs if r.fqn in unloaded}

    def _assigned_piece(self, ref: ParamRef, new: torch.Tensor, prefix: str) -> torch.Tensor:
        """This rank's part of the tensor an assigning load put in ``ref``'s place, shaped
        as its shard view (see [Note: assigned parameters])."""
        name, mesh, placements = prefix + ref.fqn, self.param_mesh(ref), tuple(self.placements(ref))
        fix = (
            "assign a DTensor made with the sharded parameter's own mesh and placements "
            "(distribute_tensor(full, param.device_mesh, param.placements), param from the "
            "model's state_dict()), or a full tensor, or load without assign=True"
        )
        if new.dtype != self.dtype:
            raise ValueError(
                f"load_state_dict(assign=True): parameter {name!r} was assigned a tensor of "
                f"dtype {new.dtype}; fully_shard holds it in {self.dtype}: cast the state "
                "dict's tensor to it, or load without assign=True (which casts)"
            )
        if isinstance(new, DTensor):
            if new.device_mesh == mesh and tuple(new.placements) == placements:
                return new._local_tensor
            raise ValueError(
                f"load_state_dict(assign=True): parameter {name!r} was assigned a DTensor "
                f"with placements {tuple(new.placements)} on {new.device_mesh}; expected "
                f"{placements} on {mesh} (its RaggedShard): {fix}"
            )
        if type(new) in (torch.Tensor, nn.Parameter) and new.shape == ref.shape:
            if ref.tp is not None:
                raise ValueError(
                    f"load_state_dict(assign=True): parameter {name!r} is tensor-parallel "
                    f"and was assigned a plain tensor; expected a DTensor with placements "
                    f"{placements} on {mesh}: {fix}"
                )
            return ref.placement.local_view(new.detach().contiguous(), self.rank)
        raise ValueError(
            f"load_state_dict(assign=True): parameter {name!r} was assigned a "
            f"{type(new).__name__} of shape {tuple(new.shape)}; expected a DTensor with "
            f"placements {placements} on {mesh} or a tensor of shape {tuple(ref.shape)}: {fix}"
        )

    # ---- unshard / reshard ----------------------------------------------------------------
    @phase("all_gather")
    def unshard(self, async_op: bool = False) -> None:
        """Start (or do) the all-gather of the global storage; ``wait_for_unshard`` ends it."""
        if self.state is ShardedState.UNSHARDED or self._gather is not None:
            return
        if self._grads_hold_params:  # a reduce-scatter still reads the storage
            self.wait_reduce()
        if self.device.type == "meta" or self.unloaded:
            names = list(self.unloaded.values()) or [r.fqn for r in self.refs]
            raise RuntimeError(
                f"fully_shard: parameters {names[:3]}{'...' if len(names) > 3 else ''} of "
                f"{self.name} are still on the meta device; call module.to_empty(device=...) "
                "and initialise them, or load them (load_state_dict(..., assign=True), "
                "set_model_state_dict), before forward"
            )
        # [Note: version counter] autograd saved the unsharded parameters in forward;
        # refilling their storage for backward is the point, so the all-gather must not
        # bump their version counter. gloo writes the output on its own thread (the bump
        # can land any time before wait()), so the version is restored after the wait.
        version = self.dbuf.global_params.tensor._version
        received = None  # FP8: the gathered codes and scales
        with self.streams.gathering():  # see [Note: streams]
            if self.state is ShardedState.SHARDED_POST_FORWARD:  # a smaller gather
                out, inp = self.dbuf.global_params.alloc(), self._post_forward_piece
                pg = self.post_forward_group.process_group
                work = all_gather_single(out, inp, group=pg, async_op=True)
            elif self.subclass is not None:  # see [Note: tensor-subclass all-gather]
                work, inp, received = self.subclass.start(self.process_group)
            elif self.fp8 is not None:  # see [Note: FP8 all-gather]
                inp = self.fp8.quantize(self.dbuf.shard, self.rank)
                if self.world == 1:  # the codes are what a gather would receive
                    received, work = inp, completed_work()
                else:
                    received = torch.empty(
                        self.world * inp.numel(), dtype=torch.uint8, device=self.device
                    )
                    work = all_gather_single(received, inp, group=self.process_group, async_op=True)
            else:
                work, inp = self.dbuf.all_gather(self.process_group, async_op=True)
        self._gather = PendingGather(work, version, inp, received)
        if not async_op:
            self.wait_for_unshard()

    @phase("all_gather_wait")
    def wait_for_unshard(self) -> None:
        """Finish the all-gather; the modules hold the unsharded parameters."""
        if self._gather is None:
            self._expect("wait_for_unshard (no all-gather in flight)", ShardedState.UNSHARDED)
            return
        gather, self._gather = self._gather, None
        gather.work.wait()
        if self.subclass is not None:  # the copy-out into the outputs
            self.subclass.finish(gather.received)
        elif gather.received is not None:  # FP8: decode into the compute-dtype storage
            self.fp8.dequantize(gather.received, self.dbuf.global_params.alloc())
        torch._C._autograd._unsafe_set_version_counter(
            (self.dbuf.global_params.tensor,), (gather.version,)
        )  # see [Note: version counter]
        self._post_forward_piece = None
        for ref in self.refs:
            if ref.requires_grad != ref.sharded.requires_grad:  # frozen / unfrozen since
                self._forget_unsharded(ref)
                ref.requires_grad = ref.sharded.requires_grad
            value = None if self.subclass is None else self.subclass.post_all_gather(ref)
            if ref.unsharded is None:
                view = self.dbuf.global_view(ref.fqn) if value is None else value
                if ref.tp is not None:  # the module's TP DTensor over the view
                    view = ref.tp.unsharded(view, ref.requires_grad)
                ref.unsharded = nn.Parameter(view, requires_grad=ref.requires_grad)
                if ref.requires_grad:
                    hook = reads_no_parameters(functools.partial(self._first_grad_hook, ref))
                    ref.hooks.append(ref.unsharded.register_hook(hook))
                    ref.hooks.append(
                        ref.unsharded.register_post_accumulate_grad_hook(_mark_got_grad(ref))
                    )
            ref.register(ref.unsharded)
        self.state = ShardedState.UNSHARDED

    def _forget_unsharded(self, ref: ParamRef) -> None:
        """Drop ``ref``'s unsharded parameter (and our hooks on it): the next unshard
        makes a new one, with the sharded parameter's ``requires_grad``."""
        for handle in ref.hooks:
            handle.remove()
        ref.hooks.clear()
        ref.unsharded, ref.sharded_grad, ref.assigned_grad = None, None, None

    @phase("reshard")
    def reshard(self, post_forward: bool = False, free: bool = True) -> None:
        """Free the global storage; the modules hold the sharded parameters again.

        Args:
            post_forward: keep this rank's piece of the parameters for the smaller
                group ``post_forward_group`` (``reshard_after_forward=int``), so that
                backward gathers over it only. Ignored without that group.
            free: False keeps the storage, which now holds the gradients (see [Note:
                gradients in place]); the reduce-scatter frees it.
        """
        if self._gather is not None:
            self.wait_for_unshard()
        if self.state is not ShardedState.UNSHARDED:
            self._post_forward_piece = None  # a piece kept after forward is not needed now
            self.state = ShardedState.SHARDED
            return
        # A subclass buffer reshards fully (FSDP2 refuses reshard_after_forward=int for it).
        keep = self.post_forward_group if post_forward and self.subclass is None else None
        if keep is not None:
            full = self.dbuf.global_params.tensor  # 1D, m*S
            piece = full.numel() // keep.size
            self._post_forward_piece = full[keep.position * piece :][:piece].clone()
        if free:
            self.dbuf.global_params.free()
            if self.subclass is not None:
                self.subclass.free()
        self.streams.resharded()
        for ref in self.refs:
            ref.register(ref.sharded)
        self.state = ShardedState.SHARDED if keep is None else ShardedState.SHARDED_POST_FORWARD

    # ---- gradients ------------------------------------------------------------------------
    def release_dropped_grads(self) -> None:
        """Free the shard gradient storage if every sharded ``.grad`` was dropped."""
        if self._reduce is None and all(ref.sharded.grad is None for ref in self.refs):
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
        ``grad`` (the parameter's whole gradient of this backward)."""
        if not self.needs_post_backward:
            return grad
        if self._in_place:
            self._grad_over_param(ref)
        elif not self.dbuf.global_grads.allocated:
            self._alloc_grads()
        return grad

    def _grad_over_param(self, ref: ParamRef) -> None:
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
        ref.assigned_grad = grad if ref.tp is None else ref.tp.unsharded(grad, False)
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

    def _point_at_storage(self, ref: ParamRef) -> None:
        grad = self.dbuf.global_grad_view(ref.fqn)
        ref.assigned_grad = grad if ref.tp is None else ref.tp.unsharded(grad, False)

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
                local = ref.assigned_grad.to_local() if ref.tp is not None else ref.assigned_grad
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
            target = ref.assigned_grad.to_local() if ref.tp is not None else ref.assigned_grad
            grad = grad.detach()
            target.copy_(grad.to_local() if ref.tp is not None else grad)
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
        accumulate = earlier is not None or any(ref.sharded.grad is not None for ref in self.refs)
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
        op = self._reduce_op()
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
                op,
                self.reduce_dtype,
                async_op=True,
                source=source,
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

    def _reduce_op(self):
        """AVG, unless a divide factor or force-sum asks for SUM (divided in finalize)."""
        avg = self.gradient_divide_factor is None and not self.force_sum_reduction
        return dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM

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

    def local_grad_flags(self) -> list[bool]:
        return [ref.got_grad for ref in self.refs]

    @phase("post_backward_set_grads")
    def finalize_grads(self, got_grad: list[bool]) -> list[str]:
        """Wait for the reduce-scatter and set the sharded ``.grad``s (views of shard grads).

        Returns the parameters another rank's gradient arrived for while this rank had
        none (see ``_gradients_arrived``); then no gradient of the group is set."""
        self.wait_reduce()
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
                dist.all_reduce(output, op=self._reduce_op(), group=self.replicate_group)
        if self.gradient_divide_factor is not None:
            output.div_(self.gradient_divide_factor)
        elif self.force_sum_reduction:
            output.div_(self.world * self.replicate_size)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(output)
        if not direct and all(ref.sharded.grad is None for ref in self.refs):
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
                if not direct and ref.sharded.grad is None:
                    # keep the buffer's norm exact: no stale values where .grad is None
                    self.dbuf.shard_grad_view(ref.fqn).zero_()
                continue
            if ref.sharded_grad is None:
                ref.sharded_grad = DTensor.from_local(
                    self.dbuf.shard_grad_view(ref.fqn),
                    self.param_mesh(ref),
                    self.placements(ref),
                    shape=ref.shape,
                    stride=ref.sharded.stride(),
                )
            existing = ref.sharded.grad
            if not direct:
                part = self.dbuf.local_view(output, ref.fqn)
                if existing is None:
                    ref.sharded_grad._local_tensor.copy_(part)
                else:
                    existing._local_tensor.add_(part)
            if direct or existing is None:
                ref.sharded.grad = ref.sharded_grad
            _run_post_accumulate_grad_hooks(ref.sharded)
        return []


def _gradients_arrived(group: ParamGroup, gets_grad: list[bool], output, direct) -> list[str]:
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


def _mesh_device(mesh) -> torch.device:
    """The compute device of ``mesh`` (this process's accelerator, or the CPU)."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device(kind)
    return torch.device(kind, torch.accelerator.current_device_index())


def _run_post_accumulate_grad_hooks(param: nn.Parameter) -> None:
    """As FSDP2: a sharded parameter's post-accumulate-grad hooks run once its reduced
    gradient is set (optimizer in backward steps it there). Autograd never runs them:
    the sharded parameter is not in the graph."""
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def _mark_got_grad(ref: ParamRef):
    def hook(_param):
        ref.got_grad = True

    return reads_no_parameters(hook)
