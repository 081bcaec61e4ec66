"""One ``fully_shard`` group: its buffers' ``ParamGroup``s, one or several (see [Note:
multi-buffer groups] in ``raggedfsdp/planner/multi.py``).

Every ``FSDPState`` with parameters holds a ``GroupSet``, so one buffer and many are one
case. It runs each action on every buffer's ``ParamGroup`` (buffers may live on
different meshes: [Note: a mesh per parameter] in ``_planning.py``): all-gathers are issued
back to back and waited together, reduce-scatters likewise, each still in place. Each
buffer keeps its own gradient storage, allocated at its own first gradient ([Note:
gradient storage]), so a buffer whose parameters get their gradients late in backward
holds no gradient memory until then.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._grads import holds_unreduced_grads, release_dropped_grads
from raggedfsdp.fsdp._param_group import ParamGroup
from raggedfsdp.fsdp._records import ParamRef, ShardedState

__all__ = ["GroupSet"]


class GroupSet:
    """The ``ParamGroup``s of one ``fully_shard`` call (one per buffer, one or more),
    acting as one group.

    Args:
        groups: the buffers' groups, in buffer order.
        name: how messages name the group.
    """

    def __init__(self, groups: list[ParamGroup], name: str):
        if not groups:
            raise ValueError(f"GroupSet {name}: no buffer")
        self.groups = list(groups)
        self.name = name

    # ---- what every buffer shares ----------------------------------------------------------
    @property
    def refs(self) -> list[ParamRef]:
        return [ref for g in self.groups for ref in g.refs]

    @property
    def device(self):
        return self.groups[0].device

    @property
    def streams(self):
        return self.groups[0].streams

    @property
    def process_group(self):
        """The first buffer's shard group (buffers of a mesh per parameter may differ:
        code that needs each buffer's reads ``groups``)."""
        return self.groups[0].process_group

    @property
    def replicate_group(self):
        """A buffer's replicate group (HSDP), None when no buffer has one."""
        return next((g.replicate_group for g in self.groups if g.replicate_group), None)

    @property
    def state(self):
        return self.groups[0].state

    def on_meta(self) -> list[ParamRef]:
        return [ref for g in self.groups for ref in g.on_meta()]

    @property
    def is_unsharded(self) -> bool:
        return all(g.is_unsharded for g in self.groups)

    # ---- unshard / reshard -----------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        for g in self.groups:
            g.unshard(async_op=True)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        for g in self.groups:
            g.wait_for_unshard()

    def reshard(self, post_forward: bool = False) -> None:
        for g in self.groups:
            g.reshard(post_forward=post_forward)

    def reset_after_apply(self) -> None:
        for g in self.groups:
            g.reset_after_apply()

    def adopt_assigned(self, prefix: str = "") -> None:
        for g in self.groups:
            g.adopt_assigned(prefix)

    def adopt_registered(self) -> None:
        """At lazy init: see [Note: parameters registered after fully_shard] in
        ``_assigned.py``, and [Note: re-tied parameters]."""
        if all(g.state is ShardedState.SHARDED for g in self.groups) and self._ties_changed():
            self._replan()
        for g in self.groups:
            g.adopt_registered()

    def _ties_changed(self) -> bool:
        """Whether the modules now tie parameters otherwise than when fully_shard ran."""
        firsts: set[int] = set()
        for ref in self.refs:
            held = {id(m._parameters.get(n)) for m, n in ref.uses}
            if len(held) > 1 or not firsts.isdisjoint(held):
                return True
            firsts |= held
        return False

    def _replan(self) -> None:
        """Plan the buffers again for the parameters as the modules now tie them.

        [Note: re-tied parameters]
        A model may tie two of a group's parameters after ``fully_shard`` and before the
        first forward (``head.weight = embedding.weight``): one parameter now, used in two
        places, where the buffers hold two. FSDP2 lets both of its records point at the
        one parameter; here the group's buffers are planned again (with the call's own
        settings, which ``fully_shard`` keeps as ``ParamGroup.replan``) for the
        parameters the modules now hold, each once with all its uses, so the tied
        parameter is one tensor in one buffer, its gradient the sum of its uses'. Each
        parameter keeps its identity (an optimizer built already still holds it); the
        group's settings (``set_*`` called before the first forward) carry over: the new
        groups share the call's ``CommSettings`` (``replan`` builds them with it) and take
        the old ones' post-forward and reduce-scatter process groups.
        Parameters tied across meshes, tensor-parallel or tensor-subclass ones, a tie
        undone, and a group partly on meta are refused by name.
        """
        parts: dict[int, tuple] = {}  # id(replan) -> (replan, its groups)
        for g in self.groups:
            if g.replan is None or g.subclass is not None or any(r.tp for r in g.refs):
                raise NotImplementedError(
                    f"fully_shard: the parameters of {g.name} were tied otherwise after "
                    "fully_shard; re-tying tensor-parallel or tensor-subclass parameters is "
                    "not supported: tie them before fully_shard"
                )
            parts.setdefault(id(g.replan), (g.replan, []))[1].append(g)
        owner: dict[int, int] = {}  # id(held parameter) -> id(replan) of its part
        merged: dict[int, tuple[ParamRef, torch.Tensor]] = {}  # id(held) -> (new ref, held)
        for key, (_, groups) in parts.items():
            for ref in (r for g in groups for r in g.refs):
                held = [m._parameters.get(n) for m, n in ref.uses]
                first = held[0]
                if first is None or any(p is not first for p in held):
                    raise NotImplementedError(
                        f"fully_shard: parameter {ref.fqn!r} is no longer one parameter in "
                        "all the places it was tied in (a tie undone, or a parameter "
                        "deleted, after fully_shard); undo ties before fully_shard"
                    )
                if owner.setdefault(id(first), key) != key:
                    raise NotImplementedError(
                        f"fully_shard: parameter {ref.fqn!r} was tied after fully_shard to a "
                        "parameter of another mesh of the same call; tie parameters of one "
                        "mesh, or before fully_shard"
                    )
                if id(first) in merged:
                    merged[id(first)][0].uses.extend(ref.uses)
                    continue
                new = ParamRef(
                    fqn=ref.fqn,
                    uses=list(ref.uses),
                    shape=first.shape,
                    requires_grad=first.requires_grad,
                )
                if isinstance(first, DTensor) and isinstance(first, nn.Parameter):
                    new.sharded = first  # keeps its identity: _make_sharded re-points it
                merged[id(first)] = (new, first)
        on_meta = {ref.fqn for ref, p in merged.values() if p.is_meta}
        if on_meta and len(on_meta) < len(merged):
            raise NotImplementedError(
                f"fully_shard: parameters of {self.name} were tied otherwise after "
                f"fully_shard while {sorted(on_meta)} are still on meta; materialize the "
                "group (to_empty) first, or tie them before fully_shard"
            )
        rebuilt: list[ParamGroup] = []
        for key, (replan, groups) in parts.items():
            mine = [(ref, p) for ref, p in merged.values() if owner[id(p)] == key]
            originals = [_full_value(p) for _, p in mine]
            new_groups = replan([ref for ref, _ in mine], originals)
            for g in new_groups:
                g.replan = replan
                g.post_forward_group = groups[0].post_forward_group
                if groups[0].reduce_process_group is not groups[0].process_group:
                    g.use_separate_reduce_scatter_group(True)
            rebuilt += new_groups
        self.groups = rebuilt

    # ---- gradients -------------------------------------------------------------------------
    def release_dropped_grads(self) -> None:
        for g in self.groups:
            release_dropped_grads(g.grads, g.refs, g.dbuf)

    def prepare_grads(
        self, unsharded: bool = True, reshard: bool = True, module_hooks: str | None = None
    ) -> None:
        for g in self.groups:
            g.prepare_grads(unsharded=unsharded, reshard=reshard, module_hooks=module_hooks)

    @property
    def needs_post_backward(self) -> bool:
        return any(g.grads.needs_post_backward for g in self.groups)

    def post_backward(self, reshard: bool) -> None:
        for g in self.groups:
            g.post_backward(reshard=reshard)

    @property
    def holds_unreduced_grads(self) -> bool:
        """Gradients accumulated without sync wait for a reduce-scatter."""
        return any(holds_unreduced_grads(g.grads, g.dbuf) for g in self.groups)

    def reduce_held_grads(self, reshard: bool) -> None:
        """``post_backward`` outside a backward, for gradients accumulated without sync
        (``FSDPState.reduce_held_grads``)."""
        for g in self.groups:
            if holds_unreduced_grads(g.grads, g.dbuf):
                g.grads.needs_post_backward = True
                g.post_backward(reshard=reshard)

    @property
    def reduce_pending(self) -> bool:
        return any(g.grads.reduce_pending for g in self.groups)

    @property
    def reduce_in_flight(self) -> bool:
        return any(g.grads.reduce_in_flight for g in self.groups)

    def wait_reduce(self) -> None:
        for g in self.groups:
            g.wait_reduce()

    def use_separate_reduce_scatter_group(self, enable: bool) -> None:
        for g in self.groups:
            g.use_separate_reduce_scatter_group(enable)

    def reset_iter_state(self) -> None:
        for g in self.groups:
            g.reset_iter_state()


def _full_value(p: torch.Tensor) -> torch.Tensor:
    """``p``'s whole value as a plain tensor (what ``fully_shard`` lays out), the same on
    every rank; a meta tensor for a parameter on meta."""
    if p.is_meta:
        return torch.empty(p.shape, dtype=p.dtype, device="meta")
    if isinstance(p, DTensor):
        return p.full_tensor().detach()
    return p.detach()
