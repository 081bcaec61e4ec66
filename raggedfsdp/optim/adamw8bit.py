"""AdamW with block-wise 8-bit moments whose blocks never cross a rank.

[Note: 8-bit states under RaggedShard]
Each moment of a parameter of at least ``min_8bit_size`` elements (its *global*
size, so sharding never changes which parameters are 8-bit; torchao decides from
the local shard, pytorch/ao#4912) is stored as a uint8 code per element and one
fp32 scale per quantization block of ``block_size`` (B) elements, counted from the
parameter's own element 0 (for a stacked ``[E, ...]`` tensor, from each member's):
see [Note: dynamic tree quantization] in ``_quant.py`` for the codes. Smaller
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

The state seen by ``state_dict`` and DCP is per parameter: ``exp_avg_codes`` and
``exp_avg_sq_codes`` (uint8, placed like the parameter) and ``exp_avg_scales`` /
``exp_avg_sq_scales`` (fp32, shape ``[scales]``, a 1-D ``RaggedShard`` whose
``local_units`` are each rank's scale counts), so a checkpoint reshards codes and
scales together by global position, with no requantization.

For parameters sharded by ``fully_shard`` the codes live in two flat uint8 tensors
of S elements (like the group's shard storage) and the scales in two flat fp32
tensors with one entry per block of the shard (the gaps between 8-bit parameters
count as blocks too); ``state[p]`` holds views. As in the flat ``AdamW``, when every
parameter of a buffer steps together one update covers the whole buffer (a fixed
number of kernels); otherwise each parameter steps over the same views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate

from raggedfsdp.fsdp._param_group import ParamGroup, owner_of
from raggedfsdp.optim._quant import (
    Blocks,
    dequantize,
    dynamic_tree_map,
    param_block_lengths,
    quantize_,
)
from raggedfsdp.placement import RaggedShard

__all__ = ["AdamW8bit", "AdamW8bitBlockPolicy", "adamw8bit_block_policy", "is_8bit_eligible"]

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
    balance. Parameters that keep fp32 moments get blocks of one row.

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
        shape = tuple(param.shape)
        if len(shape) <= 1 or not is_8bit_eligible(shape, self.block_size, self.min_8bit_size):
            return 1  # a 1-D tensor is one row, always whole; fp32 moments need no alignment
        row = shape[-1]
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
@dataclass(frozen=True, eq=False)
class _ParamQuant:
    """One 8-bit parameter: its blocks on this rank and its scales' global layout."""

    numel: int
    member_numel: int
    lo: int  # this rank's elements [lo, hi) of the flattened tensor
    hi: int
    n_scales: int  # global
    scale_lo: int  # this rank's scales [scale_lo, scale_hi)
    scale_hi: int
    scale_units: tuple[int, ...] | None  # scales per rank when RaggedShard, else None
    blocks: Blocks

    @property
    def scale_placement(self) -> RaggedShard:
        return RaggedShard(dims=(0,), local_units=self.scale_units)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _param_quant(name: str, p: torch.Tensor, block: int) -> _ParamQuant:
    """Where ``p``'s quantization blocks lie; raises if a rank boundary splits one."""
    shape = tuple(p.shape)
    numel = math.prod(shape)
    member = numel // _members(shape)
    per_member = -(-member // block)

    def scale_index(elem: int) -> int:  # first scale at or after an aligned element
        return (elem // member) * per_member + -(-(elem % member) // block)

    cuts, rank, ragged = [0, numel], 0, False
    if isinstance(p, DTensor):
        placements = tuple(p.placements)
        if p.device_mesh.ndim == 1 and isinstance(placements[0], RaggedShard):
            placement, world = placements[0], p.device_mesh.size(0)
            rank, ragged = p.device_mesh.get_local_rank(0), True
            row = placement.row_numel(shape)
            cuts = [placement.local_row_range(shape, r)[0] * row for r in range(world)] + [numel]
        elif not all(isinstance(pl, Replicate) for pl in placements):
            raise NotImplementedError(
                f"AdamW8bit: parameter {name!r} is a DTensor with placements {placements}; "
                f"8-bit states need whole quantization blocks on every rank: shard it with "
                f"raggedfsdp.fully_shard(..., block_policy=adamw8bit_block_policy({block})), "
                f"or pass plain or replicated tensors"
            )
    for r, cut in enumerate(cuts[:-1]):
        if (cut % member) % block:
            where = "its member's start" if member != numel else "its start"
            raise ValueError(
                f"AdamW8bit: parameter {name!r} of shape {shape} is cut at element {cut} "
                f"(rank {r}'s first), {(cut % member) % block} elements past a quantization "
                f"block of {block} counted from {where}: the quantization block does not divide "
                f"its RaggedShard block; shard it with fully_shard(..., "
                f"block_policy=adamw8bit_block_policy({block}))"
            )
    lo, hi = cuts[rank], cuts[rank + 1]
    units = None
    if ragged:
        units = tuple(scale_index(cuts[r + 1]) - scale_index(cuts[r]) for r in range(len(cuts) - 1))
    lengths = param_block_lengths(numel, member, lo, hi, block)
    return _ParamQuant(
        numel=numel,
        member_numel=member,
        lo=lo,
        hi=hi,
        n_scales=scale_index(numel),
        scale_lo=scale_index(lo),
        scale_hi=scale_index(hi),
        scale_units=units,
        blocks=Blocks.from_lengths(lengths),
    )


def _like_param(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor placed like ``p`` (or ``local`` itself for a plain ``p``)."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _scales_like(local: torch.Tensor, p: torch.Tensor, pq: _ParamQuant) -> torch.Tensor:
    if not isinstance(p, DTensor):
        return local
    placements = [pq.scale_placement] if pq.scale_units is not None else list(p.placements)
    return DTensor.from_local(local, p.device_mesh, placements, shape=(pq.n_scales,), stride=(1,))


# ---- flat state of one fully_shard buffer ----------------------------------------------------
@dataclass(eq=False)
class _FlatState:
    codes: tuple[torch.Tensor, torch.Tensor]  # uint8, 1D, S elements each
    scales: tuple[torch.Tensor, torch.Tensor]  # fp32, one per block of `blocks`
    blocks: Blocks  # the shard storage cut into quantization blocks and gaps
    small: tuple[torch.Tensor, torch.Tensor]  # fp32 moments of the fp32-state parameters
    small_index: torch.Tensor  # int64: their elements in the shard storage
    scale_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # fqn -> scales
    small_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # fqn -> small
    quant: dict[str, _ParamQuant] = field(default_factory=dict)  # fqn -> its blocks


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with block-wise 8-bit moments.

    See [Note: 8-bit states under RaggedShard]. Parameters may be plain tensors,
    replicated DTensors, or RaggedShard DTensors whose ranks hold whole quantization
    blocks (``fully_shard`` with ``adamw8bit_block_policy``). The update: dequantize,
    the AdamW step in fp32 (the new moments, not their codes, make the update),
    requantize.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr: learning rate. Default 1e-3.
        betas: coefficients of the moment averages. Default (0.9, 0.999).
        eps: added to the denominator. Default 1e-8.
        weight_decay: decoupled weight decay. Default 1e-2.
        block_size: B, elements per quantization block (one fp32 scale each). Default 256.
        min_8bit_size: parameters with fewer elements (global size) keep fp32 moments.
            Default 4096.

    Raises:
        ValueError: a hyperparameter out of range, naming it; at the first step, a
            parameter whose shards split a quantization block.
        NotImplementedError: at the first step, a DTensor parameter placed other than
            RaggedShard or Replicate on a 1-D mesh.
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
        if not lr >= 0.0:
            raise ValueError(f"AdamW8bit: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"AdamW8bit: eps must be >= 0, got {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"AdamW8bit: betas[{i}] must be in [0, 1), got {b}")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW8bit: weight_decay must be >= 0, got {weight_decay}")
        _check_sizes("AdamW8bit", block_size, min_8bit_size)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size
        self._flat: dict[int, _FlatState] = {}
        self._quant: dict[int, _ParamQuant] = {}  # id(param) -> blocks (not fully_shard's)

    def is_8bit(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has 8-bit moments (decided from its global shape)."""
        return is_8bit_eligible(tuple(p.shape), self.block_size, self.min_8bit_size)

    def _name(self, p: torch.Tensor) -> str:
        owner = owner_of(p)
        if owner is not None:
            return owner[1].fqn
        for gi, g in enumerate(self.param_groups):
            for pi, q in enumerate(g["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}]"
        return "<unknown>"

    # ---- state ----------------------------------------------------------------------------
    def _flat_state(self, group: ParamGroup) -> _FlatState:
        fs = self._flat.get(id(group))
        if fs is not None and fs.codes[0].shape == group.dbuf.shard.shape:
            return fs
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        S, rank, layout = group.layout.shard_size, group.rank, group.layout
        lengths, small_index = [], []
        scale_ranges, small_ranges, quant = {}, {}, {}
        pos = n_small = 0
        for ref in sorted(group.refs, key=lambda r: layout[r.fqn].offset):
            if id(ref.sharded) not in mine:
                continue
            start, stop = layout.shard_range(ref.fqn, rank)
            if not self.is_8bit(ref.sharded):
                small_index.append(torch.arange(start, stop))
                small_ranges[ref.fqn] = (n_small, n_small + stop - start)
                n_small += stop - start
                continue
            pq = _param_quant(ref.fqn, ref.sharded, self.block_size)
            quant[ref.fqn] = pq
            if stop == start:
                scale_ranges[ref.fqn] = (len(lengths), len(lengths))
                continue
            if start > pos:
                lengths.append(start - pos)  # a gap: fp32-state parameters and padding
            first = len(lengths)
            lengths += pq.blocks.lengths.mul(pq.blocks.unit).tolist()
            scale_ranges[ref.fqn] = (first, len(lengths))
            pos = stop
        if pos < S:
            lengths.append(S - pos)
        shard = group.dbuf.shard
        zero = (dynamic_tree_map(True).zero, dynamic_tree_map(False).zero)
        blocks = Blocks.from_lengths(lengths)
        fs = _FlatState(
            codes=tuple(torch.full((S,), z, dtype=torch.uint8, device=shard.device) for z in zero),
            scales=tuple(torch.zeros(blocks.count, device=shard.device) for _ in range(2)),
            blocks=blocks,
            small=tuple(torch.zeros(n_small, device=shard.device) for _ in range(2)),
            small_index=(torch.cat(small_index) if small_index else torch.zeros(0)).long(),
            scale_ranges=scale_ranges,
            small_ranges=small_ranges,
            quant=quant,
        )
        fs.small_index = fs.small_index.to(shard.device)
        self._flat[id(group)] = fs
        return fs

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if state:
            return state
        state["step"] = torch.tensor(0.0)
        owner = owner_of(p)
        local = _local(p)
        if owner is not None:
            group, ref = owner
            fs = self._flat_state(group)
            start, stop = group.layout.shard_range(ref.fqn, group.rank)
            if ref.fqn in fs.quant:
                a, b = fs.scale_ranges[ref.fqn]
                for i, key in enumerate(_MOMENTS):
                    codes = fs.codes[i][start:stop].view(local.shape)
                    state[f"{key}_codes"] = _like_param(codes, p)
                    state[f"{key}_scales"] = _scales_like(fs.scales[i][a:b], p, fs.quant[ref.fqn])
            else:
                a, b = fs.small_ranges[ref.fqn]
                for i, key in enumerate(_MOMENTS):
                    state[key] = _like_param(fs.small[i][a:b].view(local.shape), p)
            return state
        if not self.is_8bit(p):
            for key in _MOMENTS:
                state[key] = _like_param(torch.zeros_like(local, dtype=torch.float32), p)
            return state
        pq = _param_quant(self._name(p), p, self.block_size)
        self._quant[id(p)] = pq
        for signed, key in zip((True, False), _MOMENTS):
            codes = torch.full_like(local, dynamic_tree_map(signed).zero, dtype=torch.uint8)
            scales = torch.zeros(pq.scale_hi - pq.scale_lo, device=local.device)
            state[f"{key}_codes"] = _like_param(codes, p)
            state[f"{key}_scales"] = _scales_like(scales, p, pq)
        return state

    def _param_quant_of(self, p: torch.Tensor) -> _ParamQuant:
        owner = owner_of(p)
        if owner is not None:
            return self._flat_state(owner[0]).quant[owner[1].fqn]
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
            self.state[p] = {}
            fresh = self._state(p)
            shapes = {k: tuple(_local(v).shape) for k, v in fresh.items() if k != "step"}
            got = {k: tuple(_local(v).shape) for k, v in loaded.items() if k != "step"}
            if shapes != got:
                raise ValueError(
                    f"AdamW8bit.load_state_dict: parameter {self._name(p)!r} has states "
                    f"{got} in the state dict but {shapes} here; load it with the "
                    f"block_size / min_8bit_size it was saved with (now {self.block_size} / "
                    f"{self.min_8bit_size})"
                )
            fresh["step"] = loaded["step"].detach().clone().float().cpu()
            for key, value in fresh.items():
                if key != "step":
                    _local(value).copy_(_local(loaded[key]))

    # ---- step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hyper: dict[int, dict] = {}
        by_buffer: dict[int, tuple[ParamGroup, list]] = {}
        single = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                hyper[id(p)] = g
                owner = owner_of(p)
                if owner is None:
                    single.append(p)
                else:
                    by_buffer.setdefault(id(owner[0]), (owner[0], []))[1].append(p)
        for group, members in by_buffer.values():
            if not self._step_buffer(group, members, hyper):
                single.extend(members)
        for p in single:
            self._step_param(p, hyper[id(p)])
        return loss

    def _step_buffer(self, group: ParamGroup, members: list, hyper: dict) -> bool:
        """One update of a whole buffer; False when the per-parameter path must run.

        Needs every parameter of the buffer here, trainable, with its gradient a view
        of the flat gradient storage, and one lr / betas / eps / step count.
        """
        if len(members) != len(group.refs):
            return False  # a frozen parameter, or one of another optimizer, shares the buffer
        if any(ref.sharded.grad is not ref.sharded_grad for ref in group.refs):
            return False
        hp = [hyper[id(ref.sharded)] for ref in group.refs]
        if len({(h["lr"], h["betas"], h["eps"]) for h in hp}) != 1:
            return False
        states = [self._state(ref.sharded) for ref in group.refs]
        if len({s["step"].item() for s in states}) != 1:
            return False
        fs = self._flat_state(group)
        for s in states:
            s["step"] += 1
        h = hp[0]
        step = states[0]["step"].item()
        param = group.dbuf.shard  # 1D, S elements
        grad = group.dbuf.shard_grad.float()  # 1D, S
        lr = h["lr"]
        for start, stop, wd in self._decay_runs(group, hp):
            param[start:stop].mul_(1 - lr * wd)
        signed, unsigned = dynamic_tree_map(True), dynamic_tree_map(False)
        m = dequantize(fs.codes[0], fs.scales[0], fs.blocks, signed)  # 1D, S fp32
        v = dequantize(fs.codes[1], fs.scales[1], fs.blocks, unsigned)
        if fs.small_index.numel():
            m.index_copy_(0, fs.small_index, fs.small[0])
            v.index_copy_(0, fs.small_index, fs.small[1])
        _moments(m, v, grad, *h["betas"])
        if fs.small_index.numel():
            torch.index_select(m, 0, fs.small_index, out=fs.small[0])
            torch.index_select(v, 0, fs.small_index, out=fs.small[1])
        _update(param, m, v, step, lr, *h["betas"], h["eps"])
        quantize_(m, fs.blocks, signed, fs.codes[0], fs.scales[0])
        quantize_(v, fs.blocks, unsigned, fs.codes[1], fs.scales[1])
        return True

    @staticmethod
    def _decay_runs(group: ParamGroup, hp: list) -> list[tuple[int, int, float]]:
        """``(start, stop, weight decay)`` runs covering the shard storage, merged."""
        layout, rank = group.layout, group.rank
        spans = sorted(
            (layout.shard_range(ref.fqn, rank), h["weight_decay"]) for ref, h in zip(group.refs, hp)
        )
        runs: list[list] = []
        for (start, stop), wd in spans:
            if stop == start:
                continue
            if runs and runs[-1][2] == wd:
                runs[-1][1] = stop  # padding in between is zero: decaying it is harmless
            else:
                runs.append([start, stop, wd])
        return [tuple(r) for r in runs]

    def _step_param(self, p: torch.Tensor, h: dict) -> None:
        state = self._state(p)
        state["step"] += 1
        step, lr, (beta1, beta2), eps = state["step"].item(), h["lr"], h["betas"], h["eps"]
        param = _local(p).view(-1)
        grad = _local(p.grad).reshape(-1).float()
        param.mul_(1 - lr * h["weight_decay"])
        if "exp_avg" in state:
            m, v = (_local(state[key]).view(-1) for key in _MOMENTS)
            _moments(m, v, grad, beta1, beta2)
            _update(param, m, v, step, lr, beta1, beta2, eps)
            return
        pq = self._param_quant_of(p)
        maps = (dynamic_tree_map(True), dynamic_tree_map(False))
        codes = [_local(state[f"{key}_codes"]).view(-1) for key in _MOMENTS]
        scales = [_local(state[f"{key}_scales"]) for key in _MOMENTS]
        m, v = (dequantize(c, s, pq.blocks, q) for c, s, q in zip(codes, scales, maps))
        _moments(m, v, grad, beta1, beta2)
        _update(param, m, v, step, lr, beta1, beta2, eps)
        for x, c, s, q in zip((m, v), codes, scales, maps):
            quantize_(x, pq.blocks, q, c, s)


# [Note: bit-identical under any sharding] (see _quant.py): single correctly rounded ops only.
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
