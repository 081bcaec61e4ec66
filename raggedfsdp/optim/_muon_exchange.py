"""Distributed Muon's exchange: one step's Newton-Schulz over one shard group's matrices.

``ShardGroupStep`` runs a ``muon_plan.StepPlan``, steps 2-3 of [Note: distributed Muon]
in ``muon.py``: the gathers of every round issued up front, each matrix's NS on its root
(communication-free matrices filling the waits), the results scattered back and applied
to each rank's rows; and, for matrices that tensor parallelism cuts, the tp stage below.
``MuonStepStats`` counts what it did.

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
..., RaggedShard)`` (see [Note: FSDP x TP] in ``fsdp/_tp.py``): the RaggedShard cuts the
rows of the *TP-local* tensor. The plan of [Note: distributed Muon] runs unchanged over
the shard dim on the TP-local matrices: every rank of one tp group has the same dp
coordinate, the same TP-local shapes and the same plan, so the ranks of a tp group are
dp-roots of the same matrices in the same round, each for its own TP piece. Then a
second stage crosses tp: each such matrix gets a tp root (the same greedy balance over
the tp ranks, largest first), one all-to-all over tp brings it the other TP pieces, it
runs NS on the whole matrix (the pieces concatenated along the cut dim) and a second
all-to-all returns each tp rank its piece of the result. So every matrix has one root on
the whole ``tp x shard`` grid, and the learning-rate adjustment uses the whole matrix's
shape. The tp stage of a round runs synchronously (the shard-dim gathers of later rounds
are already in flight). A stacked ``[E, out, in]`` parameter sharded ``Shard(0)`` over
``ep`` (FSDP x EP) holds whole members: no tp stage. ``Replicate()`` on a tp axis means
every tp rank computes its own copy, as replicas do. Parameters are planned per
shard-dim process group (``fully_shard(experts, mesh=dp_mod_ep)`` beside
``fully_shard(block, mesh=dp)`` gives two): each group's matrices are planned and
exchanged among its own ranks, one group after another in the order the parameters come.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from raggedfsdp.optim._muon_cuts import MuonCut
from raggedfsdp.optim._muon_math import NS_DTYPE, adjust_lr, newton_schulz
from raggedfsdp.optim.flat import local
from raggedfsdp.optim.muon_plan import Exchange, Matrix, StepPlan, ns_flops

__all__ = ["MuonStepStats", "ShardGroupStep", "ShardedParam", "timed_ns"]


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


def timed_ns(stats: MuonStepStats, matrix: Tensor, hyper: dict) -> Tensor:
    """``newton_schulz(matrix, hyper)``, its time and FLOPs counted in ``stats``."""
    t0, c0 = time.perf_counter(), time.thread_time()
    out = newton_schulz(matrix, hyper)
    stats.ns_seconds += time.perf_counter() - t0
    stats.ns_cpu_seconds += time.thread_time() - c0
    rows, cols = matrix.shape  # a 2-D matrix
    stats.ns_flops += ns_flops(rows, cols, hyper["ns_steps"])
    return out


@dataclass
class ShardedParam:
    """A Muon parameter cut by RaggedShard, in one step: its hyperparameters, its NS
    input (this rank's rows, flat bf16) and how it is cut."""

    param: Tensor
    hyper: dict
    ns_input: Tensor
    cut: MuonCut


class ShardGroupStep:
    """One step's distributed Newton-Schulz over one shard group's matrices (``plan``):
    gathers, NS at each matrix's root, scatters back, and the tp stage of [Note: Muon
    under TP and EP] for matrices that tensor parallelism cuts."""

    def __init__(
        self, plan: StepPlan, sharded: list[ShardedParam], stats: MuonStepStats, distributed: str
    ):
        self.plan, self.sharded, self.stats = plan, sharded, stats
        self.distributed = distributed  # Muon's: "root" or "replicated"
        self.matrices = plan.matrices
        cut = sharded[0].cut
        self.pg, self.me = cut.group, cut.piece.coord  # the shard dim's
        self.local_start = [e.cut.piece_start(self.me) for e in sharded]
        self.device = sharded[0].ns_input.device  # of the NS inputs: the parameters'
        self.tp = next((e.cut for e in sharded if e.cut.tp_axis is not None), None)
        self.tp_load = [0.0] * (self.tp.tp_size if self.tp is not None else 1)

    # ---- a matrix's place -----------------------------------------------------------------
    def tp_cut(self, i: int) -> MuonCut | None:
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
        out = timed_ns(self.stats, matrix, self.sharded[self.matrices[i].item].hyper)
        self.stats.rooted += 1
        return out

    def all_to_all(self, send: Tensor, send_splits, recv_splits, group, async_op) -> tuple:
        recv = torch.empty(sum(recv_splits), dtype=NS_DTYPE, device=self.device)
        work = dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=group, async_op=async_op
        )
        self.stats.bytes_sent += send.numel() * send.element_size()
        self.stats.bytes_received += recv.numel() * recv.element_size()
        self.stats.collectives += 1
        return work, recv

    def cat(self, parts: list[Tensor]) -> Tensor:
        return torch.cat(parts) if parts else torch.empty(0, dtype=NS_DTYPE, device=self.device)

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
        full = torch.empty(m.numel, dtype=NS_DTYPE, device=self.device)
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
        if self.distributed != "replicated":
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


def _split(recv: Tensor, segments: list[tuple[int, int]], matrices: list[Matrix]) -> dict:
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
