"""One way to build a parallel model: the mesh spec, its parser, the device mesh, and
``parallelize`` (tensor and expert parallel, then ``fully_shard`` per block and the root),
used by the application (``train``), the simulator and the benchmarks.

[Note: mesh specs]
``--mesh`` names the dims of the device mesh the ranks build; every form but the
default is a product of exactly the job's ranks (W), row-major, ``tp`` / ``ep`` last:

    --mesh                       device mesh (dim names)              fully_shard mesh
    (none)                       (W,)                                 all W ranks
    replicate=R,shard=S          (R, S) ("replicate", "shard")        the whole (R, S)
    replicate=R,shard=S,tp=T     (R, S, T) + "tp"                     ["replicate", "shard"]
    [dp=D,]tp=T                  (D, T) ("dp", "tp"); D = W / T       ["dp"]
    [dp=W,]ep=E                  (W / E, E) ("dp_mod_ep", "ep")       experts: ["dp_mod_ep"];
                                                                      the rest: the flattened dp

Tensor parallel (``tp``) splits each block's attention (and a dense block's feed-forward)
column- then row-wise over T ranks that see the same rows of the batch, so the
data-parallel ranks are ``W / T`` and rank ``r`` reads the rows of data rank ``r // T``.
Expert parallel (``ep``) splits each MoE layer's stacked experts over E ranks that
exchange tokens; every rank is a data-parallel rank (under ep, ``dp`` counts all of them,
as torchtitan's ``dp_shard``). ``tp`` with ``ep`` and HSDP with ``ep`` are not supported yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from raggedfsdp._mesh_arg import parse_mesh_pairs

__all__ = ["MeshSpec", "build_mesh", "parallelize", "parse_mesh_spec", "tp_plan"]

_MESH_EXAMPLE = "e.g. --mesh replicate=2,shard=2, --mesh dp=2,tp=2 or --mesh ep=2"
_MESH_DIMS = ("replicate", "shard", "dp", "tp", "ep")
_FUTURE_DIMS = {"cp": "context parallel", "pp": "pipeline parallel"}


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """The device mesh of ``--mesh``: a frozen value that checks itself. See [Note: mesh specs].

    Args:
        world: the job's ranks (W).
        replicate: replicas under HSDP; None: no replicate dim. Default None.
        tp: tensor-parallel ranks (T). Default 1.
        ep: expert-parallel ranks (E). Default 1.

    Raises:
        ValueError: sizes whose product is not ``world``.
        NotImplementedError: ``tp`` with ``ep``, or HSDP with ``ep``.
    """

    world: int
    replicate: int | None = None
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.tp > 1 and self.ep > 1:
            raise NotImplementedError(
                f"--mesh with tp={self.tp} and ep={self.ep}: tensor and expert parallel "
                "together are not supported yet; pass one of them"
            )
        if self.ep > 1 and self.replicate is not None:
            raise NotImplementedError(
                f"--mesh with ep={self.ep} and replicate={self.replicate}: HSDP x EP is not "
                f"supported yet; pass ep={self.ep} alone (dp = all {self.world} ranks)"
            )
        for name, size in (("tp", self.tp), ("ep", self.ep)):
            if self.world % size:
                raise ValueError(
                    f"--mesh {name}={size} does not divide the job's {self.world} ranks; pick a "
                    f"{name} size that divides them"
                )
        if self.replicate is not None and self.data_ranks % self.replicate:
            raise ValueError(
                f"--mesh replicate={self.replicate} does not divide the {self.data_ranks} "
                "data-parallel ranks"
            )

    @property
    def data_ranks(self) -> int:
        """Ranks that read different rows of the batch (``W / T``)."""
        return self.world // self.tp

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank`` (tp is the mesh's last dim)."""
        return rank // self.tp

    @property
    def shard(self) -> int:
        """Ranks a block's buffer is sharded over (the shard dim's size)."""
        dp = self.data_ranks
        return dp // self.replicate if self.replicate is not None else dp

    @property
    def dims(self) -> dict[str, int] | None:
        """The device mesh's dims and sizes, in order; None: the unnamed 1-D mesh."""
        if self.replicate is not None:
            hsdp = {"replicate": self.replicate, "shard": self.shard}
            return hsdp | ({"tp": self.tp} if self.tp > 1 else {})
        if self.tp > 1:
            return {"dp": self.data_ranks, "tp": self.tp}
        if self.ep > 1:
            return {"dp_mod_ep": self.world // self.ep, "ep": self.ep}
        return None

    @property
    def text(self) -> str | None:
        """The canonical ``--mesh`` (None: the 1-D default), as ``summary.json`` records it."""
        if self.replicate is not None:
            tp = f",tp={self.tp}" if self.tp > 1 else ""
            return f"replicate={self.replicate},shard={self.shard}{tp}"
        if self.tp > 1:
            return f"dp={self.data_ranks},tp={self.tp}"
        if self.ep > 1:
            return f"dp={self.world},ep={self.ep}"
        return None


def parse_mesh_spec(text: str | None, world: int) -> MeshSpec:
    """``--mesh`` as a ``MeshSpec`` over ``world`` ranks. See [Note: mesh specs].

    Args:
        text: comma-separated ``name=size`` pairs (``replicate``, ``shard``, ``dp``,
            ``tp``, ``ep``), each once, in any order; None: the 1-D mesh.
        world: the job's ranks.

    Raises:
        ValueError: a malformed pair, a size that is not an int >= 1, an unknown or
            repeated dim, replicate without shard (or the reverse), dp with HSDP dims,
            sizes whose product is not ``world``.
        NotImplementedError: a cp / pp dim, tp with ep, HSDP with ep.
    """
    if text is None:
        return MeshSpec(world=world)
    sizes = parse_mesh_pairs(
        text, _MESH_DIMS, _FUTURE_DIMS, _MESH_EXAMPLE, "train takes replicate, shard, dp, tp and ep"
    )
    hsdp = [name for name in ("replicate", "shard") if name in sizes]
    if hsdp and "dp" in sizes:
        raise ValueError(
            f"--mesh {text!r}: dp and {hsdp[0]} both name the data-parallel ranks; give "
            "dp=D (FSDP) or replicate=R,shard=S (HSDP), not both"
        )
    if len(hsdp) == 1:
        missing = "shard" if hsdp[0] == "replicate" else "replicate"
        raise ValueError(
            f"--mesh {text!r}: the {missing!r} dim is missing; give both, "
            "e.g. --mesh replicate=2,shard=2 (replicate=1 is plain FSDP)"
        )
    tp, ep = sizes.get("tp", 1), sizes.get("ep", 1)
    spec = MeshSpec(world=world, replicate=sizes.get("replicate"), tp=tp, ep=ep)
    if hsdp:
        r, s = sizes["replicate"], sizes["shard"]
        if r * s * tp != world:
            t = f" x {tp}" if tp > 1 else ""
            raise ValueError(
                f"--mesh {text} has {r} x {s}{t} = {r * s * tp} ranks, but the job has "
                f"{world}; make {'R x S x T' if t else 'R x S'} equal the number of ranks"
            )
    elif "dp" in sizes:
        dp, want = sizes["dp"], world // tp if ep == 1 else world
        if dp != want:
            what = f"dp x tp = {dp * tp}" if ep == 1 else f"dp = {dp} (under ep, every rank)"
            raise ValueError(
                f"--mesh {text}: {what}, but the job has {world} ranks; "
                + (
                    f"make dp x tp equal the number of ranks (or leave dp out: {world} / tp)"
                    if ep == 1
                    else f"pass dp={world} or leave dp out"
                )
            )
    return spec


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
