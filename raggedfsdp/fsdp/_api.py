"""``fully_shard`` and ``FSDPModule``: FSDP2's API over RaggedShard buffers."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor import Shard

from raggedfsdp.fsdp._buffers import buffer_of
from raggedfsdp.fsdp._device import default_device_type, move_to_mesh_device
from raggedfsdp.fsdp._fp8 import Float8BlockAllGather, check_master_dtype
from raggedfsdp.fsdp._group_set import GroupSet
from raggedfsdp.fsdp._mesh import dp_key, placement_and_mesh
from raggedfsdp.fsdp._param_group import ParamGroup, ParamRef, ShardedState, group_specs
from raggedfsdp.fsdp._policy import BlockPolicy, BlockRows, MixedPrecisionPolicy
from raggedfsdp.fsdp._spmd import spmd_mesh, spmd_of_placement
from raggedfsdp.fsdp._state import FSDPState, resolve_reshard_after_forward, state_of
from raggedfsdp.fsdp._subclass import subclass_params
from raggedfsdp.fsdp._torch_state import register_torch_state
from raggedfsdp.fsdp._trace import logger
from raggedfsdp.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    DEFAULT_MAX_BUFFERS,
    MAX_UNSHARDED_RATIO,
    BufferLayout,
    gap_eligible,
    plan_buffers,
)

__all__ = ["FSDP2_SURFACE", "FSDPModule", "UnshardHandle", "fully_shard"]

_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()
# Set on a parameter fully_shard sharded: a uid that outlives it (an id may be reused),
# as FSDP2's _orig_param_uid, so that a later call sharding it again is known.
_UID_ATTR = "_raggedfsdp_uid"
_UIDS = itertools.count()


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
    if isinstance(max_buffers, bool) or not isinstance(max_buffers, int) or max_buffers < 1:
        raise ValueError(
            f"fully_shard: max_buffers must be an int >= 1, got {max_buffers!r}; pass 1 to keep "
            "each group in one buffer"
        )
    if not isinstance(grads_in_params, bool):
        raise ValueError(f"fully_shard: grads_in_params must be a bool, got {grads_in_params!r}")
    if not (isinstance(member_gaps, bool) or member_gaps == "always"):
        raise ValueError(
            f"fully_shard: member_gaps must be True, False or 'always', got {member_gaps!r}"
        )
    if buffer_alpha_bytes is not None and (
        isinstance(buffer_alpha_bytes, bool) or not isinstance(buffer_alpha_bytes, int)
    ):
        raise ValueError(
            "fully_shard: buffer_alpha_bytes must be an int (bytes) or None, got "
            f"{buffer_alpha_bytes!r}"
        )
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError(
            "fully_shard: module must be an nn.Module or a non-empty list of them, got "
            f"{type(module).__name__}"
        )
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard: a {type(m).__name__} has no forward, so nothing would unshard "
                "its parameters; fully_shard each module in it, or a list of them as one group "
                "(fully_shard(list(container))), or the module that calls them"
            )
        if state_of(m) is not None:
            raise InputError(
                f"fully_shard: {type(m).__name__} was already passed to fully_shard; "
                "call it once per module (bottom-up: blocks first, then the root)"
            )
    mp_policy = _mixed_precision(mp_policy)
    _check_unsupported(offload_policy)
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError(
                "fully_shard: no mesh given and no default process group; "
                "call torch.distributed.init_process_group first"
            )
        mesh = init_device_mesh(default_device_type(), (dist.get_world_size(),))
    spmd = None
    if dp_mesh_dims is not None:  # see [Note: the SPMD mesh] in _spmd.py
        spmd = spmd_mesh(mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                "reshard_after_forward as int is not yet supported with SPMD mesh "
                "(dp_mesh_dims), as in FSDP2: pass True or False"
            )
        mesh = spmd.dp
    if mesh.ndim not in (1, 2):
        raise ValueError(  # FSDP2's words first: see [Note: FSDP2's exception types]
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: a {mesh.ndim}-D mesh "
            f"of shape {tuple(mesh.shape)}; FSDP is 1-D, HSDP 2-D (replicate, shard): pass "
            "the data-parallel dims, e.g. mesh['dp_replicate', 'dp_shard']"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise InputError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified: fully_shard got a "
            f"2-D mesh of shape {tuple(mesh.shape)} without mesh_dim_names (replicate first, "
            "then shard): init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
        )
    resolve_reshard_after_forward(reshard_after_forward, mesh.size(-1))  # raises on bad input
    refs, originals = _collect_params(modules, set(ignored_params or ()))
    meshes = [mesh] * len(refs)  # each parameter's data-parallel mesh
    spmds = [spmd] * len(refs)  # and its whole SPMD mesh (dp_mesh_dims)
    if shard_placement_fn is not None:
        for i, (ref, p) in enumerate(zip(refs, originals)):
            result = shard_placement_fn(p)
            placement, meshes[i] = placement_and_mesh(ref.fqn, result, mesh)
            if spmd is not None and meshes[i] is not mesh:
                own = spmds[i] = spmd_of_placement(ref.fqn, result)
                meshes[i] = own.dp
            _check_placement(ref.fqn, p, placement)
    name = type(modules[0]).__name__ + (f" and {len(modules) - 1} more" if len(modules) > 1 else "")
    move_to_mesh_device(modules, originals, mesh, is_managed=lambda m: state_of(m) is None)
    group = None
    # [Note: a mesh per parameter] Parameters that shard_placement_fn gives their own mesh
    # (torch's ShardPlacementResult) are planned apart, one buffer kind per data-parallel
    # mesh (compared by process groups, as FSDP2 groups them); the call's groups are one
    # GroupSet whose buffers live on different meshes.
    by_mesh: dict[tuple, list[int]] = {}
    for i, param_mesh in enumerate(meshes):
        whole = spmds[i]
        by_mesh.setdefault((*dp_key(param_mesh), whole and whole.full), []).append(i)
    parts = []
    for k, mine in enumerate(by_mesh.values()):
        part_name = name if len(by_mesh) == 1 else f"{name}[mesh {k}]"
        plan_part = functools.partial(  # kept by the groups: see [Note: re-tied parameters]
            _new_group,
            mesh=meshes[mine[0]],
            mp_policy=mp_policy,
            block_policy=block_policy,
            alignment_bytes=alignment_bytes,
            max_buffers=max_buffers,
            alpha=buffer_alpha_bytes,
            gaps=member_gaps,
            spmd=spmds[mine[0]],
            name=part_name,
            offload=isinstance(offload_policy, CPUOffloadPolicy),
            pin_memory=getattr(offload_policy, "pin_memory", True),
            grads_in_params=grads_in_params,
        )
        parts.append(plan_part([refs[i] for i in mine], [originals[i] for i in mine]))
        for g in parts[-1]:
            g.replan = plan_part
    if parts:
        buffers = [g for part in parts for g in part]
        group = GroupSet(buffers, buffers[0].name if len(buffers) == 1 else name)
    for ref, p in zip(refs, originals):
        setattr(p, _UID_ATTR, ref.origin)
    state = FSDPState(modules, group, mesh, mp_policy, reshard_after_forward)
    for m in modules:
        m.__class__ = _fsdp_class(m.__class__)
        register_torch_state(m, state)  # see [Note: FSDP2's state, as torch reads it]
        if group is not None:  # see [Note: assigned parameters] in _param_group.py
            where = {"prefix": ""}  # the module's prefix in the state dict being loaded
            one = len(modules) == 1  # a list's parameters are named by position, not prefix
            m.register_load_state_dict_pre_hook(functools.partial(_before_load, group, where))
            m.register_load_state_dict_post_hook(
                functools.partial(_after_load, group, where if one else {"prefix": ""})
            )
    return module


class InputError(ValueError, AssertionError):
    """A bad call that FSDP2 refuses with ``AssertionError``.

    [Note: FSDP2's exception types]
    ``fully_shard`` raises, for each input FSDP2 refuses at call time, the exception type
    FSDP2 raises (code written for FSDP2 catches it), with a message that names what is
    wrong and the fix. Where FSDP2 uses ``AssertionError`` for a user's mistake (``fully_shard``
    twice on one module, a 2-D mesh without dim names), this class is both that and the
    ``ValueError`` a bad input is everywhere else in raggedfsdp.
    """


def _before_load(group, where: dict, module, state_dict, prefix: str, *args) -> None:
    """``load_state_dict`` works on the sharded parameters (as FSDP2's pre-load hook)."""
    where["prefix"] = prefix
    if group.state is not ShardedState.SHARDED:
        group.reshard()


def _after_load(group, where: dict, module, incompatible_keys) -> None:
    group.adopt_assigned(where["prefix"])  # see [Note: assigned parameters]


def _mixed_precision(policy) -> MixedPrecisionPolicy:
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if isinstance(policy, TorchMixedPrecisionPolicy):
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
    raise ValueError(
        "fully_shard: mp_policy must be a MixedPrecisionPolicy (raggedfsdp's or "
        f"torch.distributed.fsdp's), got {type(policy).__name__}"
    )


def _check_unsupported(offload_policy) -> None:
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(
            "fully_shard: offload_policy must be a torch.distributed.fsdp.OffloadPolicy or "
            f"CPUOffloadPolicy, got {type(offload_policy).__name__}"
        )


def _aligned_where_rows_allow(specs, itemsize: int, at) -> Sequence[BufferLayout]:
    """The default alignment (``alignment_bytes=None``): ``DEFAULT_ALIGNMENT_BYTES``, unless
    the group's blocks are not whole multiples of it and that alignment bloats a buffer.

    [Note: alignment where rows allow] A shard start (a multiple of ``S``) and a tensor's
    offset are both multiples of the alignment, so a cut inside a tensor whose blocks are
    not a multiple of it falls only every lcm(alignment, block) elements: a 260-element
    fp32 row under 128-byte alignment is cut every 8 rows, and at thousands of ranks such
    a buffer gathers many times its elements where FSDP2 gathers one row per rank. Where
    the aligned plan holds a buffer over ``MAX_UNSHARDED_RATIO`` times its elements, the
    group is planned again at the finest alignment its blocks allow (the gcd of the
    alignment and every block's bytes, at least one element), and the plan that holds
    fewer elements wins. Groups whose blocks are multiples of the alignment (the weights
    of real models) are never affected; an explicit ``alignment_bytes`` is used as given.
    """
    aligned = at(DEFAULT_ALIGNMENT_BYTES)
    if not any(lay.global_size > MAX_UNSHARDED_RATIO * lay.total_numel for lay in aligned):
        return aligned
    finer = DEFAULT_ALIGNMENT_BYTES
    for s in specs:
        finer = math.gcd(finer, s.block_elems * itemsize)
    finer = max(finer, itemsize)
    if finer == DEFAULT_ALIGNMENT_BYTES:
        return aligned
    relaxed = at(finer)
    if sum(lay.global_size for lay in relaxed) < sum(lay.global_size for lay in aligned):
        logger.debug(
            "fully_shard: %d-byte alignment instead of %d: the group's blocks are not "
            "multiples of it (see [Note: alignment where rows allow])",
            finer,
            DEFAULT_ALIGNMENT_BYTES,
        )
        return relaxed
    return aligned


def _leaves_a_rank_empty(layout: BufferLayout, world: int) -> bool:
    """Whether some rank holds none of a tensor that has a row for every rank."""
    return any(t.shape[0] >= world and 0 in layout.local_units(t.name) for t in layout.tensors)


def _check_placement(fqn: str, param: nn.Parameter, placement) -> None:
    if placement is not None and not isinstance(placement, Shard):
        raise ValueError(
            f"fully_shard: shard_placement_fn gives parameter {fqn!r} {placement!r}; expected "
            "None or Shard(dim) (RaggedShard cuts dim 0: return None or Shard(0))"
        )
    if placement is None or -param.dim() <= placement.dim < param.dim():
        return  # Shard(d > 0) is laid out as dim-0 rows: see [Note: Shard(d) placements]
    dim = placement.dim if placement.dim >= 0 else placement.dim + param.dim()
    raise InputError(  # FSDP2's AssertionError, and its words first
        f"Shard dim {dim} is invalid for {param.dim()}D tensor: {param.shape}: fully_shard's "
        f"shard_placement_fn gives parameter {fqn!r} {placement!r}; return None or Shard(d) "
        f"with -{param.dim()} <= d < {param.dim()}"
    )


# [Note: Shard(d) placements]
# FSDP2 cuts a parameter on the dim ``shard_placement_fn`` names; RaggedShard always cuts
# dim-0 rows in whole blocks, and a ``Shard(d)`` for ``d > 0`` is accepted and laid out
# the same way. The numbers do not depend on where a shard is cut (every rank reduces and
# updates its own elements of each parameter), so training gives FSDP2's losses and
# parameters. What FSDP2 uses ``Shard(1)`` for, a parameter whose dim 0 is smaller than
# the mesh (torchtitan's experts when there are more data-parallel ranks than experts,
# where dim-0 chunks would leave ranks empty and pad them), costs nothing here: the
# planner balances the whole group's rows over the ranks (a stacked 3-D parameter's rows
# are its (member, row) pairs), within its padding bound. What differs: the sharded
# parameter's placement is RaggedShard, so its local tensor holds whole rows, not a
# range of dim d (as every raggedfsdp parameter's placement differs from FSDP2's).


def _collect_params(
    modules: list[nn.Module], ignored: set
) -> tuple[list[ParamRef], list[nn.Parameter]]:
    """The parameters this call manages: not ignored, not inside a nested fully_shard."""
    refs: dict[int, ParamRef] = {}
    originals: dict[int, nn.Parameter] = {}
    managed_elsewhere: set[int] = set()

    def visit(mod: nn.Module, prefix: str, top: bool) -> None:
        if not top and state_of(mod) is not None:  # a nested fully_shard owns this subtree
            managed_elsewhere.update(id(p) for p in mod.parameters())
            return
        for name, p in mod._parameters.items():
            if p is None or p in ignored:
                continue
            _check_param(prefix + name, p)
            # The original of a parameter another group already replaced is sharded
            # again, as FSDP2 does; the root refuses the pair at the first forward
            # (FSDPState._validate_params), where FSDP2 does.
            owner = _sharded_by(p)
            if owner is not None:  # already sharded: fully_shard(root) came before this call
                raise ValueError(
                    f"fully_shard: parameter {prefix + name!r} is already sharded, as "
                    f"{owner[1]!r} of {owner[0]}; apply fully_shard bottom-up: each block "
                    "first, then the root"
                )
            if id(p) in refs:
                refs[id(p)].uses.append((mod, name))  # tied: one parameter, several places
            else:
                uid = getattr(p, _UID_ATTR, None)  # set: an earlier call sharded it too
                refs[id(p)] = ParamRef(
                    fqn=prefix + name,
                    uses=[(mod, name)],
                    shape=p.shape,
                    requires_grad=p.requires_grad,
                    origin=next(_UIDS) if uid is None else uid,
                    resharded=uid is not None,
                )
                originals[id(p)] = p
        for child_name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)

    for i, module in enumerate(modules):
        visit(module, "" if len(modules) == 1 else f"{i}.", True)
    crossing = [refs[i].fqn for i in refs if i in managed_elsewhere]
    if crossing:
        raise NotImplementedError(
            f"fully_shard: parameters {crossing} are shared with a module that has its own "
            "fully_shard; tied parameters must be in one group: fully_shard their common parent"
        )
    return list(refs.values()), list(originals.values())


