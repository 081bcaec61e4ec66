"""Blocked Shampoo for RaggedShard parameters: every rank preconditions its own whole blocks.

[Note: Shampoo blocks on ranks]
Blocked Shampoo (Gupta et al. 2018; Anil et al. 2020; Shi et al. 2023) cuts each
matrix ``(rows, cols)`` (each member of an ``[E, rows, cols]`` stack) into blocks of at
most ``block_size`` x ``block_size``: here the rows as ``torch.split(row_block)`` and
the columns as ``torch.split(block_size)`` (the last block of a dim shorter; ``row_block
<= block_size``, default 128 x 1024), a partition of the shape and the settings only,
never of the world size. It keeps per block ``G_b`` (``m x n``) its own statistics and
inverse roots. Step ``t`` of one block, ``beta2`` the statistics' decay, ``eps`` the
ridge, ``f`` the precondition frequency, ``t0`` the start step::

    L  <- beta2 L + (1 - beta2) G G^T        (L <- L + G G^T when beta2 = 1)
    R  <- beta2 R + (1 - beta2) G^T G
    every f steps from t0:  L^ = (L / c + eps I)^(-1/4),  R^ likewise,
                            c = 1 - beta2^t (1 when beta2 = 1); in ``root_dtype``
    P  = L^ G R^                             (t >= t0; the graft direction before)

Adam grafting (the default) gives P the norm of Adam's update ``A = G / (sqrt(v / (1 -
b^t)) + e)``, ``v <- b v + (1 - b) G*G`` element-wise: ``P ||A_b|| / ||P_b||`` per block
(``grafting="block"``) or per matrix (``"parameter"``). Then, with ``D`` the grafted
direction of the whole parameter: ``m <- mu m + D``; ``x <- (1 - lr wd) x - lr (D + mu m)``
(Nesterov) or ``- lr m``.

Everything but the block statistics is element-wise, and every block's work needs that
block alone. ``shampoo_block_policy`` makes the RaggedShard block ``row_block`` whole
rows (or whole matrices where ``row_block`` does not divide the rows), so a rank's rows
are whole row blocks; it cuts them into column blocks itself.

Why rows shorter than columns: the RaggedShard block is ``row_block * cols`` elements,
and the planner pads every rank of a ``fully_shard`` group to a multiple of its blocks.
Square 1024 blocks make it 1024 rows (4-15 M elements on a dense layer), more than a
rank's share past a few dozen ranks: llama3-8b padded 394% at 64 ranks. 128 rows keep
the padding within 7% at 64 ranks on the catalogue (the MoE models up to 1024 ranks);
dense models at 256-1024 ranks need ``row_block`` 8-32, or a shard group of at most 64
ranks (HSDP). The cost: per Shampoo element,
``2 (m^2 + n^2) / (m n)`` elements of statistics and roots (4 for square blocks, 16 for
128 x 1024, ~2 n / m) and ``(m^3 + n^3) / (m n)`` of root work (4x the square blocks'
at 128 x 1024): the left roots shrink, the right roots multiply.
``benchmarks/_shampoo_balance.py`` prints the balance, padding, cost and state at each
``row_block``; ``benchmarks/results/optim.md`` section 5 holds the table. Each rank then updates the
statistics and computes the roots of its own blocks only: the optimizer step issues no
collective at all, and its numbers are those of one device at any world size (the same
ops on the same block values, in the same order). A rank's statistics are its blocks'
matrices concatenated in the global block order (member, row block, column block), so
the state of a parameter is a 1-D ``RaggedShard`` DTensor over all of them: its global
shape does not depend on the world size, and checkpoints reshard.
``grafting="parameter"`` needs a matrix's norm, so it needs each matrix whole on one
rank (``shampoo_block_policy(whole_matrices=True)``); it too communicates nothing.

Under HSDP every replica holds the same shard gradients and steps the same blocks (no
byte crosses the replicate dim); a stack of experts cut evenly by ``Shard(0)`` over ep
holds whole members. A tensor-parallel cut of a matrix would cut its blocks: refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from raggedfsdp.optim._muon_policy import default_use_muon
from raggedfsdp.optim._shampoo_layout import (
    DEFAULT_BLOCK_SIZE,
    ShampooBlockPolicy,
    ShampooLayout,
    block_view,
    blocks_of,
    member_view,
    members_held,
    resolve_row_block,
    root_cost,
    shampoo_block_policy,
    shampoo_layout,
)
from raggedfsdp.optim.adamw import FlatAdamW
from raggedfsdp.optim.flat import Item, check_hyper, like_param, local, name_of, split_by_flag

__all__ = [
    "Shampoo",
    "ShampooBlockPolicy",
    "blocks_of",
    "inverse_root",
    "root_cost",
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


class Shampoo(FlatAdamW):
    """Blocked Shampoo with Adam grafting for matrices, AdamW for the rest; RaggedShard-aware.

    See [Note: Shampoo blocks on ranks]. Parameter groups carry ``use_shampoo``:
    ``True`` groups get Shampoo (``lr, momentum, nesterov, beta2, epsilon, weight_decay,
    precondition_frequency, start_preconditioning_step, graft_beta2, graft_eps``),
    ``False`` groups AdamW (``lr, betas, eps, weight_decay``; defaults from the ``adamw_*``
    arguments), stepped as ``FlatAdamW`` (whole buffers where it can). A group without
    ``use_shampoo`` is split by ``use_shampoo(fqn, param)``. Parameters sharded by
    ``fully_shard`` must be sharded with ``shampoo_block_policy(block_size, row_block=row_block)``.

    Args:
        params: parameters or parameter groups.
        lr: learning rate. Default 1e-3.
        momentum: momentum of the grafted direction (0: none). Default 0.9.
        nesterov: Nesterov momentum. Default True.
        beta2: decay of the block statistics (1: their sum, as AdaGrad). Default 0.999.
        epsilon: ridge added to each statistic before its root. Default 1e-12.
        weight_decay: decoupled weight decay. Default 0.0.
        block_size: largest block side (the column blocks' width); the same as
            ``shampoo_block_policy``'s. Default 1024.
        row_block: rows per block, ``1 <= row_block <= block_size``; the same as
            ``shampoo_block_policy``'s. Default None: ``min(128, block_size)``.
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
        NotImplementedError: a Shampoo parameter whose sharding cuts a Shampoo block (not
            sharded with ``shampoo_block_policy``) or that tensor parallelism cuts.
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
        self._layouts: dict[Tensor, ShampooLayout] = {}
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
        layouts = {}
        if shampoo:
            gi = len(self.param_groups)
            for i, p in enumerate(params):
                name = name_of(p, f"#{i} of group {gi}")
                layouts[p] = shampoo_layout(
                    p, name, self.block_size, self.row_block, self.grafting == "parameter"
                )
        super().add_param_group(group)
        self._layouts.update(layouts)
        if not shampoo:  # drop the Shampoo-only defaults torch filled in
            for k in _SHAMPOO_KEYS:
                self.param_groups[-1].pop(k, None)

    # ---- step -----------------------------------------------------------------------------
    def _step_items(self, items: list[Item]) -> None:
        """AdamW on the AdamW groups (``FlatAdamW``), Shampoo on each Shampoo parameter."""
        for p, _ in items:
            if torch.is_complex(p):
                raise NotImplementedError(
                    f"Shampoo: parameter {name_of(p, '?')!r} is complex; Shampoo and this "
                    "AdamW support real parameters only"
                )
        self._step_flat([(p, g) for p, g in items if not g["use_shampoo"]])
        for p, h in items:
            if h["use_shampoo"]:
                self._shampoo_step(p, h)

    def _shampoo_state(self, p: Tensor, lay: ShampooLayout) -> dict:
        state = self.state[p]
        if state:
            return state
        dtype, x = _work_dtype(p), local(p)
        state["step"] = torch.tensor(0.0, device="cpu")  # as torch.optim: a CPU count
        state["momentum_buffer"] = like_param(torch.zeros(x.shape, dtype=dtype, device=x.device), p)
        if self.grafting is not None:
            zeros = torch.zeros(x.shape, dtype=dtype, device=x.device)
            state["graft_exp_avg_sq"] = like_param(zeros, p)
        sizes = {"left": lay.left_local(), "right": lay.right_local()}
        for key in _STATS:
            side = key.split("_")[0]
            numel, units = (
                (lay.left_numel, lay.left_units)
                if side == "left"
                else (lay.right_numel, lay.right_units)
            )
            flat = torch.zeros(sizes[side], dtype=dtype, device=x.device)  # 1D, blocks' matrices
            state[key] = lay.state(flat, numel, units)
        return state

    def _shampoo_step(self, p: Tensor, h: dict) -> None:
        """One step of one Shampoo parameter on this rank's blocks: no communication."""
        lay = self._layouts[p]
        state = self._shampoo_state(p, lay)
        state["step"] += 1
        t = state["step"].item()  # a CPU tensor: no device sync
        assert p.grad is not None  # only parameters with a gradient step
        x, grad = local(p), local(p.grad)
        dtype = _work_dtype(p)
        g = grad.to(dtype)
        # 1. the graft direction, element-wise over the local rows
        if self.grafting is not None:
            b, v = h["graft_beta2"], local(state["graft_exp_avg_sq"])
            v.mul_(b).addcmul_(g, g, value=1 - b)
            graft = g / ((v / (1 - b**t)).sqrt() + h["graft_eps"])
        else:
            graft = g.clone(memory_format=torch.contiguous_format)
        # 2. per block: statistics, roots when due, the preconditioned block
        start, freq = h["start_preconditioning_step"], h["precondition_frequency"]
        precondition = t >= start
        roots_due = precondition and (t - start) % freq == 0
        update = torch.empty(x.shape, dtype=dtype, device=x.device) if precondition else graft
        self._blocks(lay, state, h, t, g, graft, update, precondition, roots_due)
        if precondition and self.grafting == "parameter":
            for e in members_held(lay):
                want = member_view(graft, lay, e).clone(memory_format=torch.contiguous_format)
                have = member_view(update, lay, e)
                norm = have.clone(memory_format=torch.contiguous_format).norm()
                have.mul_(want.norm() / norm.clamp_min(torch.finfo(dtype).tiny))
        # 3. momentum, weight decay, the update: element-wise
        mu = h["momentum"]
        if mu:
            m = local(state["momentum_buffer"])
            m.mul_(mu).add_(update)
            update = update.add(m, alpha=mu) if h["nesterov"] else m
        x.mul_(1 - h["lr"] * h["weight_decay"])
        x.add_(update, alpha=-h["lr"])

    def _blocks(self, lay, state, h, t, g, graft, update, precondition, roots_due) -> None:
        beta2, eps = h["beta2"], h["epsilon"]
        w = 1.0 if beta2 == 1.0 else 1.0 - beta2
        correction = 1.0 if beta2 == 1.0 else 1.0 - beta2**t
        left, right = local(state["left"]), local(state["right"])
        left_root, right_root = local(state["left_root"]), local(state["right_root"])
        tiny = torch.finfo(g.dtype).tiny
        lo = ro = 0  # offsets of this block's L and R in the flat statistics
        for block in lay.blocks:
            _, r0, r1, c0, c1 = block
            m, n = r1 - r0, c1 - c0
            gb = block_view(g, lay, block).clone(memory_format=torch.contiguous_format)
            L, R = left[lo : lo + m * m].view(m, m), right[ro : ro + n * n].view(n, n)
            L.addmm_(gb, gb.T, beta=beta2, alpha=w)
            R.addmm_(gb.T, gb, beta=beta2, alpha=w)
            Lr, Rr = left_root[lo : lo + m * m].view(m, m), right_root[ro : ro + n * n].view(n, n)
            lo, ro = lo + m * m, ro + n * n
            if not precondition:
                continue
            if roots_due:
                Lr.copy_(inverse_root(L, correction, eps, self.root_dtype))
                Rr.copy_(inverse_root(R, correction, eps, self.root_dtype))
            pb = (Lr @ gb) @ Rr
            if self.grafting == "block":
                want = block_view(graft, lay, block).clone(memory_format=torch.contiguous_format)
                pb.mul_(want.norm() / pb.norm().clamp_min(tiny))
            block_view(update, lay, block).copy_(pb)

    def load_state_dict(self, state_dict) -> None:
        """Load; Shampoo states stay in this optimizer's dtype (torch casts them to the
        parameter's)."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if p in self._layouts:
                dtype = _work_dtype(p)
                for k, v in state.items():
                    if k != "step" and v.dtype != dtype:
                        state[k] = v.to(dtype)


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
