"""Policies of ``fully_shard``: frozen, keyword-only, self-validating."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Literal, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._fp8 import Float8BlockAllGather
from raggedfsdp.planner import WHOLE

BlockRows = Union[int, Literal["whole"]]  # noqa: UP007 (a runtime alias)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As ``torch.distributed.fsdp.MixedPrecisionPolicy``, whose four fields it takes in
    the same order, positionally too (``MixedPrecisionPolicy(torch.bfloat16)``, as torch's
    dataclass); ``all_gather``, raggedfsdp's own, is keyword-only.

    Args:
        param_dtype: dtype of the unsharded parameters used in forward and backward
            (one cast of the whole shard feeds the all-gather). Default: unchanged.
        reduce_dtype: dtype of the gradient reduce-scatter. Default: ``param_dtype``.
        output_dtype: dtype the module's floating-point outputs are cast to. Default:
            unchanged.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
            Default True.
        all_gather: ``Float8BlockAllGather(tile=...)`` gathers the matrices it selects
            as FP8 codes with per-tile scales, dequantized into ``param_dtype`` (see
            [Note: FP8 all-gather] in ``_fp8.py``). Default None: every parameter
            gathers in ``param_dtype``. raggedfsdp only (torch's policy has no such field).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    _: KW_ONLY
    all_gather: Float8BlockAllGather | None = None

    def __post_init__(self) -> None:
        if self.all_gather is not None and not isinstance(self.all_gather, Float8BlockAllGather):
            raise ValueError(
                "MixedPrecisionPolicy: all_gather must be a Float8BlockAllGather or None, got "
                f"{self.all_gather!r}"
            )
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecisionPolicy: {field} must be a floating torch.dtype or None, "
                    f"got {value!r}"
                )


@dataclass(frozen=True, kw_only=True)
class BlockPolicy:
    """How many rows form a block, the unit a shard boundary never splits.

    A row is one row of the parameter seen as ``[numel / last_dim, last_dim]``; for
    a stacked ``[E, out, in]`` tensor, a row of one member; for a 1-D parameter (a
    bias, a norm weight), one element. A block policy (this class
    or any ``(fqn, param) -> rows``) is called with the parameter as the module holds
    it: under FSDP x TP the TP DTensor, whose rows are counted in its local tensor
    (what the RaggedShard cuts; see [Note: FSDP x TP] in ``_tp.py``).

    Args:
        rows: rows per block for every parameter: a positive int, or ``"whole"``
            (the whole tensor; for a stack, each whole member). Default 1. An int
            counts matrix rows, so it leaves 1-D parameters cut between elements
            (as FSDP2 cuts them); ``"whole"`` keeps them whole too.
        overrides: per-FQN rows, matched by suffix (``{"experts.w1": "whole"}``);
            for a 1-D parameter, elements (``{"output.bias": "whole"}``). Default none.
        whole_if_fewer_rows: a parameter with fewer rows than its block is kept
            whole instead of raising. Default True.
    """

    rows: BlockRows = 1
    overrides: tuple[tuple[str, BlockRows], ...] = ()
    whole_if_fewer_rows: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.overrides, dict):
            object.__setattr__(self, "overrides", tuple(self.overrides.items()))
        for where, value in [("rows", self.rows), *self.overrides]:
            _check_rows(value, f"BlockPolicy {where!r}")

    def __call__(self, fqn: str, param: nn.Parameter) -> BlockRows:
        rows = 1 if param.dim() == 1 and self.rows != WHOLE else self.rows
        for suffix, value in self.overrides:
            if fqn == suffix or fqn.endswith("." + suffix):
                rows = value
        if rows != WHOLE and self.whole_if_fewer_rows and rows > member_rows(param):
            return WHOLE
        return rows


def _check_rows(value, where: str) -> None:
    if value == WHOLE:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where}: a block must be a positive number of rows or 'whole', got {value!r}"
        )


def param_rows(param: torch.Tensor) -> int:
    """Rows of ``param`` seen as ``[numel / last_dim, last_dim]`` (members' rows for stacks;
    elements for a 1-D tensor); of its local tensor for a DTensor (the TP piece that
    fully_shard cuts)."""
    if isinstance(param, DTensor):
        param = param.to_local()
    if param.dim() <= 1:
        return param.numel()
    return param.numel() // param.shape[-1]


def member_rows(param: torch.Tensor) -> int:
    """Rows of one member of a stacked ``[E, out, in]`` tensor; ``param_rows`` otherwise
    (of the local tensor for a DTensor)."""
    if isinstance(param, DTensor):
        param = param.to_local()
    return param_rows(param) // (param.shape[0] if param.dim() >= 3 else 1)


def resolve_block_rows(
    policy: BlockPolicy | Callable[[str, nn.Parameter], BlockRows] | None,
    fqn: str,
    param: nn.Parameter,
) -> BlockRows:
    """The block rows ``policy`` gives ``fqn``, checked against the parameter."""
    rows = (policy or BlockPolicy())(fqn, param)
    _check_rows(rows, f"fully_shard: block_policy for parameter {fqn!r}")
    if rows == WHOLE:
        return rows
    rows_per_member = member_rows(param)
    if rows_per_member % rows:
        local = param.to_local() if isinstance(param, DTensor) else param
        shape = ("local shape " if local is not param else "shape ") + str(tuple(local.shape))
        raise ValueError(
            f"fully_shard: parameter {fqn!r} of {shape} has {rows_per_member} "
            f"rows, not a multiple of its block of {rows} rows; pass a block_policy whose "
            f"rows divide {rows_per_member}, or 'whole'"
        )
    return rows
