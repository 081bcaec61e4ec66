"""One way to build a parallel model: the device mesh of a ``MeshSpec`` (``build_mesh``)
and ``parallelize`` (tensor and expert parallel, then ``fully_shard`` per block and the
root), used by the application (``train``), the simulator, the benchmarks and the tests.
The mesh spec and its parser live beside it, in ``raggedfsdp/models/mesh.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from raggedfsdp.models.mesh import MeshSpec, parse_mesh_spec

__all__ = ["MeshSpec", "build_mesh", "parallelize", "parse_mesh_spec", "tp_plan"]


def build_mesh(spec: MeshSpec, device_type: str = "cpu") -> DeviceMesh:
    """The device mesh of ``spec`` (see [Note: mesh specs])."""
    if spec.dims is None:
        return init_device_mesh(device_type, (spec.world,))
    dims = spec.dims
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def tp_plan(block) -> dict:
    """Column- then row-wise splits of a block's attention (and dense feed-forward):
    each tp rank computes whole heads (hidden rows); the MoE experts stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan["attention.wo"] = RowwiseParallel()
    if not block.is_moe:
        plan |= {f"feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")}
        plan["feed_forward.w2"] = RowwiseParallel()
    return plan


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    spec: MeshSpec | None = None,
    *,
    fully_shard: Callable | None = None,
    blocks: list[nn.Module] | None = None,
    grouping: str = "blocks",
    **kwargs: Any,
) -> dict[str, tuple]:
    """Tensor and expert parallel where ``spec`` asks, then ``fully_shard`` each block and
    the root, in place: the one recipe the application, the simulator and the benchmarks
    share (see [Note: mesh specs]).

    Args:
        model: a ``raggedfsdp.models.Transformer`` (``blocks`` given: any model).
        mesh: ``build_mesh(spec)``, or any 1-D or (replicate, shard) mesh without ``spec``.
        spec: the mesh's dims; None: ``fully_shard`` over ``mesh`` alone.
        fully_shard: raggedfsdp's (default) or torch's FSDP2 ``fully_shard``.
        blocks: the modules sharded one by one before the root; default the model's
            ``transformer_blocks()``.
        grouping: ``"blocks"`` (each block, then the root) or ``"torchtitan"`` (the
            embedding, each block, ``[norm, output]``, then the root; not with tp or ep).
        **kwargs: passed to every ``fully_shard`` call (``mp_policy``, ...).

    Returns:
        ``{fqn: (shape, ranks)}``: each parameter as ``fully_shard`` splits it (the TP- /
        EP-local tensor) and the size of its shard group.

    Raises:
        ValueError: an unknown ``grouping``, or ``"torchtitan"`` with tp or ep.
    """
    if fully_shard is None:
        from raggedfsdp import fully_shard
    if grouping not in ("blocks", "torchtitan"):
        raise ValueError(
            f"parallelize: grouping must be 'blocks' or 'torchtitan', got {grouping!r}"
        )
    tp = spec is not None and spec.tp > 1
    ep = spec is not None and spec.ep > 1
    if grouping == "torchtitan" and (tp or ep):
        raise ValueError("parallelize: grouping='torchtitan' takes no tp or ep; use 'blocks'")
    if tp:
        fsdp_mesh = mesh["replicate", "shard"] if spec.replicate is not None else mesh["dp"]
    elif ep:
        fsdp_mesh = mesh._flatten("dp")  # all ranks (torchtitan's dp_shard)
    else:
        fsdp_mesh = mesh
    blocks = list(model.transformer_blocks()) if blocks is None else blocks
    names = {m: n for n, m in model.named_modules()}
    split: dict[str, tuple] = {}

    def shard(module, on, **extra) -> None:
        """``fully_shard`` one module (or a list: one group), recording the parameters it
        takes that no earlier call took."""
        for m in module if isinstance(module, list) else [module]:
            prefix = names[m] + "." if names[m] else ""
            for name, p in model.named_parameters():
                if name.startswith(prefix) and name not in split:
                    split[name] = (tuple(_local(p).shape), on.size(-1))
        fully_shard(module, mesh=on, **kwargs, **extra)

    if grouping == "torchtitan":
        shard(model.tok_embeddings, fsdp_mesh)
    for i, block in enumerate(blocks):
        if tp:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(block, mesh["tp"], tp_plan(block))
        if ep and block.is_moe:
            # See [Note: expert parallelism] in raggedfsdp/models/transformer.py: the
            # experts' gradients sum the tokens of every ep rank, so divide by all ranks.
            from raggedfsdp.models.transformer import expert_parallel

            expert_parallel(block.moe, mesh["ep"])
            shard(block.moe.experts, mesh["dp_mod_ep"])
            block.moe.experts.set_gradient_divide_factor(spec.world)
            block.moe.experts.set_force_sum_reduction_for_comms(True)
        if grouping == "torchtitan":
            shard(block, fsdp_mesh, reshard_after_forward=i < len(blocks) - 1)
        else:
            shard(block, fsdp_mesh)
    if grouping == "torchtitan":
        shard([model.norm, model.output], fsdp_mesh, reshard_after_forward=False)
    shard(model, fsdp_mesh)
    return split