def _check_param(fqn: str, p: nn.Parameter) -> None:
    """FSDP2's checks of a parameter, with its exception types."""
    if p.dim() == 0:  # FSDP2's words first: see [Note: FSDP2's exception types]
        raise ValueError(
            "fully_shard doesn't support scalar parameters. Change "
            f"{fqn} to a 1D tensor with numel equal to 1. (fully_shard: parameter {fqn!r} is "
            "0-d; a shard cuts a dim: make it shape (1,), or pass it in ignored_params)"
        )
    if not p.is_contiguous():
        raise NotImplementedError(
            "FSDP does not support non-contiguous parameters yet: fully_shard got parameter "
            f"{fqn!r} of shape {tuple(p.shape)} with strides {p.stride()} (e.g. channels_last): "
            "make it contiguous first (module.to(memory_format=torch.contiguous_format))"
        )


def _sharded_by(p) -> tuple[str, str] | None:
    found = buffer_of(p)
    return None if found is None else (found[0]._group.name, found[1].fqn)


def _check_gaps_beside_tp(refs, specs, gaps) -> None:
    """Member gaps lay a stack out member by member, each member whole on its rank. A stack
    that tensor parallelism shards over its members (expert parallelism: ``Shard(0)``)
    keeps whole members locally, so it takes gaps; one sharded inside its members
    (``Shard(1)``, ``Shard(2)``) is not supported yet."""
    for ref, spec in zip(refs, specs):
        if ref.tp is None or not gap_eligible(spec):
            continue
        inside = [p for p in ref.tp.placements if not (p.is_replicate() or p == Shard(0))]
        if inside:
            raise NotImplementedError(
                f"fully_shard: member_gaps={gaps!r} with {ref.fqn!r}, a stack of "
                f"{spec.members} members that tensor parallelism shards inside its members "
                f"({inside[0]!r}), is not supported yet; pass member_gaps=False (a stack sharded "
                "over its members, Shard(0) as expert parallelism does, takes gaps)"
            )


