"""How a group's gradients are divided by the data-parallel size: FSDP2's
``_get_gradient_divide_factors``, for the reduce-scatter (``start_reduce`` in
``_grads.py``) and the HSDP all-reduce. See [Note: divide factors]."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["DivideFactors", "divide_factors"]


class DivideFactors(NamedTuple):
    """How a group's gradients are divided by the data-parallel size (FSDP2's
    ``_get_gradient_divide_factors``): see [Note: divide factors]."""

    scale_input: Callable[[torch.Tensor], None] | None  # in place, on the reduce-scatter input
    reduce_scatter_op: dist.ReduceOp | dist.ReduceOp.RedOpType
    all_reduce_op: dist.ReduceOp | dist.ReduceOp.RedOpType  # HSDP, over the replicate dim
    post: float | None  # divide the reduced gradients by it, after the all-reduce hook


def divide_factors(
    world: int,
    replicate: int | None,
    reduce_dtype: torch.dtype,
    factor: float | None,
    force_sum: bool,
    *,
    premul_sum: bool = True,
) -> DivideFactors:
    """FSDP2's division of the gradients, for a reduce-scatter over ``world`` ranks and
    (HSDP) an all-reduce over ``replicate`` ranks.

    [Note: divide factors]
    As FSDP2 (torch 2.13's ``_get_gradient_divide_factors`` and ``foreach_reduce``):

    - fp32 / bf16, no factor, no force-sum: ``AVG`` (``SUM`` over one rank in all).
    - fp32 / bf16 with ``set_gradient_divide_factor(f)``: the reduce-scatter is ``AVG``
      when ``f`` is its size, else ``PREMUL_SUM(1 / f)``; the all-reduce ``SUM``. gloo
      has no ``PREMUL_SUM`` (FSDP2 fails there): the input is multiplied by ``1 / f``,
      then summed, which is what ``PREMUL_SUM`` computes.
    - any other dtype (fp16, fp64), or ``set_force_sum_reduction_for_comms(True)``:
      ``SUM`` both ways, the factor ``f`` (default: the data-parallel size) split for
      fp16 / fp64 into a division of the input by ``pre`` (the first power of two whose
      square reaches ``f``, or where ``f`` stops dividing) and of the result by
      ``f / pre``, so that a sum of large fp16 gradients does not overflow (40,000 on
      each of 2 ranks sums to 40,000, not to inf); fp32 / bf16 under force-sum divide
      the result by ``f`` only.
    - over one rank the reduce-scatter is a copy; a factor it would have applied is a
      division of the input (FSDP2's ``input / factor``).

    The all-reduce hook (``set_all_reduce_hook``) sees the reduced gradients before the
    division of the result.
    """
    size = world * (replicate or 1)
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    if not overflow_risk and not force_sum:
        if factor is None:
            op = SUM if size == 1 else AVG
            return DivideFactors(None, op, op, None)
        if world == 1:
            return DivideFactors(_div(factor), SUM, SUM, None)
        if factor == world:
            return DivideFactors(None, AVG, SUM, None)
        if premul_sum:
            return DivideFactors(None, dist._make_nccl_premul_sum(1 / factor), SUM, None)
        return DivideFactors(_mul(1 / factor), SUM, SUM, None)
    if factor is None:
        factor = float(size)
    if not overflow_risk:
        return DivideFactors(None, SUM, SUM, factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return DivideFactors(_div(pre) if pre != 1 else None, SUM, SUM, factor / pre)


def _div(by: float) -> Callable[[torch.Tensor], None]:
    def scale(t: torch.Tensor) -> None:
        t.div_(by)

    return scale


def _mul(by: float) -> Callable[[torch.Tensor], None]:
    def scale(t: torch.Tensor) -> None:
        t.mul_(by)

    return scale
