"""The one mesh parser: ``--mesh name=size,...`` as every command reads it.

``parse_mesh_spec`` turns a job's ``--mesh`` into a ``MeshSpec`` (the data, tensor and
expert parallel sizes, checked), which ``raggedfsdp.models.parallelize.build_mesh`` makes
a ``DeviceMesh``; ``parse_hsdp_mesh`` reads the HSDP-only ``--mesh`` of ``plan`` and
``simulate``; both read the pairs with ``parse_mesh_pairs``. Pure Python: no torch.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "HSDP_DIMS",
    "NOT_YET_DIMS",
    "MeshSpec",
    "parse_hsdp_mesh",
    "parse_mesh_pairs",
    "parse_mesh_spec",
]

HSDP_DIMS = ("replicate", "shard")
NOT_YET_DIMS = {  # dims of parallelisms an HSDP-only command does not take
    "tp": "tensor parallel",
    "ep": "expert parallel",
    "cp": "context parallel",
    "pp": "pipeline parallel",
}


def parse_mesh_pairs(
    text: str, dims: Sequence[str], future: Mapping[str, str], example: str, takes: str
) -> dict[str, int]:
    """The ``name: size`` pairs of ``text`` (comma-separated ``name=size``, any order).

    Args:
        text: the ``--mesh`` value.
        dims: the dim names the command takes.
        future: dims of parallelisms not supported yet, name -> what it is.
        example: a valid ``--mesh`` for the error messages.
        takes: how the command's dims read in a message ("only HSDP meshes are: ...").

    Raises:
        ValueError: a malformed pair, an unknown or repeated name, a size that is not
            an int >= 1.
        NotImplementedError: a dim in ``future``.
    """
    sizes: dict[str, int] = {}
    for pair in text.split(","):
        name, eq, size = (part.strip() for part in pair.partition("="))
        if not eq or not name:
            raise ValueError(
                f"--mesh {text!r}: expected name=size pairs separated by commas, got "
                f"{pair!r}; {example}"
            )
        if name in future:
            raise NotImplementedError(
                f"--mesh {text!r}: the {name!r} dim ({future[name]}) is not supported yet; {takes}"
            )
        if name not in dims:
            raise ValueError(
                f"--mesh {text!r}: unknown dim {name!r}; expected some of {', '.join(dims)}, "
                f"{example}"
            )
        if name in sizes:
            raise ValueError(f"--mesh {text!r}: {name!r} is given twice; give it once")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"--mesh {text!r}: the size of {name!r} must be an int >= 1, got {size!r}"
            )
        sizes[name] = int(size)
    return sizes


def parse_hsdp_mesh(text: str, world: int | None, command: str) -> tuple[int, int]:
    """``--mesh replicate=R,shard=S`` (both dims, any order) of an HSDP-only command
    (``plan``, ``simulate``) as ``(R, S)``, checked against its ``--world`` if given.

    Args:
        text: the ``--mesh`` value.
        world: the command's ``--world``, or None when it was not given.
        command: the command's name, for the messages.

    Raises:
        ValueError: what ``parse_mesh_pairs`` raises, a missing dim, or a ``world``
            other than ``R * S``.
        NotImplementedError: a dim in ``NOT_YET_DIMS``.
    """
    example = "e.g. --mesh replicate=2,shard=4"
    takes = f"{command} takes HSDP meshes: pass replicate=R,shard=S"
    sizes = parse_mesh_pairs(text, HSDP_DIMS, NOT_YET_DIMS, example, takes)
    missing = [name for name in HSDP_DIMS if name not in sizes]
    if missing:
        raise ValueError(
            f"--mesh {text!r}: the {missing[0]!r} dim is missing; give both, {example} "
            "(replicate=1 is plain FSDP)"
        )
    r, s = sizes["replicate"], sizes["shard"]
    if world is not None and world != r * s:
        raise ValueError(
            f"--world {world} and --mesh {text} ({r} x {s} = {r * s} ranks) disagree; drop "
            f"--world (the mesh gives it) or make it {r * s}"
        )
    return r, s


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
