"""The two in-place collectives, skipped over a group of one rank.

torch 2.13 calls them ``all_gather_single`` and ``reduce_scatter_single`` and deprecates
``all_gather_into_tensor`` / ``reduce_scatter_tensor``, the names older torch has (same
arguments, same ``c10d`` ops underneath). raggedfsdp is tested on 2.13; this keeps the
GPU check runnable on an accelerator machine's older torch (``RAGGEDFSDP_UNTESTED_TORCH``).

Over a group of one rank (world size 1, or a mesh dim of size 1) a collective's result
is its input: no collective is issued (as FSDP2 issues none there), the input is copied
into the output (or nothing, when they are the same memory).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single",
    "completed_work",
    "group_size",
    "one_rank_collective",
    "reduce_scatter_single",
]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# ops whose result over one rank is the input itself
_IDENTITY_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


class _Done:
    """The ``Work`` of a collective that had nothing to do."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def completed_work() -> _Done:
    """A ``Work`` already done (a collective skipped over one rank)."""
    return _Done()


def group_size(group) -> int:
    return dist.get_world_size(group)


_running: list[str] = []  # the one-rank collective whose copy runs now (see below)


def one_rank_collective() -> str | None:
    """The collective being done as a copy over one rank, while its copy runs, else None:
    how ``raggedfsdp.tools.profiling.CopyCounter`` tells that copy (the collective's own data
    movement, as gloo's loopback would make it) from copies around a collective."""
    return _running[-1] if _running else None


def _copy(kind: str, out: torch.Tensor, inp: torch.Tensor, async_op: bool):
    if out.data_ptr() != inp.data_ptr() or out.dtype != inp.dtype:
        _running.append(f"{kind} over one rank")
        try:
            out.copy_(inp.view_as(out))
        finally:
            _running.pop()
    return _Done() if async_op else None


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (m x the input) gets every rank's ``inp``, in rank order."""
    if group_size(group) == 1:
        return _copy("all_gather", out, inp, async_op)
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_single(
    out: torch.Tensor, inp: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op=False
):
    """``out`` gets this rank's chunk of ``inp`` reduced over the group's ranks."""
    if group_size(group) == 1 and op in _IDENTITY_OPS:
        return _copy("reduce_scatter", out, inp, async_op)
    return _reduce_scatter(out, inp, op=op, group=group, async_op=async_op)
