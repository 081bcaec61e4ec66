"""Muon for RaggedShard parameters: whole-matrix Newton-Schulz on load-balanced root ranks.

[Note: distributed Muon]
Muon's update of a matrix is Newton-Schulz (NS) orthogonalisation of its momentum,
which needs the *whole* matrix; everything else (momentum, weight decay, the
update itself) is element-wise. So, per step:

1. momentum and the Nesterov mix run on each rank's own rows (element-wise);
2. every matrix (a 2-D parameter, or each member of an ``[E, out, in]`` stack)
   has a root rank, chosen to balance NS FLOPs (``muon_plan.assign_roots``);
   the ranks holding its rows send them to the root: what
   ``redistribute(mesh, [RaggedShard(dims, units with every block on the root)])``
   does, one all-to-all;
3. NS runs on the root; its result goes back to the holders (the inverse
   redistribute), and each rank applies its rows of the update.

A matrix that one rank holds whole (``muon_block_policy`` arranges this wherever
the planner can do it cheaply) is rooted there and moves no byte. The others
travel in rounds (see [Note: Muon roots] in ``muon_plan``): one all-to-all per
round carries the pieces of several matrices. All gathers are issued
asynchronously up front; while a round's gather is still in flight the rank runs
NS of its communication-free matrices, then the round's NS as soon as its pieces
are in, and sends the results back asynchronously, so they travel while later
rounds and the remaining communication-free matrices compute.

Numbers: torch's NS starts with ``grad.bfloat16()``, and its result is bf16, so
the pieces travel as bf16 (half the bytes of fp32) and the result is exactly
torch's: the same NS (same ops, coefficients, steps, eps) on the same whole
matrix, and element-wise ops that give the same bits on any slice. Parameters
match ``torch.optim.Muon`` (+ ``torch.optim.AdamW`` for the rest) to rounding of
the element-wise ops. One deliberate difference: torch's NS divides its input
in place, which for bf16 parameters with ``nesterov=False`` scales the momentum
buffer itself; here the NS input is always a copy.

``distributed="replicated"`` is the baseline the paper improves on: every rank
gathers every matrix (an all-gather, as the same all-to-all rounds) and runs
every NS; no results travel back.

[Note: Muon under HSDP]
On a 2-D ``(replicate, shard)`` mesh a parameter is placed ``(Replicate(),
RaggedShard)``, and after a backward every replica holds the same shard gradients
(the FSDP runtime all-reduces them over the replicate dim; see [Note: HSDP] in
``fsdp/_param_group.py``). Each replica is then a copy of the 1-D case: the plan is
made over the shard dim (its size, this rank's index on it), the all-to-alls run
over the shard dim's process group, and every replica picks the same roots and
runs the same NS on the same values, so the replicas' parameters stay identical
and no byte crosses the replicate dim. (Spreading the NS over all ``R x S`` ranks
would divide each rank's NS work by up to ``R``, at the price of sending pieces
and results across the replicate dim: between nodes, in the usual HSDP layout.)
``BufferView.process_group`` is the same shard-dim group.

[Note: Muon under TP and EP]
Under FSDP x TP a parameter lives on the ``(tp, *dp dims)`` mesh placed ``(Shard(d),
..., RaggedShard)`` (see [Note: FSDP x TP] in ``fsdp/_tp.py``): the RaggedShard cuts
the rows of the *TP-local* tensor. The plan above runs unchanged over the shard dim
on the TP-local matrices: every rank of one tp group has the same dp coordinate, the
same TP-local shapes and the same plan, so the ranks of a tp group are dp-roots of the
same matrices in the same round, each for its own TP piece. Then a second stage
crosses tp: each such matrix gets a tp root (the same greedy balance over the tp
ranks, largest first), one all-to-all over tp brings it the other TP pieces, it runs
NS on the whole matrix (the pieces concatenated along the cut dim) and a second
all-to-all returns each tp rank its piece of the result. So every matrix has one
root on the whole ``tp x shard`` grid, and the learning-rate adjustment uses the
whole matrix's shape. The tp stage of a round runs synchronously (the shard-dim
gathers of later rounds are already in flight). A stacked ``[E, out, in]`` parameter
sharded ``Shard(0)`` over ``ep`` (FSDP x EP) holds whole members: no tp stage.
``Replicate()`` on a tp axis means every tp rank computes its own copy, as replicas
do. Parameters are planned per shard-dim process group (``fully_shard(experts,
mesh=dp_mod_ep)`` beside ``fully_shard(block, mesh=dp)`` gives two): each group's
matrices are planned and exchanged among its own ranks, one group after another in
the order the parameters come.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from raggedfsdp.optim._muon_policy import (
    MuonBlockPolicy,
    default_use_muon,
    muon_block_policy,
    muon_param_groups,
)
from raggedfsdp.optim.adamw import FlatAdamW
from raggedfsdp.optim.flat import Item, check_hyper, like_param, local, name_of, split_by_flag
from raggedfsdp.optim.muon_plan import (
    Exchange,
    StepPlan,
    build_plan,
    comm_free_matrices,
    matrix_members,
    ns_flops,
    plan_matrices,
    plan_whole_matrices,
)
from raggedfsdp.tensor import RaggedPiece, ragged_piece
from raggedfsdp.tensor.placement import RaggedShard

__all__ = [
    "Muon",
    "MuonBlockPolicy",
    "MuonStepStats",
    "adjust_lr",
    "comm_free_matrices",
    "default_use_muon",
    "muon_block_policy",
    "muon_param_groups",
    "plan_whole_matrices",
    "zeropower_via_newtonschulz",
]

# torch.optim.Muon's constants (Keller Jordan's Muon).
EPS = 1e-7
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_DISTRIBUTED = ("root", "replicated")
_MUON_KEYS = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn")
_COMM = torch.bfloat16  # NS runs in bf16: pieces and results travel as bf16 (exact)


# ---------------------------------------------------------------------------------------------
# The math, as torch.optim.Muon has it
# ---------------------------------------------------------------------------------------------
def zeropower_via_newtonschulz(
    x: Tensor, ns_coefficients: Sequence[float], ns_steps: int, eps: float
) -> Tensor:
    """Quintic Newton-Schulz orthogonalisation of a 2-D ``x``, as ``torch.optim.Muon``.

    The same ops in the same order as torch's ``_zeropower_via_newtonschulz``: cast
    to bf16, transpose a tall matrix, divide by the Frobenius norm (at least
    ``eps``), ``ns_steps`` times ``X <- a X + (b A + c A A) X`` with ``A = X X^T``.

    Args:
        x: the matrix ``(rows, cols)``; a bf16 ``x`` is divided in place.
        ns_coefficients: ``(a, b, c)``.
        ns_steps: iterations (< 100).
        eps: lower bound of the norm.

    Returns:
        The bf16 result ``(rows, cols)`` (a transposed view for a tall ``x``).
    """
    a, b, c = ns_coefficients
    ortho = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Muon's learning rate for a ``rows x cols`` matrix, as ``torch.optim.Muon``.

    ``None`` / ``"original"``: ``lr * sqrt(max(1, rows / cols))`` (Keller Jordan);
    ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(rows, cols))`` (Moonshot).
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


@dataclass
class MuonStepStats:
    """What the last ``Muon.step`` did on this rank.

    Args:
        bytes_sent, bytes_received: bytes this rank sent / received for NS.
        collectives: all-to-alls issued.
        ns_seconds: wall time of this rank's Newton-Schulz.
        ns_cpu_seconds: CPU time of the thread running it (what contention does not inflate).
        wait_seconds: wall time spent waiting for communication.
        ns_flops: NS FLOPs on this rank.
        ns_flops_per_rank: planned NS FLOPs of every rank of the shard dim (the load
            balance; summed over the shard groups, see [Note: Muon under TP and EP]).
        matrices: Muon matrices stepped (all ranks).
        rooted: matrices whose NS ran on this rank.
        comm_free: matrices held whole by one rank (no communication).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    ns_seconds: float = 0.0
    ns_cpu_seconds: float = 0.0
    wait_seconds: float = 0.0
    ns_flops: float = 0.0
    ns_flops_per_rank: list[float] = field(default_factory=list)
    matrices: int = 0
    rooted: int = 0
    comm_free: int = 0


