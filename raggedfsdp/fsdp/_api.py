"""``fully_shard`` and ``FSDPModule``: FSDP2's API over RaggedShard buffers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from raggedfsdp.fsdp._checks import (
    _UID_ATTR,
    _check_options,
    _check_unsupported,
    _collect_params,
    _mesh_of_call,
    _mixed_precision,
    _modules_of,
    _param_meshes,
)
from raggedfsdp.fsdp._device import move_to_mesh_device
from raggedfsdp.fsdp._group_set import GroupSet
from raggedfsdp.fsdp._mesh import dp_key
from raggedfsdp.fsdp._planning import GroupOptions, _plan_groups
from raggedfsdp.fsdp._policy import BlockPolicy, BlockRows, MixedPrecisionPolicy
from raggedfsdp.fsdp._records import CommSettings, ShardedState
from raggedfsdp.fsdp._state import FSDPState, state_of
from raggedfsdp.fsdp._torch_state import register_torch_state, torch_state_of
from raggedfsdp.planner import DEFAULT_MAX_BUFFERS

__all__ = ["FSDP2_SURFACE", "FSDPModule", "UnshardHandle", "fully_shard"]

_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy = _NO_MIXED_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims=None,
    block_policy: BlockPolicy | Callable[[str, nn.Parameter], BlockRows] | None = None,
    alignment_bytes: int | None = None,
    max_buffers: int = DEFAULT_MAX_BUFFERS,
    buffer_alpha_bytes: int | None = None,
    grads_in_params: bool = True,
    member_gaps: bool | str = False,
):
    """Shard ``module``'s parameters (those not already sharded by a nested call).

    Same contract as ``torch.distributed.fsdp.fully_shard`` (torch 2.13): apply it to
    each transformer block, then to the root; it mutates and returns ``module``, whose
    class becomes a subclass of ``FSDPModule`` (and of torch's ``FSDPModule``). The
    group's parameters are planned into one flat buffer (see ``raggedfsdp.planner``)
    and become ``nn.Parameter``s holding ``RaggedShard`` DTensors over views of it.

    Args:
        module: the module to shard, or a list of modules that form one group (they
            unshard before the first of them runs forward, reshard after the last).
        mesh: a 1-D ``DeviceMesh``, or a 2-D one ``(replicate, shard)`` for HSDP (see
            [Note: HSDP]). Default, as FSDP2's: all ranks of the default process group, on
            torch's accelerator when it has one, else on the CPU (see [Note: the mesh's
            device] in ``_device.py``). Parameters and buffers not on the mesh's device
            move there, as in FSDP2 (meta ones stay on meta).
        reshard_after_forward: free the unsharded parameters after forward (True),
            keep them until after backward (False), or keep them sharded over groups
            of this many consecutive ranks (an int that divides the mesh size; as in
            FSDP2, 1 means False, with a warning, and the mesh size means True).
            Default None, as in FSDP2: True, except for the root, whose parameters
            backward needs first (an explicit True reshards the root too).
        shard_placement_fn: FSDP2's per-parameter placement: ``None`` or ``Shard(0)``
            for a parameter is what RaggedShard does (dim-0 rows, whole blocks);
            ``Shard(d)`` for ``d > 0`` is laid out as dim-0 rows too, with FSDP2's numbers
            (see [Note: Shard(d) placements]). torch's
            ``ShardPlacementResult(placement, mesh_info)`` also gives the parameter its
            own data-parallel mesh (experts over an expert-data-parallel mesh): such
            parameters lie in buffers of their own mesh, see [Note: a mesh per
            parameter]. Default None.
        mp_policy: mixed precision, raggedfsdp's or torch's ``MixedPrecisionPolicy``.
            Default: none.
        offload_policy: torch's ``OffloadPolicy`` (none) or ``CPUOffloadPolicy``: the
            sharded parameters, their gradients and the optimizer step on the CPU, the
            unsharded ones on the mesh's device (see [Note: CPU offload]).
        ignored_params: parameters left as they are (not sharded, not reduced).
        dp_mesh_dims: torch's ``DataParallelMeshDims``: ``mesh`` is then the whole mesh of a
            model whose parameters are DTensors on it, ``Replicate()`` on the named
            data-parallel dims (``shard``, and ``replicate`` for HSDP); see [Note: the SPMD
            mesh] in ``_spmd.py``. Default None.
        block_policy: rows per block, a ``BlockPolicy`` or a callable of
            ``(fqn, param)`` returning a positive int or ``"whole"``. Default 1 row.
        alignment_bytes: alignment of every shard start and tensor offset, in bytes.
            Default None: 128 bytes (the planner's ``DEFAULT_ALIGNMENT_BYTES``), finer only
            for a group whose blocks are not multiples of it and where 128 bytes would
            make a buffer over twice the group's elements (see [Note: alignment where rows
            allow]).
        max_buffers: the most buffers the group's parameters may be split over, each with
            its own all-gather and reduce-scatter; the planner splits only where the
            padding saved costs more (on the wire and at the memory peak) than one more
            buffer's collectives, or where one buffer would hold over twice the group's
            elements, see [Note: multi-buffer groups] in ``raggedfsdp/planner/multi.py``.
            Default 4.
        buffer_alpha_bytes: that cost of one more buffer, in bytes of padding, without
            the twice-the-group rule (negative: split wherever the padding grows by less
            than its magnitude). Default (None): ``planner.default_alpha_bytes`` of the
            shard group's ranks, and the rule.
        grads_in_params: in backward, write each parameter's gradient over its own
            unsharded value once autograd no longer needs it, so the group holds no
            gradient buffer beside its unsharded parameters (see [Note: gradients in
            place] in ``_grads.py``). Pass False for a model that reads a
            parameter's value in backward after its gradient is complete (a
            ``detach()``-ed use), or that uses a parameter in several reentrant
            checkpointed regions (an error says so). Default True.
        member_gaps: let the planner put padding between the members of a stacked
            ``[E, out, in]`` parameter (fused experts) where that lowers the padding; such
            a stack is then cut only between members, every rank holds whole members,
            and its local tensor is a strided view ``(n, out, in)`` of the shard (see
            [Note: member gaps] in ``raggedfsdp.planner``). ``"always"`` gaps every stack
            whose member fits in a shard, even where that pads more (to exercise the
            layout). A stack sharded over its members by expert parallelism
            (``Shard(0)``) takes gaps; one that tensor parallelism shards inside its
            members raises NotImplementedError. FP8-gathered parameters are planned
            without gaps. torch warns once in backward that such a stack's gradient does
            not "obey the gradient layout contract": expected, as the gradient is added
            in place into the stack's strided span (no copy). Default False.

    Returns:
        ``module`` (or the list), now ``FSDPModule``s.

    Raises (the exception types FSDP2 raises for the same input, before the module
    changes; see [Note: FSDP2's exception types]):
        ValueError: a container without ``forward`` (``ModuleList``), a mesh that is not
            1-D or 2-D, a 0-d parameter, a bad ``reshard_after_forward`` or
            ``shard_placement_fn`` result, a bad ``dp_mesh_dims``, a block that does not
            divide a parameter's rows, a bad policy, a parameter shared with another group.
        AssertionError (also a ValueError): ``fully_shard`` twice on one module, a 2-D
            mesh without dim names.
        NotImplementedError: a non-contiguous (channels-last) parameter, an option
            raggedfsdp does not support (named).
    """
    _check_options(max_buffers, grads_in_params, member_gaps, buffer_alpha_bytes)
    modules = _modules_of(module)
    mp_policy = _mixed_precision(mp_policy)
    _check_unsupported(offload_policy)
    mesh, spmd = _mesh_of_call(mesh, dp_mesh_dims, reshard_after_forward)
    refs, originals = _collect_params(modules, set(ignored_params or ()))
    meshes, spmds = _param_meshes(refs, originals, mesh, spmd, shard_placement_fn)
    name = type(modules[0]).__name__ + (f" and {len(modules) - 1} more" if len(modules) > 1 else "")
    move_to_mesh_device(modules, originals, mesh, is_managed=lambda m: state_of(m) is None)
    options = GroupOptions(
        mp_policy=mp_policy,
        block_policy=block_policy,
        alignment_bytes=alignment_bytes,
        max_buffers=max_buffers,
        alpha=buffer_alpha_bytes,
        gaps=member_gaps,
        name=name,
        offload=isinstance(offload_policy, CPUOffloadPolicy),
        pin_memory=getattr(offload_policy, "pin_memory", True),
        grads_in_params=grads_in_params,
        settings=CommSettings(),  # the call's, shared by its state and its groups
    )
    group = _plan_groups(refs, originals, meshes, spmds, options)
    for ref, p in zip(refs, originals):
        setattr(p, _UID_ATTR, ref.origin)
    state = FSDPState(modules, group, mesh, mp_policy, reshard_after_forward, options.settings)
    for m in modules:
        _become_fsdp_module(m, state, group, one=len(modules) == 1)
    return module


# FSDP2's ``fully_shard.state(module)`` (torch's composable contract gives it one): the
# same lookup, see [Note: FSDP2's state, as torch reads it] in ``_torch_state.py``.
fully_shard.state = torch_state_of  # type: ignore[attr-defined]


def _become_fsdp_module(m: nn.Module, state: FSDPState, group, one: bool) -> None:
    """``m`` as an ``FSDPModule`` of ``state``, its state-dict loads on the sharded
    parameters; ``one``: the call's only module (a list's parameters are named by
    position in the state dict, not by the module's prefix)."""
    m.__class__ = _fsdp_class(m.__class__)
    register_torch_state(m, state)  # see [Note: FSDP2's state, as torch reads it]
    if group is not None:  # see [Note: assigned parameters] in _assigned.py
        where = {"prefix": ""}  # the module's prefix in the state dict being loaded
        m.register_load_state_dict_pre_hook(functools.partial(_before_load, group, where))
        m.register_load_state_dict_post_hook(
            functools.partial(_after_load, group, where if one else {"prefix": ""})
        )


def _before_load(group, where: dict, module, state_dict, prefix: str, *args) -> None:
    """``load_state_dict`` works on the sharded parameters (as FSDP2's pre-load hook)."""
    where["prefix"] = prefix
    if group.state is not ShardedState.SHARDED:
        group.reshard()


def _after_load(group, where: dict, module, incompatible_keys) -> None:
    group.adopt_assigned(where["prefix"])  # see [Note: assigned parameters]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, group: GroupSet | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule(TorchFSDPModule):
    """Mixed into the class of every module passed to ``fully_shard`` (as in FSDP2).

    A subclass of torch's ``FSDPModule``, so ``isinstance(m, torch.distributed.fsdp.
    FSDPModule)`` holds and torch's helpers that branch on it (torchtitan's gradient
    divide factor, ``register_fsdp_forward_method``, pipelining) treat raggedfsdp's
    modules as FSDP2's. Every public method of torch 2.13's ``FSDPModule`` is
    overridden here: implemented, or refused with ``NotImplementedError`` saying why
    (``FSDP2_SURFACE`` lists which).
    """

    # torch's __new__ finds the original class at this MRO index:
    # [FSDP<Orig>, raggedfsdp FSDPModule, torch FSDPModule, Orig, ...]
    _orig_cls_mro_index = 3

    if TYPE_CHECKING:  # the module's own (the class is mixed into an nn.Module's)

        def modules(self) -> Iterator[nn.Module]: ...

    # raggedfsdp's state, in place of torch's FSDPState: torch's helpers read it alike
    def _get_fsdp_state(self) -> FSDPState:  # type: ignore[override]
        """The module's state (what torch's ``register_fsdp_forward_method`` calls)."""
        return _checked_state(self)

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        mods = self.modules() if recurse else [cast(nn.Module, self)]
        return list(dict.fromkeys(s for m in mods if (s := state_of(m)) is not None))

    # ---- unshard / reshard ----------------------------------------------------------------
    # raggedfsdp's handle, in place of torch's: the same wait()
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:  # type: ignore[override]
        """All-gather this module's parameters now (``async_op``: return a handle). Before
        the first forward, the group's lazy init runs first, as in FSDP2."""
        state = _checked_state(self)
        state.lazy_init_group()
        group = state.group
        if group is not None:
            group.unshard(async_op=True)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters."""
        group = _checked_state(self).group
        if group is not None:
            group.reshard()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: reshard every group, drop
        collectives in flight and the gradients of the failed iteration (root only)."""
        state = _checked_state(self)
        if state.is_root is False:
            raise RuntimeError(
                "reset_iter_state: call it on the root module (the module fully_shard was "
                f"applied to last), not on {type(self).__name__}"
            )
        state.reset_iter_state()

    # ---- gradient reduction ---------------------------------------------------------------
    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: accumulate unsharded gradients locally (no reduce-scatter) across backwards."""
        for s in self._fsdp_states(recurse):
            s.set_requires_gradient_sync(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the all-reduce over the replicate dim (the reduce-scattered
        gradients accumulate until a backward with it); a 1-D mesh has none."""
        for s in self._fsdp_states(recurse):
            s.set_requires_all_reduce(bool(requires_all_reduce))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Sum gradients and divide by ``factor`` instead of averaging over ranks."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for s in self._fsdp_states(True):
            s.set_gradient_divide_factor(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2: ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``SUM`` only, dividing by the world size after (not ``AVG``)."""
        for s in self._fsdp_states(True):
            s.set_force_sum_reduction(bool(enable))

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """Call ``hook(reduce_output)`` on each reduced gradient buffer (1-D, S elements:
        the reduce-scatter output, or under HSDP the all-reduce output) before the sharded
        gradients are set, as FSDP2.

        Args:
            hook: called with the reduced buffer; it may change it in place.
            stream: FSDP2's stream to run the hook on (not with HSDP: ValueError, as
                FSDP2). On an accelerator the hook runs on it: the stream first waits for
                the reduction, and the current stream waits for the hook before the
                gradients are used. On the CPU the hook runs with ``torch.cpu.stream(stream)``
                current, as FSDP2's. Default None: the current stream.
        """
        states = self._fsdp_states(False)
        if stream is not None:
            if any(s.group is not None and s.group.replicate_group is not None for s in states):
                raise ValueError(
                    "stream cannot be set when using native HSDP: set_all_reduce_hook's hook "
                    "runs after the HSDP all-reduce, on its stream (as FSDP2); drop stream="
                )
            hook = _on_stream(hook, stream)
        for s in states:
            s.set_all_reduce_hook(hook)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """True: a parameter that got no gradient on this rank counts as a zero gradient,
        so every parameter of a group that ran backward gets the reduced gradient (zeros
        where no rank used it), as FSDP2. For ranks that use different parameters (mixture
        of experts, multi-modal branches), as DDP's ``find_unused_parameters``. False
        (default): such a parameter keeps ``.grad`` None. Either way each group
        reduce-scatters its whole buffer; see [Note: unused parameters] in ``_state.py``.
        """
        if not isinstance(reduce_scatter_unused_params, bool):
            raise ValueError(
                "set_reduce_scatter_unused_params: expected a bool, got "
                f"{type(reduce_scatter_unused_params).__name__}"
            )
        for s in self._fsdp_states(recurse):
            s.set_reduce_scatter_unused_params(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatters may be in flight at once in a backward (default 1)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers: expected an int >= 1, got "
                f"{max_input_buffers!r}"
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers: expected an int >= 1, got "
                f"{max_input_buffers}"
            )
        for s in self._fsdp_states(recurse):
            s.set_max_reduces_in_flight(max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True):
        """Run reduce-scatters on their own process group (over the same ranks)."""
        for s in self._fsdp_states(recurse):
            s.set_separate_reduce_scatter_group(bool(enable))

    # ---- resharding and prefetch ----------------------------------------------------------
    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward frees the unsharded parameters (default True)."""
        for s in self._fsdp_states(recurse):
            s.set_reshard_after_backward(reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at runtime (a bool, as in FSDP2)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                "set_reshard_after_forward: reshard_after_forward should be a bool, got "
                f"{type(reshard_after_forward).__name__}"
            )
        for s in self._fsdp_states(recurse):
            s.set_reshard_after_forward(reshard_after_forward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward needs only the gradients of this module's parameters, not the
        parameters (an embedding), so they are not all-gathered again."""
        _checked_state(self).set_unshard_in_backward(bool(unshard_in_backward))

    def set_modules_to_forward_prefetch(self, modules: Iterable[TorchFSDPModule]) -> None:
        """All-gather these modules' parameters at the start of this module's forward."""
        _checked_state(self).set_prefetch(forward=[_checked_state(m) for m in modules])

    def set_modules_to_backward_prefetch(self, modules: Iterable[TorchFSDPModule]) -> None:
        """All-gather these modules' parameters at the start of this module's backward."""
        _checked_state(self).set_prefetch(backward=[_checked_state(m) for m in modules])

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next all-gathers wait on ``event`` (recorded after the optimizer step)
        instead of the whole current stream; on the CPU there are no streams."""
        _checked_state(self).set_post_optim_event(event)

    # ---- pipelining, collectives and their memory -----------------------------------------
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2: False lets the end of a backward skip waiting for its reduce-scatters
        (pipeline schedules and chunked accumulation call it between microbatches).
        Accepted with the same numbers: raggedfsdp still finishes every reduce-scatter
        that a backward started at its end (the sharded ``.grad``s are set then), which
        only forgoes overlapping the last of them with the next microbatch's forward.
        With ``set_requires_gradient_sync(False)``, as those schedules pair it, a
        backward starts none. So nothing is kept of ``is_last_backward``."""
        _checked_state(self)

    def set_custom_all_gather(self, comm) -> None:
        """Run every all-gather of this module's group through ``comm`` (FSDP2's
        ``AllGather``), with the buffer's own input and output: see [Note: custom
        collectives].

        Raises:
            ValueError: the group's parameters live on several meshes (as FSDP2).
        """
        self._comm_settings("set_custom_all_gather").all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm) -> None:
        """Run every reduce-scatter of this module's group through ``comm`` (FSDP2's
        ``ReduceScatter``), with the buffer's own input and output: see [Note: custom
        collectives].

        Raises:
            ValueError: the group's parameters live on several meshes (as FSDP2).
        """
        self._comm_settings("set_custom_reduce_scatter").reduce_scatter_comm = comm

    def _comm_settings(self, what: str) -> CommSettings:
        """The settings a custom collective is set in, once checked (``what``: the method).

        [Note: custom collectives]
        FSDP2 lets a user replace its all-gather and reduce-scatter (``AllGather`` /
        ``ReduceScatter``: an ``allocate(size, dtype=, device=)`` for its staging buffers
        and a ``__call__``). raggedfsdp has no staging buffers: its collectives run in
        place on the DBuffer's storages, which the parameters and gradients view. So a
        custom collective is called, with FSDP2's keywords, on those storages:

        - all-gather: ``comm(output_tensor=out, input_tensor=inp, group=pg,
          async_op=True)``; ``out`` (1D, ``world * S``) is the group's global storage (or,
          for an FP8 or tensor-subclass buffer, the byte buffer decoded from), ``inp``
          (1D, ``S``) this rank's shard (or its one cast). It must write every rank's
          ``inp`` into ``out`` in rank order, as ``all_gather_into_tensor`` does, and
          return its ``Work`` (or None when done).
        - reduce-scatter: ``comm(output_tensor=out, input_tensor=inp, group=pg, op=op)``,
          called synchronously as FSDP2 calls it; ``inp`` (1D, ``world * S``) is the flat
          gradient storage (or its one cast to the reduce dtype), ``out`` (1D, ``S``) the
          shard gradient storage, ``op`` the reduction FSDP2 would use (the division by
          the world size is applied around it as FSDP2's).
        - ``allocate`` is never called: the output is the storage whose views are the
          parameters, allocated whole by the DBuffer. A comm that needs its own memory
          (a pool, symmetric memory) must copy in and out itself.
        """
        state = _checked_state(self)
        groups = [] if state.group is None else state.group.groups
        if len({dp_key(g.mesh) for g in groups}) > 1:
            raise ValueError(
                f"{what} is not supported with multiple param groups (from per-param mesh "
                "via shard_placement_fn). The custom comm would be ambiguous across groups "
                "with different meshes."
            )
        return state.settings

    def _no_custom_comm(self, what: str) -> list:
        """The group's buffers; AssertionError where a custom comm is set (as FSDP2)."""
        state = _checked_state(self)
        groups = [] if state.group is None else state.group.groups
        if groups:
            for kind, comm in (
                ("all gather", state.settings.all_gather_comm),
                ("reduce scatter", state.settings.reduce_scatter_comm),
            ):
                if comm is not None:
                    raise AssertionError(
                        f"cannot call {what}() when {kind} comm is custom: {type(comm).__name__}"
                    )
        return groups

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2: allocate the collectives' staging buffers with the process group's own
        allocator, where its backend has one (NCCL's memory pool); elsewhere (gloo, the
        CPU) FSDP2 allocates them as usual, and so does raggedfsdp: a no-op.

        Raises:
            AssertionError: a custom collective is set (as FSDP2).
            NotImplementedError: enabled where the backend allocates tensors: raggedfsdp's
                collectives run on the DBuffer's storages, resized in place so that the
                parameters stay views of them, which that allocator cannot give.
        """
        for g in self._no_custom_comm("set_allocate_memory_from_process_group"):
            for pg in {g.process_group, g.reduce_process_group}:
                if enable and pg._get_backend(g.device).supports_tensor_alloc(g.device):
                    raise NotImplementedError(
                        "set_allocate_memory_from_process_group_for_comm: the process group's "
                        f"backend allocates tensors on {g.device}, but raggedfsdp's collectives "
                        "have no staging buffers: they run on the DBuffer's storages, resized "
                        "in place so that parameters stay views of them; not supported yet: "
                        "leave it off"
                    )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """FSDP2: gather into symmetric memory (NCCL's copy-engine all-gather).

        Raises:
            AssertionError: a custom collective is set (as FSDP2).
            RuntimeError: torch has no symmetric-memory ``backend`` here (the CPU), raised
                by torch's ``set_backend`` as in FSDP2.
            NotImplementedError: where it has one: the all-gather output is the DBuffer's
                global storage, resized in place so that parameters stay views of it, not a
                rendezvoused symmetric-memory tensor.
        """
        from torch.distributed import _symmetric_memory as symm_mem

        self._no_custom_comm("set_symm_mem")
        symm_mem.set_backend(backend)  # type: ignore[arg-type]  # raises where torch has none
        raise NotImplementedError(
            "set_symm_mem_for_comm: the all-gather output is the DBuffer's global storage, "
            "resized in place so that the parameters stay views of it, not a symmetric-memory "
            "tensor; not supported yet: leave it off (the all-gather runs in place, without "
            "the staging copies symmetric memory saves in FSDP2)"
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private knob (torchtitan sets it): forward all-gathers here are always
        issued asynchronously and waited where the module needs its parameters."""

    def _apply(self, fn, recurse: bool = True):
        # Groups wholly inside this module: a group of several modules (a list) is rebuilt
        # by the _apply of a module holding them all, once every member has been applied.
        inside = {id(m) for m in self.modules()}
        states = [s for s in self._fsdp_states(True) if all(id(m) in inside for m in s.modules)]
        for s in states:
            if s.group is not None:
                s.group.reshard()  # the sharded parameters are what _apply sees
        # nn.Module's _apply, skipping torch's FSDPModule._apply (it reads FSDP2's state)
        out = super(TorchFSDPModule, self)._apply(fn, recurse)  # type: ignore[misc]
        for s in states:
            if s.group is not None:
                s.group.reset_after_apply()
        return out


def _on_stream(hook: Callable[[torch.Tensor], None], stream) -> Callable[[torch.Tensor], None]:
    """``hook`` run on ``stream`` (``set_all_reduce_hook``). On the CPU, with
    ``torch.cpu.stream(stream)`` current, as FSDP2 runs it (no work is queued there, but
    ``torch.cpu.current_stream()`` inside the hook is ``stream``)."""
    device = getattr(stream, "device", None)
    if device is None or torch.device(device).type == "cpu":

        def on_cpu(output: torch.Tensor) -> None:
            with torch.cpu.stream(stream):
                hook(output)

        return on_cpu

    def run(output: torch.Tensor) -> None:
        current = torch.accelerator.current_stream(output.device)
        stream.wait_stream(current)  # the reduced buffer is ready there
        with stream:
            hook(output)
        current.wait_stream(stream)  # the gradients are set and used after the hook

    return run


# How raggedfsdp answers each public method of torch 2.13's FSDPModule (tests check that
# this covers them all; docs/gen_fsdp2_table.py writes docs/fully_shard.md's table from it).
FSDP2_SURFACE: dict[str, str] = {
    "reset_iter_state": "supported",
    "reshard": "supported",
    "unshard": "supported",
    "set_all_reduce_hook": "supported (stream= too)",
    "set_force_sum_reduction_for_comms": "supported",
    "set_gradient_divide_factor": "supported",
    "set_reduce_scatter_divide_factor": "supported (deprecated alias, as in FSDP2)",
    "set_modules_to_backward_prefetch": "supported",
    "set_modules_to_forward_prefetch": "supported",
    "set_post_optim_event": "supported (no-op on the CPU)",
    "set_reduce_scatter_max_input_buffers": "supported",
    "set_reduce_scatter_unused_params": "supported",
    "set_requires_all_reduce": "supported (HSDP; no all-reduce on a 1-D mesh)",
    "set_requires_gradient_sync": "supported",
    "set_reshard_after_backward": "supported",
    "set_reshard_after_forward": "supported",
    "set_separate_reduce_scatter_group": "supported",
    "set_unshard_in_backward": "supported",
    "set_is_last_backward": "supported (False: a backward still finishes what it started)",
    "set_custom_all_gather": "supported: called on the buffer's own storages (no staging)",
    "set_custom_reduce_scatter": "supported: called on the buffer's own storages (no staging)",
    "set_allocate_memory_from_process_group_for_comm": (
        "a no-op where the backend has no allocator (gloo), as in FSDP2; refused where it has "
        "one (the storages are resized in place)"
    ),
    "set_symm_mem_for_comm": (
        "torch's RuntimeError without a symmetric-memory backend (the CPU), as in FSDP2; "
        "refused where there is one (the global storage is not symmetric memory)"
    ),
    "_set_unshard_async_op": "supported (private in FSDP2; gathers are always asynchronous)",
    "_get_fsdp_state": "supported (raggedfsdp's state, for register_fsdp_forward_method)",
    "_apply": "supported (to_empty, to, float: the buffers are rebuilt)",
}


def _checked_state(module) -> FSDPState:
    state = state_of(module)  # a module passed to fully_shard
    if state is None:
        raise ValueError(f"expected a module passed to fully_shard, got {type(module).__name__}")
    return state


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]
