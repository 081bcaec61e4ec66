"""AdamW with block-wise 8-bit moments whose blocks never cross a rank.

[Note: 8-bit states under RaggedShard]
Each moment of a parameter of at least ``min_8bit_size`` elements (its *global*
size, so sharding never changes which parameters are 8-bit; torchao decides from
the local shard, pytorch/ao#4912) is stored as a uint8 code per element and one
fp32 scale per quantization block of ``block_size`` (B) elements, counted from the
parameter's own element 0 (for a stacked ``[E, ...]`` tensor, from each member's):
see [Note: dynamic tree quantization] in ``quant.py`` for the codes. Smaller
parameters keep fp32 moments.

``adamw8bit_block_policy`` gives ``fully_shard`` RaggedShard blocks that are whole
quantization blocks, so every rank holds whole quantization blocks and quantizes
with no communication; the states are then bit-identical to a single process given
the same gradients (see [Note: bit-identical under any sharding]). A parameter of
shape ``(1000, 96)`` with B = 256 gets blocks of 8 rows (768 elements, 3 scales)::

    rows      0 ... 7 | 8 ... 15 | ...          RaggedShard blocks (8 rows)
    elements  0 . 767 | 768 ...  | ...
    scales    s0 s1 s2| s3 s4 s5 | ...          one per 256 elements
    rank      r0      | r0       | r1 ...       cuts only between RaggedShard blocks

Under HSDP (``(Replicate(), RaggedShard)`` on a ``(replicate, shard)`` mesh) only the
RaggedShard cuts: a rank holds the whole quantization blocks its shard rank is given,
and the replicas, fed the same all-reduced gradients, hold the same codes and
scales; no block crosses a rank boundary on either mesh dim.

The state seen by ``state_dict`` and DCP is per parameter: ``exp_avg_codes`` and
``exp_avg_sq_codes`` (uint8, placed like the parameter) and ``exp_avg_scales`` /
``exp_avg_sq_scales`` (fp32). The scales of a parameter whose rows are whole blocks
(the last dim a multiple of B) form a grid: its shape with the last dim counted in
blocks (``scale_grid``; ``(4096, 4096)`` gives ``(4096, 16)``), placed exactly like
the parameter. Otherwise they are 1-D, ``[scales]``, a ``RaggedShard`` whose
``local_units`` are each shard rank's scale counts (under HSDP placed ``(Replicate(),
RaggedShard)``). Either way a checkpoint reshards codes and scales together by global
position, with no requantization.

[Note: 8-bit states under TP and EP]
Under FSDP x TP a parameter is ``(Shard(d), ..., RaggedShard)`` on the ``(tp, *dp)``
mesh, and the RaggedShard cuts the TP-local piece. The blocks stay those of one
process (B elements from the parameter's or member's start) when the tp cut leaves
each rank whole blocks: the piece is made of runs of ``prod(local_shape[d:])``
contiguous elements of the global tensor, and each run must be a multiple of B
(checked, with the fix named: a smaller ``block_size``). Then the piece's blocks,
counted from its own start, are the global blocks in order, each rank quantizes its
own, and codes and scales are bit-identical to one process with no communication. A
stack ``[E, out, in]`` sharded ``Shard(0)`` over ``ep`` holds whole members, always
whole blocks. Row-wise TP (``Shard(1)`` of a matrix) needs rows of a multiple of B
elements per tp rank, and its scales are then the grid, cut ``Shard(1)`` like the
parameter; column-wise (``Shard(0)``) cuts 1-D scales ``Shard(0)`` as well. The block
policy sees the TP DTensor: 8-bit or not by the global shape, rows of the local piece.

For parameters sharded by ``fully_shard`` the codes live in two flat uint8 tensors
of S elements (like the buffer's shard storage) and the scales in two flat fp32
tensors with one entry per block of the shard (the gaps between 8-bit parameters
count as blocks too); ``state[p]`` holds views. A buffer that [Note: whole-buffer
steps] (``flat.py``) lets step whole is updated with a fixed number of kernels
(plus one per run of equal weight decay); every other parameter steps alone over
the same views. A stack laid out with member gaps (``fully_shard(member_gaps=True)``)
keeps its codes in the same flat tensors, at its members' positions: each member's
last quantization block is stretched over the gap after it (the gap's moments stay
zero, so they change no scale, and nothing reads them back into the parameter), so its
codes and scales are still those of one process. Such a parameter stepping alone,
outside a whole-buffer step, is gathered into one contiguous copy and written back
(one copy each way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from raggedfsdp.fsdp import BufferView, buffer_of
from raggedfsdp.optim.flat import FlatOptimizer, WholeStep, check_hyper, like_param, local
from raggedfsdp.optim.quant import (
    Blocks,
    dequantize,
    dynamic_tree_map,
    param_block_lengths,
    quantize_,
)
from raggedfsdp.tensor import ragged_axis, ragged_piece
from raggedfsdp.tensor.placement import RaggedShard

__all__ = [
    "AdamW8bit",
    "AdamW8bitBlockPolicy",
    "adamw8bit_block_policy",
    "is_8bit_eligible",
    "scale_grid",
]

DEFAULT_BLOCK_SIZE = 256
DEFAULT_MIN_8BIT_SIZE = 4096
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _members(shape) -> int:
    """Members of a stacked ``[E, out, in]`` tensor (3+ dims, as in ``fully_shard``), else 1."""
    return int(shape[0]) if len(shape) >= 3 else 1


def is_8bit_eligible(
    shape, block_size: int = DEFAULT_BLOCK_SIZE, min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE
) -> bool:
    """Whether a parameter of (global) ``shape`` gets 8-bit moments.

    True when it has at least ``min_8bit_size`` elements and, for a stack, members of
    at least ``block_size`` elements (each member starts its own blocks, so tiny
    members would spend more on scales than the 2.1 bytes per element budget).
    """
    numel = math.prod(shape)
    return numel >= min_8bit_size and numel // _members(shape) >= block_size


def _check_sizes(where: str, block_size, min_8bit_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where}: block_size must be a positive int, got {block_size!r}")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"{where}: min_8bit_size must be an int >= 0, got {min_8bit_size!r}")


@dataclass(frozen=True, kw_only=True)
class AdamW8bitBlockPolicy:
    """A ``fully_shard`` block policy whose blocks are whole quantization blocks.

    For an 8-bit-eligible parameter with rows of ``L`` elements (the last dim) the
    block is ``k = B / gcd(B, L)`` rows, the fewest whole rows that are a multiple of
    B elements; every cut is then a multiple of B from the parameter's (or member's)
    start. When ``k`` does not divide the parameter's (member's) rows, ``fully_shard``
    cannot use it, and the parameter is kept whole (``"whole"``: one rank holds the
    whole tensor, or each whole member of a stack): always aligned, but it may cost
    balance. Parameters that keep fp32 moments get blocks of one row. Under FSDP x TP
    the parameter is the TP DTensor: 8-bit or not by its global shape, ``L`` and the
    rows those of its local tensor (see [Note: 8-bit states under TP and EP]).

    Args:
        block_size: B, elements per quantization block. Default 256.
        min_8bit_size: as in ``AdamW8bit``. Default 4096.
        whole_fallback: keep unalignable parameters whole; False raises instead.
            Default True.

    Raises:
        ValueError: a bad size, or (when called) a parameter that cannot be aligned
            and ``whole_fallback=False``.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE
    whole_fallback: bool = True

    def __post_init__(self) -> None:
        _check_sizes("AdamW8bitBlockPolicy", self.block_size, self.min_8bit_size)

    def __call__(self, fqn: str, param: torch.Tensor):
        if len(param.shape) == 0 or not is_8bit_eligible(
            tuple(param.shape), self.block_size, self.min_8bit_size
        ):
            return 1  # fp32 moments need no alignment
        # eligibility from the global shape, rows from the local tensor the RaggedShard cuts
        shape = tuple((param.to_local() if isinstance(param, DTensor) else param).shape)
        row = shape[-1] if len(shape) >= 2 else 1  # a 1-D tensor's rows are its elements
        member_rows = math.prod(shape) // row // _members(shape)
        rows = self.block_size // math.gcd(self.block_size, row)
        if member_rows % rows == 0:
            return rows
        if self.whole_fallback:
            return "whole"
        raise ValueError(
            f"adamw8bit_block_policy: parameter {fqn!r} of shape {shape} has {member_rows} "
            f"rows of {row} elements; whole quantization blocks of {self.block_size} elements "
            f"need blocks of a multiple of {rows} rows, which do not divide {member_rows}; "
            f"pass whole_fallback=True to keep it whole, or pad the layer"
        )