# ---------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------
class Muon(FlatAdamW):
    """Muon for matrices and stacks of matrices, AdamW for the rest; RaggedShard-aware.

    Parameter groups carry ``use_muon``: ``True`` groups get Muon with the
    hyperparameters of ``torch.optim.Muon`` (``lr, weight_decay, momentum,
    nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn``); ``False`` groups get
    AdamW (``lr, betas, eps, weight_decay``; defaults from the ``adamw_*``
    arguments). A group without ``use_muon`` is split by ``use_muon(fqn, param)``
    (the fqn is known for parameters sharded by ``fully_shard``, and relative to
    the module passed to it; pass ``muon_param_groups(model)`` to split by full
    names). Parameters sharded by ``fully_shard`` (``RaggedShard`` DTensors) get
    distributed Newton-Schulz, see [Note: distributed Muon] (under HSDP, within each
    replica's shard group: [Note: Muon under HSDP]; tensor- and expert-parallel
    matrices: [Note: Muon under TP and EP]); plain tensors and
    ``Replicate`` DTensors are whole on every rank and computed there. The AdamW
    groups step as ``FlatAdamW`` does: a buffer whose trainable parameters are all
    in AdamW groups steps whole (see [Note: whole-buffer steps] in ``flat.py``).

    Args:
        params: parameters or parameter groups.
        lr: Muon learning rate. Default 1e-3.
        weight_decay: Muon decoupled weight decay. Default 0.1.
        momentum: Muon momentum. Default 0.95.
        nesterov: Nesterov momentum. Default True.
        ns_coefficients: Newton-Schulz ``(a, b, c)``. Default (3.4445, -4.7750, 2.0315).
        eps: lower bound of the norm NS divides by. Default 1e-7.
        ns_steps: Newton-Schulz iterations. Default 5.
        adjust_lr_fn: ``None`` / ``"original"`` or ``"match_rms_adamw"``. Default None.
        adamw_lr: AdamW learning rate. Default 1e-3.
        adamw_betas: AdamW betas. Default (0.9, 0.999).
        adamw_eps: AdamW eps. Default 1e-8.
        adamw_weight_decay: AdamW weight decay. Default 0.01.
        use_muon: ``(fqn, param) -> bool`` for groups without ``use_muon``.
            Default ``default_use_muon``.
        distributed: ``"root"`` (NS of each matrix on one load-balanced rank) or
            ``"replicated"`` (the baseline: every rank gathers every matrix and runs
            every NS). Default ``"root"``.
        matrices_per_round: matrices of each root per communication round. Default 1.

    Raises:
        ValueError: a hyperparameter out of range, or a Muon parameter that is not a
            matrix or a stack of matrices (naming it).
        NotImplementedError: a Muon parameter sharded other than by ``fully_shard``
            (a ``RaggedShard`` on the mesh's last dim, ``Replicate()`` or one tp / ep
            ``Shard(d)`` before it), or a tensor-parallel one with
            ``distributed="replicated"``.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        use_muon: Callable[[str, Tensor], bool] = default_use_muon,
        distributed: str = "root",
        matrices_per_round: int = 1,
    ):
        if distributed not in _DISTRIBUTED:
            raise ValueError(
                f"Muon: distributed must be one of {_DISTRIBUTED}, got {distributed!r}"
            )
        if isinstance(matrices_per_round, bool) or not (
            isinstance(matrices_per_round, int) and matrices_per_round >= 1
        ):
            raise ValueError(
                f"Muon: matrices_per_round must be an int >= 1, got {matrices_per_round!r}"
            )
        self._use_muon = use_muon
        self._adamw_defaults = dict(
            lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        self.distributed = distributed
        self.matrices_per_round = matrices_per_round
        self.last_step = MuonStepStats()
        self._plans: dict[str, tuple[tuple, StepPlan]] = {}  # shard group -> (key, plan)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)

    # ---- groups ---------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Add a group; one without ``use_muon`` is split by the ``use_muon`` predicate."""
        both = {True: self.defaults, False: self._adamw_defaults}
        group = split_by_flag(self, param_group, "use_muon", self._use_muon, "Muon", both)
        if group is None:  # split by self._use_muon, each part added
            return
        params, muon = group["params"], group["use_muon"]
        _check_hyper(group, muon)
        if muon:
            named = [
                (name_of(p, f"#{i} of group {gi}"), p)
                for gi, g in enumerate([*self.param_groups, group])
                if g["use_muon"]
                for i, p in enumerate(g["params"])
            ]
            for i, p in enumerate(params):
                _check_muon_param(p, f"#{i} of group {len(self.param_groups)}", self.distributed)
            _one_tp_group(named)
        super().add_param_group(group)
        if not muon:  # drop the Muon-only defaults torch filled in
            for k in _MUON_KEYS:
                self.param_groups[-1].pop(k, None)

    # ---- step -----------------------------------------------------------------------------
    def _step_items(self, items: list[Item]) -> None:
        """AdamW on the AdamW groups (``FlatAdamW``), distributed Muon on the Muon groups."""
        for p, _ in items:
            if torch.is_complex(p):
                raise NotImplementedError(
                    f"Muon: parameter {name_of(p, '?')!r} is complex; Muon and this "
                    "AdamW support real parameters only"
                )
        self._step_flat([(p, g) for p, g in items if not g["use_muon"]])
        self.last_step = MuonStepStats()
        muon = [(p, g) for p, g in items if g["use_muon"]]
        if muon:
            self._muon_step(muon)

    def _muon_step(self, items: list[Item]) -> None:
        stats = self.last_step
        # 1. momentum, Nesterov, weight decay: element-wise on local rows
        inputs: list[Tensor] = []  # per item, its local NS input, flat bf16
        for p, h in items:
            state = self.state[p]
            if "momentum_buffer" not in state:
                zeros = torch.zeros_like(local(p), memory_format=torch.preserve_format)
                state["momentum_buffer"] = like_param(zeros, p)
            assert p.grad is not None  # stepped only with a gradient
            buf, grad = local(state["momentum_buffer"]), local(p.grad)
            buf.lerp_(grad, 1 - h["momentum"])
            update = grad.lerp(buf, h["momentum"]) if h["nesterov"] else buf
            inputs.append(update.to(_COMM, copy=True).reshape(-1))
            local(p).mul_(1 - h["lr"] * h["weight_decay"])
        # 2. whole matrices on every rank (plain tensors, Replicate): no communication
        sharded: list[_Sharded] = []
        for (p, h), x in zip(items, inputs):
            cut = _cut_of(p)
            if cut is not None:
                sharded.append(_Sharded(p, h, x, cut))
                continue
            whole = local(p)  # the whole parameter, any strides
            for e, (start, shape) in enumerate(matrix_members(p.shape)):
                t0, c0 = time.perf_counter(), time.thread_time()
                result = self._ns(x[start : start + shape[0] * shape[1]].view(shape), h)
                stats.ns_seconds += time.perf_counter() - t0
                stats.ns_cpu_seconds += time.thread_time() - c0
                stats.ns_flops += ns_flops(*shape, h["ns_steps"])
                member = whole if p.dim() == 2 else whole[e]
                member.add_(result, alpha=-adjust_lr(h["lr"], h["adjust_lr_fn"], *shape))
                stats.matrices += 1
        if sharded:  # planned per shard group: see [Note: Muon under TP and EP]
            groups: dict[str, list[_Sharded]] = {}
            for entry in sharded:
                groups.setdefault(entry.cut.group.group_name, []).append(entry)
            for key, part in groups.items():
                self._distributed_ns(key, part)

    def _ns(self, x: Tensor, h: dict) -> Tensor:
        return zeropower_via_newtonschulz(x, h["ns_coefficients"], h["ns_steps"], h["eps"])

    def _step_plan(self, group: str, sharded: list[_Sharded]) -> StepPlan:
        """The plan of the Muon matrices sharded over one shard-dim process group."""
        piece = sharded[0].cut.piece
        world, me = piece.rs.world_size, piece.coord
        key = (
            tuple(
                (
                    id(e.param),
                    cast(DTensor, e.param).placements,
                    tuple(e.param.shape),
                    e.hyper["ns_steps"],
                )
                for e in sharded
            ),  # fmt: skip
            self.distributed,
            self.matrices_per_round,
        )
        cached = self._plans.get(group)
        if cached is None or cached[0] != key:
            matrices, flops = plan_matrices(
                [(e.cut.piece.shape, e.cut.piece.rs, e.hyper["ns_steps"]) for e in sharded], world
            )
            plan = build_plan(matrices, flops, world, me, self.distributed, self.matrices_per_round)
            self._plans[group] = cached = (key, plan)
        return cached[1]

    def _distributed_ns(self, group: str, sharded: list[_Sharded]) -> None:
        """Steps 2-3 of [Note: distributed Muon] for the RaggedShard parameters of one
        shard group, with the tp stage of [Note: Muon under TP and EP]."""
        _ShardGroupStep(self, self._step_plan(group, sharded), sharded).run()


