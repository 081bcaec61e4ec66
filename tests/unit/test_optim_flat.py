"""The optimizer scaffold without a process group: the whole-buffer rule, decay runs, checks.

The rule (``why_not_whole``) reads plain data (the buffer's ``ParamSlice``s, whether
its gradients are views, the stepped parameters with their groups), so each case
of [Note: whole-buffer steps] is a few lines here; ``tests/dist/test_optim_flat.py``
runs the same rule on real buffers.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import raggedfsdp.optim
from raggedfsdp.fsdp import ParamSlice
from raggedfsdp.optim import AdamW, AdamW8bit, Muon
from raggedfsdp.optim.flat import (
    check_hyper,
    decay_,
    decay_runs,
    partition_by_buffer,
    why_not_whole,
)
from raggedfsdp.optim.quant import Blocks, dynamic_tree_map

pytestmark = pytest.mark.numerics

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _buffer(*specs):
    """ParamSlices of a buffer: one ``(start, stop, requires_grad)`` per parameter."""
    return [
        ParamSlice(
            f"p{i}",
            nn.Parameter(torch.zeros(stop - start)),
            start,
            stop,
            trainable,
            (stop - start,),
            (1,),
        )
        for i, (start, stop, trainable) in enumerate(specs)
    ]


@pytest.mark.parametrize(
    "start, size, stride",
    [
        (7, (6,), (1,)),  # a plain parameter
        (5, (3, 2, 3), (8, 3, 1)),  # a stack of 3 members, 2 gap elements after each
        (9, (1, 2, 3), (8, 3, 1)),  # one member
        (9, (0, 2, 3), (8, 3, 1)),  # none on this rank
    ],
)
def test_param_slice_view_and_positions_agree(start, size, stride):
    """``view`` of a flat state and ``positions`` (an index into it) pick the same elements
    in the same order, the gaps skipped; ``positions`` spans the part only."""
    n = math.prod(size)
    stop = start + sum((k - 1) * d for k, d in zip(size, stride)) + 1 if n else start
    s = ParamSlice("w", nn.Parameter(torch.zeros(size)), start, stop, True, size, stride)
    flat = torch.arange(64) * 10
    index = s.positions(torch.device("cpu"))
    assert index.dtype == torch.int64 and index.numel() == s.numel == n
    assert torch.equal(flat[index], s.view(flat).reshape(-1))
    assert s.contiguous == (size[0] <= 1 or len(size) == 1)
    if n:
        assert index.min() == start and index.max() == stop - 1


def _rule(slices, groups, *, views=True, steps=None, stateful=()):
    steps = steps or {}
    return why_not_whole(
        slices,
        views,
        groups,
        lambda p: steps.get(p, 0.0),
        lambda p: any(p is q for q in stateful),
    )


def _all(slices, **hyper):
    return {s.param: {**ADAMW, **hyper} for s in slices if s.requires_grad}


# ---- the rule ----------------------------------------------------------------------------------
def test_every_trainable_parameter_stepped_together_steps_whole():
    slices = _buffer((0, 8, True), (8, 20, True), (24, 30, True))  # padding 20..24
    assert _rule(slices, _all(slices)) is None


def test_a_frozen_parameter_without_state_may_share_the_buffer():
    slices = _buffer((0, 8, True), (8, 12, False), (12, 20, True))
    assert _rule(slices, _all(slices)) is None


def test_a_frozen_parameter_with_state_keeps_the_buffer_per_parameter():
    slices = _buffer((0, 8, True), (8, 12, False))
    reason = _rule(slices, _all(slices), stateful=[slices[1].param])
    assert reason == "frozen parameter 'p1' has optimizer state"


def test_a_frozen_parameter_handed_a_gradient_keeps_the_buffer_per_parameter():
    slices = _buffer((0, 8, True), (8, 12, False))
    groups = {s.param: dict(ADAMW) for s in slices}
    assert _rule(slices, groups) == "frozen parameter 'p1' has a gradient"


def test_a_parameter_missing_a_gradient_keeps_the_buffer_per_parameter():
    slices = _buffer((0, 8, True), (8, 12, True))
    groups = {slices[0].param: dict(ADAMW)}  # p1 has no gradient this step
    assert _rule(slices, groups) == "trainable parameter 'p1' is not stepped here"


def test_a_parameter_of_another_optimizer_keeps_the_buffer_per_parameter():
    slices = _buffer((0, 8, True), (8, 12, True))
    ours = AdamW([slices[0].param])  # p1 belongs to another optimizer (or Muon's matrices)
    groups = {slices[0].param: ours.param_groups[0]}
    assert _rule(slices, groups) == "trainable parameter 'p1' is not stepped here"


def test_a_gradient_that_is_not_a_view_keeps_the_buffer_per_parameter():
    slices = _buffer((0, 8, True), (8, 12, True))
    assert _rule(slices, _all(slices), views=False) == (
        "a gradient is not a view of the buffer's gradient storage"
    )


@pytest.mark.parametrize("key, value", [("lr", 2e-3), ("betas", (0.8, 0.999)), ("eps", 1e-6)])
def test_mixed_lr_betas_or_eps_keep_the_buffer_per_parameter(key, value):
    slices = _buffer((0, 8, True), (8, 12, True))
    groups = _all(slices)
    groups[slices[1].param] = {**ADAMW, key: value}
    assert _rule(slices, groups) == "the parameters differ in lr, betas or eps"


def test_mixed_weight_decay_steps_whole():
    slices = _buffer((0, 8, True), (8, 12, True))
    groups = _all(slices)
    groups[slices[1].param] = {**ADAMW, "weight_decay": 0.0}
    assert _rule(slices, groups) is None


def test_mixed_step_counts_keep_the_buffer_per_parameter():
    slices = _buffer((0, 8, True), (8, 12, True))
    steps = {slices[0].param: 3.0, slices[1].param: 2.0}
    assert _rule(slices, _all(slices), steps=steps) == "the parameters differ in step count"


def test_eps_zero_keeps_the_buffer_per_parameter():
    slices = _buffer((0, 8, True), (8, 12, True))
    assert _rule(slices, _all(slices, eps=0.0)).startswith("eps is 0")


def test_partition_leaves_plain_tensors_loose():
    p, q = torch.zeros(3), torch.zeros(4)
    by_buffer, loose = partition_by_buffer([(p, {}), (q, {})])
    assert by_buffer == {} and [t for t, _ in loose] == [p, q]


# ---- weight decay by runs ----------------------------------------------------------------------
def test_decay_runs_merge_over_padding_and_stop_at_frozen_parameters():
    slices = _buffer(
        (0, 8, True),  # wd 0.1
        (10, 16, True),  # wd 0.1, after padding: one run with the first
        (16, 20, False),  # frozen: ends the run
        (20, 24, True),  # wd 0.1: a new run
        (24, 28, True),  # wd 0: no run
        (28, 28, True),  # held by another rank: nothing
        (30, 32, True),  # wd 0.2
    )
    groups = _all(slices)
    groups[slices[4].param] = {**ADAMW, "weight_decay": 0.0}
    groups[slices[6].param] = {**ADAMW, "weight_decay": 0.2}
    shuffled = [slices[i] for i in (3, 0, 6, 1, 5, 2, 4)]  # module order is not buffer order
    assert decay_runs(shuffled, groups) == [(0, 16, 0.1), (20, 24, 0.1), (30, 32, 0.2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decay_by_runs_is_the_per_parameter_decay_bit_for_bit(dtype):
    shard = torch.randn(32, generator=torch.Generator().manual_seed(0)).to(dtype)
    slices = _buffer((0, 8, True), (8, 20, True), (20, 24, False), (24, 32, True))
    groups = _all(slices)
    groups[slices[3].param] = {**ADAMW, "weight_decay": 0.05}
    lr = 3e-2
    expected = shard.clone()
    for s in slices:
        if s.requires_grad:
            expected[s.start : s.stop].mul_(1 - lr * groups[s.param]["weight_decay"])
    decay_(shard, decay_runs(slices, groups), lr)
    assert torch.equal(shard, expected)


# ---- hyper-parameters --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "X: lr must be >= 0, got -1.0"),
        (dict(eps=-1.0), "X: eps must be >= 0, got -1.0"),
        (dict(betas=(1.0, 0.9)), r"X: betas\[0\] must be in \[0, 1\), got 1.0"),
        (dict(weight_decay=-0.5), "X: weight_decay must be >= 0, got -0.5"),
    ],
)
def test_check_hyper_names_the_optimizer(kwargs, match):
    hyper = {**ADAMW, **kwargs}
    with pytest.raises(ValueError, match=match):
        check_hyper("X", **hyper)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda p, **kw: AdamW([p], **kw), "AdamW"),
        (lambda p, **kw: AdamW8bit([p], **kw), "AdamW8bit"),
        (lambda p, **kw: Muon([p], **{f"adamw_{k}": v for k, v in kw.items()}), "AdamW group"),
    ],
)
def test_every_optimizer_checks_the_shared_hyper_parameters(make, name):
    vec = nn.Parameter(torch.zeros(4))  # a vector: Muon puts it in an AdamW group
    for kwargs, what in [
        (dict(lr=-1.0), "lr must be >= 0"),
        (dict(eps=-1.0), "eps must be >= 0"),
        (dict(betas=(0.9, 1.5)), r"betas\[1\] must be in \[0, 1\)"),
        (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=rf"{name}\)?: {what}"):
            make(vec, **kwargs)


def test_muon_reuses_the_flat_adamw_on_plain_tensors():
    """Muon's AdamW groups are FlatAdamW's update: the same numbers as torch's AdamW."""
    g = torch.Generator().manual_seed(4)
    ours = nn.Parameter(torch.randn(6, generator=g))
    ref = nn.Parameter(ours.detach().clone())
    opt = Muon([{"params": [ours], "use_muon": False, "lr": 1e-2}])
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, foreach=False)
    for _ in range(3):
        grad = torch.randn(6, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(ours, ref)
    assert opt.state[ours]["step"].device == torch.device("cpu")


# ---- one way in, and the device named -----------------------------------------------------------
SOURCES = sorted(Path(raggedfsdp.optim.__file__).parent.glob("*.py"))
FACTORIES = {
    "arange", "as_tensor", "empty", "empty_strided", "eye", "full", "linspace", "logspace",
    "ones", "rand", "randint", "randn", "randperm", "scalar_tensor", "tensor", "zeros",
}  # fmt: skip


def _calls(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node


def test_optimizers_use_only_the_public_fsdp_names():
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "raggedfsdp.fsdp"
            ):
                assert node.module == "raggedfsdp.fsdp", f"{path.name}:{node.lineno}"
                assert not any(a.name.startswith("_") for a in node.names), f"{path.name}"


def test_every_tensor_made_by_the_optimizers_names_its_device():
    made = 0
    for path in SOURCES:
        for node in _calls(path):
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES:
                made += 1
                assert any(k.arg == "device" for k in node.keywords), f"{path.name}:{node.lineno}"
    assert made > 0


def test_code_tables_and_blocks_live_where_they_are_asked_for():
    meta = dynamic_tree_map(True, "meta")
    assert meta is dynamic_tree_map(True, torch.device("meta"))  # one copy per device
    assert {t.device.type for t in (meta.values, meta.thresholds, meta.lut)} == {"meta"}
    assert meta.zero == dynamic_tree_map(True).zero and dynamic_tree_map(True).lut.is_cpu
    assert Blocks.from_lengths([256, 256, 128], device="meta").lengths.device.type == "meta"
