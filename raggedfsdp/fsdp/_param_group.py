"""ParamGroup: the parameters of one buffer (of a ``fully_shard`` call), one DBuffer, one
collective each way."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from raggedfsdp.fsdp._assigned import assigned_piece, held, views_shard
from raggedfsdp.fsdp._device import can_pin_memory, mesh_device, new_group_like, streams_for
from raggedfsdp.fsdp._fp8 import Float8BlockAllGather, Fp8Layout
from raggedfsdp.fsdp._grads import (
    GradState,
    ReduceSpec,
    finalize_grads,
    finish_backward,
    first_grad,
    mark_got_grad,
    prepare_grads,
    reset_grads,
    start_reduce,
    wait_reduce,
)
from raggedfsdp.fsdp._hooks import reads_no_parameters
from raggedfsdp.fsdp._policy import MixedPrecisionPolicy, resolve_block_rows
from raggedfsdp.fsdp._records import (
    OWNER_ATTR,
    CommSettings,
    ParamRef,
    PendingGather,
    ShardedState,
)
from raggedfsdp.fsdp._reshard import PostForwardGroup
from raggedfsdp.fsdp._spmd import SPMDMesh
from raggedfsdp.fsdp._subclass import SubclassGather, values_of
from raggedfsdp.fsdp._tp import tp_spec_of
from raggedfsdp.fsdp._trace import phase
from raggedfsdp.fsdp._weak import WeakPartial
from raggedfsdp.fsdp.dbuffer import DBuffer
from raggedfsdp.planner import BufferLayout, TensorSpec
from raggedfsdp.tensor.collectives import all_gather_single, completed_work
from raggedfsdp.tensor.placement import RaggedShard

__all__ = ["ParamGroup", "group_specs"]


def _laid_out(refs, originals, mesh, spmd: SPMDMesh | None) -> list[torch.Tensor]:
    """What a group lays out: each parameter's local tensor (its TP piece, if any); sets
    each ``ref.tp`` (see [Note: FSDP x TP] in ``_tp.py``, [Note: the SPMD mesh] in
    ``_spmd.py``)."""
    for ref, p in zip(refs, originals):
        ref.tp = tp_spec_of(ref.fqn, p, mesh) if spmd is None else spmd.spec_of(ref.fqn, p)
    return [p.to_local() if ref.tp is not None else p for ref, p in zip(refs, originals)]


def group_specs(
    refs, originals, mesh, block_policy, spmd: SPMDMesh | None = None
) -> tuple[list[TensorSpec], list]:
    """The planner's view of a group's parameters, and each one's dtype (a buffer holds
    one dtype: a group of several is planned into one buffer per dtype). ``spmd``: the
    whole mesh of a ``dp_mesh_dims`` call, whose data-parallel mesh is ``mesh``. A 0-d
    parameter never gets here: ``fully_shard`` refuses it (``_checks.py``), and a
    parameter re-assigned later must keep its shape.
    """
    local = _laid_out(refs, originals, mesh, spmd)
    specs = []
    for ref, p, as_held in zip(refs, local, originals):  # block policies see them as held
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

    Two are no-ops by contract, as FSDP2's are: ``unshard`` of an unsharded group (or
    of one whose all-gather is in flight) and ``reshard`` of a sharded group (so
    ``module.unshard()`` and ``module.reshard()`` may be called in any state). Every
    other action names the states it starts from (``_expect``): ``wait_for_unshard``
    with nothing in flight, ``prepare_grads`` and ``post_backward`` out of a backward,
    ``Module._apply`` and ``load_state_dict(assign=True)`` on an unsharded group fail.
    ``FSDPState`` checks the module's hooks the same way ([Note: training states]).

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
        settings: the call's communication settings, shared with its ``FSDPState`` and
            its other buffers' groups (read at each collective).
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
        settings: CommSettings,
        name: str = "",
        offload: bool = False,
        pin_memory: bool = True,
        grads_in_params: bool = True,
        fp8: Float8BlockAllGather | None = None,
        subclass: bool = False,
    ):
        self.refs: list[ParamRef] = refs
        self._index_of = {id(ref): i for i, ref in enumerate(refs)}  # see _make_sharded
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
        self.settings = settings  # the call's, shared: FSDPModule.set_* write it
        # What the buffer lays out: each local tensor (``ref.tp`` set by ``group_specs``).
        originals = [p.to_local() if ref.tp is not None else p for ref, p in zip(refs, originals)]
        self.dtype = originals[0].dtype  # one dtype: checked by group_specs
        self.device = originals[0].device  # the compute device: the global storages'
        self.offload = offload
        shard_device = None
        if offload and self.device.type != "meta":  # on meta until to_empty / a load
            self.device = mesh_device(mesh)
            shard_device = torch.device("cpu")
        self.pin_memory = offload and pin_memory and can_pin_memory()  # [Note: the mesh's device]
        self.streams = streams_for(self.device)
        self.mp_policy = mp_policy
        self.compute_dtype = mp_policy.param_dtype or self.dtype
        self.reduce_dtype = mp_policy.reduce_dtype or self.compute_dtype
        if sorted(t.name for t in layout.tensors) != sorted(r.fqn for r in refs):
            raise AssertionError(f"fully_shard group {self.name}: its layout holds other tensors")
        self.layout = layout
        self.fp8 = None if fp8 is None else Fp8Layout(layout, fp8)
        self.subclass = (
            SubclassGather(refs, originals, mesh, mp_policy, self.device, self.dtype)
            if subclass
            else None
        )
        self.dbuf = self._new_dbuf(shard_device)
        for ref, p in zip(refs, originals):
            ref.placement = RaggedShard.from_layout(self.layout, ref.fqn)
            if self.device.type != "meta" and not self._holds(ref):
                full = values_of(p).contiguous()  # a subclass's inner tensor
                self.dbuf.shard_view(ref.fqn).copy_(ref.placement.local_view(full, self.rank))
            self._make_sharded(ref)
            ref.register(ref.sharded)
        self.state = ShardedState.SHARDED
        self._gather: PendingGather | None = None
        self._post_forward_piece: torch.Tensor | None = None  # 1D, m*S/k (SHARDED_POST_FORWARD)
        self.post_forward_group: PostForwardGroup | None = None  # reshard_after_forward=int
        self.grads_in_params = grads_in_params  # see [Note: gradients in place]
        self.grads = GradState()  # from a pre-backward to the sharded .grads: see _grads.py
        self.reduce_process_group = self.process_group  # or its own (separate RS group)
        self.unloaded: dict[str, str] = {}  # fqn -> key, on meta after a partial load
        # (refs, originals) -> the ParamGroups of this group's mesh, as fully_shard planned
        # them (set by fully_shard): see [Note: re-tied parameters] in _group_set.py
        self.replan: Callable[[list[ParamRef], list[torch.Tensor]], list[ParamGroup]] | None = None

    @property
    def is_unsharded(self) -> bool:
        """The modules hold the unsharded parameters (the all-gather waited)."""
        return self.state is ShardedState.UNSHARDED and self._gather is None

    def placements(self, ref: ParamRef) -> list:
        """The sharded parameter's placements: its TP placement (FSDP x TP; the model dims'
        on the SPMD mesh), ``[Replicate()]`` on the replicate dim (HSDP), then its
        RaggedShard."""
        tp = list(ref.tp.model_placements) if ref.tp is not None else []
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
        dt = self._dtensor(ref, local, torch.empty(ref.shape, device="meta").stride())
        if ref.sharded is None:
            ref.sharded = nn.Parameter(dt, requires_grad=ref.requires_grad)
        else:  # re-point an existing parameter (after to_empty / _apply), keeping its identity
            cast(DTensor, ref.sharded)._local_tensor = dt._local_tensor
            cast(DTensor, ref.sharded)._spec = dt._spec  # an adopted DTensor's placements
        if not self._holds(ref):  # a parameter of its own rows is in no buffer (buffer_of)
            setattr(ref.sharded, OWNER_ATTR, (weakref.ref(self), self._index_of[id(ref)]))

    def _dtensor(
        self, ref: ParamRef, local: torch.Tensor, stride: tuple[int, ...] | None = None
    ) -> DTensor:
        """``local`` (a view of the shard storage, or of the shard gradient storage) as
        ``ref``'s sharded DTensor; ``stride`` None: the sharded parameter's."""
        mesh, placements = self.param_mesh(ref), self.placements(ref)
        stride = ref.param.stride() if stride is None else stride
        return DTensor.from_local(local, mesh, placements, shape=ref.shape, stride=stride)

    def _holds(self, ref: ParamRef) -> bool:
        """A subclass parameter holding rows of its own, not a view of the shard storage
        (see [Note: tensor-subclass all-gather])."""
        return self.subclass is not None and self.subclass.holds(ref)

    def reset_after_apply(self) -> None:
        """Rebuild the storages after ``Module._apply`` (``to_empty``, ``to``, ``float``).

        ``_apply`` gives each parameter new local data; copy it into fresh shard
        storage on its device and make the parameters views again.
        """
        self._expect("Module._apply (to, to_empty)", ShardedState.SHARDED)
        current = {ref.fqn: held(ref) for ref in self.refs}
        first = next(iter(current.values()))
        local0 = first._local_tensor if isinstance(first, DTensor) else first
        shard_device = torch.device("cpu") if self.offload else local0.device
        # A storage's identity is its StorageImpl's address (``_cdata``), which fake tensors
        # have too (their data_ptr is deprecated).
        storage = self.dbuf.shard.untyped_storage()._cdata

        def unchanged(ref: ParamRef) -> bool:  # to_empty on the same device gives new tensors
            p = current[ref.fqn]
            local = p._local_tensor if isinstance(p, DTensor) else p
            if self.subclass is not None and self.subclass.holds(ref):
                return local is self.subclass.held_rows(ref)
            return values_of(local).untyped_storage()._cdata == storage

        views = all(unchanged(ref) for ref in self.refs)
        if views and (shard_device, local0.dtype) == (self.dbuf.shard.device, self.dtype):
            return
        self.unloaded = {}  # every parameter now holds what _apply gave it
        self.device = mesh_device(self.mesh) if self.offload else local0.device
        self.dtype = local0.dtype
        if self.subclass is not None:
            self.subclass.move_to(self.device, self.dtype)
        self.streams = streams_for(self.device)
        self.compute_dtype = self.mp_policy.param_dtype or self.dtype
        self.reduce_dtype = self.mp_policy.reduce_dtype or self.compute_dtype
        self.dbuf = self._new_dbuf(shard_device)
        for ref in self.refs:
            new = current[ref.fqn]
            if self._holds(ref):  # its new rows are the parameter's own
                assert self.subclass is not None
                self.subclass.adopt(ref, new._local_tensor if isinstance(new, DTensor) else new)
            else:
                self.dbuf.shard_view(ref.fqn).copy_(
                    values_of(new._local_tensor if isinstance(new, DTensor) else new)
                )
            if ref.sharded is not new:
                ref.sharded = None  # _apply made a new Parameter: adopt a fresh one
            self._make_sharded(ref)
            ref.unsharded, ref.sharded_grad = None, None
            ref.register(ref.param)

    def adopt_assigned(self, prefix: str = "") -> None:
        """Adopt what ``load_state_dict(..., assign=True)`` put in the modules' place (the
        module's load_state_dict post-hook): see [Note: assigned parameters] in
        ``_assigned.py``.

        Args:
            prefix: the group's module's prefix in the state dict (how messages name the
                parameters). Default: none.

        Raises:
            ValueError: an assigned tensor of another dtype, mesh or placement, or of a kind
                that is neither (the parameter named, with the fix).
        """
        self._adopt(prefix, registered=False)

    def adopt_registered(self) -> None:
        """Adopt, at lazy init (the first forward), what the modules hold in place of the
        sharded parameters, as FSDP2's ``reset_sharded_param`` does: see [Note: parameters
        registered after fully_shard] in ``_assigned.py``.

        Raises:
            NotImplementedError: a value of another dtype than the group's buffer (a
                submodule's ``.to(dtype)``), named.
            ValueError: a DTensor on another mesh, or a tensor of another shape.
        """
        if self.state is ShardedState.SHARDED:  # else the modules hold the unsharded ones
            self._adopt("", registered=True)

    def _adopt(self, prefix: str, registered: bool) -> None:
        """See ``adopt_assigned`` and ``adopt_registered``."""
        current = {ref.fqn: held(ref) for ref in self.refs}
        assigned = [
            ref
            for ref in self.refs
            if current[ref.fqn] is not ref.sharded
            # materialized apart (a submodule's to_empty), before a load or a forward; a
            # subclass parameter holding rows of its own views no storage of ours
            or (not self._holds(ref) and not views_shard(current[ref.fqn], self.dbuf.shard))
        ]
        if not assigned:
            if self.dbuf.shard.is_meta and not registered:  # a load left it on meta: name them
                self.unloaded = {r.fqn: prefix + r.fqn for r in self.refs}
            return
        self._expect("load_state_dict(assign=True)", ShardedState.SHARDED)
        try:
            pieces = {
                r.fqn: assigned_piece(
                    r,
                    current[r.fqn],
                    prefix + r.fqn,
                    self.name,
                    self.param_mesh(r),
                    tuple(self.placements(r)),
                    self.dtype,
                    self.rank,
                    self.dbuf,
                    registered=registered,
                )
                for r in assigned
            }
            devices = {t.device for t in pieces.values() if t.device.type != "meta"}
            if len(devices) > 1:
                raise ValueError(
                    f"load_state_dict(assign=True): the parameters of {self.name} were "
                    f"assigned tensors on several devices {sorted(map(str, devices))}; a "
                    "group's parameters live on one device: move them to one device"
                )
        except ValueError:
            for ref in assigned:  # the modules hold the sharded parameters as before
                ref.register(ref.param)
            raise
        old = self.dbuf
        shard_device = old.shard.device
        if devices:
            device = devices.pop()
            shard_device = torch.device("cpu") if self.offload else device
            self.device = mesh_device(self.mesh) if self.offload else device
            if self.subclass is not None:
                self.subclass.move_to(self.device, self.dtype)
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
                unloaded.setdefault(ref.fqn, prefix + ref.fqn)  # assigned meta, or not loaded
            elif rebuild:  # kept: its values move to the new storage
                self.dbuf.shard_view(ref.fqn).copy_(old.shard_view(ref.fqn))
            if piece is None and not rebuild:
                continue
            new = current[ref.fqn]
            adopt = isinstance(new, nn.Parameter) and isinstance(new, DTensor)
            ref.sharded = new if adopt else (ref.sharded if piece is None else None)
            self._make_sharded(ref)
            self._forget_unsharded(ref)
            ref.register(ref.param)
        self.unloaded = {r.fqn: unloaded[r.fqn] for r in self.refs if r.fqn in unloaded}

    def on_meta(self) -> list[ParamRef]:
        """The parameters still on the meta device (all of them on a meta buffer, else the
        ones a partial load left there)."""
        if self.device.type == "meta":
            return list(self.refs)
        return [r for r in self.refs if r.fqn in self.unloaded]

    # ---- unshard / reshard ----------------------------------------------------------------
    @phase("all_gather")
    def unshard(self, async_op: bool = False) -> None:
        """Start (or do) the all-gather of the global storage; ``wait_for_unshard`` ends it."""
        if self.state is ShardedState.UNSHARDED or self._gather is not None:
            return  # a no-op by contract: see [Note: group states]
        if self.grads.holds_params:  # a reduce-scatter still reads the storage
            self.wait_reduce()
        if self.device.type == "meta" or self.unloaded:  # the root checked at its first forward
            names = list(self.unloaded.values()) or [r.fqn for r in self.refs]
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {names} (of {self.name})\n"
                "call module.to_empty(device=...) and initialise them, or load them "
                "(load_state_dict(..., assign=True), set_model_state_dict), before forward"
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
                assert inp is not None and self.post_forward_group is not None  # kept by reshard
                pg = self.post_forward_group.process_group
                work = self._all_gather(out, inp, pg)
            elif self.subclass is not None:  # see [Note: tensor-subclass all-gather]
                work, inp, received = self.subclass.start(self.process_group, self._all_gather)
            elif self.fp8 is not None:  # see [Note: FP8 all-gather]
                inp = self.fp8.quantize(self.dbuf.shard, self.rank)
                if self.world == 1:  # the codes are what a gather would receive
                    received, work = inp, completed_work()
                else:
                    received = torch.empty(
                        self.world * inp.numel(), dtype=torch.uint8, device=self.device
                    )
                    work = self._all_gather(received, inp, self.process_group)
            else:
                inp = self.dbuf.all_gather_input()
                work = self._all_gather(self.dbuf.global_params.alloc(), inp, self.process_group)
        self._gather = PendingGather(work, version, inp, received)
        if not async_op:
            self.wait_for_unshard()

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, group):
        """One all-gather of the group, in place: ``out`` (1D, m x ``inp``) is the storage
        the parameters view (or the FP8 codes it decodes from), ``inp`` this rank's shard;
        through ``set_custom_all_gather``'s comm where one is set."""
        comm = self.settings.all_gather_comm
        if comm is None:
            return all_gather_single(out, inp, group=group, async_op=True)
        work = comm(output_tensor=out, input_tensor=inp, group=group, async_op=True)
        return completed_work() if work is None else work

    @phase("all_gather_wait")
    def wait_for_unshard(self) -> None:
        """Finish the all-gather; the modules hold the unsharded parameters."""
        if self._gather is None:
            self._expect("wait_for_unshard (no all-gather in flight)", ShardedState.UNSHARDED)
            return
        gather, self._gather = self._gather, None
        gather.work.wait()
        if self.subclass is not None:  # the copy-out into the outputs
            assert gather.received is not None  # SubclassGather.start returned it
            self.subclass.finish(gather.received)
        elif gather.received is not None:  # FP8: decode into the compute-dtype storage
            assert self.fp8 is not None  # only an FP8 gather receives codes
            self.fp8.dequantize(gather.received, self.dbuf.global_params.alloc())
        torch._C._autograd._unsafe_set_version_counter(
            (self.dbuf.global_params.tensor,), (gather.version,)
        )  # see [Note: version counter]
        self._post_forward_piece = None
        for ref in self.refs:
            if ref.requires_grad != ref.param.requires_grad:  # frozen / unfrozen since
                self._forget_unsharded(ref)
                ref.requires_grad = ref.param.requires_grad
            value = None if self.subclass is None else self.subclass.post_all_gather(ref)
            if ref.unsharded is None:
                view = self.dbuf.global_view(ref.fqn) if value is None else value
                if ref.tp is not None:  # the module's TP DTensor over the view
                    view = ref.tp.unsharded(view, ref.requires_grad)
                ref.unsharded = nn.Parameter(view, requires_grad=ref.requires_grad)
                if ref.requires_grad:
                    hook = reads_no_parameters(WeakPartial(self._first_grad_hook, ref))
                    ref.hooks.append(ref.unsharded.register_hook(hook))
                    ref.hooks.append(
                        ref.unsharded.register_post_accumulate_grad_hook(mark_got_grad(ref))
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
        if self.state is not ShardedState.UNSHARDED:  # see [Note: group states]
            # SHARDED: a no-op by contract; SHARDED_POST_FORWARD: drop the kept piece
            self._post_forward_piece = None
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
            ref.register(ref.param)
        self.state = ShardedState.SHARDED if keep is None else ShardedState.SHARDED_POST_FORWARD

    # ---- gradients: the functions of ``_grads.py`` over this group's state -----------------
    @property
    def reduce_spec(self) -> ReduceSpec:
        """Where and in which dtypes this group's gradients are reduced."""
        return ReduceSpec(
            self.reduce_process_group,
            self.world,
            self.replicate_group,
            self.replicate_size,
            self.dtype,
            self.compute_dtype,
            self.reduce_dtype,
            self.device,
            self.streams,
            self.offload,
        )

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
        prepare_grads(
            self.grads,
            self.refs,
            self.dbuf,
            self.name,
            self.settings,
            grads_in_params=self.grads_in_params,
            subclass=self.subclass is not None,
            unsharded=unsharded,
            reshard=reshard,
            module_hooks=module_hooks,
        )

    def _first_grad_hook(self, ref: ParamRef, grad: torch.Tensor) -> torch.Tensor:
        return first_grad(self.grads, self.refs, self.dbuf, self.name, ref, grad)

    @phase("post_backward_reduce")
    def post_backward(self, reshard: bool) -> None:
        """The group's gradients are complete: start the reduce-scatter (or keep them)."""
        if not self.grads.needs_post_backward:
            raise AssertionError(
                f"fully_shard group {self.name}: post_backward without a pre-backward "
                f"(state {self.state.value})"
            )
        in_place = finish_backward(self.grads, self.refs, self.dbuf, self.name)
        if in_place is not None:  # the storage holds the gradients: [Note: gradients in place]
            self.reshard(free=False)
            self.grads.holds_params = True
        elif reshard:
            self.reshard()
        spec = self.reduce_spec
        start_reduce(self.grads, self.refs, self.dbuf, self.name, spec, self.settings, in_place)

    def wait_reduce(self) -> None:
        """Wait for the reduce-scatter and free the unsharded gradients (the whole buffer)."""
        wait_reduce(self.grads, self.refs, self.dbuf)

    @phase("post_backward_set_grads")
    def finalize_grads(self, got_grad: list[bool]) -> list[str]:
        """Wait for the reduce-scatter and set the sharded ``.grad``s; returns the
        parameters another rank's gradient arrived for while this rank had none (then no
        gradient of the group is set). See ``_grads.finalize_grads``."""
        spec, settings = self.reduce_spec, self.settings
        return finalize_grads(
            self.grads, self.refs, self.dbuf, self.name, spec, settings, got_grad, self._dtensor
        )

    def reset_iter_state(self) -> None:
        """Drop the iteration: wait for collectives in flight, discard their results and the
        unsharded gradients, reshard."""
        if self._gather is not None:
            self.wait_for_unshard()
        reset_grads(self.grads, self.refs, self.dbuf)
        self.reshard()

    def use_separate_reduce_scatter_group(self, enable: bool) -> None:
        """Reduce-scatter over a process group of its own (the same ranks), or the shared one."""
        if enable and self.reduce_process_group is self.process_group:
            ranks = dist.get_process_group_ranks(self.process_group)
            self.reduce_process_group = new_group_like(ranks, self.process_group)
        elif not enable:
            self.reduce_process_group = self.process_group