@dataclass
class _Sharded:
    """A Muon parameter cut by RaggedShard, in one step: its hyperparameters, its NS
    input (this rank's rows, flat bf16) and how it is cut."""

    param: Tensor
    hyper: dict
    ns_input: Tensor
    cut: _Cut


class _ShardGroupStep:
    """One step's distributed Newton-Schulz over one shard group's matrices (``plan``):
    gathers, NS at each matrix's root, scatters back, and the tp stage of [Note: Muon
    under TP and EP] for matrices that tensor parallelism cuts."""

    def __init__(self, muon: Muon, plan: StepPlan, sharded: list[_Sharded]):
        self.muon, self.plan, self.sharded = muon, plan, sharded
        self.stats = muon.last_step
        self.matrices = plan.matrices
        cut = sharded[0].cut
        self.pg, self.me = cut.group, cut.piece.coord  # the shard dim's
        self.local_start = [e.cut.piece_start(self.me) for e in sharded]
        self.device = sharded[0].ns_input.device  # of the NS inputs: the parameters'
        self.tp = next((e.cut for e in sharded if e.cut.tp_axis is not None), None)
        self.tp_load = [0.0] * (self.tp.tp_size if self.tp is not None else 1)

    # ---- a matrix's place -----------------------------------------------------------------
    def tp_cut(self, i: int) -> _Cut | None:
        c = self.sharded[self.matrices[i].item].cut
        return c if c.tp_axis is not None else None

    def whole_shape(self, i: int) -> tuple[int, int]:
        """Matrix ``i``'s shape across tp."""
        shape, c = list(self.matrices[i].shape), self.tp_cut(i)
        if c is not None:
            shape[c.member_dim] *= c.tp_size
        return (shape[0], shape[1])

    def own_input(self, i: int, rank: int) -> Tensor:
        """``rank``'s piece of matrix ``i``'s NS input, from this rank's rows."""
        m = self.matrices[i]
        lo, hi = m.pieces[rank]
        base = self.local_start[m.item]
        return self.sharded[m.item].ns_input[lo - base : hi - base]

    def apply_piece(self, i: int, result: Tensor) -> None:
        """Apply this rank's rows ``result`` of matrix ``i``'s update."""
        m = self.matrices[i]
        e = self.sharded[m.item]
        lo, _ = m.pieces[self.me]
        _apply(local(e.param), lo - self.local_start[m.item], result, e.hyper, self.whole_shape(i))

    def result_piece(self, i: int, rank: int, results: dict[int, Tensor]) -> Tensor:
        lo, hi = self.matrices[i].pieces[rank]
        return results[i][lo - self.matrices[i].start : hi - self.matrices[i].start]

    # ---- compute and communication --------------------------------------------------------
    def ns(self, i: int, matrix: Tensor) -> Tensor:
        """The whole matrix ``i`` -> its NS (bf16)."""
        h, stats = self.sharded[self.matrices[i].item].hyper, self.stats
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self.muon._ns(matrix, h)
        stats.ns_seconds += time.perf_counter() - t0
        stats.ns_cpu_seconds += time.thread_time() - c0
        rows, cols = matrix.shape  # a 2-D matrix
        stats.ns_flops += ns_flops(rows, cols, h["ns_steps"])
        stats.rooted += 1
        return out

    def all_to_all(self, send: Tensor, send_splits, recv_splits, group, async_op) -> tuple:
        recv = torch.empty(sum(recv_splits), dtype=_COMM, device=self.device)
        work = dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=group, async_op=async_op
        )
        self.stats.bytes_sent += send.numel() * send.element_size()
        self.stats.bytes_received += recv.numel() * recv.element_size()
        self.stats.collectives += 1
        return work, recv

    def cat(self, parts: list[Tensor]) -> Tensor:
        return torch.cat(parts) if parts else torch.empty(0, dtype=_COMM, device=self.device)

    def issue(self, ex: Exchange, source) -> tuple:
        """Start exchange ``ex`` over the shard dim, each piece ``source(i, rank)``."""
        send = self.cat([source(i, r) for i, r in ex.send])
        work, recv = self.all_to_all(send, ex.send_splits, ex.recv_splits, self.pg, True)
        return work, recv, send

    def tp_exchange(self, parts: list[list[Tensor]], sizes: list[list[int]]) -> list[list[Tensor]]:
        """One all-to-all over tp: ``parts[r]`` go to tp rank r; ``sizes[r]`` are the
        pieces from r. Returns the received pieces, by rank."""
        assert self.tp is not None  # called only for matrices cut by tp
        send = self.cat([x for row in parts for x in row])
        splits = [sum(s) for s in sizes]
        _, recv = self.all_to_all(
            send, [sum(x.numel() for x in row) for row in parts], splits, self.tp.tp_group, False
        )
        out, at = [], 0
        for row in sizes:
            out.append(list(recv[at : at + sum(row)].split(row)))
            at += sum(row)
        return out

    def solve(self, batch: list[tuple[int, Tensor]]) -> dict[int, Tensor]:
        """``{i: this rank's piece of NS(matrix i)}`` from ``[(i, this rank's piece)]``
        (flat, bf16): NS here for matrices whole on this rank, else the tp stage of
        [Note: Muon under TP and EP]. Every rank of a tp group passes the same ``i``s."""
        matrices = self.matrices
        out = {
            i: self.ns(i, x.view(matrices[i].shape)).reshape(-1)
            for i, x in batch
            if self.tp_cut(i) is None
        }
        cut = [(i, x) for i, x in batch if self.tp_cut(i) is not None]
        if not cut:
            return out
        assert self.tp is not None  # some matrix is cut by tp
        size, t = self.tp.tp_size, self.tp.tp_rank
        roots = {}
        for i, _ in sorted(cut, key=lambda e: (-ns_flops(*self.whole_shape(e[0]), 1), e[0])):
            roots[i] = min(range(size), key=lambda r: (self.tp_load[r], r))
            self.tp_load[roots[i]] += ns_flops(*self.whole_shape(i), 1)
        mine = [(i, x) for i, x in cut if roots[i] == t]
        others = [[] if r == t else [x.numel() for _, x in mine] for r in range(size)]
        got = self.tp_exchange(
            [[] if r == t else [x for i, x in cut if roots[i] == r] for r in range(size)],
            others,
        )
        chunks = []
        for k, (i, x) in enumerate(mine):
            tp_cut = self.tp_cut(i)
            assert tp_cut is not None  # mine holds matrices cut by tp
            dim = tp_cut.member_dim
            pieces = [(x if r == t else got[r][k]).view(matrices[i].shape) for r in range(size)]
            chunks.append(self.ns(i, torch.cat(pieces, dim=dim)).chunk(size, dim=dim))
        back = self.tp_exchange(
            [[] if r == t else [c[r].reshape(-1) for c in chunks] for r in range(size)],
            [[] if r == t else [x.numel() for i, x in cut if roots[i] == r] for r in range(size)],
        )
        for (i, _), c in zip(mine, chunks):
            out[i] = c[t].reshape(-1)
        for r in range(size):
            for (i, _), part in zip([e for e in cut if roots[e[0]] == r], back[r]):
                out[i] = part
        return out

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.stats.wait_seconds += time.perf_counter() - t0

    def gathered(self, i: int, received: dict) -> Tensor:
        """The whole matrix ``i``: this rank's piece and the received ones."""
        m = self.matrices[i]
        full = torch.empty(m.numel, dtype=_COMM, device=self.device)
        for r in range(len(m.pieces)):
            lo, hi = m.pieces[r]
            if hi > lo:
                src = self.own_input(i, self.me) if r == self.me else received[i, r]
                full[lo - m.start : hi - m.start].copy_(src)
        return full

    # ---- the step -------------------------------------------------------------------------
    def _count(self) -> None:
        plan, stats, n = self.plan, self.stats, len(self.matrices)
        stats.matrices += n
        in_rounds = {i for r in plan.rounds for i in r.matrices}
        if self.muon.distributed != "replicated":
            stats.comm_free += sum(i not in in_rounds and self.tp_cut(i) is None for i in range(n))
        before, load = stats.ns_flops_per_rank, plan.load
        stats.ns_flops_per_rank = [
            (before[r] if r < len(before) else 0.0) + (load[r] if r < len(load) else 0.0)
            for r in range(max(len(before), len(load)))
        ]

    def run(self) -> None:
        plan, me, matrices = self.plan, self.me, self.matrices
        self._count()
        # every gather in flight first; communication-free matrices fill the waits
        gathers = [self.issue(rnd.gather, self.own_input) for rnd in plan.rounds]
        # matrices whole on this rank rooted here (those cut by tp: after the rounds)
        free = [i for i in plan.local if self.tp_cut(i) is None]
        free_tp = [i for i in plan.local if self.tp_cut(i) is not None]

        def next_free() -> None:
            i = free.pop()
            whole = self.own_input(i, me).clone().view(matrices[i].shape)
            self.apply_piece(i, self.ns(i, whole).reshape(-1))

        scatters = []
        for rnd, (work, recv, _send) in zip(plan.rounds, gathers):
            while free and not work.is_completed():
                next_free()
            self.wait(work)
            received = _split(recv, rnd.gather.recv, matrices)
            batch = [
                (i, self.gathered(i, received))
                for i in rnd.matrices
                if rnd.scatter is None or plan.roots[i] == me
            ]
            results = self.solve(batch)
            if rnd.scatter is not None:
                source = functools.partial(self.result_piece, results=results)
                scatters.append((rnd, self.issue(rnd.scatter, source)))
            for i in results:
                if matrices[i].held(me):
                    self.apply_piece(i, self.result_piece(i, me, results))
        while free:  # results of this rank's rounds travel back meanwhile
            next_free()
        if free_tp:
            own = [(i, self.own_input(i, me).clone()) for i in free_tp]
            for i, out in self.solve(own).items():
                self.apply_piece(i, out)
        for rnd, (work, recv, _send) in scatters:
            assert rnd.scatter is not None  # scatters holds rounds with one
            self.wait(work)
            for (i, _), part in _split(recv, rnd.scatter.recv, matrices).items():
                self.apply_piece(i, part)


