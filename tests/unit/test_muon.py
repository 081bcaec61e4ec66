"""Muon without a process group: the math against torch, root assignment, whole-matrix plans."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim._muon import _adjust_lr as torch_adjust_lr
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from raggedfsdp.models import get_config, param_groups
from raggedfsdp.models.transformer import Transformer
from raggedfsdp.optim import Muon, muon_block_policy, muon_param_groups
from raggedfsdp.optim.muon import (
    DEFAULT_NS_COEFFICIENTS,
    adjust_lr,
    default_use_muon,
    zeropower_via_newtonschulz,
)
from raggedfsdp.optim.muon_plan import (
    assign_roots,
    comm_free_matrices,
    ns_flops,
    plan_rounds,
    plan_whole_matrices,
)
from raggedfsdp.planner import WHOLE, TensorSpec, plan_buffer

pytestmark = pytest.mark.numerics


# ---- the math is torch's ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(96, 96), (260, 96), (32, 96), (7, 300), (1, 5), (5, 1)])
def test_newton_schulz_is_torch_bit_for_bit(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = zeropower_via_newtonschulz(x, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    theirs = torch_ns(x, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    assert ours.dtype == torch.bfloat16 and ours.shape == shape
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(96, 260), (260, 96), (64, 64)])
def test_adjust_lr_is_torch(fn, shape):
    assert adjust_lr(0.02, fn, *shape) == torch_adjust_lr(0.02, fn, torch.Size(shape))


def _grads(shapes, step):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("nesterov", [True, False])
def test_single_process_matches_torch_muon_and_adamw(nesterov):
    """Plain tensors: a matrix, a stack of 3 matrices (each its own 2-D torch param), a vector."""
    g = torch.Generator().manual_seed(1)
    shapes = [(24, 40), (3, 16, 24), (24,)]
    ours = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ref_matrix = nn.Parameter(ours[0].detach().clone())
    ref_members = [nn.Parameter(m.clone()) for m in ours[1].detach().unbind(0)]
    ref_vector = nn.Parameter(ours[2].detach().clone())
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    adamw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    opt = Muon(
        [{"params": ours[:2], "use_muon": True}, {"params": ours[2:], "use_muon": False, **adamw}],
        **hyper,
    )
    ref = torch.optim.Muon([ref_matrix, *ref_members], **hyper)
    ref_adamw = torch.optim.AdamW([ref_vector], foreach=False, **adamw)
    for step in range(5):
        grads = _grads(shapes, step)
        for p, gr in zip(ours, grads):
            p.grad = gr.clone()
        ref_matrix.grad = grads[0].clone()
        for m, gr in zip(ref_members, grads[1].unbind(0)):
            m.grad = gr.clone()
        ref_vector.grad = grads[2].clone()
        opt.step()
        ref.step()
        ref_adamw.step()
        assert torch.equal(ours[0], ref_matrix)
        assert torch.equal(ours[1], torch.stack(ref_members))
        assert torch.equal(ours[2], ref_vector)
    assert opt.last_step.matrices == 4 and opt.last_step.bytes_sent == 0


def test_non_contiguous_plain_parameter():
    base = torch.randn(40, 24, generator=torch.Generator().manual_seed(2))
    ours = nn.Parameter(base.clone().T)  # (24, 40), strides (1, 24)
    ref = nn.Parameter(base.T.contiguous())
    opt, ref_opt = Muon([ours], lr=0.02), torch.optim.Muon([ref], lr=0.02)
    for step in range(3):
        (grad,) = _grads([(24, 40)], step)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert not ours.is_contiguous() and torch.equal(ours, ref)


def test_param_without_grad_is_skipped():
    p, q = nn.Parameter(torch.ones(4, 4)), nn.Parameter(torch.ones(4, 4))
    opt = Muon([p, q])
    p.grad = torch.ones(4, 4)
    opt.step()
    assert torch.equal(q, torch.ones(4, 4)) and not torch.equal(p, torch.ones(4, 4))
    assert q not in opt.state


# ---- parameter groups -----------------------------------------------------------------------
def test_default_use_muon_names():
    m, v, s = torch.empty(4, 4), torch.empty(4), torch.empty(2, 4, 4)
    assert default_use_muon("layers.0.attention.wq.weight", m)
    assert default_use_muon("layers.1.moe.experts.w1", s)
    assert not default_use_muon("tok_embeddings.weight", m)
    assert not default_use_muon("output.weight", m)
    assert not default_use_muon("model.lm_head.weight", m)
    assert not default_use_muon("layers.0.attention_norm.weight", v)
    assert not default_use_muon("layers.0.moe.experts.gate_up_proj_bias", m)
    assert default_use_muon("", m) and not default_use_muon("", v)


def test_muon_param_groups_split_the_model():
    model = Transformer(get_config("llama-tiny-tied"), max_seq_len=8, seed=0)
    muon, other = muon_param_groups(model, lr=3e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    assert muon["use_muon"] and not other["use_muon"] and other["lr"] == 3e-4
    assert all(p.dim() == 2 and "layers." in names[id(p)] for p in muon["params"])
    other_names = {names[id(p)] for p in other["params"]}
    assert "tok_embeddings.weight" in other_names and "norm.weight" in other_names
    opt = Muon([muon, other], adamw_eps=1e-6)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[1]["eps"] == 1e-6 and "momentum" not in opt.param_groups[1]
    assert opt.param_groups[0]["ns_steps"] == 5


def test_group_without_use_muon_is_split_by_the_predicate():
    mat, vec = nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))
    opt = Muon([mat, vec], lr=0.05, adamw_lr=1e-4)
    assert [(g["use_muon"], g["lr"], len(g["params"])) for g in opt.param_groups] == [
        (True, 0.05, 1),
        (False, 1e-4, 1),
    ]


# ---- errors ------------------------------------------------------------------------------------
def test_errors_name_the_problem():
    vec = nn.Parameter(torch.zeros(5))
    mat = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"parameter '#0 of group 0' has shape \(5,\).*use_muon"):
        Muon([{"params": [vec], "use_muon": True}])
    with pytest.raises(ValueError, match=r"has shape \(1, 1, 1, 1\)"):
        Muon([{"params": [nn.Parameter(torch.zeros(1, 1, 1, 1))], "use_muon": True}])
    with pytest.raises(ValueError, match="lr must be >= 0, got -1"):
        Muon([mat], lr=-1)
    with pytest.raises(ValueError, match="momentum must be >= 0"):
        Muon([mat], momentum=-0.5)
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        Muon([mat], adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match=r"ns_steps must be an int in \[0, 100\), got 100"):
        Muon([mat], ns_steps=100)
    with pytest.raises(ValueError, match="ns_coefficients must be 3 numbers"):
        Muon([mat], ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"AdamW group\): betas\[1\] must be in \[0, 1\)"):
        Muon([mat, vec], adamw_betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="distributed must be one of"):
        Muon([mat], distributed="everywhere")
    with pytest.raises(ValueError, match="matrices_per_round must be an int >= 1, got 0"):
        Muon([mat], matrices_per_round=0)
    c = nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    opt = Muon([{"params": [c], "use_muon": True}])
    c.grad = torch.zeros_like(c)
    with pytest.raises(NotImplementedError, match="is complex"):
        opt.step()


# ---- root assignment ---------------------------------------------------------------------------
def test_ns_flops():
    assert ns_flops(96, 260, 5) == ns_flops(260, 96, 5) == 5 * (4 * 96 * 96 * 260 + 2 * 96**3)


def test_whole_matrices_stay_on_their_holder_and_the_rest_balance():
    flops = [10.0, 8.0, 7.0, 3.0, 2.0]
    held = [(0, 5), (3, 3), (4, 0), (1, 1), (2, 2)]  # matrix 0 whole on 1, matrix 2 whole on 0
    roots, load = assign_roots(flops, held, 2)
    assert roots[0] == 1 and roots[2] == 0
    assert roots == [1, 0, 0, 1, 1] and load == [15.0, 15.0]


def test_ties_go_to_the_biggest_holder():
    roots, _ = assign_roots([1.0], [(1, 5, 2)], 3)
    assert roots == [1]


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 6),
    mats=st.lists(
        st.tuples(st.integers(1, 1000), st.lists(st.integers(0, 4), min_size=6, max_size=6)),
        min_size=1,
        max_size=30,
    ),
)
def test_assign_roots_is_a_valid_lpt_schedule(world, mats):
    flops = [float(f) for f, _ in mats]
    held = [tuple(h[:world]) if any(h[:world]) else (1,) + (0,) * (world - 1) for _, h in mats]
    roots, load = assign_roots(flops, held, world)
    assert (roots, load) == assign_roots(flops, held, world)  # deterministic
    for h, r in zip(held, roots):
        if sum(x > 0 for x in h) == 1:
            assert h[r] > 0  # whole on one rank: rooted there
    assert [sum(f for f, r in zip(flops, roots) if r == k) for k in range(world)] == load
    if all(sum(x > 0 for x in h) > 1 for h in held):  # no forced roots: the greedy bound
        # max(load) <= sum / world + max, times world: integer-valued sums, exact
        assert world * max(load) <= sum(flops) + world * max(flops)


def test_assign_roots_errors():
    with pytest.raises(ValueError, match="matrix 0 is held by no rank"):
        assign_roots([1.0], [(0, 0)], 2)
    with pytest.raises(ValueError, match="matrix 0 has 1 holder counts, expected 2"):
        assign_roots([1.0], [(3,)], 2)


def test_rounds_take_each_roots_matrices_in_order():
    roots = [0, 1, 0, 0, 1, 2]
    order = [3, 0, 1, 2, 4, 5]  # largest first
    assert plan_rounds(order, roots, 3) == [[1, 3, 5], [0, 4], [2]]
    assert plan_rounds(order, roots, 3, per_round=2) == [[0, 1, 3, 4, 5], [2]]
    assert plan_rounds([], roots, 3) == []
    with pytest.raises(ValueError, match="per_round must be >= 1"):
        plan_rounds(order, roots, 3, per_round=0)


# ---- whole matrices on one rank ---------------------------------------------------------------
def _block_specs(model: str, group: str, rows=1):
    (g,) = [g for g in param_groups(get_config(model)) if g.name == group]
    specs = [
        TensorSpec(name=p.fqn, shape=p.shape, stack=p.stack, block_rows=min(rows, 1))
        for p in g.params
    ]
    members = {
        p.fqn: (p.shape[0] if p.stack else 1) for p in g.params if default_use_muon(p.fqn, p)
    }
    return specs, members


@pytest.mark.parametrize("world", [2, 4, 8])
def test_whole_matrix_plan_stays_in_budget_and_frees_matrices(world):
    specs, members = _block_specs("moe-small", "layers.1")
    plan = plan_whole_matrices(specs, world, list(members), max_extra_padding=0.01)
    budget = plan.base.padding + 0.01 * plan.base.total_numel
    assert plan.layout.padding <= budget
    before, total = comm_free_matrices(plan.base, members)
    after, _ = comm_free_matrices(plan.layout, members)
    assert total == 3 * 6 + 4 + 1 + 3 and before <= after
    for name in plan.whole:  # a whole tensor's members never cross a shard boundary
        assert sum(1 for r in plan.layout.local_units(name) if r) <= members[name]


def test_whole_matrix_plan_with_no_budget_never_pads_more():
    specs, members = _block_specs("llama-small", "layers.0")
    plan = plan_whole_matrices(specs, 3, list(members), max_extra_padding=0.0)
    assert plan.layout.padding <= plan.base.padding


def test_whole_matrix_plan_errors():
    specs, _ = _block_specs("llama-tiny", "layers.0")
    with pytest.raises(ValueError, match=r"candidates \['nope'\] are not in the group"):
        plan_whole_matrices(specs, 2, ["nope"])
    with pytest.raises(ValueError, match="max_extra_padding must be >= 0"):
        plan_whole_matrices(specs, 2, [], max_extra_padding=-1)


def test_comm_free_counts_stack_members():
    # a stack of 4 members of 8 elements (rows of 4), over 2 ranks of 16: members never split
    layout = plan_buffer(
        [TensorSpec(name="s", shape=(4, 2, 4), stack=True, block_rows=WHOLE)],
        2,
        dtype="float32",
        alignment_bytes=4,
    )
    assert comm_free_matrices(layout, {"s": 4}) == (4, 4)
    layout = plan_buffer(
        [TensorSpec(name="m", shape=(6, 4))], 4, dtype="float32", alignment_bytes=4
    )
    assert comm_free_matrices(layout, {"m": 1}) == (0, 1)


def test_muon_block_policy_on_a_meta_model():
    with torch.device("meta"):
        model = Transformer(get_config("llama-tiny"), max_seq_len=8)
    policy = muon_block_policy(model, 2)
    block = model.layers[0]
    assert policy("attention.wq.weight", block.attention.wq.weight) == WHOLE
    assert policy("attention_norm.weight", block.attention_norm.weight) == 1
    assert policy("tok_embeddings.weight", model.tok_embeddings.weight) == 1
    assert [g.name for g in policy.report] == ["layers.0", "layers.1", ""]
    s = policy.summary()
    assert s["matrices"] == 14 and s["comm_free_after"] == 14
    assert s["padding_after"] - s["padding_before"] <= 0.01 * s["numel"]
    assert sum(g.plan.base.total_numel for g in policy.report) == s["numel"]  # ints
