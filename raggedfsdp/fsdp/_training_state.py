"""The training states of a ``fully_shard`` call's hooks and the moves between them."""

from __future__ import annotations

import enum

__all__ = ["TrainingState"]


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


# [Note: training states]
# ``FSDPState.training_state`` moves only through ``FSDPState._enter(event)``, which
# checks the state it starts from against this table and raises, naming the group, the
# event and both states, when hooks run in an order no forward and backward produce.
#
#     event          from                                         to
#     pre_forward    any (*)                                      FORWARD
#     post_forward   FORWARD                                      IDLE
#     pre_backward   IDLE, FORWARD (**), POST_BACKWARD (***)       PRE_BACKWARD
#     post_backward  PRE_BACKWARD                                 POST_BACKWARD
#     end_backward   any: the root's final callback ends every group's backward
#     reset          any: reset_iter_state()
#
# (*) a forward or backward that raised leaves its state behind; the next forward starts
#     afresh, as FSDP2's does (``reset_iter_state()`` also drops the collectives in flight).
# (**) a group of several modules some of which did not run (the chunked loss runs the
#     head of a ``[norm, head]`` group alone) never ends its forward.
# (***) a module called twice whose first call's inputs need no gradient reduces after
#     its last call's backward, then runs backward again (see ``prepare_grads``).
# A repeated pre_backward (one per output that carries a gradient) is a no-op.
_ANY = frozenset(TrainingState)
_MOVES: dict[str, tuple[frozenset[TrainingState], TrainingState]] = {
    "pre_forward": (_ANY, TrainingState.FORWARD),
    "post_forward": (frozenset({TrainingState.FORWARD}), TrainingState.IDLE),
    "pre_backward": (
        frozenset({TrainingState.IDLE, TrainingState.FORWARD, TrainingState.POST_BACKWARD}),
        TrainingState.PRE_BACKWARD,
    ),
    "post_backward": (frozenset({TrainingState.PRE_BACKWARD}), TrainingState.POST_BACKWARD),
    "end_backward": (_ANY, TrainingState.IDLE),
    "reset": (_ANY, TrainingState.IDLE),
}
