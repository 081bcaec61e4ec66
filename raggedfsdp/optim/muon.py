"""Muon for RaggedShard parameters: whole-matrix Newton-Schulz on load-balanced root ranks.

[Note: distributed Muon]
Muon's update of a matrix is Newton-Schulz (NS) orthogonalisation of its momentum,
which needs the *whole* matrix; everything else (momentum, weight decay, the
update itself) is element-wise. So, per step:

1. momentum and the Nesterov mix run on each rank's own rows (element-wise);
2. every matrix (a 2-D parameter, or each member of an ``[E, out, in]`` stack)
   has a root rank, chosen to balance NS FLOPs (``_muon_plan.assign_roots``);
   the ranks holding its rows send them to the root: what
   ``redistribute(mesh, [RaggedShard(dims, units with every block on the root)])``
   does, one all-to-all;
3. NS runs on the root; its result goes back to the holders (the inverse
   redistribute), and each rank applies its rows of the update.

A matrix that one rank holds whole (``muon_block_policy`` arranges this wherever
the planner can do it cheaply) is rooted there and moves no byte. The others
travel in rounds (see [Note: Muon roots] in ``_muon_plan``): one all-to-all per
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
``BufferView.process_group`` is the same shard-dim group. One Muon optimizer
handles the sharded matrices of one mesh (make one per mesh); meshes of more than
2 dims are refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from raggedfsdp.fsdp import buffer_of
from raggedfsdp.optim._flat import Item, check_hyper, like_param, local
from raggedfsdp.optim._muon_plan import (
    Exchange,
    StepPlan,
    build_plan,
    comm_free_matrices,
    matrix_members,
    ns_flops,
    plan_matrices,
    plan_whole_matrices,
)
from raggedfsdp.optim._muon_policy import (
    MuonBlockPolicy,
    default_use_muon,
    muon_block_policy,
    muon_param_groups,
)
from raggedfsdp.optim.adamw import FlatAdamW
from raggedfsdp.placement import RaggedShard

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


def _name_of(p: Tensor, fallback: str) -> str:
    found = buffer_of(p)
    return found[1].fqn if found is not None else fallback


@dataclass
class MuonStepStats:
    """What the last ``Muon.step`` did on this rank.

    Args:
        bytes_sent, bytes_received: bytes this rank sent / received for NS.
        collectives: all-to-alls issued.
        ns_seconds: wall time of this rank's Newton-Schulz.
        ns_cpu_seconds: CPU time of the thread running it (what contention does not inflate).
        wait_seconds: wall time spent waiting for communication.
        ns_flops: NS FLOPs on this rank (planned).
        ns_flops_per_rank: planned NS FLOPs of every rank (the load balance).
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
    replica's shard group: [Note: Muon under HSDP]); plain tensors and
    ``Replicate`` DTensors are whole on every rank and computed there. The AdamW
    groups step as ``FlatAdamW`` does: a buffer whose trainable parameters are all
    in AdamW groups steps whole (see [Note: whole-buffer steps] in ``_flat.py``).

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
        NotImplementedError: a Muon parameter sharded in a way other than
            ``RaggedShard`` on a 1-D mesh or ``(Replicate(), RaggedShard)`` on a 2-D
            (replicate, shard) mesh (HSDP, see [Note: Muon under HSDP]), or sharded
            Muon parameters on different meshes.
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
        self._plan_key: tuple | None = None
        self._plan: StepPlan | None = None
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
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if "use_muon" not in group:
            first = len(self.param_groups)
            split = {True: [], False: []}
            for p in params:
                split[bool(self._use_muon(_name_of(p, ""), p))].append(p)
            for flag in (True, False):
                if split[flag]:
                    self.add_param_group({**group, "params": split[flag], "use_muon": flag})
            if len(self.param_groups) == first:
                raise ValueError("Muon: a parameter group has no parameters")
            return
        group["params"] = params
        muon = bool(group["use_muon"])
        for k, v in (self.defaults if muon else self._adamw_defaults).items():
            group.setdefault(k, v)
        _check_hyper(group, muon)
        if muon:
            named = [
                (_name_of(p, f"#{i} of group {gi}"), p)
                for gi, g in enumerate([*self.param_groups, group])
                if g["use_muon"]
                for i, p in enumerate(g["params"])
            ]
            for i, p in enumerate(params):
                _check_muon_param(p, f"#{i} of group {len(self.param_groups)}")
            _one_mesh(named)
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
                    f"Muon: parameter {_name_of(p, '?')!r} is complex; Muon and this "
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
            buf, grad = local(state["momentum_buffer"]), local(p.grad)
            buf.lerp_(grad, 1 - h["momentum"])
            update = grad.lerp(buf, h["momentum"]) if h["nesterov"] else buf
            inputs.append(update.to(_COMM, copy=True).reshape(-1))
            local(p).mul_(1 - h["lr"] * h["weight_decay"])
        # 2. whole matrices on every rank (plain tensors, Replicate): no communication
        sharded = []
        for (p, h), x in zip(items, inputs):
            if _shard_dim(p) is not None:
                sharded.append((p, h, x))
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
        if sharded:
            self._distributed_ns(sharded)

    def _ns(self, x: Tensor, h: dict) -> Tensor:
        return zeropower_via_newtonschulz(x, h["ns_coefficients"], h["ns_steps"], h["eps"])

    def _step_plan(self, sharded) -> StepPlan:
        mesh = _one_mesh([(_name_of(p, "?"), p) for p, _, _ in sharded])
        dim = _shard_dim(sharded[0][0])  # the shard dim: see [Note: Muon under HSDP]
        world, me = mesh.size(dim), mesh.get_local_rank(dim)
        key = (
            tuple((id(p), p.placements, tuple(p.shape), h["ns_steps"]) for p, h, _ in sharded),
            self.distributed,
            self.matrices_per_round,
        )
        if key != self._plan_key:
            matrices, flops = plan_matrices(
                [(tuple(p.shape), p.placements[dim], h["ns_steps"]) for p, h, _ in sharded], world
            )
            self._plan = build_plan(
                matrices, flops, world, me, self.distributed, self.matrices_per_round
            )
            self._plan_key = key
        return self._plan

    def _distributed_ns(self, sharded) -> None:
        """Steps 2-3 of [Note: distributed Muon] for RaggedShard parameters."""
        stats = self.last_step
        plan = self._step_plan(sharded)
        mesh, dim = sharded[0][0].device_mesh, _shard_dim(sharded[0][0])
        pg, me = mesh.get_group(dim), mesh.get_local_rank(dim)  # the shard dim's
        local_start = [_local_range_start(p, me) for p, _, _ in sharded]
        matrices = plan.matrices
        device = sharded[0][2].device  # of the NS inputs: the parameters'

        def piece(i: int, rank: int, source: Tensor, base: int) -> Tensor:
            lo, hi = matrices[i].pieces[rank]
            return source[lo - base : hi - base]

        def own_input(i: int, rank: int) -> Tensor:
            m = matrices[i]
            return piece(i, rank, sharded[m.item][2], local_start[m.item])

        def apply_piece(i: int, result: Tensor) -> None:  # result: this rank's rows of the update
            m = matrices[i]
            p, h, _ = sharded[m.item]
            lo, _ = m.pieces[me]
            _apply(local(p), lo - local_start[m.item], result, h, m.shape)

        def ns(i: int, full: Tensor) -> Tensor:
            m = matrices[i]
            h = sharded[m.item][1]
            t0, c0 = time.perf_counter(), time.thread_time()
            out = self._ns(full.view(m.shape), h).reshape(-1)  # contiguous, bf16
            stats.ns_seconds += time.perf_counter() - t0
            stats.ns_cpu_seconds += time.thread_time() - c0
            stats.ns_flops += ns_flops(*m.shape, h["ns_steps"])
            stats.rooted += 1
            return out

        def issue(ex: Exchange, source) -> tuple:
            parts = [source(i, r) for i, r in ex.send]
            send = torch.cat(parts) if parts else torch.empty(0, dtype=_COMM, device=device)
            recv = torch.empty(sum(ex.recv_splits), dtype=_COMM, device=device)
            work = dist.all_to_all_single(
                recv, send, ex.recv_splits, ex.send_splits, group=pg, async_op=True
            )
            stats.bytes_sent += send.numel() * send.element_size()
            stats.bytes_received += recv.numel() * recv.element_size()
            stats.collectives += 1
            return work, recv, send

        def wait(work) -> None:
            t0 = time.perf_counter()
            work.wait()
            stats.wait_seconds += time.perf_counter() - t0

        stats.matrices += len(matrices)
        stats.comm_free += len(matrices) - sum(len(r.matrices) for r in plan.rounds)
        if self.distributed == "replicated":
            stats.comm_free = 0
        stats.ns_flops_per_rank = list(plan.load)
        # every gather in flight first; communication-free matrices fill the waits
        gathers = [issue(rnd.gather, own_input) for rnd in plan.rounds]
        free = list(plan.local)  # communication-free matrices rooted here

        def next_free() -> None:
            i = free.pop()
            apply_piece(i, ns(i, own_input(i, me).clone()))

        scatters = []
        for rnd, (work, recv, _send) in zip(plan.rounds, gathers):
            while free and not work.is_completed():
                next_free()
            wait(work)
            received = _split(recv, rnd.gather.recv, matrices)
            results: dict[int, Tensor] = {}
            for i in rnd.matrices:
                if rnd.scatter is not None and plan.roots[i] != me:
                    continue
                m = matrices[i]
                full = torch.empty(m.numel, dtype=_COMM, device=device)  # the whole matrix
                for r in range(len(m.pieces)):
                    lo, hi = m.pieces[r]
                    if hi > lo:
                        src = own_input(i, me) if r == me else received[i, r]
                        full[lo - m.start : hi - m.start].copy_(src)
                results[i] = ns(i, full)
            if rnd.scatter is not None:

                def result_piece(i: int, rank: int, results=results) -> Tensor:
                    lo, hi = matrices[i].pieces[rank]
                    return results[i][lo - matrices[i].start : hi - matrices[i].start]

                scatters.append((rnd, issue(rnd.scatter, result_piece)))
            for i, out in results.items():
                if matrices[i].held(me):
                    lo, hi = matrices[i].pieces[me]
                    apply_piece(i, out[lo - matrices[i].start : hi - matrices[i].start])
        while free:  # results of this rank's rounds travel back meanwhile
            next_free()
        for rnd, (work, recv, _send) in scatters:
            wait(work)
            for (i, _), part in _split(recv, rnd.scatter.recv, matrices).items():
                apply_piece(i, part)


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
    flat = param.view(-1)
    lr = adjust_lr(h["lr"], h["adjust_lr_fn"], *shape)
    flat[offset : offset + update.numel()].add_(update, alpha=-lr)


