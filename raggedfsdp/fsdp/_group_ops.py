"""Group operations: one kernel per buffer instead of one per parameter.

``split_whole_buffers(params)`` splits a parameter list into whole DBuffers (every parameter
of the buffer is in the list) and the rest, handled per tensor. A whole buffer's
element-wise work runs on its flat shard storage: padding elements hold zeros in
the gradient and never change the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._buffers import BufferView, buffer_of

__all__ = ["clip_grad_norm_", "split_whole_buffers"]


def split_whole_buffers(
    params: Iterable[torch.Tensor],
) -> tuple[list[BufferView], list[torch.Tensor]]:
    """``(buffers to treat whole, the other parameters, to treat one by one)``.

    A buffer is whole when every trainable parameter of it is in ``params`` and its
    ``.grad`` is its view of the shard gradient storage (``grads_are_views``):
    frozen parameters and padding hold zero gradients there.
    """
    by_buffer: dict[int, tuple[BufferView, list]] = {}
    rest = []
    for p in params:
        found = buffer_of(p)
        if found is None:
            rest.append(p)
        else:
            by_buffer.setdefault(id(found[0]), (found[0], []))[1].append(p)
    whole = []
    for view, members in by_buffer.values():
        trainable = {id(s.param) for s in view.params if s.requires_grad}
        if {id(p) for p in members} == trainable and view.grads_are_views():
            whole.append(view)
        else:
            rest.extend(members)
    return whole, rest


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients to a global norm: one norm per buffer plus one all-reduce.

    Same contract as ``torch.nn.utils.clip_grad_norm_`` for sharded parameters
    (raggedfsdp's and other DTensors) and replicated plain tensors.

    Args:
        parameters: parameters (or a module whose parameters) to clip.
        max_norm: the largest allowed norm.
        norm_type: the p of the p-norm; ``inf`` for the max norm. Default 2.
        error_if_nonfinite: raise if the total norm is nan or inf. Default False.

    Returns:
        The total norm of all gradients, a 0-d tensor (the same on every rank).
    """
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    groups, rest = split_whole_buffers(params)
    for g in [g for g in groups if g.tensor_parallel]:  # norms summed over different axes
        groups.remove(g)
        rest.extend(s.param for s in g.params if s.requires_grad and s.param.grad is not None)
    # Each local part, keyed by the process groups its norm is summed over: the mesh
    # axes its tensor is sharded on (a whole buffer: the shard dim; FSDP x TP: tp and
    # the shard dim, or the shard dim alone for a tp-Replicate parameter; a replicated
    # plain tensor: none).
    parts: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
    for g in groups:
        parts.setdefault((g.process_group,), []).append(g.shard_grad)  # 1D, S elements
    for p in rest:
        grad = p.grad
        assert grad is not None  # params holds the tensors with a gradient
        key: tuple[dist.ProcessGroup, ...] = ()
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            key = tuple(
                mesh.get_group(i) for i, q in enumerate(grad.placements) if not q.is_replicate()
            )
        parts.setdefault(key, []).append(_local(grad))
    device = next((t.device for ts in parts.values() for t in ts), torch.device("cpu"))

    def zero():
        return torch.zeros((), device=device)

    def norms(tensors):
        return [torch.linalg.vector_norm(t.float(), norm_type) for t in tensors if t.numel()]

    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = zero()
    for key, tensors in parts.items():
        if inf:
            part = torch.stack([zero(), *norms(tensors)]).max()
        else:
            powers = [n**norm_type for n in norms(tensors)]
            part = torch.stack(powers).sum() if powers else zero()
        for pg in key:
            dist.all_reduce(part, op=op, group=pg)
        total = torch.maximum(total, part) if inf else total + part
    if not inf:
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in groups:
        g.shard_grad.mul_(coef.to(g.shard_grad.dtype))
    for p in rest:
        assert p.grad is not None  # params holds the tensors with a gradient
        _local(p.grad).mul_(coef.to(p.grad.dtype))
    return total