def _split(recv: Tensor, segments: list[tuple[int, int]], matrices) -> dict:
    """The received buffer cut into ``{(matrix, piece rank): piece}`` (in send order)."""
    out, at = {}, 0
    for i, r in segments:
        n = matrices[i].held(r)
        out[i, r] = recv[at : at + n]
        at += n
    return out


def _apply(param: Tensor, offset: int, update: Tensor, h: dict, shape: tuple[int, int]) -> None:
    """``param -= adjusted_lr * update`` on ``update.numel()`` elements of the local
    ``param`` from ``offset``."""
    lr = adjust_lr(h["lr"], h["adjust_lr_fn"], *shape)
    if not param.is_contiguous():  # whole members of a gapped stack: within one member
        member, offset = divmod(offset, param[0].numel())
        param = param[member]
    flat = param.view(-1)
    flat[offset : offset + update.numel()].add_(update, alpha=-lr)


def _check_hyper(group: dict, muon: bool) -> None:
    if not muon:
        check_hyper(
            "Muon (AdamW group)",
            lr=group["lr"],
            eps=group["eps"],
            betas=group["betas"],
            weight_decay=group["weight_decay"],
        )
        return
    check_hyper("Muon", lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"])
    if not group["momentum"] >= 0.0:
        raise ValueError(f"Muon: momentum must be >= 0, got {group['momentum']}")
    if group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
        raise ValueError(
            f"Muon: adjust_lr_fn must be one of {_ADJUST_LR_FNS}, got {group['adjust_lr_fn']!r}"
        )
    if len(tuple(group["ns_coefficients"])) != 3:
        raise ValueError(
            f"Muon: ns_coefficients must be 3 numbers (a, b, c), got {group['ns_coefficients']}"
        )
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"Muon: ns_steps must be an int in [0, 100), got {steps!r}")


