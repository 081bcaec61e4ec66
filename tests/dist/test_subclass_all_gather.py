"""FSDP2's tensor-subclass all-gather protocol (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``) against torch's FSDP2 on 2 gloo ranks.

A test-only pair of wrapper subclasses plays the part of torchao's float8 weights: the
sharded weight (``_Bf16Weight``) gathers its shard rounded to bf16, and the gathered
weight (``_Gathered``) is the bf16 all-gather output read as ``0.75 * data`` in
``param_dtype``; the ``out=`` path only counts (its data is the output the next
all-gather refills, as torchao's). Both hooks change what the model sees, so a framework
that gathered the plain values instead would compute different losses.

On 2 ranks the comparison is bitwise: both frameworks hand the hooks the same values
(each rank's rows of the same weights), the all-gather is a copy, so every rank runs its
forward and backward on identical unsharded weights with the same kernels; the
reduction of two addends is the same sum in either order and the average's halving is
exact; SGD then updates the same master values elementwise.

Subclasses FSDP2 keeps in other ways, each against FSDP2 in the same ranks: torch's
``TwoTensor`` (two inner tensors, every op run on both) with the hooks and without them
(FSDP2 gathers it as the values its ``copy_`` gives a plain tensor), hooks set on the
sharded weights' local tensors after ``fully_shard`` (FSDP2 reads them at each gather),
and a 3-argument ``__tensor_unflatten__`` (FSDP2 never calls it).
"""

from __future__ import annotations

import collections
import functools
import gc
import weakref

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor, init_device_mesh
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils import _pytree as pytree

import raggedfsdp
from raggedfsdp.fsdp import Float8BlockAllGather, FSDPModule, MixedPrecisionPolicy, buffers_of
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics

aten = torch.ops.aten
SCALE = 0.75
STEPS = 4
CALLS: collections.Counter = collections.Counter()  # this process's hook calls
INNER: list[torch.Tensor] = []  # the gathered data each first post-all-gather returned

# Ops that keep the wrapper (what FSDP2 calls on a sharded weight: chunk, pad, view; and
# what DTensor and nn.Parameter call: detach, alias, as_strided).
_PRESERVE = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
}


def _wrapper(cls, data: torch.Tensor, dtype: torch.dtype | None = None):
    return torch.Tensor._make_wrapper_subclass(
        cls,
        data.size(),
        strides=data.stride(),
        storage_offset=data.storage_offset(),
        dtype=dtype or data.dtype,
        device=data.device,
        requires_grad=data.requires_grad,
    )


def _dispatch(cls, func, types, args=(), kwargs=None):
    """Run ``func`` on the inner tensors; rewrap what ``_PRESERVE`` ops return."""
    args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
    out = func(*args, **kwargs)
    if func not in _PRESERVE:
        return out
    return pytree.tree_map_only(torch.Tensor, cls, out)


class _Bf16Weight(torch.Tensor):
    """A master weight (fp32 ``_data``) that all-gathers as bf16."""

    @staticmethod
    def __new__(cls, data):
        return _wrapper(cls, data)

    def __init__(self, data):
        self._data = data

    __torch_dispatch__ = classmethod(_dispatch)

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        CALLS["pre"] += 1
        CALLS[f"pre: mesh of {mesh.ndim} dim, size {mesh.size()}"] += 1
        CALLS[f"pre: outer size {tuple(outer_size)}"] += 1
        CALLS[f"pre: module {type(module).__name__.removeprefix('FSDP')}"] += 1
        CALLS[f"pre: param_dtype {mp_policy.param_dtype}"] += 1
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        CALLS["post"] += 1
        CALLS[f"post: {data.dtype} {tuple(data.shape)} as {param_dtype}"] += 1
        if out is not None:  # ``data`` is the output the last call wrapped, refilled
            CALLS["post with out="] += 1
            assert isinstance(out, _Gathered) and out.dtype == param_dtype, out
            return None
        INNER.append(data)
        return _Gathered(data, param_dtype), (data,)


