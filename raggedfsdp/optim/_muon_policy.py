"""Which parameters Muon takes, and a block policy that keeps its matrices whole on one rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from raggedfsdp.fsdp import BlockPolicy, BlockRows
from raggedfsdp.optim.muon_plan import WholeMatrixPlan, comm_free_matrices, plan_whole_matrices
from raggedfsdp.planner import DEFAULT_ALIGNMENT_BYTES, WHOLE, TensorSpec

__all__ = [
    "GroupReport",
    "MuonBlockPolicy",
    "default_use_muon",
    "muon_block_policy",
    "muon_param_groups",
]


_ADAMW_NAMES = frozenset({"tok_embeddings", "embed_tokens", "embeddings", "wte", "wpe"})
_HEAD_NAMES = frozenset({"output", "lm_head"})


def default_use_muon(fqn: str, param) -> bool:
    """Whether ``param`` (named ``fqn``) is a hidden-layer matrix for Muon.

    The common split: 2-D matrices and 3-D ``[E, out, in]`` stacks go to Muon;
    embeddings (``tok_embeddings``, ``embed_tokens``, ``wte``, ...), the output head
    (``output``, ``lm_head``), biases, norms and other vectors go to AdamW.

    Args:
        fqn: the parameter's name (``""`` when unknown: the shape alone decides).
        param: a tensor, or anything with a ``.shape``.
    """
    if len(param.shape) not in (2, 3):
        return False
    parts = fqn.split(".") if fqn else []
    if any(p in _ADAMW_NAMES or p in _HEAD_NAMES for p in parts):
        return False
    return not (parts and parts[-1].endswith("bias"))


def muon_param_groups(
    model: nn.Module, *, use_muon: Callable[[str, Tensor], bool] = default_use_muon, **adamw
) -> list[dict]:
    """Split ``model``'s trainable parameters into a Muon group and an AdamW group.

    Args:
        model: the model (before or after ``fully_shard``).
        use_muon: ``(fqn, param) -> bool``. Default ``default_use_muon``.
        **adamw: hyperparameters of the AdamW group (``lr=3e-4``, ...).

    Returns:
        ``[{"params": [...], "use_muon": True}, {"params": [...], "use_muon": False, ...}]``
        (empty groups left out), for ``Muon``.
    """
    muon: list[nn.Parameter] = []
    other: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if use_muon(name, p) else other).append(p)
    groups = []
    if muon:
        groups.append({"params": muon, "use_muon": True})
    if other:
        groups.append({"params": other, "use_muon": False, **adamw})
    return groups


# ---------------------------------------------------------------------------------------------
# Block policy: whole matrices on one rank where the planner can do it cheaply
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupReport:
    """One ``fully_shard`` group under ``muon_block_policy``.

    Args:
        name: the group's module path (``""`` for the root).
        plan: the whole-matrix plan (base and chosen layouts).
        comm_free_before, comm_free_after: Muon matrices held whole by one rank with
            the base block and with the policy.
        matrices: Muon matrices in the group (stack members counted one by one).
    """

    name: str
    plan: WholeMatrixPlan
    comm_free_before: int
    comm_free_after: int
    matrices: int


class MuonBlockPolicy:
    """A ``fully_shard`` block policy that keeps chosen Muon matrices whole on one rank.

    Call it as ``fully_shard`` does, ``policy(fqn, param) -> rows``; ``report`` holds
    one ``GroupReport`` per group. Made by ``muon_block_policy``.
    """

    def __init__(self, base: BlockPolicy, whole: WeakIdKeyDictionary, report: list[GroupReport]):
        self.base = base
        self._whole = whole
        self.report = report

    def __call__(self, fqn: str, param: nn.Parameter) -> BlockRows:
        if param in self._whole:
            return WHOLE
        return self.base(fqn, param)

    def summary(self) -> dict:
        """Totals: matrices, comm-free before / after, padding elements before / after."""
        return dict(
            matrices=sum(g.matrices for g in self.report),
            comm_free_before=sum(g.comm_free_before for g in self.report),
            comm_free_after=sum(g.comm_free_after for g in self.report),
            numel=sum(g.plan.base.total_numel for g in self.report),
            padding_before=sum(g.plan.base.padding for g in self.report),
            padding_after=sum(g.plan.layout.padding for g in self.report),
        )


def muon_block_policy(
    model: nn.Module,
    world_size: int,
    *,
    modules: Iterable[nn.Module] | None = None,
    rows: BlockRows = 1,
    max_extra_padding: float = 0.01,
    use_muon: Callable[[str, Tensor], bool] = default_use_muon,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> MuonBlockPolicy:
    """A block policy that keeps Muon matrices whole on one rank wherever that is cheap.

    A matrix held whole by one rank is rooted there and needs no communication in
    ``Muon.step``. For each group that ``fully_shard`` will make, the planner is
    asked to keep every Muon matrix (each member of a stack) whole; where that
    costs more padding than ``max_extra_padding``, matrices are made whole one at a
    time, smallest first (``muon_plan.plan_whole_matrices``).

    Args:
        model: the model, before ``fully_shard`` (it may be on ``meta``).
        world_size: ranks the buffers will be sharded over: the size of the 1-D mesh
            ``fully_shard`` will use, or under HSDP its shard dim's (``mesh.size(-1)``),
            the size the planner plans for.
        modules: the modules ``fully_shard`` will be applied to, bottom-up. Default:
            ``model.transformer_blocks()`` (if it has them), then ``model``.
        rows: the base block for every other parameter. Default 1.
        max_extra_padding: padding allowed beyond the base layout's, as a share of a
            group's elements. Default 0.01.
        use_muon: ``(full fqn, param) -> bool``. Default ``default_use_muon``.
        alignment_bytes: as passed to ``fully_shard``. Default 128.

    Returns:
        A ``MuonBlockPolicy`` to pass as ``fully_shard(..., block_policy=policy)``.
    """
    if modules is None:
        has_blocks = hasattr(model, "transformer_blocks")  # raggedfsdp's models define it
        blocks = cast(Any, model).transformer_blocks() if has_blocks else []
        modules = [*blocks, model]
    base = BlockPolicy(rows=rows)
    full_names = {id(p): n for n, p in model.named_parameters()}
    module_names = {id(m): n for n, m in model.named_modules()}
    claimed: set[int] = set()
    whole = WeakIdKeyDictionary()
    report = []
    for mod in modules:
        group = [(n, p) for n, p in mod.named_parameters() if id(p) not in claimed]
        claimed.update(id(p) for _, p in group)
        if not group:
            continue
        specs = [
            TensorSpec(name=n, shape=tuple(p.shape), block_rows=base(n, p), stack=p.dim() >= 3)
            for n, p in group
        ]
        members = {
            n: (p.shape[0] if p.dim() == 3 else 1)
            for n, p in group
            if p.requires_grad and use_muon(full_names.get(id(p), n), p)
        }
        plan = plan_whole_matrices(
            specs,
            world_size,
            list(members),
            max_extra_padding=max_extra_padding,
            dtype=group[0][1].dtype,
            alignment_bytes=alignment_bytes,
        )
        for n, p in group:
            if n in plan.whole:
                whole[p] = True
        before, total = comm_free_matrices(plan.base, members)
        after, _ = comm_free_matrices(plan.layout, members)
        report.append(GroupReport(module_names.get(id(mod), "?"), plan, before, after, total))
    return MuonBlockPolicy(base, whole, report)