@dataclass(frozen=True)
class _Cut:
    """Where ``fully_shard`` (and tensor or expert parallelism before it) cut a Muon
    parameter: see [Note: Muon under TP and EP]."""

    piece: RaggedPiece  # the RaggedShard and the TP-local piece it cuts
    group: dist.ProcessGroup  # the shard dim's
    tp_axis: int | None  # the mesh axis that cuts each matrix (None: every matrix whole)
    member_dim: int  # the dim of each member matrix that axis cuts
    tp_group: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int

    def piece_start(self, rank: int) -> int:
        """First element of shard rank ``rank``'s rows in the flattened TP-local piece."""
        rs, shape = self.piece.rs, self.piece.shape
        return rs.local_row_range(shape, rank)[0] * rs.row_numel(shape)


def _cut_of(p: Tensor) -> _Cut | None:
    """How a Muon parameter is cut (None: whole on every rank)."""
    if not isinstance(p, DTensor) or not any(isinstance(q, RaggedShard) for q in p.placements):
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    piece = ragged_piece(tuple(p.shape), mesh, placements)
    cut: dict[str, Any] = dict(tp_axis=None, member_dim=0, tp_group=None, tp_size=1, tp_rank=0)
    for axis, q in enumerate(placements[: piece.axis]):
        if type(q) is Shard and not (p.dim() == 3 and q.dim == 0):  # Shard(0): whole experts
            cut = dict(
                tp_axis=axis,
                member_dim=q.dim - (p.dim() - 2),
                tp_group=mesh.get_group(axis),
                tp_size=mesh.size(axis),
                tp_rank=mesh.get_local_rank(axis),
            )
    return _Cut(piece, mesh.get_group(piece.axis), **cut)