def _local_range_start(p: DTensor, rank: int) -> int:
    rs = p.placements[_shard_dim(p)]
    return rs.local_row_range(p.shape, rank)[0] * rs.row_numel(p.shape)


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


def _shard_dim(p: Tensor) -> int | None:
    """The mesh dim a Muon parameter's ``RaggedShard`` cuts (None: whole on every rank)."""
    if not isinstance(p, DTensor):
        return None
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, RaggedShard):
            return dim
    return None


def _one_mesh(named: Sequence[tuple[str, Tensor]]):
    """The one mesh of the sharded Muon parameters ``(name, param)`` (None without any);
    raises on two."""
    mesh, first = None, ""
    for name, p in named:
        if _shard_dim(p) is None:
            continue
        if mesh is None:
            mesh, first = p.device_mesh, name
        elif p.device_mesh != mesh:
            raise NotImplementedError(
                f"Muon: parameter {name!r} is sharded on mesh {p.device_mesh}, but "
                f"{first!r} on mesh {mesh}; one Muon optimizer plans the Newton-Schulz roots "
                "over one mesh: make one Muon per mesh (each with the parameters sharded on it)"
            )
    return mesh


def _check_muon_param(p: Tensor, fallback: str) -> None:
    name = _name_of(p, fallback)
    if p.dim() not in (2, 3):
        raise ValueError(
            f"Muon: parameter {name!r} has shape {tuple(p.shape)}; a Muon parameter must be a "
            "matrix (out, in) or a stack of matrices (E, out, in); put it in a group with "
            "use_muon=False (AdamW), e.g. with muon_param_groups(model)"
        )
    if not isinstance(p, DTensor):
        return
    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim > 2:
        raise NotImplementedError(
            f"Muon: parameter {name!r} is a DTensor on a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; distributed Muon supports 1-D meshes (FSDP) and 2-D "
            "(replicate, shard) meshes (HSDP, placements (Replicate(), RaggedShard)): "
            "fully_shard the model on one of those"
        )
    for placement in placements:
        if not isinstance(placement, (RaggedShard, Replicate)):
            if any(isinstance(q, RaggedShard) for q in placements):  # FSDP x TP / EP
                raise NotImplementedError(
                    f"Muon: parameter {name!r} is placed {placements} on mesh "
                    f"{mesh.mesh_dim_names}: tensor- or expert-parallel as well as sharded "
                    "by fully_shard. Newton-Schulz needs the whole matrix, which would be "
                    "gathered across that dim too; not supported yet: put such matrices in "
                    "a use_muon=False (AdamW) group, or parallelize without TP / EP"
                )
            raise NotImplementedError(
                f"Muon: parameter {name!r} is sharded as {placement!r}; Muon needs RaggedShard "
                "(raggedfsdp.fully_shard) or Replicate: shard the model with raggedfsdp"
            )
    dim = _shard_dim(p)
    if dim is None:
        return
    if dim != mesh.ndim - 1:
        raise NotImplementedError(
            f"Muon: parameter {name!r} is placed {placements} on a {mesh.ndim}-D mesh; "
            "under HSDP Muon needs (Replicate(), RaggedShard): the RaggedShard on the "
            "mesh's last (shard) dim, as fully_shard places it"
        )
    placements[dim].validate_for(tuple(p.shape), mesh.size(dim))
