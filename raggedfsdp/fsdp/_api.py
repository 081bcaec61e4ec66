"""``fully_shard`` and ``FSDPModule``: FSDP2's API over RaggedShard buffers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raggedfsdp.fsdp._param_group import ParamGroup, ParamRef
from raggedfsdp.fsdp._policy import BlockPolicy, BlockRows, MixedPrecisionPolicy
from raggedfsdp.fsdp._state import FSDPState, resolve_reshard_after_forward, state_of
from raggedfsdp.planner import DEFAULT_ALIGNMENT_BYTES

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard"]

_NO_MIXED_PRECISION = MixedPrecisionPolicy()


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
    block_policy: BlockPolicy | Callable[[str, nn.Parameter], BlockRows] | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> nn.Module:
    """Shard ``module``'s parameters (those not already sharded by a nested call).

    Same contract as ``torch.distributed.fsdp.fully_shard``: apply it to each
    transformer block, then to the root; it mutates and returns ``module``, whose
    class becomes a subclass of ``FSDPModule``. The group's parameters are planned
    into one flat buffer (see ``raggedfsdp.planner``) and become ``nn.Parameter``s
    holding ``RaggedShard`` DTensors over views of it.

    Args:
        module: the module to shard.
        mesh: a 1-D ``DeviceMesh``. Default: all ranks of the default process group.
        reshard_after_forward: free the unsharded parameters after forward (True),
            keep them until after backward (False), or keep them sharded over groups
            of this many consecutive ranks (an int that divides the mesh size; as in
            FSDP2, 1 means False, with a warning, and the mesh size means True).
            Default None, as in FSDP2: True, except for the root, whose parameters
            backward needs first (an explicit True reshards the root too).
        mp_policy: mixed precision. Default: none.
        block_policy: rows per block, a ``BlockPolicy`` or a callable of
            ``(fqn, param)`` returning a positive int or ``"whole"``. Default 1 row.
        ignored_params: parameters left as they are (not sharded, not reduced).
        alignment_bytes: alignment of every shard start. Default 128 (see the planner).

    Returns:
        ``module``, now an ``FSDPModule``.

    Raises:
        ValueError: ``fully_shard`` twice on one module, a mesh that is not 1-D, a
            block that does not divide a parameter's rows, a bad policy.
    """
    if state_of(module) is not None:
        raise ValueError(
            f"fully_shard: {type(module).__name__} was already passed to fully_shard; "
            "call it once per module (bottom-up: blocks first, then the root)"
        )
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError(
                "fully_shard: no mesh given and no default process group; "
                "call torch.distributed.init_process_group first"
            )
        device = next(
            (p.device.type for p in module.parameters() if p.device.type != "meta"), "cpu"
        )
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard: mesh must be 1-D, got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; HSDP (a 2-D mesh) is not supported yet"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}"
        )

    resolve_reshard_after_forward(reshard_after_forward, mesh.size(0))  # raises on bad input
    refs, originals = _collect_params(module, set(ignored_params or ()))
    group = (
        ParamGroup(
            refs,
            originals,
            mesh,
            mp_policy,
            block_policy,
            alignment_bytes,
            name=type(module).__name__,
        )
        if refs
        else None
    )
    FSDPState(module, group, mesh, mp_policy, reshard_after_forward)
    cls = module.__class__
    module.__class__ = _fsdp_class(cls)
    return module


def _collect_params(module: nn.Module, ignored: set) -> tuple[list[ParamRef], list[nn.Parameter]]:
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
            if id(p) in refs:
                refs[id(p)].uses.append((mod, name))  # tied: one parameter, several places
            else:
                refs[id(p)] = ParamRef(
                    fqn=prefix + name,
                    uses=[(mod, name)],
                    shape=p.shape,
                    requires_grad=p.requires_grad,
                )
                originals[id(p)] = p
        for child_name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)

    visit(module, "", True)
    crossing = [refs[i].fqn for i in refs if i in managed_elsewhere]
    if crossing:
        raise NotImplementedError(
            f"fully_shard: parameters {crossing} are shared with a module that has its own "
            "fully_shard; tied parameters must be in one group: fully_shard their common parent"
        )
    return list(refs.values()), list(originals.values())


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, group: ParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into the class of every module passed to ``fully_shard`` (as in FSDP2)."""

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        mods = self.modules() if recurse else [self]
        return [s for m in mods if (s := state_of(m)) is not None]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (``async_op``: return a handle)."""
        group = state_of(self).group
        if group is not None:
            group.unshard(async_op=True)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters."""
        group = state_of(self).group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: accumulate unsharded gradients locally (no reduce-scatter) across backwards."""
        for s in self._fsdp_states(recurse):
            s.set_requires_gradient_sync(requires_gradient_sync)

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

    def set_modules_to_forward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """All-gather these modules' parameters at the start of this module's forward."""
        state_of(self).set_prefetch(forward=[_checked_state(m) for m in modules])

    def set_modules_to_backward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """All-gather these modules' parameters at the start of this module's backward."""
        state_of(self).set_prefetch(backward=[_checked_state(m) for m in modules])

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Sum gradients and divide by ``factor`` instead of averaging over ranks."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for s in self._fsdp_states(True):
            s.set_gradient_divide_factor(factor)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        for s in self._fsdp_states(True):
            if s.group is not None:
                s.group.reset_after_apply()
        return out


def _checked_state(module) -> FSDPState:
    state = state_of(module)
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
