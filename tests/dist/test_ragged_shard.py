"""RaggedShard as a DTensor placement, on 1-5 gloo ranks, against full-tensor references.

Each test spawns once per world size and runs a grid of layouts inside: units with
empty ranks, dims prefixes (0,) and (0, 1), several dtypes.

Comparisons are bitwise where the arithmetic is the same as the reference's (data
movement, element-wise ops, exact sums, max / min / counts); a norm or sum that adds the
ranks' parts in another order lies within ``_reduction_bound`` of it, a bound derived
from the rounding of the operations themselves ([Note: derived tolerances] in
``tests/numerics.py``).
"""

import math
from fractions import Fraction
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from torch.distributed.tensor.debug import CommDebugMode

from raggedfsdp import RaggedShard
from tests.harness import run_cases, spawn
from tests.numerics import log_check

pytestmark = pytest.mark.numerics

WORLDS = [1, 2, 3, 4]

# Per world size: local_units patterns, empty ranks included. Every pattern sums to
# 1, 2, 3 or 6 blocks, so it cuts the 6-row and 12-row tensors below.
UNITS = {
    1: [(1,), (3,), (6,)],
    2: [(1, 2), (0, 3), (2, 0), (3, 3)],
    3: [(1, 0, 2), (2, 2, 2), (0, 0, 3), (0, 1, 0)],
    4: [(1, 0, 2, 3), (0, 1, 1, 0), (0, 0, 0, 2), (2, 1, 0, 3)],
    5: [(1, 0, 2, 0, 3), (0, 0, 0, 0, 6), (1, 1, 1, 1, 2)],
}
# (shape, dims): 6 rows each way, so every pattern above applies.
SHAPES = [((6, 4), (0,)), ((2, 3, 5), (0, 1)), ((6,), (0,))]
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