def _new_group(
    refs,
    originals,
    mesh,
    mp_policy,
    block_policy,
    alignment_bytes,
    max_buffers,
    alpha,
    gaps,
    spmd,
    **kw,
):
    """The buffers of one mesh of a ``fully_shard`` call: one ``ParamGroup`` per buffer
    (several where the planner splits the group: see [Note: multi-buffer groups]).
    ``spmd``: the whole mesh of a ``dp_mesh_dims`` call, or None."""
    specs, dtypes = group_specs(refs, originals, mesh, block_policy, spmd)
    if gaps:
        _check_gaps_beside_tp(refs, specs, gaps)
    fp8 = mp_policy.all_gather
    selected = _fp8_selected(refs, specs, dtypes, fp8, kw) if fp8 is not None else set()
    if selected:  # see [Note: FP8 all-gather]: selected tensors plan apart from the rest
        specs = [
            dataclasses.replace(s, block_rows=fp8.block_rows_for(s.block_rows))
            if i in selected
            else s
            for i, s in enumerate(specs)
        ]
    # Tensor subclasses with FSDP2's hooks plan apart too: [Note: tensor-subclass all-gather]
    hooked = subclass_params(
        refs, originals, specs, fp8_selected=selected, offload=kw.get("offload", False)
    )
    plain = set(range(len(specs))) - selected - hooked
    world = mesh.size(mesh.ndim - 1)

    def plan(part: list, how: Float8BlockAllGather | None) -> Sequence[BufferLayout]:
        dtype = dtypes[index[part[0].name]]

        def at(align: int) -> tuple[BufferLayout, ...]:
            return plan_buffers(
                part,
                world,
                max_buffers=max_buffers,
                alpha_bytes=alpha,
                dtype=dtype,
                member_gaps=gaps if how is None else False,
                alignment_bytes=align,
            ).layouts

        if how is not None:
            return at(
                how.alignment_bytes(
                    DEFAULT_ALIGNMENT_BYTES if alignment_bytes is None else alignment_bytes, dtype
                )
            )
        if alignment_bytes is not None:
            return at(alignment_bytes)
        return _aligned_where_rows_allow(part, dtype.itemsize, at)

    index = {ref.fqn: i for i, ref in enumerate(refs)}
    # [Note: mixed dtypes] A buffer holds one dtype: each kind of buffer below is planned
    # once per dtype of its parameters, so a group of several dtypes (a frozen bf16 base
    # beside fp32 adapters) has one buffer, collective and cast path per dtype.
    kinds = [(selected, fp8, False), (hooked, None, True), (plain, None, False)]
    by_dtype = [
        ({i for i in part if dtypes[i] == dt}, how, hooks)
        for part, how, hooks in kinds
        for dt in dict.fromkeys(dtypes[i] for i in sorted(part))
    ]
    layouts: list[tuple[BufferLayout, Float8BlockAllGather | None, bool]] = []
    for part, how, by_hooks in by_dtype:
        part_specs = [s for i, s in enumerate(specs) if i in part]
        if not part_specs:
            continue
        planned = plan(part_specs, how)
        if by_hooks and any(_leaves_a_rank_empty(layout, world) for layout in planned):
            # A subclass's fsdp_pre_all_gather runs on every rank's rows, and may not take
            # none (torchao's dynamic float8 scale takes an amax of them): each such
            # parameter gets a buffer of its own, its rows spread over every rank, as
            # FSDP2's even chunks are (one more all-gather per parameter).
            planned = [layout for spec in part_specs for layout in plan([spec], how)]
        layouts += [(layout, how, by_hooks) for layout in planned]
    for layout, _, _ in layouts:
        logger.debug(
            "fully_shard %s: a buffer of %d tensors over %d ranks: S = %d elements per rank, "
            "padding %d of %d (%.2f%%)",
            kw["name"],
            len(layout.tensors),
            world,
            layout.shard_size,
            layout.padding,
            layout.global_size,
            100.0 * layout.padding / max(layout.global_size, 1),
        )
    if len(layouts) == 1:
        layout, how, by_hooks = layouts[0]
        return [
            ParamGroup(refs, originals, mesh, mp_policy, layout, fp8=how, subclass=by_hooks, **kw)
        ]
    groups = []
    for k, (layout, how, by_hooks) in enumerate(layouts):
        mine = sorted(index[t.name] for t in layout.tensors)  # module order
        sub = {**kw, "name": f"{kw['name']}[buffer {k}]", "fp8": how, "subclass": by_hooks}
        parts = ([refs[i] for i in mine], [originals[i] for i in mine])
        groups.append(ParamGroup(*parts, mesh, mp_policy, layout, **sub))
    return groups