def adamw8bit_block_policy(
    block_elems: int = DEFAULT_BLOCK_SIZE,
    *,
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
    whole_fallback: bool = True,
) -> AdamW8bitBlockPolicy:
    """The block policy for ``fully_shard(..., block_policy=...)`` that ``AdamW8bit`` needs.

    Pass the same ``block_elems`` / ``min_8bit_size`` as to ``AdamW8bit``; see
    ``AdamW8bitBlockPolicy``.
    """
    return AdamW8bitBlockPolicy(
        block_size=block_elems, min_8bit_size=min_8bit_size, whole_fallback=whole_fallback
    )


# ---- where a parameter's quantization blocks lie ---------------------------------------------
def scale_grid(shape, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[int, ...] | None:
    """The shape of an 8-bit parameter's scales when its rows hold whole quantization
    blocks: the parameter's shape, its last dim counted in blocks; None (1-D scales of
    ``[scales]``) otherwise. See [Note: 8-bit states under TP and EP]."""
    shape = tuple(shape)
    if len(shape) >= 2 and shape[-1] % block_size == 0:
        return (*shape[:-1], shape[-1] // block_size)
    return None


@dataclass(frozen=True, eq=False)
class _ParamQuant:
    """One 8-bit parameter: its blocks on this rank and its scales' global layout."""

    numel: int  # of the piece this rank's blocks are counted in (the TP-local piece)
    member_numel: int  # of one member of that piece
    lo: int  # this rank's elements [lo, hi) of the flattened piece
    hi: int
    n_scales: int  # global
    grid: tuple[int, ...] | None  # the scales' global shape, if not (n_scales,)
    block_size: int
    scale_lo: int  # this rank's scales [scale_lo, scale_hi) of the piece's
    scale_hi: int
    scale_units: tuple[int, ...] | None  # scales per rank when RaggedShard, else None
    blocks: Blocks
    ragged_dim: int | None = None  # the mesh dim the RaggedShard cuts (None: not sharded)

    def scale_placements(self, placements: tuple) -> list:
        """The scales' placements: the parameter's when the scales are a grid (cut as the
        parameter), else its RaggedShard made one over the 1-D scales."""
        out = list(placements)
        if self.ragged_dim is not None and self.grid is None:
            assert self.scale_units is not None  # set with ragged_dim (a RaggedShard)
            out[self.ragged_dim] = RaggedShard(dims=(0,), local_units=self.scale_units)
        return out

    def local_scales(self, scales: torch.Tensor, local_shape) -> torch.Tensor:
        """This rank's flat ``scales`` shaped as its piece of the scales (a view)."""
        if self.grid is None:
            return scales
        return scales.view(*local_shape[:-1], local_shape[-1] // self.block_size)


def _check_tp_cut(name: str, shape, piece_shape, cut, axis, block: int, grid) -> None:
    """Raise unless the Shard ``cut`` (tensor or expert parallelism) leaves each rank whole
    quantization blocks whose scales can be placed like the parameter."""
    if len(shape) >= 3 and cut.dim == 0:
        return  # whole members of a stack (experts over ep): blocks count from each member
    run = math.prod(piece_shape[cut.dim :])  # contiguous elements of the global tensor
    where = f"AdamW8bit: parameter {name!r} of shape {shape} is placed {cut} on mesh dim {axis!r}"
    if run % block:
        raise ValueError(
            f"{where}: a rank holds runs of {run} elements of it, not whole quantization blocks "
            f"of {block} elements, so blocks would span ranks of that dim; pass a block_size "
            f"that divides {run} (e.g. {math.gcd(run, block)}) to AdamW8bit and to "
            "adamw8bit_block_policy"
        )
    if cut.dim > 0 and grid is None:
        raise NotImplementedError(
            f"{where}: its rows of {shape[-1]} elements are not whole quantization blocks of "
            f"{block}, so its scales cannot be cut as the parameter is; pass a block_size that "
            f"divides {shape[-1]}"
        )


def _param_quant(name: str, p: torch.Tensor, block: int) -> _ParamQuant:
    """Where ``p``'s quantization blocks lie; raises if a rank boundary splits one."""
    shape = tuple(p.shape)
    grid = scale_grid(shape, block)
    n_scales = _members(shape) * -(-math.prod(shape) // _members(shape) // block)
    # Only a RaggedShard cuts the piece the blocks are counted in; a Shard before it (TP,
    # EP) leaves each rank a piece of whole blocks (checked), and every other mesh dim
    # (Replicate, HSDP's replicate dim) the whole of what its shard rank is given.
    piece_shape, cuts, rank, dim, on = shape, None, 0, None, ""
    if isinstance(p, DTensor):
        placements, mesh = tuple(p.placements), p.device_mesh
        names: tuple[str | int, ...] = mesh.mesh_dim_names or tuple(range(mesh.ndim))
        tp = [(i, q) for i, q in enumerate(placements) if type(q) is Shard]
        try:
            found = ragged_axis(placements)
        except (ValueError, NotImplementedError):
            found = None
        plain = all(isinstance(q, Replicate) for q in placements)
        if not plain and (found is None or len(tp) > 1):
            raise NotImplementedError(
                f"AdamW8bit: parameter {name!r} is a DTensor with placements {placements}; "
                f"8-bit states need whole quantization blocks on every rank, which "
                f"RaggedShard on the mesh's last dim, Replicate and one tensor- or "
                f"expert-parallel Shard before it give: shard it with "
                f"raggedfsdp.fully_shard(..., block_policy=adamw8bit_block_policy({block})), "
                f"or pass plain or replicated tensors"
            )
        if found is not None:
            piece = ragged_piece(shape, mesh, placements)
            for i, q in tp:
                _check_tp_cut(name, shape, piece.shape, q, names[i], block, grid)
            piece_shape, dim, rank = piece.shape, piece.axis, piece.coord
            rs, numel = piece.rs, math.prod(piece.shape)
            row = rs.row_numel(piece_shape)
            cuts = [rs.local_row_range(piece_shape, r)[0] * row for r in range(rs.world_size)]
            cuts.append(numel)
            if mesh.ndim > 1:
                on = f" on mesh dim {names[dim]!r}"
    numel = math.prod(piece_shape)
    member = numel // _members(piece_shape)
    per_member = -(-member // block)
    cuts = cuts or [0, numel]

    def scale_index(elem: int) -> int:  # first scale at or after an aligned element
        return (elem // member) * per_member + -(-(elem % member) // block)

    for r, cut in enumerate(cuts[:-1]):
        if (cut % member) % block:
            where = "its member's start" if member != numel else "its start"
            raise ValueError(
                f"AdamW8bit: parameter {name!r} of shape {shape} is cut at element {cut} "
                f"(rank {r}'s first{on}), {(cut % member) % block} elements past a quantization "
                f"block of {block} counted from {where}: the quantization block does not divide "
                f"its RaggedShard block; shard it with fully_shard(..., "
                f"block_policy=adamw8bit_block_policy({block}))"
            )
    lo, hi = cuts[rank], cuts[rank + 1]
    units = None
    if dim is not None:
        units = tuple(scale_index(cuts[r + 1]) - scale_index(cuts[r]) for r in range(len(cuts) - 1))
    lengths = param_block_lengths(numel, member, lo, hi, block)
    return _ParamQuant(
        numel=numel,
        member_numel=member,
        lo=lo,
        hi=hi,
        n_scales=n_scales,
        grid=grid,
        block_size=block,
        scale_lo=scale_index(lo),
        scale_hi=scale_index(hi),
        scale_units=units,
        blocks=Blocks.from_lengths(lengths, device=local(p).device),
        ragged_dim=dim,
    )


def _scales_like(scales: torch.Tensor, p: torch.Tensor, pq: _ParamQuant) -> torch.Tensor:
    """This rank's flat ``scales`` of ``p`` as its state: shaped as ``pq.grid`` (or 1-D),
    a DTensor of all its scales placed as ``pq.scale_placements`` for a DTensor ``p``."""
    scales = pq.local_scales(scales, local(p).shape)
    if not isinstance(p, DTensor):
        return scales
    shape = pq.grid or (pq.n_scales,)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    placements = pq.scale_placements(tuple(p.placements))
    # torch's stub says torch.Size; from_local takes any tuple of ints
    return DTensor.from_local(
        scales,
        p.device_mesh,
        placements,
        shape=shape,  # type: ignore[arg-type]
        stride=stride,
    )


# ---- flat state of one fully_shard buffer ----------------------------------------------------
@dataclass(eq=False)
class _FlatState:
    codes: tuple[torch.Tensor, ...]  # (m, v): uint8, 1D, S elements each
    scales: tuple[torch.Tensor, ...]  # (m, v): fp32, one per block of `blocks`
    blocks: Blocks  # the shard storage cut into quantization blocks and gaps
    small: tuple[torch.Tensor, ...]  # (m, v): fp32 moments of the fp32-state parameters
    small_index: torch.Tensor  # int64: their elements in the shard storage
    scale_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # fqn -> scales
    small_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # fqn -> small
    quant: dict[str, _ParamQuant] = field(default_factory=dict)  # fqn -> its blocks


class AdamW8bit(FlatOptimizer):
    """AdamW (decoupled weight decay) with block-wise 8-bit moments.

    See [Note: 8-bit states under RaggedShard]. Parameters may be plain tensors,
    replicated DTensors, or RaggedShard DTensors whose ranks hold whole quantization
    blocks (``fully_shard`` with ``adamw8bit_block_policy``, on a 1-D mesh, HSDP's
    ``(replicate, shard)`` mesh, or beside tensor / expert parallelism: see [Note:
    8-bit states under TP and EP]). The update: dequantize,
    the AdamW step in fp32 (the new moments, not their codes, make the update),
    requantize.

    Args:
        params, lr, betas, eps, weight_decay: as for ``AdamW`` (and with its defaults:
            1e-3, (0.9, 0.999), 1e-8, 1e-2).
        block_size: B, elements per quantization block (one fp32 scale each). Default 256.
        min_8bit_size: parameters with fewer elements (global size) keep fp32 moments.
            Default 4096.

    Raises:
        ValueError: a hyperparameter out of range, naming it; at the first step, a
            parameter whose shards split a quantization block.
        NotImplementedError: at the first step, a DTensor parameter placed other than
            RaggedShard on the mesh's last dim, Replicate and one Shard before it.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
    ):
        check_hyper("AdamW8bit", lr=lr, eps=eps, betas=betas, weight_decay=weight_decay)
        _check_sizes("AdamW8bit", block_size, min_8bit_size)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size
        self._quant: dict[int, _ParamQuant] = {}  # id(param) -> blocks (not fully_shard's)

    def is_8bit(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has 8-bit moments (decided from its global shape)."""
        return is_8bit_eligible(tuple(p.shape), self.block_size, self.min_8bit_size)

    # ---- state ----------------------------------------------------------------------------
    def _flat_state(self, buf: BufferView) -> _FlatState:
        fs = self._flat.get(buf)
        shard = buf.shard  # 1D, S elements
        if fs is not None and fs.codes[0].shape == shard.shape:
            return fs
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        S, layout, device = buf.layout.shard_size, buf.layout, shard.device
        lengths: list[int] = []
        small_index: list[torch.Tensor] = []
        scale_ranges, small_ranges, quant = {}, {}, {}
        pos = n_small = 0
        for s in sorted(buf.params, key=lambda s: layout[s.fqn].offset):
            if id(s.param) not in mine:
                continue
            start, stop = s.start, s.stop
            if not self.is_8bit(s.param):
                small_index.append(s.positions(device))
                small_ranges[s.fqn] = (n_small, n_small + s.numel)
                n_small += s.numel
                continue
            pq = _param_quant(s.fqn, s.param, self.block_size)
            quant[s.fqn] = pq
            if stop == start:
                scale_ranges[s.fqn] = (len(lengths), len(lengths))
                continue
            if start > pos:
                lengths.append(start - pos)  # a gap: fp32-state parameters and padding
            first = len(lengths)
            own = param_block_lengths(pq.numel, pq.member_numel, pq.lo, pq.hi, self.block_size)
            lengths += own if s.contiguous else _with_member_gaps(own, s)
            scale_ranges[s.fqn] = (first, len(lengths))
            pos = stop
        if pos < S:
            lengths.append(S - pos)
        blocks = Blocks.from_lengths(lengths, device=device)
        codes = (dynamic_tree_map(True, device).zero, dynamic_tree_map(False, device).zero)
        self._flat[buf] = fs = _FlatState(
            codes=tuple(torch.full((S,), z, dtype=torch.uint8, device=device) for z in codes),
            scales=tuple(torch.zeros(blocks.count, device=device) for _ in range(2)),
            blocks=blocks,
            small=tuple(torch.zeros(n_small, device=device) for _ in range(2)),
            small_index=(
                torch.cat(small_index)
                if small_index
                else torch.zeros(0, dtype=torch.int64, device=device)
            ),
            scale_ranges=scale_ranges,
            small_ranges=small_ranges,
            quant=quant,
        )
        return fs

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        found = buffer_of(p)
        shape = local(p).shape
        if found is not None:
            buf, s = found
            fs = self._flat_state(buf)
            if s.fqn in fs.quant:
                a, b = fs.scale_ranges[s.fqn]
                for i, key in enumerate(_MOMENTS):
                    state[f"{key}_codes"] = like_param(s.view(fs.codes[i]), p)
                    state[f"{key}_scales"] = _scales_like(fs.scales[i][a:b], p, fs.quant[s.fqn])
            else:
                a, b = fs.small_ranges[s.fqn]
                for i, key in enumerate(_MOMENTS):
                    state[key] = like_param(fs.small[i][a:b].view(shape), p)
            return
        if not self.is_8bit(p):
            for key in _MOMENTS:
                state[key] = like_param(torch.zeros_like(local(p), dtype=torch.float32), p)
            return
        pq = _param_quant(self._name(p), p, self.block_size)
        self._quant[id(p)] = pq
        for signed, key in zip((True, False), _MOMENTS):
            zero = dynamic_tree_map(signed, p.device).zero
            codes = torch.full_like(local(p), zero, dtype=torch.uint8)
            scales = local(p).new_zeros(pq.scale_hi - pq.scale_lo, dtype=torch.float32)
            state[f"{key}_codes"] = like_param(codes, p)
            state[f"{key}_scales"] = _scales_like(scales, p, pq)

    def _check_new(self, p: torch.Tensor) -> None:
        if self.is_8bit(p):
            _param_quant(self._name(p), p, self.block_size)  # raises where a rank cuts a block

    def _param_quant_of(self, p: torch.Tensor) -> _ParamQuant:
        found = buffer_of(p)
        if found is not None:
            return self._flat_state(found[0]).quant[found[1].fqn]
        return self._quant[id(p)]

    def load_state_dict(self, state_dict) -> None:
        """Load, then copy every loaded moment into this optimizer's own storage.

        The loaded tensors are taken from ``state_dict`` itself, not from torch's
        loading (which casts floating state to the parameter's dtype: lossy for fp32
        scales of bf16 parameters).
        """
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved, params):
            loaded = state_dict["state"].get(i)
            if not loaded:
                continue
            self._reload(p, loaded)

    def _load_hint(self) -> str:
        return (
            f"; load it with the block_size / min_8bit_size it was saved with (now "
            f"{self.block_size} / {self.min_8bit_size})"
        )

    # ---- step -----------------------------------------------------------------------------
    def _step_whole(self, whole: WholeStep) -> None:
        buf, h = whole.buffer, whole.group
        fs = self._flat_state(buf)
        lr, (beta1, beta2) = h["lr"], h["betas"]
        param = buf.shard  # 1D, S elements
        grad = buf.shard_grad.float()  # 1D, S
        signed = dynamic_tree_map(True, param.device)  # first moment's code table
        unsigned = dynamic_tree_map(False, param.device)  # second moment's
        m = dequantize(fs.codes[0], fs.scales[0], fs.blocks, signed)  # 1D, S fp32
        v = dequantize(fs.codes[1], fs.scales[1], fs.blocks, unsigned)
        if fs.small_index.numel():
            m.index_copy_(0, fs.small_index, fs.small[0])
            v.index_copy_(0, fs.small_index, fs.small[1])
        _moments(m, v, grad, beta1, beta2)
        if fs.small_index.numel():
            torch.index_select(m, 0, fs.small_index, out=fs.small[0])
            torch.index_select(v, 0, fs.small_index, out=fs.small[1])
        _update(param, m, v, whole.step, lr, beta1, beta2, h["eps"])
        quantize_(m, fs.blocks, signed, fs.codes[0], fs.scales[0])
        quantize_(v, fs.blocks, unsigned, fs.codes[1], fs.scales[1])

    def _step_param(self, p: torch.Tensor, h: dict, step: float) -> None:
        state = self.state[p]
        lr, (beta1, beta2), eps = h["lr"], h["betas"], h["eps"]
        assert p.grad is not None  # stepped only with a gradient
        grad = local(p.grad).reshape(-1).float()
        if "exp_avg" in state:
            # the states are contiguous (a view: written in place); only param may be gapped
            param, m, v = _flat(local(p)), *(local(state[key]).view(-1) for key in _MOMENTS)
            _moments(m, v, grad, beta1, beta2)
            _update(param, m, v, step, lr, beta1, beta2, eps)
            _write_back(local(p), param)
            return
        pq = self._param_quant_of(p)
        param = _flat(local(p))
        maps = (dynamic_tree_map(True, param.device), dynamic_tree_map(False, param.device))
        codes = [local(state[f"{key}_codes"]).view(-1) for key in _MOMENTS]
        scales = [local(state[f"{key}_scales"]).view(-1) for key in _MOMENTS]
        m, v = (dequantize(c, s, pq.blocks, q) for c, s, q in zip(codes, scales, maps))
        _moments(m, v, grad, beta1, beta2)
        _update(param, m, v, step, lr, beta1, beta2, eps)
        _write_back(local(p), param)
        for x, c, s, q, key in zip((m, v), codes, scales, maps, _MOMENTS):
            quantize_(x, pq.blocks, q, c, s)
            _write_back(local(state[f"{key}_codes"]), c)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 1D: a view, or a copy of a gapped stack's members (see ``_write_back``)."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def _write_back(t: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` (from ``_flat(t)``) back into ``t`` unless it is a view of it: the
    one copy each way of a parameter planned with member gaps stepped on its own."""
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def _with_member_gaps(lengths: list[int], s) -> list[int]:
    """Block ``lengths`` of a gapped stack's whole members, each member's last block
    stretched over the gap after it: the flat state's blocks, laid out as the storage.

    The gap is padding, zero in the moments, so a stretched block's scale (its amax)
    and its members' codes are those of the unstretched block.
    """
    member, gap = math.prod(s.size[1:]), s.stride[0] - math.prod(s.size[1:])
    out, acc = [], 0
    for n in lengths:
        acc += n
        out.append(n)
        if acc % member == 0 and acc < s.numel:
            out[-1] += gap
    return out


# [Note: bit-identical under any sharding] (see quant.py): single correctly rounded ops only.
def _moments(m, v, grad, beta1, beta2) -> None:
    """``m = beta1 m + (1 - beta1) g`` and ``v = beta2 v + (1 - beta2) g^2``, in place."""
    m.mul_(beta1).add_(grad * (1 - beta1))
    v.mul_(beta2).add_((grad * grad).mul_(1 - beta2))


def _update(param, m, v, step, lr, beta1, beta2, eps) -> None:
    """``param -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` (decay already applied)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = v.sqrt().div_(math.sqrt(bias_correction2)).add_(eps)
    update = torch.div(m, denom, out=denom).mul_(lr / bias_correction1)
    param.sub_(update)