def _full(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _layouts(world):
    for units in UNITS[world]:
        for shape, dims in SHAPES:
            yield f"units={units} shape={shape}", RaggedShard(dims, units), shape


def _counts(comm: CommDebugMode) -> dict[str, int]:
    return {k._qualified_op_name: v for k, v in comm.get_comm_counts().items()}


def _gamma(k: float, u: float) -> float:
    """``k u / (1 - k u)``: the relative error of ``k`` roundings of unit roundoff ``u``
    compounded (second-order terms included)."""
    return k * u / (1 - k * u)


def _reduction_bound(xs, p, world: int, levels: int) -> float:
    """The most two computations of the ``p``-norm of all elements of ``xs`` may differ by
    (``p=None``: their sum) when they add the terms in other orders, over ``world`` ranks,
    and take the p-th root of partial sums at other points.

    Derivation (``u``: the unit roundoff of the dtype of ``xs``). Each result lies within
    the following of the exact value, so twice it bounds their difference:

    - a sum of signed terms, in any order: a term passes through at most ``n - 1``
      additions inside the tensors, ``world - 1`` across ranks and ``len(xs) - 1`` across
      tensors, so the error is at most ``(n + world + len(xs)) u sum|x|``;
    - a p-norm: every term ``|x|**p`` is >= 0, so every error is relative to the result.
      Each term's ``pow`` is within 1 ulp (2u); the sum adds the count above; each of
      ``levels`` partial norms taken and raised back to p (a rank's local norm,
      clip_grad_norm_'s per-tensor norm) turns its root's 2u into 2pu, adds its power's
      2u, and moves its partial sum ``s`` by ``u |ln s|`` where ``fl(1/p) * p != 1``
      (``s**(fl(1/p) p) = s**(1 + d)``, ``|d| <= u``; exact for p = 1, 2); the final root
      divides that by p and adds 2u + ``u |ln S| / p``. Every partial sum ``s`` lies
      between the least non-zero term and the total ``S``, which bound ``|ln s|``.
    """
    u = torch.finfo(xs[0].dtype).eps / 2
    flat = torch.cat([x.detach().reshape(-1).double() for x in xs])
    adds = flat.numel() + world + len(xs)
    if p is None:
        return 2 * _gamma(adds, u) * flat.abs().sum().item()
    terms = flat.abs() ** p
    total = terms.sum().item()
    if total == 0:
        return 0.0
    log_s = 0.0
    if Fraction(1 / p) * Fraction(p) != 1:
        least = terms[terms > 0].min().item()
        log_s = max(abs(math.log(least)), abs(math.log(total)))
    k_sum = 2 + adds + levels * (2 * p + 2 + log_s)
    k_norm = k_sum / p + 2 + log_s / p
    return 2 * _gamma(k_norm, u) * total ** (1 / p)


def _assert_within(got, want, bound, what=""):
    diff = (got.double() - want.double()).abs().max().item()
    log_check("reduction order", what, diff, 0.0, bound)
    assert diff <= bound, f"{what}: {got} vs {want}: differ by {diff:.3g} > derived {bound:.3g}"


# ---------------------------------------------------------------------------------------------
# data movement
# ---------------------------------------------------------------------------------------------
def _check_construct(mesh, rs, shape, dtype):
    rank = mesh.get_local_rank(0)
    full = _full(shape, dtype)
    d = distribute_tensor(full, mesh, [rs])
    assert d.placements == (rs,) and d.shape == full.shape and d.dtype == dtype
    assert torch.equal(d.to_local(), rs.local_view(full, rank))
    assert torch.equal(d.full_tensor(), full)
    # from_local over a view of a flat buffer stays a view of that buffer
    buf = torch.zeros(full.numel() + 7, dtype=dtype)
    start, end = rs.local_row_range(shape, rank)
    row = rs.row_numel(shape)
    local = buf[3 + start * row : 3 + end * row].view(rs.local_shape(shape, rank))
    local.copy_(rs.local_view(full, rank))
    e = DTensor.from_local(local, mesh, [rs], shape=full.shape, stride=full.stride())
    assert e.to_local().data_ptr() == local.data_ptr()
    assert e.to_local().untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert torch.equal(e.full_tensor(), full)


def _check_redistribute(mesh, rs, shape, dtype, world):
    full = _full(shape, dtype)
    d = distribute_tensor(full, mesh, [rs])
    r = d.redistribute(mesh, [Replicate()])
    assert torch.equal(r.to_local(), full)
    back = r.redistribute(mesh, [rs])
    assert torch.equal(back.to_local(), d.to_local())
    s = d.redistribute(mesh, [Shard(0)])
    assert torch.equal(s.to_local(), distribute_tensor(full, mesh, [Shard(0)]).to_local())
    assert torch.equal(s.redistribute(mesh, [rs]).to_local(), d.to_local())
    # to every other pattern of this world size: one all-to-all, nothing gathered
    for units in UNITS[world]:
        other = RaggedShard(rs.dims, units)
        with CommDebugMode() as comm:
            o = d.redistribute(mesh, [other])
        assert torch.equal(o.to_local(), distribute_tensor(full, mesh, [other]).to_local())
        assert _counts(comm) == ({} if other == rs else {"c10d::alltoall_base_": 1})


def _check_partial_to_ragged(mesh, rs, shape, dtype, world):
    rank = mesh.get_local_rank(0)
    full = _full(shape, dtype)
    for reduce_op, expect in [
        ("sum", full * sum(range(1, world + 1))),
        ("avg", full * (world + 1) / 2),
        ("max", full * world if True else None),
    ]:
        if reduce_op == "max":
            expect = torch.maximum(full, full * world)
        p = DTensor.from_local(full * (rank + 1), mesh, [Partial(reduce_op)])
        with CommDebugMode() as comm:
            out = p.redistribute(mesh, [rs])
        # a true reduce-scatter; none over one rank (its result is the input)
        assert _counts(comm) == ({"c10d::_reduce_scatter_base_": 1} if world > 1 else {})
        assert out.placements == (rs,)
        # float64 holding fp32 values: full * k and every sum of those are exact, and
        # avg's division lands on the representable full * (world + 1) / 2: bitwise
        assert torch.equal(out.to_local(), rs.local_view(expect.to(dtype), rank)), reduce_op


def _check_autograd(mesh, rs, shape):
    rank = mesh.get_local_rank(0)
    full = _full(shape, torch.float64)
    weight = _full(shape, torch.float64, seed=1)
    x = distribute_tensor(full, mesh, [rs]).requires_grad_()
    y = x.redistribute(mesh, [Replicate()])
    (y.to_local() * weight).sum().backward()
    assert x.grad.placements == (rs,)
    assert torch.equal(x.grad.to_local(), rs.local_view(weight, rank))
    # and the other way: a replicated leaf redistributed to RaggedShard gets a replicated grad
    z = distribute_tensor(full, mesh, [Replicate()]).requires_grad_()
    (z.redistribute(mesh, [rs]) * 3).sum().backward()
    assert z.grad.placements == (Replicate(),)
    assert torch.equal(z.grad.full_tensor(), torch.full_like(full, 3.0))  # 3.0s, moved


def _check_elementwise(mesh, rs, shape, dtype):
    a_full, b_full = _full(shape, dtype, 0), _full(shape, dtype, 1)
    a, b = distribute_tensor(a_full, mesh, [rs]), distribute_tensor(b_full, mesh, [rs])

    def same(t, ref):  # the same element-wise op on the same values: the same bits
        assert t.placements == (rs,), t.placements
        assert torch.equal(t.full_tensor(), ref)

    same(a * 2 + b, a_full * 2 + b_full)
    same(torch.lerp(a, b, 0.3), torch.lerp(a_full, b_full, 0.3))
    same(a.to(torch.float32), a_full.to(torch.float32))
    same(torch.zeros_like(a), torch.zeros_like(a_full))
    same(a.clone().mul_(3).add_(b, alpha=2), a_full * 3 + b_full * 2)
    c = a.clone()
    torch._foreach_mul_([c], 0.5)
    torch._foreach_add_([c], [b])
    same(c, a_full * 0.5 + b_full)
    c.copy_(b)
    same(c, b_full)


def _check_norms(mesh, rs, shape, world):
    full = _full(shape, torch.float64)
    d = distribute_tensor(full, mesh, [rs])
    for p in [2, 1, 3.5, float("inf"), float("-inf"), 0]:
        got = [torch.linalg.vector_norm(d, p), *torch._foreach_norm([d, d * 2], p)]
        for g, ref in zip(got, [full, full, full * 2]):
            g, want = g.full_tensor(), torch.linalg.vector_norm(ref, p)
            if p in (float("inf"), float("-inf"), 0):  # a max, min or count: exact
                assert torch.equal(g, want), (p, g, want)
            else:  # each rank's norm, raised to p, summed over ranks, rooted
                _assert_within(g, want, _reduction_bound([ref], p, world, levels=1), f"p={p}")
    want = full.sum()
    _assert_within(d.sum().full_tensor(), want, _reduction_bound([full], None, world, 0), "sum")


def _grid_core(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    cases = {}
    for name, rs, shape in _layouts(world):
        for dtype in DTYPES:
            cases[f"construct {name} {dtype}"] = partial(_check_construct, mesh, rs, shape, dtype)
        for dtype in (torch.float32, torch.bfloat16):
            cases[f"redistribute {name} {dtype}"] = partial(
                _check_redistribute, mesh, rs, shape, dtype, world
            )
        cases[f"partial {name}"] = partial(
            _check_partial_to_ragged, mesh, rs, shape, torch.float64, world
        )
        cases[f"autograd {name}"] = partial(_check_autograd, mesh, rs, shape)
        cases[f"elementwise {name}"] = partial(_check_elementwise, mesh, rs, shape, torch.float32)
        cases[f"norms {name}"] = partial(_check_norms, mesh, rs, shape, world)
    run_cases(cases)


@pytest.mark.parametrize("world", [*WORLDS, 5])
def test_placement_core(world):
    spawn(world, _grid_core)


# ---------------------------------------------------------------------------------------------
# optimizers and gradient clipping: same full parameters as on the full tensors
# ---------------------------------------------------------------------------------------------
PARAM_SHAPES = [((6, 4), (0,)), ((2, 3, 5), (0, 1)), ((12,), (0,))]


def _grad(shape, step, i):
    return _full(shape, torch.float32, seed=100 * step + i)


def _check_optimizer(mesh, make_opt, units):
    rank = mesh.get_local_rank(0)
    fulls = [_full(shape, torch.float32, seed=i) for i, (shape, _) in enumerate(PARAM_SHAPES)]
    refs = [nn.Parameter(f.clone()) for f in fulls]
    places = [RaggedShard(dims, units) for _, dims in PARAM_SHAPES]
    params = [nn.Parameter(distribute_tensor(f, mesh, [p])) for f, p in zip(fulls, places)]
    ref_opt, opt = make_opt(refs), make_opt(params)
    for step in range(5):
        for i, (ref, p, rs) in enumerate(zip(refs, params, places)):
            g = _grad(ref.shape, step, i)
            ref.grad = g
            p.grad = distribute_tensor(g, mesh, [rs])
        ref_opt.step()
        opt.step()
    for ref, p, rs in zip(refs, params, places):
        assert p.placements == (rs,)
        assert p.to_local().shape == rs.local_shape(ref.shape, rank)
        # element-wise updates of the very same gradients: the same bits
        assert torch.equal(p.full_tensor(), ref.detach())


def _check_clip(mesh, units, norm_type, foreach, world):
    fulls = [_grad(shape, 0, i) for i, (shape, _) in enumerate(PARAM_SHAPES)]
    refs = [nn.Parameter(torch.zeros_like(f)) for f in fulls]
    places = [RaggedShard(dims, units) for _, dims in PARAM_SHAPES]
    params = [
        nn.Parameter(distribute_tensor(torch.zeros_like(f), mesh, [p]))
        for f, p in zip(fulls, places)
    ]
    for ref, p, f, rs in zip(refs, params, fulls, places):
        ref.grad = f.clone()
        p.grad = distribute_tensor(f, mesh, [rs])
    ref_norm = nn.utils.clip_grad_norm_(refs, 0.5, norm_type=norm_type, foreach=foreach)
    norm = nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type, foreach=foreach)
    norm = norm.full_tensor()
    if math.isinf(norm_type):  # a max: exact, and so is all that follows from it
        assert torch.equal(norm, ref_norm), (norm, ref_norm)
    else:  # levels: each rank's norm and each tensor's norm, raised back to p
        bound = _reduction_bound(fulls, norm_type, world, levels=2)
        _assert_within(norm, ref_norm, bound, f"clip p={norm_type}")
    if torch.equal(norm, ref_norm):  # the same coefficient times the same gradients
        for ref, p in zip(refs, params):
            assert torch.equal(p.grad.full_tensor(), ref.grad)
        return
    # Each side scales by c = min(1, 0.5 / (norm + 1e-6)) of its own norm: two roundings
    # from the exact c of that norm (4u between the two sides), which moves by at most
    # c |dnorm| / (norm - |dnorm|); then one rounding of each product (2u between the two
    # sides): |dgrad| <= |g| c (|dnorm| / (norm - |dnorm|) + 6u), 6u compounded.
    u = torch.finfo(norm.dtype).eps / 2
    want = ref_norm.double().item()
    c = min(1.0, 0.5 / (want + 1e-6))
    dnorm = abs(norm.double().item() - want)
    for ref, p, f in zip(refs, params, fulls):
        bound = f.double().abs() * c * (dnorm / (want - dnorm) + _gamma(6, u))
        diff = (p.grad.full_tensor().double() - ref.grad.double()).abs()
        i = (diff / bound).argmax()
        log_check(
            "clipped grad",
            f"p={norm_type}",
            diff.flatten()[i].item(),
            0.0,
            bound.flatten()[i].item(),
        )
        assert bool((diff <= bound).all()), f"clipped grads differ by {diff.max():.3g}"


OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
    "sgd-foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True
    ),
    "sgd-loop": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False
    ),
}


