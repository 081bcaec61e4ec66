"""What a ``fully_shard`` call takes in, checked before anything changes: its options,
its modules, its mesh, each parameter and its placement (FSDP2's exception types: see
[Note: FSDP2's exception types])."""

from __future__ import annotations

import itertools

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import Shard

from raggedfsdp.fsdp._buffers import buffer_of
from raggedfsdp.fsdp._device import default_device_type
from raggedfsdp.fsdp._mesh import placement_and_mesh
from raggedfsdp.fsdp._policy import MixedPrecisionPolicy
from raggedfsdp.fsdp._records import ParamRef
from raggedfsdp.fsdp._reshard import resolve_reshard_after_forward
from raggedfsdp.fsdp._spmd import spmd_mesh, spmd_of_placement
from raggedfsdp.fsdp._state import state_of

# Set on a parameter fully_shard sharded: a uid that outlives it (an id may be reused),
# as FSDP2's _orig_param_uid, so that a later call sharding it again is known.
_UID_ATTR = "_raggedfsdp_uid"
_UIDS = itertools.count()


class InputError(ValueError, AssertionError):
    """A bad call that FSDP2 refuses with ``AssertionError``.

    [Note: FSDP2's exception types]
    ``fully_shard`` raises, for each input FSDP2 refuses at call time, the exception type
    FSDP2 raises (code written for FSDP2 catches it), with a message that names what is
    wrong and the fix. Where FSDP2 uses ``AssertionError`` for a user's mistake (``fully_shard``
    twice on one module, a 2-D mesh without dim names), this class is both that and the
    ``ValueError`` a bad input is everywhere else in raggedfsdp.
    """


def _check_options(max_buffers, grads_in_params, member_gaps, buffer_alpha_bytes) -> None:
    """``fully_shard``'s planning options: the types and ranges it takes."""
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


def _modules_of(module) -> list[nn.Module]:
    """The modules of one call (a module, or a list of them that form one group)."""
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
    return modules


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


def _mesh_of_call(mesh, dp_mesh_dims, reshard_after_forward):
    """The call's data-parallel mesh (the default one where ``mesh`` is None) and its whole
    SPMD mesh (``dp_mesh_dims``; None without), checked, and ``reshard_after_forward``
    checked against them."""
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
    return mesh, spmd


def _param_meshes(refs, originals, mesh, spmd, shard_placement_fn):
    """Each parameter's data-parallel mesh and whole SPMD mesh: the call's, or the one
    ``shard_placement_fn`` gives it (see [Note: a mesh per parameter])."""
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
    return meshes, spmds


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