def _fp8_selected(refs, specs, dtypes, fp8: Float8BlockAllGather, kw) -> set[int]:
    """Indices of the parameters an FP8 all-gather gathers (see [Note: FP8 all-gather]).

    Raises:
        NotImplementedError: FP8 with tensor parallelism or CPU offload (not yet).
        ValueError: a master dtype without an FP8 path.
    """
    if kw.get("offload"):
        raise NotImplementedError(
            "fully_shard: FP8 all-gather (MixedPrecisionPolicy.all_gather) with CPU offload "
            "is not supported yet; drop one of them"
        )
    tp = [ref.fqn for ref in refs if ref.tp is not None and ref.tp.model_parallel]
    if tp:
        raise NotImplementedError(
            f"fully_shard: FP8 all-gather (MixedPrecisionPolicy.all_gather) on a tensor-"
            f"parallel mesh dimension is not supported yet (parameters {tp[:3]}...); use it on "
            "FSDP or HSDP meshes, or leave all_gather unset for this module"
        )
    chosen = {i for i, s in enumerate(specs) if fp8.selects(s.shape)}
    for i in sorted(chosen):
        check_master_dtype(specs[i].name, dtypes[i])
    return chosen


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
        self._set_comm("set_custom_all_gather", all_gather_comm=comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """Run every reduce-scatter of this module's group through ``comm`` (FSDP2's
        ``ReduceScatter``), with the buffer's own input and output: see [Note: custom
        collectives].

        Raises:
            ValueError: the group's parameters live on several meshes (as FSDP2).
        """
        self._set_comm("set_custom_reduce_scatter", reduce_scatter_comm=comm)

    def _set_comm(self, what: str, **comm) -> None:
        """[Note: custom collectives]
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
        state.set_comms(**comm)

    def _no_custom_comm(self, what: str) -> list:
        """The group's buffers; AssertionError where a custom comm is set (as FSDP2)."""
        state = _checked_state(self)
        groups = [] if state.group is None else state.group.groups
        for g in groups:
            for kind, comm in (
                ("all gather", g.all_gather_comm),
                ("reduce scatter", g.reduce_scatter_comm),
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
