"""A profiler trace names each phase of each group, and the ``raggedfsdp`` logger says at
debug level what plan each group got and where each backward stored its gradients."""

import logging

import torch
from torch import nn

from raggedfsdp import fully_shard
from raggedfsdp.tools.simulate import fake_world

GROUPS = ("Linear(weight, bias)", "Sequential(1.weight, 1.bias)")
PHASES = (
    "pre_forward",
    "all_gather",
    "all_gather_wait",
    "post_forward",
    "reshard",
    "pre_backward",
    "post_backward_reduce",
    "post_backward_set_grads",
)


def _step(caplog):
    with fake_world(4) as mesh:
        with caplog.at_level(logging.DEBUG, logger="raggedfsdp"):
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
            with torch.profiler.profile() as prof:
                model(torch.randn(2, 8)).sum().backward()
    return prof.events(), [r.getMessage() for r in caplog.records if r.name == "raggedfsdp"]


def test_trace_names_every_phase_per_group(caplog):
    events, _ = _step(caplog)
    names = {e.name for e in events}
    for group in GROUPS:
        for phase in PHASES:
            assert f"FSDP::{phase} ({group})" in names, (phase, group)
    assert f"FSDP::root_post_backward_callback ({GROUPS[1]})" in names
    # each group's all-gather is issued inside one of its all_gather phases (the others
    # found it gathered or in flight already)
    collectives = [e for e in events if "allgather" in e.name.lower()]
    for group in GROUPS:
        spans = [e.time_range for e in events if e.name == f"FSDP::all_gather ({group})"]
        assert any(s.start <= c.time_range.start <= s.end for s in spans for c in collectives), (
            group
        )


def test_debug_log_names_plans_and_gradient_storage(caplog):
    _, lines = _step(caplog)
    plans = [line for line in lines if "a buffer of 2 tensors over 4 ranks" in line]
    assert len(plans) == 2 and all("padding" in line for line in plans), lines
    for group in GROUPS:
        assert f"fully_shard group {group}: gradients written over the parameters" in lines
