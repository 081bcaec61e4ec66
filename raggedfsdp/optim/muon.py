"""Muon for RaggedShard parameters: whole-matrix Newton-Schulz on load-balanced root ranks.

This file holds the optimizer: its parameter groups, the element-wise part of the step
and one plan per shard group. The rest of Muon, one role per file:

- ``muon_plan.py``: the pure plan, the same on every rank: each matrix's root rank,
  the rounds, each rank's all-to-all segments; which matrices a layout keeps whole;
- ``_muon_exchange.py``: a plan run: the all-to-alls, Newton-Schulz on the roots, the
  results applied (and under HSDP, TP and EP: [Note: Muon under HSDP], [Note: Muon
  under TP and EP]);
- ``_muon_cuts.py``: how a parameter is cut across its mesh, and the cuts Muon refuses;
- ``_muon_math.py``: Newton-Schulz and the learning-rate adjustment, as torch has them;
- ``_muon_policy.py``: which parameters go to Muon, and the block policy that keeps
  Muon matrices whole on one rank.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from raggedfsdp.optim._muon_cuts import check_muon_param, check_one_tp_group, muon_cut
from raggedfsdp.optim._muon_exchange import (
    MuonStepStats,
    ShardedParam,
    ShardGroupStep,
    timed_ns,
)
from raggedfsdp.optim._muon_math import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    EPS,
    NS_DTYPE,
    adjust_lr,
    zeropower_via_newtonschulz,
)
from raggedfsdp.optim._muon_policy import (
    MuonBlockPolicy,
    default_use_muon,
    muon_block_policy,
    muon_param_groups,
)
from raggedfsdp.optim.adamw import FlatAdamW
from raggedfsdp.optim.flat import Item, check_hyper, like_param, local, name_of, split_by_flag
from raggedfsdp.optim.muon_plan import (
    StepPlan,
    build_plan,
    comm_free_matrices,
    matrix_members,
    plan_matrices,
    plan_whole_matrices,
)

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

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_DISTRIBUTED = ("root", "replicated")
_MUON_KEYS = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn")


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
                check_muon_param(p, f"#{i} of group {len(self.param_groups)}", self.distributed)
            check_one_tp_group(named)
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
            inputs.append(update.to(NS_DTYPE, copy=True).reshape(-1))
            local(p).mul_(1 - h["lr"] * h["weight_decay"])
        # 2. whole matrices on every rank (plain tensors, Replicate): no communication
        sharded: list[ShardedParam] = []
        for (p, h), x in zip(items, inputs):
            cut = muon_cut(p)
            if cut is not None:
                sharded.append(ShardedParam(p, h, x, cut))
                continue
            whole = local(p)  # the whole parameter, any strides
            for e, (start, shape) in enumerate(matrix_members(p.shape)):
                result = timed_ns(stats, x[start : start + shape[0] * shape[1]].view(shape), h)
                member = whole if p.dim() == 2 else whole[e]
                member.add_(result, alpha=-adjust_lr(h["lr"], h["adjust_lr_fn"], *shape))
                stats.matrices += 1
        if sharded:  # planned per shard group: see [Note: Muon under TP and EP]
            groups: dict[str, list[ShardedParam]] = {}
            for entry in sharded:
                groups.setdefault(entry.cut.group.group_name, []).append(entry)
            for key, part in groups.items():
                self._distributed_ns(key, part)

    def _step_plan(self, group: str, sharded: list[ShardedParam]) -> StepPlan:
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

    def _distributed_ns(self, group: str, sharded: list[ShardedParam]) -> None:
        """Steps 2-3 of [Note: distributed Muon] for the RaggedShard parameters of one
        shard group, with the tp stage of [Note: Muon under TP and EP]."""
        plan = self._step_plan(group, sharded)
        ShardGroupStep(plan, sharded, self.last_step, self.distributed).run()


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
