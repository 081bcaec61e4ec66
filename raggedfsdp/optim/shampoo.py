"""Blocked Shampoo for RaggedShard parameters: each block preconditioned on one owner rank.

[Note: Shampoo blocks on ranks]
Blocked Shampoo (Gupta et al. 2018; Anil et al. 2020; Shi et al. 2023) cuts each
matrix ``(rows, cols)`` (each member of an ``[E, rows, cols]`` stack) into blocks of at
most ``block_size`` x ``block_size``: here the rows as ``torch.split(row_block)`` and
the columns as ``torch.split(block_size)`` (the last block of a dim shorter; ``row_block
<= block_size``, default square 1024 x 1024), a partition of the shape and the settings
only, never of the world size. It keeps per block ``G_b`` (``m x n``) its own statistics
and inverse roots. Step ``t`` of one block, ``beta2`` the statistics' decay, ``eps`` the
ridge, ``f`` the precondition frequency, ``t0`` the start step::

    L  <- beta2 L + (1 - beta2) G G^T        (L <- L + G G^T when beta2 = 1)
    R  <- beta2 R + (1 - beta2) G^T G
    every f steps from t0:  L^ = (L / c + eps I)^(-1/4),  R^ likewise,
                            c = 1 - beta2^t (1 when beta2 = 1); in ``root_dtype``;
                            eigenvalues below eps (rounding) count as eps
    P  = L^ G R^                             (t >= t0; the graft direction before)

Adam grafting (the default) gives P the norm of Adam's update ``A = G / (sqrt(v / (1 -
b^t)) + e)``, ``v <- b v + (1 - b) G*G`` element-wise: ``P ||A_b|| / ||P_b||`` per block
(``grafting="block"``) or per matrix (``"parameter"``). Then, with ``D`` the grafted
direction of the whole parameter: ``m <- mu m + D``; ``x <- (1 - lr wd) x - lr (D + mu m)``
(Nesterov) or ``- lr m``. Where these conventions differ from Meta's DistributedShampoo
(weight decay, the root schedule, the eigenvalue floor, 3-D tensors): ``docs/shampoo.md``.

Every block's statistics, roots, graft moment and direction need that block alone; the
rest (momentum, weight decay, the update) is element-wise. So each block has one *owner*
rank that keeps its state (statistics, roots, the graft's second moment) and computes its
direction ``D_b``; see [Note: Shampoo block owners] in ``_shampoo_owners.py`` for how
owners are chosen and what travels. Two modes follow from the layout, per shard group:

- *communication-free*: every block lies whole on one rank (``shampoo_block_policy``:
  RaggedShard blocks of ``row_block`` whole rows), which owns it; the step issues no
  collective. It pads the FSDP buffers wherever a row block exceeds a rank's share.
- *owner*: any other layout (the planner's fine default blocks: FSDP padding as for
  AdamW). Each block's gradient rows go to its owner in one all-to-all, the owner
  computes ``D_b``, and a second all-to-all brings each holder its rows of ``D_b``.

The optimizer picks the mode itself (``Shampoo.modes()``). Either way a rank runs the
reference's per-block ops on the same block values, so the numbers are those of one
device at every world size and in both modes (bit for bit given the same gradients). A
parameter's state is one 1-D ``RaggedShard`` DTensor per kind: its blocks' matrices
(``L``, ``R``, the roots; ``m x n`` values for the graft moment) concatenated in the
global block order (member, row block, column block), each rank holding the run of its
owned blocks; the global shape does not depend on the world size or the mode, so
checkpoints reshard across both. ``grafting="parameter"`` needs a matrix's norm, so it
needs each matrix whole on one rank (``shampoo_block_policy(whole_matrices=True)``).

Under HSDP every replica holds the same shard gradients and steps the same blocks (no
byte crosses the replicate dim); a stack of experts cut evenly by ``Shard(0)`` over ep
holds whole members. A tensor-parallel cut of a matrix would cut its blocks: refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from raggedfsdp.optim._muon_policy import default_use_muon
from raggedfsdp.optim._shampoo_layout import (
    DEFAULT_BLOCK_SIZE,
    ShampooBlockPolicy,
    ShampooCut,
    ShampooLayoutChoice,
    blocks_of,
    member_view,
    resolve_row_block,
    root_cost,
    rows_view,
    shampoo_auto_policy,
    shampoo_block_policy,
    shampoo_cut,
)
from raggedfsdp.optim._shampoo_owners import (
    COMMUNICATION_FREE,
    OWNER,
    BlockPlace,
    OwnerPlan,
    ParamRows,
    load_bound,
    plan_owners,
)
from raggedfsdp.optim.adamw import FlatAdamW
from raggedfsdp.optim.flat import Item, check_hyper, like_param, local, name_of, split_by_flag
from raggedfsdp.optim.muon_plan import Exchange

__all__ = [
    "COMMUNICATION_FREE",
    "OWNER",
    "OwnerPlan",
    "ParamRows",
    "Shampoo",
    "ShampooBlockPolicy",
    "ShampooLayoutChoice",
    "ShampooStepStats",
    "blocks_of",
    "inverse_root",
    "load_bound",
    "plan_owners",
    "root_cost",
    "shampoo_auto_policy",
    "shampoo_block_policy",
]

_GRAFTING = ("block", "parameter", None)
_SHAMPOO_KEYS = (
    "momentum",
    "nesterov",
    "beta2",
    "epsilon",
    "precondition_frequency",
    "start_preconditioning_step",
    "graft_beta2",
    "graft_eps",
)
_STATS = ("left", "right", "left_root", "right_root")


def inverse_root(stat: Tensor, correction: float, epsilon: float, dtype: torch.dtype) -> Tensor:
    """``(stat / correction + epsilon I)^(-1/4)`` of a symmetric ``stat`` (``n x n``), by
    ``torch.linalg.eigh`` in ``dtype``; eigenvalues below ``epsilon`` (rounding) count as
    ``epsilon``. Returns the root in ``dtype``."""
    a = stat.to(dtype, copy=True)
    if correction != 1.0:
        a.div_(correction)
    a.diagonal().add_(epsilon)
    lam, q = torch.linalg.eigh(a)
    return (q * lam.clamp_min(epsilon).pow(-0.25)) @ q.T


def _work_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


@dataclass
class ShampooStepStats:
    """What the last ``Shampoo.step`` did on this rank.

    Args:
        modes: per shard group (its process group's name; ``""`` for parameters whole on
            every rank), ``"communication-free"`` or ``"owner"``.
        bytes_sent, bytes_received: bytes this rank sent / received (both all-to-alls).
        collectives: all-to-alls issued.
        blocks: Shampoo blocks this rank preconditioned.
        root_cost: their root cost (``m^3 + n^3`` summed), whether or not roots were due.
    """

    modes: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    blocks: int = 0
    root_cost: int = 0


@dataclass(frozen=True)
class _Owned:
    """A parameter's blocks this rank owns, and where each one's state lies in the flat
    (1-D) states: ``(index in the parameter's blocks, place, left offset, right offset,
    graft offset)``."""

    blocks: tuple[tuple[int, BlockPlace, int, int, int], ...]
    units: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # left, right, graft
    sizes: tuple[int, int, int]  # this rank's left, right, graft elements


@dataclass
class _GroupPlan:
    """The owners of one shard group's blocks (identical on every rank) and this rank's
    view of them."""

    params: list[Tensor]
    index: dict[int, int]  # id(param) -> its index in the plan
    plan: OwnerPlan
    me: int
    owned: list[_Owned]
    exchanges: dict[tuple[int, ...], tuple[Exchange, Exchange]] = field(default_factory=dict)


@dataclass
class _Work:
    """One Shampoo parameter in one step."""

    param: Tensor
    hyper: dict
    k: int  # index in the group plan
    cut: ShampooCut
    state: dict
    t: float
    g: Tensor  # this rank's rows of the gradient, in the work dtype
    direction: Tensor  # this rank's rows of D (filled block by block)
    graft: Tensor | None  # this rank's rows of Adam's direction (grafting="parameter" only)
    precondition: bool
    roots_due: bool


class Shampoo(FlatAdamW):
    """Blocked Shampoo with Adam grafting for matrices, AdamW for the rest; RaggedShard-aware.

    See [Note: Shampoo blocks on ranks]. Parameter groups carry ``use_shampoo``:
    ``True`` groups get Shampoo (``lr, momentum, nesterov, beta2, epsilon, weight_decay,
    precondition_frequency, start_preconditioning_step, graft_beta2, graft_eps``),
    ``False`` groups AdamW (``lr, betas, eps, weight_decay``; defaults from the ``adamw_*``
    arguments), stepped as ``FlatAdamW`` (whole buffers where it can). A group without
    ``use_shampoo`` is split by ``use_shampoo(fqn, param)``. Parameters sharded by
    ``fully_shard`` with any block policy work: under ``shampoo_block_policy(block_size,
    row_block=row_block)`` each rank preconditions its own whole blocks without
    communication, otherwise blocks go to owner ranks ([Note: Shampoo block owners]).

    Args:
        params: parameters or parameter groups.
        lr: learning rate. Default 1e-3.
        momentum: momentum of the grafted direction (0: none). Default 0.9.
        nesterov: Nesterov momentum. Default True.
        beta2: decay of the block statistics (1: their sum, as AdaGrad). Default 0.999.
        epsilon: ridge added to each statistic before its root. Default 1e-12.
        weight_decay: decoupled weight decay. Default 0.0.
        block_size: largest block side (the column blocks' width). Default 1024.
        row_block: rows per block, ``1 <= row_block <= block_size``. Default None:
            ``block_size`` (square blocks).
        precondition_frequency: steps between root recomputations. Default 20.
        start_preconditioning_step: first step that preconditions (and computes the
            roots); before it the grafted direction alone. Default: ``precondition_frequency``.
        root_dtype: dtype of the root computations (``torch.float32`` or ``float64``).
            Default ``torch.float32``.
        grafting: ``"block"`` (Adam's norm per block), ``"parameter"`` (per matrix; needs
            whole matrices on a rank) or None (no grafting: the gradient before the
            start step). Default ``"block"``.
        graft_beta2: Adam grafting's second-moment decay. Default 0.999.
        graft_eps: Adam grafting's epsilon. Default 1e-8.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW groups'
            defaults. Default 1e-3, (0.9, 0.999), 1e-8, 0.01.
        use_shampoo: ``(fqn, param) -> bool`` for groups without ``use_shampoo``.
            Default ``default_use_muon`` (hidden matrices and expert stacks).

    Raises:
        ValueError: a hyperparameter out of range, or a Shampoo parameter that is not a
            matrix or a stack of matrices (naming it).
        NotImplementedError: a Shampoo parameter that tensor parallelism cuts, or, with
            ``grafting="parameter"``, one whose matrices lie across ranks.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.9,
        nesterov: bool = True,
        beta2: float = 0.999,
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        row_block: int | None = None,
        precondition_frequency: int = 20,
        start_preconditioning_step: int | None = None,
        root_dtype: torch.dtype = torch.float32,
        grafting: str | None = "block",
        graft_beta2: float = 0.999,
        graft_eps: float = 1e-8,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        use_shampoo: Callable[[str, Tensor], bool] = default_use_muon,
    ):
        row_block = resolve_row_block("Shampoo", block_size, row_block)
        if root_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"Shampoo: root_dtype must be torch.float32 or torch.float64, got {root_dtype!r}"
            )
        if grafting not in _GRAFTING:
            raise ValueError(f"Shampoo: grafting must be one of {_GRAFTING}, got {grafting!r}")
        self.block_size = block_size
        self.row_block = row_block
        self.root_dtype = root_dtype
        self.grafting = grafting
        self._use_shampoo = use_shampoo
        self._adamw_defaults = dict(
            lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        self._cuts: dict[Tensor, ShampooCut] = {}
        self._plans: dict[str, _GroupPlan] = {}
        self.last_step = ShampooStepStats()
        if start_preconditioning_step is None:
            start_preconditioning_step = precondition_frequency
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            beta2=beta2,
            epsilon=epsilon,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            graft_beta2=graft_beta2,
            graft_eps=graft_eps,
        )
        super().__init__(params, defaults)

    # ---- groups ---------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Add a group; one without ``use_shampoo`` is split by the ``use_shampoo`` predicate."""
        both = {True: self.defaults, False: self._adamw_defaults}
        group = split_by_flag(self, param_group, "use_shampoo", self._use_shampoo, "Shampoo", both)
        if group is None:  # split by self._use_shampoo, each part added
            return
        params, shampoo = group["params"], group["use_shampoo"]
        _check_hyper(group, shampoo)
        cuts = {}
        if shampoo:
            if self._plans:
                raise NotImplementedError(
                    "Shampoo: add_param_group after the first step (or modes()) would move "
                    "the blocks' owners and their state; add every Shampoo group before"
                )
            gi = len(self.param_groups)
            for i, p in enumerate(params):
                name = name_of(p, f"#{i} of group {gi}")
                cuts[p] = cut = shampoo_cut(p, name)
                if self.grafting == "parameter":
                    _check_whole_matrices(cut, name, self.block_size, self.row_block)
        super().add_param_group(group)
        self._cuts.update(cuts)
        if not shampoo:  # drop the Shampoo-only defaults torch filled in
            for k in _SHAMPOO_KEYS:
                self.param_groups[-1].pop(k, None)

    # ---- plans ----------------------------------------------------------------------------
    def _group_plan(self, key: str) -> _GroupPlan:
        """The owners of shard group ``key``'s blocks, planned once over every Shampoo
        parameter of the optimizer in it (see [Note: Shampoo block owners])."""
        gp = self._plans.get(key)
        if gp is not None:
            return gp
        params = [
            p
            for g in self.param_groups
            if g["use_shampoo"]
            for p in g["params"]
            if self._cuts[p].key == key
        ]
        cuts = [self._cuts[p] for p in params]
        world, me = cuts[0].world_size, cuts[0].coord
        plan = plan_owners(
            [ParamRows(c.members, c.rows, c.cols, c.segments) for c in cuts],
            world,
            self.block_size,
            self.row_block,
        )
        owned = []
        for k in range(len(params)):
            blocks, lo, ro, vo = [], 0, 0, 0
            for i in plan.owned(k, me):
                place = plan.params[k][i]
                blocks.append((i, place, lo, ro, vo))
                m, n = place.shape
                lo, ro, vo = lo + m * m, ro + n * n, vo + m * n
            owned.append(_Owned(tuple(blocks), plan.units(k), (lo, ro, vo)))
        gp = _GroupPlan(params, {id(p): k for k, p in enumerate(params)}, plan, me, owned)
        self._plans[key] = gp
        return gp

    def modes(self) -> dict[str, str]:
        """``{shard group: "communication-free" or "owner"}``, planning every group (a pure
        computation, identical on every rank; ``""`` names parameters whole on every rank)."""
        keys = dict.fromkeys(self._cuts[p].key for p in self._cuts)
        return {key: self._group_plan(key).plan.mode for key in keys}

    def plan_of(self, key: str) -> OwnerPlan:
        """The owner plan of shard group ``key`` (see ``modes``)."""
        return self._group_plan(key).plan

    # ---- step -----------------------------------------------------------------------------
    def _step_items(self, items: list[Item]) -> None:
        """AdamW on the AdamW groups (``FlatAdamW``), Shampoo on the Shampoo parameters,
        one shard group at a time."""
        for p, _ in items:
            if torch.is_complex(p):
                raise NotImplementedError(
                    f"Shampoo: parameter {name_of(p, '?')!r} is complex; Shampoo and this "
                    "AdamW support real parameters only"
                )
        self._step_flat([(p, g) for p, g in items if not g["use_shampoo"]])
        self.last_step = ShampooStepStats()
        by_group: dict[str, list[Item]] = {}
        for p, h in items:
            if h["use_shampoo"]:
                by_group.setdefault(self._cuts[p].key, []).append((p, h))
        for key, part in by_group.items():
            self._group_step(self._group_plan(key), part)

    def _shampoo_state(self, p: Tensor, cut: ShampooCut, owned: _Owned) -> dict:
        state = self.state[p]
        if state:
            return state
        dtype, x = _work_dtype(p), local(p)
        state["step"] = torch.tensor(0.0, device="cpu")  # as torch.optim: a CPU count
        state["momentum_buffer"] = like_param(torch.zeros(x.shape, dtype=dtype, device=x.device), p)
        (left_units, right_units, graft_units), (nl, nr, nv) = owned.units, owned.sizes
        if self.grafting is not None:
            zeros = torch.zeros(nv, dtype=dtype, device=x.device)  # 1D, owned blocks' m x n
            state["graft_exp_avg_sq"] = cut.state(zeros, graft_units)
        for key in _STATS:
            left = key.startswith("left")
            flat = torch.zeros(nl if left else nr, dtype=dtype, device=x.device)  # 1D
            state[key] = cut.state(flat, left_units if left else right_units)
        return state

    def _group_step(self, gp: _GroupPlan, items: list[Item]) -> None:
        """One step of one shard group's Shampoo parameters: see [Note: Shampoo block
        owners] for the two all-to-alls of the owner mode."""
        plan = gp.plan
        self.last_step.modes[self._cuts[items[0][0]].key] = plan.mode
        work = []
        for p, h in sorted(items, key=lambda e: gp.index[id(e[0])]):
            cut = self._cuts[p]
            k = gp.index[id(p)]
            state = self._shampoo_state(p, cut, gp.owned[k])
            state["step"] += 1
            t = state["step"].item()  # a CPU tensor: no device sync
            assert p.grad is not None  # only parameters with a gradient step
            g = local(p.grad).to(_work_dtype(p))  # this rank's rows
            start, freq = h["start_preconditioning_step"], h["precondition_frequency"]
            precondition = t >= start
            parameter = precondition and self.grafting == "parameter"
            work.append(
                _Work(
                    p,
                    h,
                    k,
                    cut,
                    state,
                    t,
                    g,
                    direction=torch.empty_like(g),
                    graft=torch.empty_like(g) if parameter else None,
                    precondition=precondition,
                    roots_due=precondition and (t - start) % freq == 0,
                )
            )
        if plan.mode == COMMUNICATION_FREE:
            for w in work:
                for _, place, *offsets in gp.owned[w.k].blocks:
                    _, a, b = place.pieces[0]
                    gb = self._rows(w, place, w.g, a, b).clone(
                        memory_format=torch.contiguous_format
                    )
                    self._block(w, place, offsets, gb)
        else:
            _OwnerStep(self, gp, work).run()
        for w in work:
            self._finish(w)

    @staticmethod
    def _rows(w: _Work, place: BlockPlace, t: Tensor, a: int, b: int) -> Tensor:
        """Rows ``[a, b)`` of block ``place`` in this rank's local ``t`` (a view)."""
        _, _, _, c0, c1 = place.block
        return rows_view(t, w.cut, a, b, c0, c1)

    def _block(self, w: _Work, place: BlockPlace, offsets, gb: Tensor) -> Tensor:
        """Block ``place`` of parameter ``w`` on its owner: statistics, roots when due, the
        grafted direction ``D_b`` (``m x n``, returned), written into this rank's rows."""
        h, state, t = w.hyper, w.state, w.t
        (m, n), (lo, ro, vo) = place.shape, offsets
        dtype = gb.dtype
        if self.grafting is not None:
            b = h["graft_beta2"]
            v = local(state["graft_exp_avg_sq"])[vo : vo + m * n].view(m, n)
            v.mul_(b).addcmul_(gb, gb, value=1 - b)
            graft = gb / ((v / (1 - b**t)).sqrt() + h["graft_eps"])
        else:
            graft = gb
        beta2, eps = h["beta2"], h["epsilon"]
        w2 = 1.0 if beta2 == 1.0 else 1.0 - beta2
        L = local(state["left"])[lo : lo + m * m].view(m, m)
        R = local(state["right"])[ro : ro + n * n].view(n, n)
        L.addmm_(gb, gb.T, beta=beta2, alpha=w2)
        R.addmm_(gb.T, gb, beta=beta2, alpha=w2)
        if not w.precondition:
            d = graft
        else:
            Lr = local(state["left_root"])[lo : lo + m * m].view(m, m)
            Rr = local(state["right_root"])[ro : ro + n * n].view(n, n)
            if w.roots_due:
                correction = 1.0 if beta2 == 1.0 else 1.0 - beta2**t
                Lr.copy_(inverse_root(L, correction, eps, self.root_dtype))
                Rr.copy_(inverse_root(R, correction, eps, self.root_dtype))
            d = (Lr @ gb) @ Rr
            if self.grafting == "block":
                d.mul_(graft.norm() / d.norm().clamp_min(torch.finfo(dtype).tiny))
        base = place.block[0] * w.cut.rows + place.block[1]  # the block's first row
        for r, a, b in place.pieces:
            if r == w.cut.coord:
                self._rows(w, place, w.direction, a, b).copy_(d[a - base : b - base])
                if w.graft is not None:  # grafting="parameter": whole on this rank
                    self._rows(w, place, w.graft, a, b).copy_(graft[a - base : b - base])
        self.last_step.blocks += 1
        self.last_step.root_cost += root_cost(place.block)
        return d

    def _finish(self, w: _Work) -> None:
        """Per-matrix grafting (``"parameter"``), momentum, weight decay and the update,
        element-wise over this rank's rows."""
        update, h, x = w.direction, w.hyper, local(w.param)
        if w.graft is not None:
            tiny = torch.finfo(update.dtype).tiny
            first = w.cut.first_row  # this rank holds whole matrices (checked)
            held = w.g.numel() // w.cut.cols
            for e in range(first // w.cut.rows, (first + held) // w.cut.rows):
                want = member_view(w.graft, w.cut, e).clone(memory_format=torch.contiguous_format)
                have = member_view(update, w.cut, e)
                norm = have.clone(memory_format=torch.contiguous_format).norm()
                have.mul_(want.norm() / norm.clamp_min(tiny))
        mu = h["momentum"]
        if mu:
            m = local(w.state["momentum_buffer"])
            m.mul_(mu).add_(update)
            update = update.add(m, alpha=mu) if h["nesterov"] else m
        x.mul_(1 - h["lr"] * h["weight_decay"])
        x.add_(update, alpha=-h["lr"])

    def load_state_dict(self, state_dict) -> None:
        """Load; Shampoo states stay in this optimizer's dtype (torch casts them to the
        parameter's)."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if p in self._cuts:
                dtype = _work_dtype(p)
                for k, v in state.items():
                    if k != "step" and v.dtype != dtype:
                        state[k] = v.to(dtype)


class _OwnerStep:
    """The owner mode of one shard group in one step (see [Note: Shampoo block owners]):
    the gather of each block's rows on its owner (asynchronous; the blocks this rank
    holds whole are computed meanwhile), the blocks, the scatter of their directions."""

    def __init__(self, opt: Shampoo, gp: _GroupPlan, work: list[_Work]):
        self.opt, self.gp, self.work = opt, gp, work
        self.plan, self.me, self.stats = gp.plan, gp.me, opt.last_step
        ks = tuple(w.k for w in work)
        if ks not in gp.exchanges:
            gp.exchanges[ks] = gp.plan.exchanges(gp.me, ks)
        self.gather, self.scatter = gp.exchanges[ks]
        # block ids as the exchanges number them: the blocks of ``work``'s parameters
        self.blocks = [(w, i) for w in work for i in range(len(gp.plan.params[w.k]))]
        self.first_id: dict[int, int] = {}  # parameter -> its first block's id
        for gid, (w, _) in enumerate(self.blocks):
            self.first_id.setdefault(w.k, gid)
        dtypes = {w.g.dtype for w in work}
        self.comm = dtypes.pop() if len(dtypes) == 1 else torch.float64  # exact either way
        self.device = work[0].g.device
        self.group = work[0].cut.group

    def piece(self, gid: int, rank: int) -> tuple[_Work, BlockPlace, int, int]:
        """Block ``gid``: its parameter, its place, and the rows ``[a, b)`` ``rank`` holds."""
        w, i = self.blocks[gid]
        place = self.plan.params[w.k][i]
        _, a, b = next(p for p in place.pieces if p[0] == rank)
        return w, place, a, b

    def exchange(self, ex: Exchange, parts: list[Tensor]) -> tuple:
        send = (
            torch.cat([x.reshape(-1).to(self.comm) for x in parts])
            if parts
            else torch.empty(0, dtype=self.comm, device=self.device)
        )
        recv = torch.empty(sum(ex.recv_splits), dtype=self.comm, device=self.device)
        handle = dist.all_to_all_single(
            recv, send, ex.recv_splits, ex.send_splits, group=self.group, async_op=True
        )
        self.stats.bytes_sent += send.numel() * send.element_size()
        self.stats.bytes_received += recv.numel() * recv.element_size()
        self.stats.collectives += 1
        return handle, recv

    def split(self, segments: list[tuple[int, int]], recv: Tensor) -> dict:
        """The received buffer cut into ``{(block id, piece rank): rows (b - a, n)}``."""
        out, at = {}, 0
        for gid, r in segments:
            _, place, a, b = self.piece(gid, r)
            n = (b - a) * place.shape[1]
            out[gid, r] = recv[at : at + n].view(b - a, place.shape[1])
            at += n
        return out

    def run(self) -> None:
        opt, me = self.opt, self.me
        parts = []
        for gid, _ in self.gather.send:
            w, place, a, b = self.piece(gid, me)
            parts.append(opt._rows(w, place, w.g, a, b))
        handle, recv = self.exchange(self.gather, parts)
        owned = [
            (w, i, place, offsets)
            for w in self.work
            for i, place, *offsets in self.gp.owned[w.k].blocks
        ]
        results: dict[int, Tensor] = {}
        received: dict = {}

        def compute(w: _Work, i: int, place: BlockPlace, offsets) -> None:
            gid = self.first_id[w.k] + i
            base = place.block[0] * w.cut.rows + place.block[1]
            gb = torch.empty(place.shape, dtype=w.g.dtype, device=self.device)
            for r, a, b in place.pieces:
                src = opt._rows(w, place, w.g, a, b) if r == me else received[gid, r]
                gb[a - base : b - base].copy_(src)
            results[gid] = opt._block(w, place, offsets, gb)

        here = [e for e in owned if all(r == me for r, _, _ in e[2].pieces)]
        for e in here:  # while the gather is in flight
            compute(*e)
        handle.wait()
        received = self.split(self.gather.recv, recv)
        for e in owned:
            if any(r != me for r, _, _ in e[2].pieces):
                compute(*e)
        parts = []
        for gid, r in self.scatter.send:
            w, place, a, b = self.piece(gid, r)
            base = place.block[0] * w.cut.rows + place.block[1]
            parts.append(results[gid][a - base : b - base])
        handle, recv = self.exchange(self.scatter, parts)
        handle.wait()
        for (gid, _), rows in self.split(self.scatter.recv, recv).items():
            w, place, a, b = self.piece(gid, me)
            opt._rows(w, place, w.direction, a, b).copy_(rows)


def _check_whole_matrices(cut: ShampooCut, name: str, size: int, row_block: int) -> None:
    """Raise if a matrix of ``cut`` lies across ranks (``grafting="parameter"``)."""
    for r, g0, g1 in cut.segments:
        if g0 % cut.rows or g1 % cut.rows:
            raise NotImplementedError(
                f"Shampoo: parameter {name!r} is placed {cut.placements}: shard rank {r} holds "
                f"rows [{g0}, {g1}) of its {cut.members} x {cut.rows} rows, which cut a matrix; "
                "grafting='parameter' needs every matrix whole on one rank: shard with "
                f"block_policy=shampoo_block_policy({size}, row_block={row_block}, "
                "whole_matrices=True)"
            )


def _check_hyper(group: dict, shampoo: bool) -> None:
    if not shampoo:
        check_hyper(
            "Shampoo (AdamW group)",
            lr=group["lr"],
            eps=group["eps"],
            betas=group["betas"],
            weight_decay=group["weight_decay"],
        )
        return
    check_hyper("Shampoo", lr=group["lr"], eps=group["epsilon"], weight_decay=group["weight_decay"])
    for key in ("momentum", "graft_beta2"):
        if not 0.0 <= group[key] < 1.0:
            raise ValueError(f"Shampoo: {key} must be in [0, 1), got {group[key]}")
    if not 0.0 < group["beta2"] <= 1.0:
        raise ValueError(f"Shampoo: beta2 must be in (0, 1], got {group['beta2']}")
    if not group["epsilon"] > 0.0:
        raise ValueError(
            f"Shampoo: epsilon must be > 0 (the ridge of every root), got {group['epsilon']}"
        )
    if not group["graft_eps"] > 0.0:
        raise ValueError(f"Shampoo: graft_eps must be > 0, got {group['graft_eps']}")
    for key in ("precondition_frequency", "start_preconditioning_step"):
        v = group[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Shampoo: {key} must be an int >= 1, got {v!r}")