def _grid_optim(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    cases = {}
    for units in UNITS[world]:
        for name, make in OPTIMIZERS.items():
            cases[f"{name} units={units}"] = partial(_check_optimizer, mesh, make, units)
        for norm_type in (2.0, 1.0, float("inf")):
            for foreach in (True, False):
                cases[f"clip p={norm_type} foreach={foreach} units={units}"] = partial(
                    _check_clip, mesh, units, norm_type, foreach, world
                )
    run_cases(cases)


@pytest.mark.parametrize("world", WORLDS)
def test_optimizers_and_clipping(world):
    spawn(world, _grid_optim)


# ---------------------------------------------------------------------------------------------
# distributed checkpoint: save at one layout / world size, load into another
# ---------------------------------------------------------------------------------------------
CKPT_SHAPES = {"w": ((6, 4), (0,)), "experts": ((2, 3, 5), (0, 1)), "norm": ((12,), (0,))}


def _ckpt_units(world, variant):
    return UNITS[world][variant % len(UNITS[world])]


def _ckpt_state(mesh, world, variant, fill):
    units = _ckpt_units(world, variant)
    state = {}
    for i, (name, (shape, dims)) in enumerate(CKPT_SHAPES.items()):
        full = _full(shape, torch.float32, seed=i) if fill else torch.zeros(shape)
        state[name] = distribute_tensor(full, mesh, [RaggedShard(dims, units)])
    return state


def _save(rank, world, path, variant):
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(_ckpt_state(mesh, world, variant, fill=True), checkpoint_id=path)


def _load(rank, world, path, variant):
    mesh = init_device_mesh("cpu", (world,))
    state = _ckpt_state(mesh, world, variant, fill=False)
    locals_before = {k: v.to_local() for k, v in state.items()}
    dcp.load(state, checkpoint_id=path)
    for i, (name, (shape, _)) in enumerate(CKPT_SHAPES.items()):
        assert state[name].to_local().data_ptr() == locals_before[name].data_ptr()  # in place
        assert torch.equal(state[name].full_tensor(), _full(shape, torch.float32, seed=i)), name
    # and into plain Shard(0) DTensors (what torch's FSDP2 would hold)
    plain = {
        name: distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])
        for name, (shape, _) in CKPT_SHAPES.items()
    }
    dcp.load(plain, checkpoint_id=path)
    for i, (name, (shape, _)) in enumerate(CKPT_SHAPES.items()):
        assert torch.equal(plain[name].full_tensor(), _full(shape, torch.float32, seed=i)), name


