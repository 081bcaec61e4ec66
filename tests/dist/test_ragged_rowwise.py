"""Row-wise ops on sharded parameters, as FSDP2 users write them, against torch's FSDP2
(``Shard(0)`` DTensors) and against plain tensors, on 2 and 3 gloo ranks.

- Reductions within rows (``linalg.norm(w, dim=1)``, ``sum(1)``, ``amax(1)``, ``mean(1)``,
  ...) keep the RaggedShard, move no data, and give the plain result bit for bit: each
  row is reduced by the same kernel wherever it lives. Their backward reaches the leaf
  with FSDP2's gradient, bit for bit.
- Reductions over the rows give a Partial; the ranks' parts are added in another order,
  so sums and p-norms lie within ``_reduction_bound`` (derived in test_ragged_shard);
  max, min and the inf norm are exact.
- ``t()``, ``transpose`` and ``F.linear`` gather the RaggedShard to Replicate (one
  all-gather) and then compute what one process computes: bitwise.
- The chunked loss (torchtitan's chunked cross-entropy: the head group called once per
  chunk, one backward per chunk) against FSDP2 doing the same.

Patterns include ranks that hold no rows ([Note: row-wise ops] in
``raggedfsdp.tensor._dtensor_ext``).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import raggedfsdp
from raggedfsdp import RaggedShard
from tests.dist.test_ragged_shard import _assert_within, _reduction_bound
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics

UNITS = {
    2: [(1, 2), (0, 3), (2, 0), (3, 3)],
    3: [(1, 0, 2), (2, 2, 2), (0, 0, 3), (0, 1, 0)],
}
SHAPE = (6, 4)

# Ops within rows: the result is the RaggedShard of its own shape, no communication.
ROW_OPS = {
    "linalg.norm(dim=1)": lambda w: torch.linalg.norm(w, dim=1),
    "norm(dim=-1, keepdim)": lambda w: w.norm(dim=-1, keepdim=True),
    "sum(dim=1)": lambda w: w.sum(dim=1),
    "abs().amax(dim=1)": lambda w: w.abs().amax(dim=1),
    "mean(dim=1)": lambda w: w.mean(dim=1),
    "vector_norm(inf, dim=1)": lambda w: torch.linalg.vector_norm(w, float("inf"), dim=1),
    "logsumexp(dim=1)": lambda w: w.logsumexp(dim=1),
    "softmax(-1)": lambda w: torch.softmax(w, dim=-1),
    "w / norm(keepdim)": lambda w: w / w.norm(dim=1, keepdim=True),
    "view(6, 2, 2).sum(-1)": lambda w: w.view(6, 2, 2).sum(-1),
    "unsqueeze(-1).expand": lambda w: w.unsqueeze(-1).expand(6, 4, 3) * 2,
}
# Ops that move the rows: gathered (one all-gather), then computed as on one process.
GATHERED_OPS = {
    "t()": lambda w, x: w.t(),
    "transpose(0, 1)": lambda w, x: w.transpose(0, 1),
    "F.linear(x, w)": lambda w, x: F.linear(x, w),
    "x @ w.T": lambda w, x: x @ w.T,
}
# Reductions over the rows: a Partial.
PARTIAL_OPS = {
    "sum(dim=0)": (lambda w: w.sum(dim=0), None),
    "linalg.norm(dim=0)": (lambda w: torch.linalg.norm(w, dim=0), 2),
    "vector_norm(1, dim=(0, 1))": (lambda w: torch.linalg.vector_norm(w, 1, dim=(0, 1)), 1),
    "amax(dim=0)": (lambda w: w.amax(dim=0), "exact"),
    "abs().amax()": (lambda w: w.abs().amax(), "exact"),
    "vector_norm(inf, dim=0)": (
        lambda w: torch.linalg.vector_norm(w, float("inf"), dim=0),
        "exact",
    ),
    "amin(dim=0)": (lambda w: w.amin(dim=0), "exact"),
}


def _full(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _counts(comm: CommDebugMode) -> dict[str, int]:
    return {k._qualified_op_name: v for k, v in comm.get_comm_counts().items()}


def _fsdp2_weight(mesh, full):
    """The weight of a Linear sharded by torch's FSDP2: a Shard(0) DTensor leaf."""
    lin = nn.Linear(full.shape[1], full.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(full)
    torch_fsdp.fully_shard(lin, mesh=mesh)
    return lin.weight


def _ragged_weight(mesh, full, units):
    if units is None:  # raggedfsdp's own fully_shard: its planner's rows per rank
        lin = nn.Linear(full.shape[1], full.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(full)
        raggedfsdp.fully_shard(lin, mesh=mesh)
        return lin.weight
    return nn.Parameter(distribute_tensor(full, mesh, [RaggedShard((0,), units)]))


def _backward(out, seed):
    """``(out * c).sum()`` with a fixed Replicate ``c`` of out's shape: every element of
    the result carries its own weight into the gradient."""
    c = _full(out.shape, seed)
    (
        out * distribute_tensor(c, out.device_mesh, [Replicate()] * out.device_mesh.ndim)
    ).sum().backward()
    return c


def _check_row_op(mesh, units, name):
    fn = ROW_OPS[name]
    full = _full(SHAPE)
    w, ref_w = _ragged_weight(mesh, full, units), _fsdp2_weight(mesh, full)
    plain = full.clone().requires_grad_()
    with CommDebugMode() as comm:
        out = fn(w)
    assert _counts(comm) == {}, _counts(comm)
    rs = w.placements[0]
    assert out.placements == (RaggedShard((0,), rs.local_units),), out.placements
    want = fn(plain)
    # the same kernel on the same rows: the same bits
    assert torch.equal(out.full_tensor(), want.detach()), (out.full_tensor(), want)
    assert torch.equal(fn(ref_w).full_tensor(), want.detach())
    c = _backward(out, 1)
    _backward(fn(ref_w), 1)
    (want * c).sum().backward()
    assert torch.equal(w.grad.full_tensor(), ref_w.grad.full_tensor())
    assert torch.equal(w.grad.full_tensor(), plain.grad)


def _check_gathered_op(mesh, units, name):
    fn = GATHERED_OPS[name]
    full, x_full = _full(SHAPE), _full((3, SHAPE[1]), 2)
    w, ref_w = _ragged_weight(mesh, full, units), _fsdp2_weight(mesh, full)
    plain = full.clone().requires_grad_()
    x = distribute_tensor(x_full, mesh, [Replicate()])
    with CommDebugMode() as comm:
        out = fn(w, x)
    # one all-gather of the weight (none on one holding rank: still the collective)
    assert sum(_counts(comm).values()) == 1, _counts(comm)
    assert out.placements == (Replicate(),)
    want = fn(plain, x_full)
    # gathered, then the very computation of one process: the same bits
    assert torch.equal(out.full_tensor(), want.detach())
    c = _backward(out, 1)
    (want * c).sum().backward()
    assert torch.equal(w.grad.full_tensor(), plain.grad)
    # FSDP2 multiplies its local rows (Shard(1) of the result): another GEMM shape, so
    # another summation order of each dot product
    ref = fn(ref_w, x)
    _backward(ref, 1)
    if "linear" in name or "@" in name:
        _assert_dots(ref.full_tensor(), want, x_full.abs() @ full.abs().t(), SHAPE[1])
        grad_terms = c.abs().t() @ x_full.abs()  # grad_w = c^T x: dots of 3 terms
        _assert_dots(ref_w.grad.full_tensor(), plain.grad, grad_terms, c.shape[0])
    else:
        assert torch.equal(ref.full_tensor(), want.detach())
        assert torch.equal(ref_w.grad.full_tensor(), plain.grad)


def _assert_dots(got, want, terms, n):
    """Two fp32 computations of dot products of ``n`` terms (of magnitudes summing to
    ``terms``) in other orders: each within ``gamma(n) * terms`` of the exact value (n - 1
    additions and one product per term, each one rounding), so within twice that of each
    other."""
    u = torch.finfo(torch.float32).eps / 2
    bound = 2 * (n * u / (1 - n * u)) * terms.double()
    diff = (got.detach().double() - want.detach().double()).abs()
    assert bool((diff <= bound).all()), f"differ by {diff.max():.3g} > {bound.max():.3g}"


def _check_partial_op(mesh, units, name, world):
    fn, kind = PARTIAL_OPS[name]
    full = _full(SHAPE).double()
    w = nn.Parameter(distribute_tensor(full, mesh, [RaggedShard((0,), units)]))
    with CommDebugMode() as comm:
        out = fn(w)
    assert _counts(comm) == {}
    assert all(p.is_partial() for p in out.placements), out.placements
    got, want = out.full_tensor(), fn(full)
    if kind == "exact":  # a max or min: exact
        assert torch.equal(got, want), (got, want)
    else:  # each column's parts added over the ranks in another order
        cols = [full] if want.dim() == 0 else list(full.t())
        for i, col in enumerate(cols):
            bound = _reduction_bound([col], kind, world, levels=1)
            _assert_within(got.reshape(-1)[i], want.reshape(-1)[i], bound, name)


def _check_stack_rows(mesh, units):
    """A RaggedShard of two row dims (a stack of experts): a trailing dim of the global
    tensor is a different dim of the local tensor."""
    full = _full((2, 3, 5)).double()
    rs = RaggedShard((0, 1), units)
    w = distribute_tensor(full, mesh, [rs])
    for fn in (
        lambda t: t.sum(dim=-1),
        lambda t: torch.linalg.vector_norm(t, 2, dim=2, keepdim=True),
        lambda t: torch.softmax(t, dim=2),
        lambda t: t.amax(dim=2),
        lambda t: t / t.norm(dim=2, keepdim=True),
    ):
        out = fn(w)
        assert out.placements == (rs,), out.placements
        assert torch.equal(out.full_tensor(), fn(full))


def _check_errors(mesh, units):
    """What still cannot run says so, naming the op and the placement."""
    rs = RaggedShard((0,), units)
    w = distribute_tensor(_full(SHAPE), mesh, [rs])
    placed = r"RaggedShard\(dims=\(0,\), local_units="
    for fn, match in [
        (
            lambda: w.mean(dim=0),
            rf"aten.mean.dim over dims \[0\] .* placed \({placed}.*over the rows",
        ),
        (lambda: w.view(3, 8), rf"aten.view.default of .* placed \({placed}.*row dim"),
        (lambda: w.unsqueeze(0), rf"aten.unsqueeze.default of .* placed \({placed}"),
        (
            lambda: w @ distribute_tensor(_full((4, 4)), mesh, [Replicate()]),
            rf"aten.mm.default .*{placed}",
        ),
        (lambda: torch.cumsum(w, dim=0), rf"aten.cumsum.default over dims 0 .*{placed}"),
    ]:
        with pytest.raises(NotImplementedError, match=match):
            fn()
    stack = distribute_tensor(_full((2, 3, 5)), mesh, [RaggedShard((0, 1), units)])
    with pytest.raises(NotImplementedError, match=r"over some of the row dims only"):
        stack.sum(dim=1)


def _grid_ops(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    cases = {}
    for units in [*UNITS[world], None]:
        for name in ROW_OPS:
            cases[f"{name} units={units}"] = partial(_check_row_op, mesh, units, name)
        for name in GATHERED_OPS:
            cases[f"{name} units={units}"] = partial(_check_gathered_op, mesh, units, name)
    for units in UNITS[world]:
        for name in PARTIAL_OPS:
            cases[f"{name} units={units}"] = partial(_check_partial_op, mesh, units, name, world)
        cases[f"stack units={units}"] = partial(_check_stack_rows, mesh, units)
        cases[f"errors units={units}"] = partial(_check_errors, mesh, units)
    run_cases(cases)


@pytest.mark.parametrize("world", [2, 3])
def test_rowwise_ops(world):
    spawn(world, _grid_ops)


# ---------------------------------------------------------------------------------------------
# the chunked loss: the head group called once per chunk, one backward per chunk
# ---------------------------------------------------------------------------------------------
VOCAB, DIM, SEQ, CHUNKS = 11, 8, 12, 3


class _LM(nn.Module):
    """emb -> blocks -> norm; the head is applied by the loss, chunk by chunk."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.norm(h)


def _sharded_lm(fully_shard, mesh):
    model = _LM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _chunked_step(model, tokens, targets):
    """torchtitan's chunked cross-entropy: a backward per chunk of the sequence."""
    h = model(tokens)
    total = 0.0
    chunks = list(zip(h.chunk(CHUNKS, dim=1), targets.chunk(CHUNKS, dim=1)))
    for i, (hc, tc) in enumerate(chunks):
        logits = model.head(hc)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tc.reshape(-1)) / CHUNKS
        loss.backward(retain_graph=i < len(chunks) - 1)
        total += loss.detach()
    return total


def _check_chunked_loss(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, VOCAB, (2, 2 * world, SEQ + 1), generator=gen)
    models = [_sharded_lm(torch_fsdp.fully_shard, mesh), _sharded_lm(raggedfsdp.fully_shard, mesh)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(2):
        batch = data[step, 2 * rank : 2 * rank + 2]
        losses = []
        for model in models:
            losses.append(_chunked_step(model, batch[:, :-1], batch[:, 1:]))
        # the same gathered parameters and the same local arithmetic on each rank; the
        # reduce-scatter adds the same per-rank gradients
        assert torch.equal(losses[0], losses[1]), (step, losses)
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), (step, name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
    dist.barrier()


def test_chunked_loss_matches_fsdp2():
    # 2 ranks: a reduction of two addends is one sum in either order, so the comparison is
    # bitwise (over 3 the two backends' reduce-scatters may add in different orders)
    spawn(2, _check_chunked_loss)
