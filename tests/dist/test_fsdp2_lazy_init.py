"""What FSDP2 does at and around its lazy init (the first forward), against torch's FSDP2 on 2
gloo ranks in the same run: parameters re-assigned after ``fully_shard``, a submodule's
``to_empty`` inside a group (torchtune's LoRA recipe), ``state_dict()`` after a forward that
kept the parameters unsharded, ``cast_forward_inputs`` through a dataclass, and how the
gradients are divided by the data-parallel size (fp16's pre- and post-division, a divide
factor, force-sum with an all-reduce hook, a one-rank shard dim).

Bitwise: both gather the same parameters, so each rank computes the same values with the
same kernels; the reductions are the same operations on two addends (FSDP2's division
factors reproduced exactly, not an equivalent within rounding).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor, init_device_mesh

import raggedfsdp
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _values(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _fill(param: nn.Parameter, full: torch.Tensor) -> None:
    """Write ``full`` (the whole tensor, the same on every rank) into a sharded parameter."""
    with torch.no_grad():
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements))


class _LoRA(nn.Module):
    """A frozen base layer and a low-rank update in submodules (torchtune's LoRALinear)."""

    def __init__(self, n: int):
        super().__init__()
        self.base = nn.Linear(n, n)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(n, 2, bias=False)
        self.lora_b = nn.Linear(2, n, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class _Net(nn.Module):
    """Two blocks (a group each) and a root scale vector (the root group's)."""

    def __init__(self, lora: bool = False):
        super().__init__()
        self.l1 = _LoRA(8) if lora else nn.Linear(8, 16)
        self.l2 = nn.Linear(8 if lora else 16, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) * self.scale


def _build(fully_shard, device: str = "cpu", lora: bool = False, **kw) -> _Net:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    with torch.device(device):
        model = _Net(lora)
    for m in (model.l1, model.l2, model):
        fully_shard(m, mesh=mesh, **kw)
    return model


def _train(model: nn.Module, rank: int, steps: int = 2) -> dict:
    """Losses, first gradients and final parameters of ``steps`` SGD steps."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(5)
    out: dict = {}
    for step in range(steps):
        x = torch.randn(4, 8, generator=gen)[2 * rank : 2 * rank + 2]
        loss = model(x).square().mean()
        loss.backward()
        out[f"loss {step}"] = loss.detach()
        if step == 0:
            for n, p in model.named_parameters():
                out[f"grad {n}"] = None if p.grad is None else _full(p.grad)
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        out[f"param {n}"] = _full(p.detach())
    return out


def _same(case, rank: int, world: int) -> None:
    """``case(fully_shard, rank) -> dict``: every value bitwise equal to FSDP2's."""
    _check_same(case(raggedfsdp.fully_shard, rank), case(torch_fsdp.fully_shard, rank))


def _check_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key, w in want.items():
        g = got[key]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), (key, g)
            assert g.dtype == w.dtype and g.shape == w.shape, (key, g.dtype, w.dtype)
            if not torch.equal(g, w):
                at = (g != w).flatten().nonzero()[0].item()
                raise AssertionError(
                    f"{key}: element {at} is {g.flatten()[at].item()!r} where FSDP2 has "
                    f"{w.flatten()[at].item()!r}"
                )
        else:
            assert g == w, f"{key}: {g!r} where FSDP2 has {w!r}"


# ---- parameters re-assigned before the first forward -------------------------------------------
def _reassigned(fully_shard, rank):
    """``model.scale = nn.Parameter(DTensor)`` after fully_shard (a re-init)."""
    model = _build(fully_shard)
    old = model.scale
    model.scale = nn.Parameter(distribute_tensor(_values(8, 1), old.device_mesh, old.placements))
    return _train(model, rank)


def _reassigned_then_unshard(fully_shard, rank):
    """As ``_reassigned``, then ``model.unshard()`` before the first forward (FSDP2 lazily
    initializes the group there)."""
    model = _build(fully_shard)
    old = model.scale
    model.scale = nn.Parameter(distribute_tensor(_values(8, 2), old.device_mesh, old.placements))
    model.unshard()
    out = {"unsharded scale": model.scale.detach().clone()}
    model.reshard()
    return {**out, **_train(model, rank)}


def _reassigned_from_weights_on_meta(fully_shard, rank):
    """PyTorch's ``test_reset_sharded_param_in_lazy_init``: a meta model whose blocks are
    materialized, its root parameter re-assigned a norm of their weights (a DTensor with
    the blocks' placements)."""
    model = _build(fully_shard, device="meta")
    for k, block in enumerate((model.l1, model.l2)):
        block.to_empty(device="cpu")
        _fill(block.weight, _values(block.weight.shape, 10 + k))
        _fill(block.bias, _values(block.bias.shape, 20 + k))
    with torch.no_grad():
        norm = torch.linalg.norm(model.l2.weight, dim=1) + 1.0
    model.scale = nn.Parameter(norm)
    return _train(model, rank)


class _TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 8, bias=False)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x))) * self.scale