def test_checkpoint_across_layouts_and_world_sizes(tmp_path):
    saved = str(tmp_path / "w4")
    spawn(4, _save, saved, 0)  # units (1, 0, 2, 3)
    spawn(4, _load, saved, 2)  # same world, other units (0, 0, 0, 2)
    for world in (3, 1):
        spawn(world, _load, saved, 0)
    back = str(tmp_path / "w3")
    spawn(3, _save, back, 3)  # units (0, 1, 0)
    spawn(2, _load, back, 1)  # into (0, 3)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def _check_errors(rank, world):
    import re

    mesh = init_device_mesh("cpu", (world,))
    full = torch.zeros(6, 4)
    wrong_len = RaggedShard((0,), (1,) * (world + 1))
    cases = [
        (
            lambda: distribute_tensor(full, mesh, [wrong_len]),
            r"local_units has \d entries but the mesh axis has",
        ),
        (
            lambda: distribute_tensor(full, mesh, [RaggedShard((0,), (5,) + (0,) * (world - 1))]),
            r"the 6 rows .* cannot be cut into 5 equal blocks",
        ),
        (
            lambda: DTensor.from_local(
                torch.zeros(5, 4),
                mesh,
                [RaggedShard((0,), (6,) + (0,) * (world - 1))],
                shape=full.shape,
                stride=full.stride(),
            ),
            r"must hold a local tensor of shape \((6|0), 4\), got \(5, 4\)",
        ),
        (
            lambda: DTensor.from_local(torch.zeros(6, 4), mesh, [RaggedShard((0,), (1,) * world)]),
            r"needs the global shape= and stride=",
        ),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    mesh2 = init_device_mesh("cpu", (world, 1))
    two = [RaggedShard((0,), (1,) * world), RaggedShard((0,), (1,))]
    with pytest.raises(ValueError, match=re.escape("hold 2 RaggedShards")):
        distribute_tensor(full, mesh2, two)
    with pytest.raises(ValueError, match=re.escape("hold 2 RaggedShards")):
        DTensor.from_local(torch.zeros(1, 4), mesh2, two, shape=full.shape, stride=full.stride())
    d = distribute_tensor(full, mesh, [RaggedShard((0,), (1,) * world)])
    with pytest.raises(
        NotImplementedError, match=r"aten.mm.default is not supported on a RaggedShard"
    ):
        d @ distribute_tensor(torch.zeros(4, 4), mesh, [Replicate()])
    # (a Replicate of the same shape is sliced locally: tests/dist/test_dtensor_init_and_replicate)
    with pytest.raises(NotImplementedError, match=r"meets a DTensor of another layout"):
        d + distribute_tensor(full[:1], mesh, [Replicate()])  # broadcast: another shape
    if world > 1:
        with pytest.raises(NotImplementedError, match=r"meets a DTensor of another layout"):
            d + distribute_tensor(full, mesh, [Shard(0)])
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2])
def test_bad_input(world):
    spawn(world, _check_errors)