def _one_tp_group(named: Sequence[tuple[str, Tensor]]) -> None:
    """Raise if the tensor-parallel Muon parameters of one shard group lie on two tp groups."""
    seen: dict[str, tuple[str, dist.ProcessGroup]] = {}
    for name, p in named:
        cut = _cut_of(p)
        if cut is None or cut.tp_group is None:
            continue
        first = seen.setdefault(cut.group.group_name, (name, cut.tp_group))
        if first[1] is not cut.tp_group:
            raise NotImplementedError(
                f"Muon: parameters {first[0]!r} and {name!r} are sharded over the same "
                "data-parallel ranks but cut by tensor parallelism over different process "
                "groups; one Muon optimizer gathers a shard group's matrices across one tp "
                "group: make one Muon per tp mesh"
            )


def _check_muon_param(p: Tensor, fallback: str, distributed: str) -> None:
    name = name_of(p, fallback)
    if p.dim() not in (2, 3):
        raise ValueError(
            f"Muon: parameter {name!r} has shape {tuple(p.shape)}; a Muon parameter must be a "
            "matrix (out, in) or a stack of matrices (E, out, in); put it in a group with "
            "use_muon=False (AdamW), e.g. with muon_param_groups(model)"
        )
    if not isinstance(p, DTensor):
        return
    mesh, placements = p.device_mesh, tuple(p.placements)
    if not any(isinstance(q, RaggedShard) for q in placements):
        for placement in placements:
            if not isinstance(placement, Replicate):
                raise NotImplementedError(
                    f"Muon: parameter {name!r} is sharded as {placement!r} and not by "
                    "fully_shard; Muon needs RaggedShard (raggedfsdp.fully_shard) or "
                    "Replicate: shard the model with raggedfsdp"
                )
        return
    where = f"Muon: parameter {name!r} is placed {placements} on mesh {mesh.mesh_dim_names}"
    try:
        piece = ragged_piece(tuple(p.shape), mesh, placements)
    except (ValueError, NotImplementedError) as err:
        raise NotImplementedError(f"{where}: {err}") from None
    if piece.axis != mesh.ndim - 1:
        raise NotImplementedError(
            f"{where}; Muon needs the RaggedShard on the mesh's last (shard) dim, as "
            "fully_shard places it (under HSDP (Replicate(), RaggedShard))"
        )
    cuts = [q for q in placements if type(q) is Shard]
    if len(cuts) > 1:
        raise NotImplementedError(
            f"{where}: cut by {len(cuts)} Shard axes before fully_shard's; Muon gathers a "
            "matrix across one tensor- or expert-parallel axis: parallelize on one mesh axis"
        )
    cut = _cut_of(p) if cuts else None  # not None with cuts: p is RaggedShard-placed
    if cut is not None and distributed == "replicated" and cut.tp_axis is not None:
        raise NotImplementedError(
            f"{where}: a tensor-parallel matrix, which distributed='replicated' (the "
            "baseline) does not gather across tp; use distributed='root'"
        )
    if cut is not None and cut.tp_axis is not None:
        dim = cast(Shard, placements[cut.tp_axis]).dim
        if p.shape[dim] % cut.tp_size:
            # The tp stage exchanges equal pieces, and each tp rank plans its own piece's
            # rows over the shard dim: uneven pieces would give the tp ranks other plans.
            raise NotImplementedError(
                f"{where}: its dim {dim} of size {p.shape[dim]} is cut unevenly over "
                f"{cut.tp_size} tensor-parallel ranks; Muon gathers a matrix across tp from "
                "equal pieces: pad the layer to a multiple of the tp size, or step it with "
                "the AdamW part (use_muon=False)"
            )
    piece.rs.validate_for(piece.shape, mesh.size(piece.axis))