class _OldSignature(_Bf16Weight):
    """FSDP2 still calls the one-argument ``fsdp_pre_all_gather(mesh)`` (torchao's)."""

    def fsdp_pre_all_gather(self, mesh):
        CALLS["pre (mesh only)"] += 1
        return (self._data.to(torch.bfloat16),), None


class _Gathered(torch.Tensor):
    """An unsharded weight: bf16 ``_data`` read as ``SCALE * data`` in ``dtype``."""

    @staticmethod
    def __new__(cls, data, dtype):
        return _wrapper(cls, data, dtype)

    def __init__(self, data, dtype):
        self._data, self._dtype = data, dtype

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _PRESERVE and func is not aten._to_copy.default:
            dtype = args[0]._dtype
            args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
            return pytree.tree_map_only(
                torch.Tensor, lambda t: cls(t, dtype), func(*args, **kwargs)
            )
        args, kwargs = pytree.tree_map_only(
            cls, lambda t: t._data.to(t._dtype) * SCALE, (args, kwargs or {})
        )
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data"], self._dtype

    @classmethod
    def __tensor_unflatten__(cls, inner, dtype, outer_size, outer_stride):
        return cls(inner["_data"], dtype)


class _Block(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.l1 = nn.Linear(8, hidden)
        self.l2 = nn.Linear(hidden, 16)

    def forward(self, x):
        return torch.tanh(self.l2(torch.tanh(self.l1(x))))


class _Model(nn.Module):
    def __init__(self, kind=_Bf16Weight, hidden: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.block = _Block(hidden)
        self.head = nn.Linear(16, 4)
        for lin in (self.block.l1, self.block.l2):  # weights wrapped, biases plain
            lin.weight = nn.Parameter(kind(lin.weight.detach().clone()))

    def forward(self, x):
        return self.head(self.block(x))


def _shard(fully_shard, model, mesh, **kw):
    fully_shard(model.block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _data(rank):
    gen = torch.Generator().manual_seed(3)
    xs = torch.randn(STEPS, 4, 6, 8, generator=gen)
    return [x[2 * rank : 2 * rank + 2] for x in xs]


def _plain_local(p: DTensor) -> torch.Tensor:
    local = p._local_tensor
    return local._data if isinstance(local, _Bf16Weight) else local


def _full(p) -> torch.Tensor:
    """The whole parameter (plain), whatever its local tensor's class."""
    local = DTensor.from_local(
        _plain_local(p), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
    )
    return local.full_tensor()


def _train(model, rank, micro: int = 1) -> dict:
    """4 SGD steps of ``micro`` microbatches (synced on the last); losses, final
    parameters, hook calls, and what the out= path reused."""
    CALLS.clear()
    INNER.clear()
    seen = []  # the unsharded weight of l1 each forward ran with
    model.block.l1.register_forward_pre_hook(lambda m, args: seen.append(m.weight))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in _data(rank):
        for i, piece in enumerate(x.chunk(micro)):
            model.set_requires_gradient_sync(i == micro - 1)
            loss = model(piece).square().mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    wrapped = [model.block.l1.weight, model.block.l2.weight]
    assert all(isinstance(p._local_tensor, _Bf16Weight) for p in wrapped), [
        type(p._local_tensor) for p in wrapped
    ]
    assert all(isinstance(w, _Gathered) for w in seen), [type(w) for w in seen]
    return {
        "losses": torch.stack(losses),
        "params": {n: _full(p.detach()) for n, p in model.named_parameters()},
        "calls": dict(CALLS),
        "one unsharded parameter reused": len({id(w) for w in seen}) == 1,
        "inner tensors freed after the step": [t.untyped_storage().nbytes() for t in INNER],
    }


def _compare(rank, world, *, mesh_shape=None, kind=_Bf16Weight, micro=1, **kw):
    if mesh_shape is None:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    want = _train(_shard(torch_fsdp.fully_shard, _Model(kind), mesh, **kw), rank, micro)
    model = _shard(raggedfsdp.fully_shard, _Model(kind), mesh, **kw)
    # One buffer of both wrapped weights would leave a rank none of l1's rows (FSDP2's
    # even chunks never do, and a hook may not take none): each gets a buffer of its own.
    units = [p.placements[-1].local_units for p in (model.block.l1.weight, model.block.l2.weight)]
    assert not any(0 in u for u in units), units
    got = _train(model, rank, micro)
    bufs = [b for b in buffers_of(model) if b.subclass_all_gather]  # the two weights
    assert len(bufs) == 2, bufs
    for buf in bufs:
        assert buf.grad_storage_reason.startswith("tensor-subclass all-gather"), buf
    assert torch.equal(got["losses"], want["losses"]), (got["losses"], want["losses"])
    for name, w in want["params"].items():
        g = got["params"][name]
        assert torch.equal(g, w), f"{name} differs from FSDP2's by {(g - w).abs().max():.3g}"
    assert got["calls"] == want["calls"], (got["calls"], want["calls"])
    post = "pre (mesh only)" if kind is _OldSignature else "pre"
    gathers = 2 * STEPS * micro  # each forward and each backward, for the block
    assert want["calls"][post] == 2 * gathers, want["calls"]  # 2 weights
    assert want["calls"]["post with out="] == 2 * (gathers - 1), want["calls"]
    for key in ("one unsharded parameter reused", "inner tensors freed after the step"):
        assert got[key] == want[key], (key, got[key], want[key])
    assert want["one unsharded parameter reused"]
    assert want["inner tensors freed after the step"] == [0, 0]


CASES = {
    "fp32": {},
    "bf16 params, fp32 reduce": {
        "mp_policy": torch_fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    },
    "HSDP mesh (1, 2)": {"mesh_shape": (1, 2)},
    "one-argument fsdp_pre_all_gather": {"kind": _OldSignature},
    "2 microbatches, the first without gradient sync": {"micro": 2},
}


# ---- subclasses FSDP2 keeps in other ways -----------------------------------------------------
class _TwoHooked(TwoTensor):
    """torch's TwoTensor (two inner tensors, every op run on both) with the all-gather
    hooks: both inner tensors are gathered and the gathered pair is the parameter."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        CALLS["pre"] += 1
        return (self.a, self.b), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        CALLS["post"] += 1
        a, b = outputs
        if out is not None:  # the outputs were refilled in place: out holds them
            assert out.a.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
            return None
        return TwoTensor(a, b), (a, b)


class _UnflattenOf3(_Bf16Weight):
    """A 3-argument ``__tensor_unflatten__`` that returns a plain tensor (as torch's
    BFloat16AllGatherTensor test class): FSDP2 never calls it."""

    @staticmethod
    def __tensor_unflatten__(inner, outer_size, outer_stride):
        raise AssertionError("FSDP2 never calls __tensor_unflatten__")


class _PaddedInputs(_Bf16Weight):
    """Pads its all-gather input to FSDP2's even chunk (``ceil(rows / world)`` rows, NaN
    beyond its own) where FSDP2's chunks are uneven, as torch's BFloat16AllGatherTensor
    test class does: the padding must never be read."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        CALLS["pre"] += 1
        if outer_size[0] % mesh.size() == 0:
            return (self._data.to(torch.bfloat16),), None
        chunk = -(-outer_size[0] // mesh.size())
        padded = torch.full((chunk, *outer_size[1:]), float("nan"), dtype=torch.bfloat16)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        CALLS["post"] += 1
        (data,) = outputs
        return None if out is not None else (_Gathered(data, param_dtype), (data,))


def _hooks_on_the_local_shards(model) -> None:
    """FSDP2's monkey patch: hooks set on each sharded weight's local tensor (an instance,
    after fully_shard) that gather it in bf16 and read it back in ``param_dtype``."""

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        CALLS["pre (patched)"] += 1
        return (self.to(torch.bfloat16),), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        CALLS["post (patched)"] += 1
        (data,) = outputs
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(data)
            return None
        value = data.to(param_dtype)
        return value, (data, value)

    for name, p in model.named_parameters():
        if name.endswith("weight") and name.startswith("block"):
            local = p._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = post.__get__(local)


def _two(w):
    return TwoTensor(w, w.clone())


def _values(p) -> dict[str, torch.Tensor]:
    """The whole parameter, per inner tensor for a TwoTensor (plain otherwise)."""
    local = p._local_tensor
    pieces = {"a": local.a, "b": local.b} if isinstance(local, TwoTensor) else {"": local}
    if isinstance(local, _Bf16Weight):
        pieces = {"": local._data}
    return {
        k: DTensor.from_local(
            v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        ).full_tensor()
        for k, v in pieces.items()
    }


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.a if isinstance(t, TwoTensor) else t


def _train_kind(model, rank, setup) -> dict:
    CALLS.clear()
    setup(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in _data(rank)[:3]:
        loss = model(x).square().mean()
        loss.backward()
        losses.append(_plain(loss.detach()))
        opt.step()
        opt.zero_grad()
    kinds = {n: type(p._local_tensor).__name__ for n, p in model.named_parameters()}
    params = {
        f"{n}{k}": v for n, p in model.named_parameters() for k, v in _values(p.detach()).items()
    }
    return {"losses": torch.stack(losses), "params": params, "calls": dict(CALLS), "kinds": kinds}


def _compare_kind(rank, world, kind, setup=lambda m: None, hidden=16):
    """The same training as FSDP2's, bit for bit, the same hook calls, and the sharded
    weights keep their class."""
    mesh = init_device_mesh("cpu", (world,))
    want = _train_kind(_shard(torch_fsdp.fully_shard, _Model(kind, hidden), mesh), rank, setup)
    got = _train_kind(_shard(raggedfsdp.fully_shard, _Model(kind, hidden), mesh), rank, setup)
    assert got["kinds"] == want["kinds"], (got["kinds"], want["kinds"])
    assert torch.equal(got["losses"], want["losses"]), (got["losses"], want["losses"])
    assert got["params"].keys() == want["params"].keys()
    for name, w in want["params"].items():
        g = got["params"][name]
        assert torch.equal(g, w), f"{name} differs from FSDP2's by {(g - w).abs().max():.3g}"
    assert got["calls"] == want["calls"], (got["calls"], want["calls"])


KINDS = {
    "two inner tensors, with the hooks": {"kind": lambda w: _TwoHooked(w, w.clone())},
    "two inner tensors, no hooks (gathered as a plain tensor)": {"kind": _two},
    "hooks set on the local shards after fully_shard": {
        "kind": _two,
        "setup": _hooks_on_the_local_shards,
    },
    "a 3-argument __tensor_unflatten__": {"kind": _UnflattenOf3},
    "inputs padded to FSDP2's even chunk (15 rows on 2 ranks)": {
        "kind": _PaddedInputs,
        "hidden": 15,
    },
}


def _parity(rank, world):
    cases = {name: functools.partial(_compare, rank, world, **kw) for name, kw in CASES.items()}
    for name, kw in KINDS.items():
        cases[name] = functools.partial(_compare_kind, rank, world, **kw)
    run_cases(cases)


def test_subclass_all_gather_equals_fsdp2():
    spawn(2, _parity)


# ---- meta-device init -------------------------------------------------------------------------
def _meta_init(rank, world):
    """On meta, sharded, ``to_empty``, loaded: the weights keep their class, and train as a
    model sharded from real weights; both are freed with their last references."""
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = _Model()
    _shard(raggedfsdp.fully_shard, model, mesh)
    model.to_empty(device="cpu")
    reference = _Model()
    params = dict(model.named_parameters())
    model.load_state_dict(
        {
            n: distribute_tensor(p.detach(), params[n].device_mesh, params[n].placements)
            for n, p in reference.named_parameters()
        }
    )
    want = _train(_shard(raggedfsdp.fully_shard, reference, mesh), rank)
    got = _train(model, rank)
    assert torch.equal(got["losses"], want["losses"]), (got["losses"], want["losses"])
    assert got["calls"] == want["calls"], (got["calls"], want["calls"])

    # Both trained models (their groups hold SubclassGathers, whose entries hold modules) go
    # with their last references, the garbage collector off: no reference cycle holds them.
    views = buffers_of(model) + buffers_of(reference)
    refs = [weakref.ref(obj) for obj in (model, reference, *(v._group for v in views))]
    del views, params
    gc.collect()  # only what torch's first imports left
    gc.disable()
    try:
        del model, reference
        alive = [type(r()).__name__ for r in refs if r() is not None]
        assert alive == [], f"still alive after the last reference: {alive}"
    finally:
        gc.enable()


def test_meta_init_keeps_the_subclass():
    spawn(2, _meta_init)


# ---- refusals --------------------------------------------------------------------------------
class _PlainWrapper(torch.Tensor):
    """A traceable wrapper subclass without the all-gather hooks."""

    @staticmethod
    def __new__(cls, data):
        return _wrapper(cls, data)

    def __init__(self, data):
        self._data = data

    __torch_dispatch__ = classmethod(_dispatch)
    __tensor_flatten__ = _Bf16Weight.__tensor_flatten__
    __tensor_unflatten__ = classmethod(_Bf16Weight.__tensor_unflatten__.__func__)


class _PreOnly(_PlainWrapper):
    fsdp_pre_all_gather = _Bf16Weight.fsdp_pre_all_gather


class _ThreeArgs(_Bf16Weight):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride):
        raise AssertionError("never called")


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(_Bf16Weight(torch.randn(2, 8, 8)))


def _refused(rank, world, make, match, error=NotImplementedError, **kw):
    """fully_shard raises ``error`` naming the parameter and its class, before changing
    anything: the module keeps its class and its parameters."""
    mesh = init_device_mesh("cpu", (world,))
    model = make()
    before = dict(model.named_parameters())
    with pytest.raises(error, match=match):
        raggedfsdp.fully_shard(model, mesh=mesh, **kw)
    assert not isinstance(model, FSDPModule)
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in before.items()}


def _refusals(rank, world):
    fp8 = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, all_gather=Float8BlockAllGather(tile=(8, 8))
    )
    cases = {
        "3-D parameter": (_Stack, r"'experts' is a _Bf16Weight.*3-D", {}),
        "FP8 block all-gather": (
            functools.partial(_Model),
            r"'block\.l1\.weight' is a _Bf16Weight.*Float8BlockAllGather",
            {"mp_policy": fp8},
        ),
        "CPU offload": (
            functools.partial(_Model),
            r"'block\.l1\.weight' is a _Bf16Weight.*CPU offload",
            {"offload_policy": torch_fsdp.CPUOffloadPolicy(pin_memory=False)},
        ),
    }
    checks = {
        name: functools.partial(_refused, rank, world, make, match, **kw)
        for name, (make, match, kw) in cases.items()
    }
    checks["pre hook only"] = functools.partial(
        _refused,
        rank,
        world,
        functools.partial(_Model, _PreOnly),
        r"'block\.l1\.weight' is a _PreOnly.*both",
        ValueError,
    )
    checks["a three-argument fsdp_pre_all_gather"] = functools.partial(
        _refused,
        rank,
        world,
        functools.partial(_Model, _ThreeArgs),
        r"'block\.l1\.weight' is a _ThreeArgs.*fsdp_pre_all_gather\(self, mesh, outer_size",
        ValueError,
    )
    checks["hooks set on a plain parameter's local shard"] = functools.partial(
        _hooks_on_a_plain_shard_refused, world
    )
    run_cases(checks)


def _hooks_on_a_plain_shard_refused(world):
    """FSDP2 reads hooks set on any local shard; raggedfsdp gathers plain parameters as
    views of their buffer, so it refuses them at the first forward, naming the parameter."""
    model = _shard(raggedfsdp.fully_shard, _Model(_two), init_device_mesh("cpu", (world,)))
    local = model.head.weight._local_tensor  # plain: its buffer is a plain one
    local.fsdp_pre_all_gather = _Bf16Weight.fsdp_pre_all_gather.__get__(local)
    local.fsdp_post_all_gather = _Bf16Weight.fsdp_post_all_gather.__get__(local)
    with pytest.raises(NotImplementedError, match=r"parameter 'head.weight' got FSDP2's all-gath"):
        model(_data(0)[0])


def test_unsupported_subclasses_are_refused():
    spawn(2, _refusals)
