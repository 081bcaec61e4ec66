"""One ``fully_shard`` group: its buffers' ``ParamGroup``s, one or several (see [Note:
multi-buffer groups] in ``raggedfsdp/planner/multi.py``).

Every ``FSDPState`` with parameters holds a ``GroupSet``, so one buffer and many are one
case. It runs each action on every buffer's ``ParamGroup`` (buffers may live on
different meshes: [Note: a mesh per parameter] in ``_api.py``): all-gathers are issued
back to back and waited together, reduce-scatters likewise, each still in place. Each
buffer keeps its own gradient storage, allocated at its own first gradient ([Note:
gradient storage]), so a buffer whose parameters get their gradients late in backward
holds no gradient memory until then.
"""

from __future__ import annotations

from raggedfsdp.fsdp._param_group import ParamGroup, ParamRef

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

    def configure(self, **settings) -> None:
        """Write ``FSDPState``'s settings (``requires_gradient_sync=...``, ...) on every
        buffer's group; each must be an attribute the group already has."""
        for key, value in settings.items():
            for g in self.groups:
                if not hasattr(g, key):
                    raise AttributeError(f"GroupSet {self.name}: {key!r} is not a setting")
                setattr(g, key, value)

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

    # ---- gradients -------------------------------------------------------------------------
    def release_dropped_grads(self) -> None:
        for g in self.groups:
            g.release_dropped_grads()

    def prepare_grads(
        self, unsharded: bool = True, reshard: bool = True, module_hooks: str | None = None
    ) -> None:
        for g in self.groups:
            g.prepare_grads(unsharded=unsharded, reshard=reshard, module_hooks=module_hooks)

    @property
    def needs_post_backward(self) -> bool:
        return any(g.needs_post_backward for g in self.groups)

    def post_backward(self, reshard: bool) -> None:
        for g in self.groups:
            g.post_backward(reshard=reshard)

    @property
    def holds_unreduced_grads(self) -> bool:
        return any(g.holds_unreduced_grads for g in self.groups)

    def reduce_held_grads(self, reshard: bool) -> None:
        for g in self.groups:
            if g.holds_unreduced_grads:
                g.reduce_held_grads(reshard=reshard)

    @property
    def reduce_pending(self) -> bool:
        return any(g.reduce_pending for g in self.groups)

    @property
    def reduce_in_flight(self) -> bool:
        return any(g.reduce_in_flight for g in self.groups)

    def wait_reduce(self) -> None:
        for g in self.groups:
            g.wait_reduce()

    def use_separate_reduce_scatter_group(self, enable: bool) -> None:
        for g in self.groups:
            g.use_separate_reduce_scatter_group(enable)

    def reset_iter_state(self) -> None:
        for g in self.groups:
            g.reset_iter_state()
