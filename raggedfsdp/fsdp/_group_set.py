"""One ``fully_shard`` group held in several buffers: see [Note: multi-buffer groups]
in ``raggedfsdp/planner/_multi.py``.

A ``GroupSet`` answers ``FSDPState`` as one ``ParamGroup`` would, and runs each action
on every buffer's ``ParamGroup`` (buffers may live on different meshes: [Note: a mesh
per parameter] in ``_api.py``): all-gathers are issued back to back and waited
together, reduce-scatters likewise, each still in place. Each buffer keeps its own
gradient storage, allocated at its own first gradient ([Note: gradient storage]), so
a buffer whose parameters get their gradients late in backward holds no gradient
memory until then.
"""

from __future__ import annotations

from raggedfsdp.fsdp._param_group import ParamGroup, ParamRef

__all__ = ["GroupSet"]

# Settings FSDPState writes on its group: written to every buffer's group.
_SETTINGS = frozenset(
    {
        "post_forward_group",
        "requires_gradient_sync",
        "gradient_divide_factor",
        "requires_all_reduce",
        "force_sum_reduction",
        "all_reduce_hook",
        "reduce_scatter_unused_params",
    }
)


class GroupSet:
    """The ``ParamGroup``s of one ``fully_shard`` call, acting as one group.

    Args:
        groups: the buffers' groups (two or more), in buffer order.
        name: how messages name the group.
    """

    def __init__(self, groups: list[ParamGroup], name: str):
        object.__setattr__(self, "groups", list(groups))
        object.__setattr__(self, "name", name)

    def __setattr__(self, key: str, value) -> None:
        if key not in _SETTINGS:
            raise AttributeError(f"GroupSet: {key!r} is not a setting of the group")
        for g in self.groups:
            setattr(g, key, value)

    def __getattr__(self, key: str):
        if key in _SETTINGS:  # the same on every buffer
            return getattr(self.groups[0], key)
        raise AttributeError(key)

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

    def local_grad_flags(self) -> list[bool]:
        return [flag for g in self.groups for flag in g.local_grad_flags()]

    def finalize_grads(self, got_grad: list[bool]) -> list[str]:
        """Per buffer, its parameters' flags (in ``refs`` order)."""
        at, arrived = 0, []
        for g in self.groups:
            arrived += g.finalize_grads(got_grad[at : at + len(g.refs)])
            at += len(g.refs)
        return arrived