def _tied(fully_shard, rank, *, after: bool, setup=None):
    """``out.weight = inp.weight`` (re-tying, as embeddings are), after ``fully_shard`` or
    before it; the one group holds both. ``setup(model)`` runs between ``fully_shard``
    and the tie."""
    torch.manual_seed(0)
    model = _TwoLinear()
    if not after:
        model.out.weight = model.inp.weight
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    if setup is not None:
        setup(model)
    if after:
        model.out.weight = model.inp.weight
    return _train(model, rank)


def _retied(rank, world):
    """Tied after fully_shard: the same numbers as FSDP2's model tied before it. (FSDP2
    tied after reduce-scatters the two uses' gradients apart and adds them, a sum in
    another order.)"""
    want = _tied(torch_fsdp.fully_shard, rank, after=False)
    got = _tied(raggedfsdp.fully_shard, rank, after=True)
    _check_same(got, want)


def _retied_keeps_settings(rank, world):
    """The settings set between fully_shard and a re-tie hold for the re-planned buffers:
    the same numbers as FSDP2's model tied before it, with the same settings (a forced
    sum, and an all-reduce hook that adds one to every reduced gradient)."""

    def setup(model):
        model.set_force_sum_reduction_for_comms(True)
        model.set_all_reduce_hook(_add_one)

    want = _tied(torch_fsdp.fully_shard, rank, after=False, setup=setup)
    got = _tied(raggedfsdp.fully_shard, rank, after=True, setup=setup)
    _check_same(got, want)


def _refused(rank, world):
    """What lazy init cannot adopt is refused by name, on every rank, before any
    collective; the model works once put right."""
    x = torch.ones(2, 8)
    model = _build(raggedfsdp.fully_shard)
    model.scale = nn.Parameter(torch.ones(5))
    with pytest.raises(ValueError, match=r"'scale' .* shape \(5,\), not \(8,\)"):
        model(x)
    model.scale = nn.Parameter(torch.ones(8))
    model(x)  # lazy init again, now adopting it

    model = _build(raggedfsdp.fully_shard, lora=True)
    model.l1.lora_a.double()  # a submodule inside the block's group
    match = r"'lora_a.weight' .* dtype torch.float64; its buffer"
    with pytest.raises(NotImplementedError, match=match):
        model(x)

    torch.manual_seed(0)
    model = _TwoLinear()
    model.out.weight = model.inp.weight
    raggedfsdp.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    model.out.weight = nn.Parameter(torch.ones(8, 8))  # the tie undone
    with pytest.raises(NotImplementedError, match=r"'inp.weight' is no longer one parameter"):
        model(x)

    with torch.device("meta"):
        model = _TwoLinear()
    raggedfsdp.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    model.inp.to_empty(device="cpu")
    model.out.weight = model.inp.weight
    with pytest.raises(NotImplementedError, match=r"\['scale'\] are still on meta"):
        model(x)


# ---- a submodule's to_empty inside a group ---------------------------------------------------
def _lora_to_empty_on_meta(fully_shard, rank):
    """torchtune's LoRA recipe: a meta model, the base weights loaded by an assigning
    load of DTensors, each adapter submodule materialized by ``to_empty`` and initialized."""
    model = _build(fully_shard, device="meta", lora=True)
    loaded = {}
    for k, (name, meta) in enumerate(model.state_dict().items()):
        if "lora" not in name:
            full = _values(meta.shape, 30 + k)
            loaded[name] = nn.Parameter(distribute_tensor(full, meta.device_mesh, meta.placements))
    model.load_state_dict(loaded, strict=False, assign=True)
    for k, adapter in enumerate((model.l1.lora_a, model.l1.lora_b)):
        adapter.to_empty(device="cpu")
        _fill(adapter.weight, _values(adapter.weight.shape, 40 + k))
    return _train(model, rank)


def _lora_to_empty_then_load_on_meta(fully_shard, rank):
    """torchtune 0.6.1's order: each submodule of the LoRA layer (the base too) materialized
    by ``to_empty`` and initialized, then the base weights loaded by an assigning load."""
    model = _build(fully_shard, device="meta", lora=True)
    for sub in (model.l1.base, model.l1.lora_a, model.l1.lora_b):
        sub.to_empty(device="cpu")
    for k, adapter in enumerate((model.l1.lora_a, model.l1.lora_b)):
        _fill(adapter.weight, _values(adapter.weight.shape, 40 + k))
    loaded = {}
    for k, (name, meta) in enumerate(model.state_dict().items()):
        if "lora" not in name:
            full = _values(meta.shape, 30 + k)
            loaded[name] = nn.Parameter(distribute_tensor(full, meta.device_mesh, meta.placements))
    model.load_state_dict(loaded, strict=False, assign=True)
    return _train(model, rank)


