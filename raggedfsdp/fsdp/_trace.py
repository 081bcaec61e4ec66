"""What a profiler and a log see of the runtime.

[Note: profiler phases] Every phase of a group runs inside
``torch.profiler.record_function("FSDP::<phase> (<group>)")``, with FSDP2's phase names
where the phase is FSDP2's, so a trace reads as FSDP2's does, per group:

    FSDP::pre_forward, FSDP::post_forward, FSDP::pre_backward, FSDP::post_backward
        the hooks of a group's modules (``FSDPState``)
    FSDP::all_gather, FSDP::all_gather_wait
        issuing a group's all-gather (the cast of its shard included), then waiting for
        it and, where a copy-out or a post-all-gather hook exists, running it
    FSDP::reshard
    FSDP::post_backward_reduce
        a group's reduce-scatter (the gradient cast included)
    FSDP::post_backward_set_grads
        the wait for it, the HSDP all-reduce, and setting the sharded gradients
    FSDP::root_post_backward_callback
        the end of backward (every group's ``post_backward_set_grads`` inside)

The logger ``raggedfsdp`` says at debug level what a user may need to see: the plan a
group got (buffers, shard size, padding) and, each backward, where a group's gradients
were stored and why.
"""

from __future__ import annotations

import functools
import logging

from torch.profiler import record_function

__all__ = ["logger", "phase"]

logger = logging.getLogger("raggedfsdp")


def phase(name: str):
    """Run the decorated method of an object with a ``name`` inside
    ``record_function(f"FSDP::{name} ({obj.name})")``."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            with record_function(f"FSDP::{name} ({self.name})"):
                return fn(self, *args, **kwargs)

        return run

    return wrap
