"""Everyday autograd patterns against torch's FSDP2 on 2 gloo ranks: double backward,
tensor hooks and module backward hooks that read weights, optimizer in backward
(post-accumulate-grad hooks on the sharded parameters), and the patterns a gradient
storage must survive (retain_graph, a second backward, ``autograd.grad``, activation
checkpointing, frozen parameters, tying, a module called twice, accumulation).

Each case runs the same model, data and calls under FSDP2 and under raggedfsdp. On 2
ranks the comparison is bitwise: both gather the same parameters, so each rank computes
the same local gradients with the same kernels; the reduction of two addends is the same
sum in either order, and the average's halving is exact. ``grads_in_params`` True and
False are both checked: the choice of gradient storage must never change a number.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.utils.checkpoint import checkpoint

import raggedfsdp
from raggedfsdp.fsdp import buffers_of, reads_no_parameters
from raggedfsdp.tools.profiling import CommCounter
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics


class _LoRALinear(nn.Linear):
    """A frozen linear layer plus a trained low-rank update (LoRA), one module."""

    def __init__(self, n: int, rank: int = 2):
        super().__init__(n, n)
        for p in (self.weight, self.bias):
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, n) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(n, rank) * 0.1)

    def forward(self, x):
        return super().forward(x) + x @ self.lora_a.t() @ self.lora_b.t()


class _MLP(nn.Module):
    def __init__(
        self,
        checkpointed: bool = False,
        twice: bool = False,
        adapters: bool = False,
        tied: bool = False,
        frozen_bf16: bool = False,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16)
        self.l2 = _LoRALinear(16) if adapters else nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 8)
        self.checkpointed = checkpointed
        self.twice = twice
        if tied:  # the last layer's weight is the first's, transposed in use
            self.l3.weight = self.l1.weight
        if frozen_bf16:  # a frozen bf16 layer beside trained fp32 ones, in one group
            self.l2.to(torch.bfloat16).requires_grad_(False)
        self.one_group = tied or frozen_bf16
        self.frozen_bf16 = frozen_bf16

    def _l2(self, h):
        if self.frozen_bf16:
            return torch.tanh(self.l2(h.to(torch.bfloat16)).to(h.dtype))
        return torch.tanh(self.l2(h))

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if self.checkpointed:
            h = checkpoint(self._l2, h, use_reentrant=False)
        else:
            h = self._l2(h)
        if self.twice:  # the same module, its parameters used twice in one forward
            h = self._l2(h)
        if self.l3.weight is self.l1.weight:
            return h @ self.l1.weight
        return self.l3(h)


def _shard(fully_shard, model, mesh, **kw):
    if not model.one_group:  # tied, mixed dtypes: one group holds all
        for m in (model.l1, model.l2, model.l3):
            fully_shard(m, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _data(rank, steps=2):
    gen = torch.Generator().manual_seed(11)
    xs = torch.randn(steps, 4, 6, 8, generator=gen)
    return [x[2 * rank : 2 * rank + 2] for x in xs]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(model):
    return {n: None if p.grad is None else _full(p.grad) for n, p in model.named_parameters()}


def _params(model):
    return {n: _full(p.detach()) for n, p in model.named_parameters()}


def _equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, got.keys(), want.keys())
    for name in want:
        g, w = got[name], want[name]
        if w is None or g is None:
            assert g is None and w is None, (
                f"{what}: {name}: {'None' if g is None else 'a tensor'}, FSDP2's "
                f"{'None' if w is None else 'a tensor'}"
            )
            continue
        diff = (g - w).abs().max().item()
        assert torch.equal(g, w), f"{what}: {name} differs from FSDP2's by {diff:.3g}"


def _compare(rank, world, pattern, *, model_kw=None, **shard_kw):
    """``pattern(model, rank) -> dict`` under FSDP2 and raggedfsdp (both gradient modes);
    every value of the dicts must be bitwise equal."""
    mesh = init_device_mesh("cpu", (world,))
    ref = pattern(_shard(torch_fsdp.fully_shard, _MLP(**(model_kw or {})), mesh), rank)
    for in_params in (True, False):
        model = _shard(
            raggedfsdp.fully_shard,
            _MLP(**(model_kw or {})),
            mesh,
            grads_in_params=in_params,
            **shard_kw,
        )
        got = pattern(model, rank)
        for key in ref:
            _equal(got[key], ref[key], f"grads_in_params={in_params} {key}")


# ---- the patterns ---------------------------------------------------------------------------
def _create_graph(model, rank):
    x = _data(rank)[0]
    model(x).square().mean().backward(create_graph=True)
    return {"grads": _grads(model)}


def _gradient_penalty(model, rank):
    """WGAN-GP: the input gradient's norm is part of the loss (double backward through
    the weights)."""
    x = _data(rank)[0].requires_grad_()
    out = model(x).square().mean()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    (out + gx.square().sum()).backward()
    return {"grads": _grads(model)}


def _tensor_hook_reads_weight(model, rank):
    """An L2 term added by a gradient hook on the weight, registered during forward."""
    handles = []

    def register(module, args):
        w = module.weight
        handles.append(w.register_hook(lambda g: g + 0.5 * w.detach()))

    for m in (model.l1, model.l2):
        m.register_forward_pre_hook(register)
    for x in _data(rank):
        model(x).square().mean().backward()
        for h in handles:
            h.remove()
        handles.clear()
    return {"grads": _grads(model)}


def _backward_hook_reads_weight(model, rank):
    seen = {}

    def record(module, grad_input, grad_output):
        seen[f"{id(module)}"] = module.weight.detach().clone()

    model.l2.register_full_backward_hook(record)
    model(_data(rank)[0]).square().mean().backward()
    return {"grads": _grads(model), "read in the hook": {"l2.weight": seen[f"{id(model.l2)}"]}}


def _optimizer_in_backward(model, rank):
    """torchtune's / torchtitan's pattern: one optimizer per parameter, stepped by its
    post-accumulate-grad hook (after FSDP's reduce-scatter), so no step follows backward."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optims = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in trained}
    calls = []

    def step(p):
        calls.append(p)
        optims[p].step()
        optims[p].zero_grad()

    for p in trained:
        p.register_post_accumulate_grad_hook(step)
    for x in _data(rank, steps=3):
        model(x).square().mean().backward()
    n = len(trained)
    assert len(calls) == 3 * n, f"post-accumulate-grad hooks ran {len(calls)} times of {3 * n}"
    return {"params": _params(model)}


def _retain_graph_twice(model, rank):
    loss = model(_data(rank)[0]).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    return {"grads": _grads(model)}


def _autograd_grad(model, rank):
    out = model(_data(rank)[0]).square().mean()
    x = _data(rank)[1].requires_grad_()
    (gx,) = torch.autograd.grad(model(x).sum(), x)
    (out + (gx * 0.1).sum() * 0).backward()
    return {"grads": _grads(model), "input grads": {"x": gx}}


def _frozen_first_layer(model, rank):
    model.l1.weight.requires_grad_(False)
    model.l1.bias.requires_grad_(False)
    for x in _data(rank):
        model(x).square().mean().backward()
    return {"grads": _grads(model)}


def _accumulate_no_sync(model, rank):
    for i, x in enumerate(_data(rank, steps=3)):
        model.set_requires_gradient_sync(i == 2)
        model(x).square().mean().backward()
    return {"grads": _grads(model)}


def _pipeline_reduce_grad_ref(model, rank):
    return _pipeline_reduce_grad(model, rank)  # defined below, with the pipelining notes


def _pipeline_microbatches(model, rank):
    """What torch.distributed.pipelining does around each microbatch's backward: all
    but the last without gradient sync, without reshard, and not the last backward."""
    xs = _data(rank, steps=3)
    for i, x in enumerate(xs):
        last = i == len(xs) - 1
        model.set_is_last_backward(last)
        model.set_reshard_after_backward(last)
        model.set_requires_gradient_sync(last)
        model(x).square().mean().backward()
    return {"grads": _grads(model)}


def _not_last_backward_with_sync(model, rank):
    """``set_is_last_backward(False)`` with gradient sync on: each backward reduces."""
    xs = _data(rank, steps=3)
    for i, x in enumerate(xs):
        model.set_is_last_backward(i == len(xs) - 1)
        model(x).square().mean().backward()
    return {"grads": _grads(model)}


PATTERNS = {
    "torch.distributed.pipelining's perform_reduce_grad": (_pipeline_reduce_grad_ref, {}),
    "pipeline microbatches (set_is_last_backward)": (_pipeline_microbatches, {}),
    "set_is_last_backward(False) with sync": (_not_last_backward_with_sync, {}),
    "create_graph": (_create_graph, {}),
    "tensor hook reads the weight": (_tensor_hook_reads_weight, {}),
    "full backward hook reads the weight": (_backward_hook_reads_weight, {}),
    "optimizer in backward": (_optimizer_in_backward, {}),
    "retain_graph, two backwards": (_retain_graph_twice, {}),
    "autograd.grad then backward": (_autograd_grad, {}),
    "checkpointed layer": (_retain_graph_twice, {"checkpointed": True}),
    "frozen first layer": (_frozen_first_layer, {}),
    "frozen base, trained adapters": (_retain_graph_twice, {"adapters": True}),
    "tied weights in one group": (_retain_graph_twice, {"tied": True}),
    "a frozen bf16 layer beside fp32 ones in one group": (
        _optimizer_in_backward,
        {"frozen_bf16": True},
    ),
    "optimizer in backward, adapters": (_optimizer_in_backward, {"adapters": True}),
    "module called twice": (_retain_graph_twice, {"twice": True}),
    "accumulate without sync": (_accumulate_no_sync, {}),
}


def _all_patterns(rank, world):
    run_cases(
        {
            name: (lambda fn=fn, kw=kw: _compare(rank, world, fn, model_kw=kw))
            for name, (fn, kw) in PATTERNS.items()
        }
    )


def test_everyday_patterns_equal_fsdp2():
    spawn(2, _all_patterns)


def _penalty_raises_as_in_fsdp2(rank, world):
    """WGAN-GP's double backward after ``autograd.grad``: the second backward reads
    parameters the first one resharded. FSDP2 raises; so must raggedfsdp (never a
    silently different gradient)."""
    mesh = init_device_mesh("cpu", (world,))
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        model = _shard(fully_shard, _MLP(), mesh)
        with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
            _gradient_penalty(model, rank)


def test_gradient_penalty_raises_as_fsdp2():
    spawn(2, _penalty_raises_as_in_fsdp2)


# ---- which gradient storage ran --------------------------------------------------------------
def _mode_reported(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = _shard(raggedfsdp.fully_shard, _MLP(), mesh)
    x = _data(rank)[0]
    assert {b.grads_in_params_ran for b in buffers_of(model)} == {None}  # no backward yet
    model(x).square().mean().backward()
    assert {b.grads_in_params_ran for b in buffers_of(model)} == {True}
    assert {b.grad_storage_reason for b in buffers_of(model)} == {None}
    model(x).square().mean().backward(create_graph=True)
    assert {b.grads_in_params_ran for b in buffers_of(model)} == {False}
    reasons = {b.grad_storage_reason for b in buffers_of(model)}
    assert reasons == {"backward with create_graph=True (the gradients are differentiable)"}
    handle = model.l2.register_full_backward_hook(lambda *a: None)
    model.zero_grad()
    model(x).square().mean().backward()
    ran = [buffers_of(m)[0].grads_in_params_ran for m in (model.l1, model.l2, model.l3)]
    assert ran == [True, False, True], ran
    reason = buffers_of(model.l2)[0].grad_storage_reason
    assert reason == "a backward hook on module FSDPLinear", reason
    handle.remove()  # a hook declared not to read parameters keeps gradients in place
    model.l2.register_full_backward_hook(reads_no_parameters(lambda *a: None))
    model(x).square().mean().backward()
    assert [b.grads_in_params_ran for b in buffers_of(model)] == [True] * 3
    dist.barrier()


def test_buffers_report_the_gradient_storage_that_ran():
    spawn(2, _mode_reported)


# ---- inference mode before training ----------------------------------------------------------
def _validate_then_train(model, rank, mode):
    xs = _data(rank)
    with mode():
        out = model(xs[0]).clone()
    for x in xs:
        model(x).square().mean().backward()
    return out, _grads(model)


def _inference_mode_first(rank, world):
    """Lightning's sanity check validates under ``torch.inference_mode`` before training.
    FSDP2 then fails at the next all-gather (its unsharded parameters became inference
    tensors); raggedfsdp trains, and equals FSDP2 validating under ``no_grad``."""
    mesh = init_device_mesh("cpu", (world,))
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        _validate_then_train(
            _shard(torch_fsdp.fully_shard, _MLP(), mesh), rank, torch.inference_mode
        )
    want_out, want = _validate_then_train(
        _shard(torch_fsdp.fully_shard, _MLP(), mesh), rank, torch.no_grad
    )
    for in_params in (True, False):
        model = _shard(raggedfsdp.fully_shard, _MLP(), mesh, grads_in_params=in_params)
        out, got = _validate_then_train(model, rank, torch.inference_mode)
        assert torch.equal(out, want_out)
        _equal(got, want, f"grads_in_params={in_params}")


def test_inference_mode_before_training():
    spawn(2, _inference_mode_first)


# ---- one rank --------------------------------------------------------------------------------
def _one_rank(rank, world):
    """At world size 1 a collective's result is its input: FSDP2 issues none, nor may
    raggedfsdp (no all-gather, reduce-scatter or gradient-flag all-reduce), with the same
    gradients and parameters."""
    mesh = init_device_mesh("cpu", (1,))
    results = []
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        model = _shard(fully_shard, _MLP(), mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with CommCounter() as comms:
            for x in _data(0):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        results.append((comms.summary(), _params(model)))
    (want_comms, want), (got_comms, got) = results
    assert want_comms == {}, want_comms
    assert got_comms == want_comms, got_comms
    _equal(got, want, "one rank")


def test_one_rank_issues_no_collective():
    spawn(1, _one_rank)


# ---- collectives per step ----------------------------------------------------------------------
def _gathers_per_step(rank, world):
    """Activation checkpointing around an FSDP module reruns its forward in backward: as
    FSDP2, the rerun must neither reshard nor gather again (the backward's gathers are
    the pre-backward ones), so both gather as often."""
    mesh = init_device_mesh("cpu", (world,))
    counts = []
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        model = _shard(fully_shard, _MLP(checkpointed=True), mesh)
        xs = _data(rank, steps=3)
        model(xs[0]).square().mean().backward()  # the first step records the order
        with CommCounter() as comms:
            for x in xs[1:]:
                model(x).square().mean().backward()
        counts.append(comms.summary()["all_gather"].count)
    assert counts[1] == counts[0], f"all-gathers: raggedfsdp {counts[1]}, FSDP2 {counts[0]}"


def test_checkpointed_module_gathers_as_fsdp2():
    spawn(2, _gathers_per_step)


# ---- Shard(d > 0) ------------------------------------------------------------------------------
def _shard_dims(rank, world):
    """``shard_placement_fn`` returning ``Shard(1)`` / ``Shard(-1)``: FSDP2 cuts that dim,
    raggedfsdp lays every parameter out as dim-0 rows; the numbers are the same (each rank
    reduces and updates its own elements wherever the cut lies)."""
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    for dim in (1, -1):

        def place(p, dim=dim):
            return Shard(dim) if p.dim() == 2 else Shard(0)

        results = []
        for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
            model = _shard(fully_shard, _MLP(), mesh, shard_placement_fn=place)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for x in _data(rank, steps=3):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            results.append(_params(model))
        _equal(results[1], results[0], f"Shard({dim})")


def test_shard_on_other_dims_equals_fsdp2():
    spawn(2, _shard_dims)


# ---- torch.distributed.pipelining's end of step ------------------------------------------------
def _pipeline_reduce_grad(model, rank):
    """What ``PipelineStage.perform_reduce_grad`` (torch 2.13) does after a stage's
    microbatches ran backward without sync: reach FSDP2's state through
    ``fully_shard.state(module)``, reduce each group, run the root's final callback."""
    for x in _data(rank, steps=3):
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
        model(x).square().mean().backward()
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    state = torch_fsdp.fully_shard.state(model)
    # the import switch keeps the lookup: raggedfsdp's fully_shard.state is torch's
    assert raggedfsdp.fully_shard.state(model) is state is not None
    assert raggedfsdp.fully_shard.state(nn.Linear(2, 2)) is None
    for s in state._state_ctx.all_states:
        for group in s._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
    return {"grads": _grads(model)}