def _submodule_to_empty_on_cpu(fully_shard, rank):
    """A CPU model whose block's adapter is re-materialized (``to_empty``) and re-initialized
    before the first forward: the new values train, not the old."""
    model = _build(fully_shard, lora=True)
    model.l1.lora_b.to_empty(device="cpu")
    _fill(model.l1.lora_b.weight, _values(model.l1.lora_b.weight.shape, 50))
    return _train(model, rank)


# ---- state_dict after a forward that kept the parameters unsharded -----------------------------
def _state_dict_after_forward(fully_shard, rank):
    model = _build(fully_shard, reshard_after_forward=False)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    loss = model(x).square().mean()
    out = {}
    for name, value in model.state_dict().items():
        out[f"{name} is a DTensor"] = isinstance(value, DTensor)
        out[f"{name} shape"] = tuple(value.shape)
        out[name] = _full(value).detach().clone()
    loss.backward()  # backward gathers them again
    for n, p in model.named_parameters():
        out[f"grad {n}"] = _full(p.grad)
    return out


# ---- cast_forward_inputs through a dataclass ---------------------------------------------------
@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    steps: int


class _TakesBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen: list[torch.dtype] = []

    def forward(self, batch: _Batch):
        self.seen.append(batch.x.dtype)
        return self.lin(batch.x) * batch.steps


def _dataclass_input(fully_shard, rank):
    torch.manual_seed(0)
    model = _TakesBatch()
    policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)), mp_policy=policy)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    out = model(_Batch(x, 2))
    out.float().square().mean().backward()
    return {"seen": model.seen, "out": out.detach(), "grad": _full(model.lin.weight.grad)}


# ---- how gradients are divided ------------------------------------------------------------------
class _Scaled(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.w = nn.Parameter(torch.ones(64, dtype=dtype))

    def forward(self, x):
        return (self.w * x).sum()


def _reduced(fully_shard, rank, *, dtype, x, mesh_shape=(2,), setup=None):
    """The reduced gradient of ``w`` when rank ``r``'s gradient is ``x[r]``."""
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = fully_shard(_Scaled(dtype), mesh=mesh)
    if setup is not None:
        setup(model)
    model(x[rank].to(dtype)).backward()
    return {"grad": _full(model.w.grad)}


def _add_one(t: torch.Tensor) -> None:
    t.add_(1.0)


def _setups():
    big = torch.full((2, 64), 40000.0)  # sums to inf in fp16 unless divided first
    noise = _values((2, 64), 60) * 1000
    return {
        "fp16 gradients summing past fp16's range": partial(_reduced, dtype=torch.float16, x=big),
        "fp16 with set_gradient_divide_factor(3)": partial(
            _reduced,
            dtype=torch.float16,
            x=big,
            setup=lambda m: m.set_gradient_divide_factor(3.0),
        ),
        "force-sum divides after the all-reduce hook": partial(
            _reduced,
            dtype=torch.float32,
            x=noise,
            setup=lambda m: (
                m.set_force_sum_reduction_for_comms(True),
                m.set_all_reduce_hook(_add_one),
            ),
        ),
        "HSDP (2, 1) with set_gradient_divide_factor(3)": partial(
            _reduced,
            dtype=torch.float32,
            x=noise,
            mesh_shape=(2, 1),
            setup=lambda m: m.set_gradient_divide_factor(3.0),
        ),
    }


CASES = {
    "re-assigned parameter": _reassigned,
    "re-assigned parameter, then unshard()": _reassigned_then_unshard,
    "re-assigned from other weights, meta init": _reassigned_from_weights_on_meta,
    "LoRA adapters to_empty after an assigning load, meta init": _lora_to_empty_on_meta,
    "LoRA layers to_empty, then an assigning load, meta init": _lora_to_empty_then_load_on_meta,
    "submodule to_empty on a CPU model": _submodule_to_empty_on_cpu,
    "state_dict after a forward with reshard_after_forward=False": _state_dict_after_forward,
    "cast_forward_inputs through a dataclass": _dataclass_input,
}


def _grid(rank, world):
    cases = {**CASES, **_setups()}
    checks = {name: partial(_same, case, rank, world) for name, case in cases.items()}
    checks["parameters tied after fully_shard"] = partial(_retied, rank, world)
    checks["tied after fully_shard, settings set before"] = partial(
        _retied_keeps_settings, rank, world
    )
    checks["refused at lazy init"] = partial(_refused, rank, world)
    run_cases(checks)


def test_lazy_init_and_reduction_as_fsdp2():
    spawn(2, _grid, timeout=300)
