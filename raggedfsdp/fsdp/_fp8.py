"""FP8 all-gather with block scales that never leave their rank.

[Note: FP8 all-gather]
``MixedPrecisionPolicy(all_gather=Float8BlockAllGather(tile=(128, 128)))`` gathers the
selected matrices as ``torch.float8_e4m3fn`` codes with one scale per tile, instead of
in the compute dtype. The planner already keeps blocks whole on every rank; the block
policy of a selected parameter is raised to a multiple of the tile's rows
(``block_rows_for``), so every tile lies on one rank, and each rank quantizes its own
master rows: the result is bit-identical to quantizing the whole matrix on one device,
with no amax all-reduce and no padding beyond the plan's.

Scales: fp32 ``max(amax / 448, 2**-126)``, or, with ``scale_dtype=torch.float8_e8m0fnu``
(MX), a power of two stored as its 8-bit biased exponent: the least ``2**e >= amax / 448``
and ``>= 2**-126``, so no code ever saturates. ``amax`` is the largest magnitude of the
tile's finite elements; a non-finite element decodes as NaN at its own position (see
[Note: FP8 edge values]).

Selected parameters go to buffers of their own (``_planning._new_group`` plans them apart
from the rest, which gather in the compute dtype), planned with offsets and shard size
in whole tile columns (``alignment_elems``). A rank's shard is then a sequence of
*segments*: ``tile[1]`` contiguous elements, one row of one tile (or padding). Per
buffer and all-gather, in kernels whose count does not depend on the tensors or ranks:

- quantize: the amax of every segment's finite elements (one ``nan_to_num`` into a
  temporary, one ``vector_norm``), reduced to the tiles' (one ``scatter_reduce``; MX's
  one-row tiles are the segments themselves), the scales written to the send buffer,
  and every segment divided by its tile's scale straight into the send buffer as codes
  (one ``div`` whose output is float8: the one cast that a ``param_dtype`` all-gather
  makes on its send side), the NaN code written where the shard is not finite (one
  ``ne``, one ``masked_fill_``);
- one all-gather of the send buffer, codes (``S`` bytes) then scales (``T`` per rank,
  the most tiles any rank holds, at a 4-byte boundary);
- dequantize: the received codes cast into the global parameter storage (one
  ``copy_``: the one cast on the receive side), then multiplied in place by their
  segments' scales (one ``mul_``; computed in fp32, as ``code * scale`` is).

A tile with rows (``tile[0] > 1``) maps segments to tiles through an index built from
the pieces (a rank's whole tiles of one parameter) in a few vectorized ops over the
segments, 1 / ``tile[1]`` of the elements, made for each gather and freed after it; an
MX tile needs none (there is one scale per segment, padding included). Backward is
unchanged (gradients are written over the dequantized parameters and reduce-scattered in
``reduce_dtype``); optimizers step the master weights; checkpoints hold master weights
only.

A tile is ``tile[0]`` rows by ``tile[1]`` columns of a 2-D matrix, or of one member
of a stacked ``[E, rows, cols]`` parameter. ``(1, 32)`` with E8M0 scales is MXFP8's
layout (``Float8BlockAllGather.mx()``).

[Note: FP8 edge values]
Two kinds of tile break ``code = x / (amax / 448)``, and the quantizer handles both in
the same kernels for every tile, with no host sync (no ``.item()``: nothing waits on
the values):

- *Tiny tiles.* Below ``amax = 448 * 2**-126`` (about 5e-36), ``amax / 448`` is an fp32
  subnormal: it has few significant bits, so ``x / scale`` can exceed 448 (the cast
  saturates it, or gives NaN), and below ``amax = 224 * 2**-149`` (about 3e-43) it
  underflows to 0 (``0 / 0``: NaN), as does any subnormal where arithmetic flushes them
  to zero. So every scale is at least ``2**-126``, fp32's least normal number (an E8M0
  scale never went lower). With that least scale the codes are ``x * 2**126`` rounded
  to float8_e4m3fn, exactly decoded: a tile whose elements are all at most ``2**-136``
  (about 1.1e-41; an all-zero tile, or one whose ``amax / 448`` used to underflow)
  decodes to exactly zeros, since ``x * 2**126 <= 2**-10`` is at most half
  float8_e4m3fn's least subnormal and rounds to 0; a tiny tile above that decodes within
  half a float8 step times ``2**-126`` of its values, the bound every tile meets with its
  own scale. A plain all-gather would keep such values (fp32 and bf16 hold subnormals);
  FP8 cannot give them exactly, since a code holds four significant bits.
- *Non-finite elements.* One inf or NaN made ``amax`` non-finite and took its whole tile
  with it (fp32 scales: every code ``x / inf`` and every decode ``0 * inf``, NaN; E8M0:
  a scale of ``2**127``, under which every finite element of ordinary size decodes to 0). Raising an
  error naming the parameter would need a host sync on every gather to learn that
  there is one; instead the quantizer works element-wise, as a plain all-gather does:
  ``amax`` is taken over the finite elements (non-finite ones count as 0), so the finite
  elements decode exactly as they would if each non-finite one were 0, and each
  non-finite element is written as the NaN code (``0x7F``) at its own position.
  float8_e4m3fn has no infinity, and its NaN is its only non-finite code, so ``inf``
  and ``-inf`` decode as NaN, not as themselves; the cast alone would not even give
  that (recent torch casts saturate ``±inf`` to ``±448``, a finite value), hence the
  explicit code. The position is what a user's NaN check and the forward see: a row
  with a non-finite weight gives a non-finite output either way. The cost: three more
  kernels on the send side (``nan_to_num``, ``ne``, ``masked_fill_``, over the rank's
  ``S`` elements, not the gathered ``m * S``; the fp32 scale is one kernel shorter than
  before) and a temporary of ``S`` master elements while the amax is taken.

On an accelerator with ``torch._scaled_mm`` taking block scales, the gathered codes
and scales are what it takes: each rank's piece of a parameter is a row-major view of
the receive buffer's codes, its scales a row-major ``[rows / tile[0], cols / tile[1]]``
run of that rank's scales (MX: E8M0 bytes, ``view(torch.float8_e8m0fnu)``). A module
could run its GEMM on them directly and skip the dequantize; this build (CPU) runs the
GEMMs on the dequantized weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from raggedfsdp.planner import WHOLE, BufferLayout

__all__ = ["FP8_MAX", "Float8BlockAllGather", "Fp8Layout"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
LEAST_SCALE = 2.0**-126  # fp32's least normal number: see [Note: FP8 edge values]
_NAN_CODE = 0x7F  # float8_e4m3fn's NaN (S.1111.111, the sign bit clear)
E8M0 = torch.float8_e8m0fnu
_SCALE_DTYPES = (torch.float32, E8M0)
_MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class Float8BlockAllGather:
    """Gather selected matrices as float8_e4m3fn codes with one scale per tile.

    Args:
        tile: ``(rows, cols)`` of one scale's tile. Default ``(128, 128)``. A parameter
            is selected when it is 2-D (or a stacked 3-D ``[E, rows, cols]``) and its
            rows (per member) and columns are whole tiles; the rest gathers in the
            compute dtype.
        scale_dtype: ``torch.float32`` (default: ``max(amax / 448, 2**-126)``) or
            ``torch.float8_e8m0fnu`` (a power of two in one byte, as MX). See
            [Note: FP8 edge values] for tiny tiles and non-finite elements.
    """

    tile: tuple[int, int] = (128, 128)
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        ok = (
            isinstance(self.tile, tuple)
            and len(self.tile) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in self.tile)
        )
        if not ok:
            raise ValueError(
                f"Float8BlockAllGather: tile must be a tuple of two positive ints (rows, cols), "
                f"got {self.tile!r}; e.g. (128, 128), or (1, 32) for MX-style scaling"
            )
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(
                f"Float8BlockAllGather: scale_dtype must be torch.float32 or "
                f"torch.float8_e8m0fnu, got {self.scale_dtype!r}"
            )

    @classmethod
    def mx(cls) -> Float8BlockAllGather:
        """MXFP8's layout: one E8M0 scale per 32 elements of a row."""
        return cls(tile=(1, 32), scale_dtype=E8M0)

    @property
    def scale_bytes(self) -> int:
        return 4 if self.scale_dtype == torch.float32 else 1

    def selects(self, shape: tuple[int, ...]) -> bool:
        """Whether a parameter of this (local) shape gathers in FP8."""
        tr, tc = self.tile
        if len(shape) not in (2, 3):
            return False
        return shape[-2] % tr == 0 and shape[-1] % tc == 0

    def block_rows_for(self, rows: int | str) -> int | str:
        """The block rows of a selected parameter: ``rows`` (its block policy's, already
        checked to divide its rows per member) raised to the least multiple of the tile's
        rows. Both divide the rows per member (``selects``), so their lcm does too: no
        plan can cut a tile, and no user policy is refused for it."""
        return rows if rows == WHOLE else math.lcm(int(rows), self.tile[0])

    def alignment_bytes(self, alignment_bytes: int, dtype: torch.dtype) -> int:
        """The alignment an FP8 buffer is planned with: ``alignment_bytes`` raised to whole
        tile columns of ``dtype`` elements, so that every segment of a shard is one row of
        one tile (or padding)."""
        return math.lcm(alignment_bytes, self.tile[1] * dtype.itemsize)


def _round4(n: int) -> int:
    return -(-n // 4) * 4


class Fp8Layout:
    """Where each rank's tiles and scales lie in one FP8 buffer (from its ``BufferLayout``).

    Args:
        layout: the buffer's plan; every tensor in it is selected, and ``S`` and every
            offset are whole tile columns (``Float8BlockAllGather.alignment_bytes``).
        policy: the tile and scale dtype.

    Raises:
        AssertionError: the plan breaks either of those (``fully_shard`` never makes one).
    """

    def __init__(self, layout: BufferLayout, policy: Float8BlockAllGather):
        self.layout, self.policy, self.tile = layout, policy, policy.tile
        tr, tc = self.tile
        S = layout.shard_size
        if S % tc:
            raise AssertionError(f"FP8 all-gather: shard size {S} is not whole {tc}-column tiles")
        self.segments = S // tc  # per rank
        # one row per piece (a rank's whole tiles of one tensor), in buffer order:
        # first segment, end segment (global numbering), tiles per row, first tile slot
        pieces: list[tuple[int, int, int, int]] = []
        self._where: dict[tuple[int, str], tuple[int, int, int, int]] = {}
        most = 0
        for rank in range(layout.world_size):
            tiles = 0
            for t in sorted(layout.tensors, key=lambda t: t.offset):
                lo, hi = layout.local_range(t.name, rank)
                if hi <= lo:
                    continue
                start, stop = layout.shard_range(t.name, rank)
                cols = t.shape[-1]
                rows = (hi - lo) // cols
                whole = (hi - lo) % cols == 0 and rows % tr == 0 and cols % tc == 0
                whole = whole and (lo // cols) % t.shape[-2] % tr == 0
                if not whole or stop - start != hi - lo or start % tc:
                    raise AssertionError(
                        f"FP8 all-gather: rank {rank}'s piece of {t.name!r} (elements "
                        f"[{lo}, {hi}), at {start} of its shard) is not whole {tr}x{tc} tiles"
                    )
                first = rank * self.segments + start // tc
                pieces.append((first, first + (stop - start) // tc, cols // tc, tiles))
                self._where[rank, t.name] = (start, rows, cols, tiles)
                tiles += (rows // tr) * (cols // tc)
            most = max(most, tiles)
        # MX-style (one-row) tiles: one scale per segment, padding included (no index)
        self.tiles_per_rank = self.segments if tr == 1 else most
        self._pieces = torch.tensor(pieces, dtype=torch.int64).reshape(-1, 4)
        self._pieces_on: dict[torch.device, torch.Tensor] = {}
        self._mine: dict[torch.device, torch.Tensor] = {}
        self.scales_at = _round4(S)  # byte offset of the scales in a rank's send buffer
        self.send_bytes = _round4(self.scales_at + policy.scale_bytes * self.tiles_per_rank)

    def piece(self, chunk: torch.Tensor, rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``rank``'s piece of tensor ``name`` in ``chunk`` (that rank's ``send_bytes`` of the
        all-gather: its send buffer, or its part of the received one), as views: the codes,
        ``[rows, cols]`` float8_e4m3fn, and their scales, ``[rows / tile[0], cols / tile[1]]``
        (fp32, or float8_e8m0fnu). What ``torch._scaled_mm`` takes, with no dequantize.

        Raises:
            KeyError: ``rank`` holds none of ``name``.
        """
        start, rows, cols, tiles = self._where[rank, name]
        (tr, tc), sb = self.tile, self.policy.scale_bytes
        codes = chunk[start : start + rows * cols].view(FP8_DTYPE).view(rows, cols)
        at = start // tc if tr == 1 else tiles  # MX: one scale per segment
        n = (rows // tr) * (cols // tc)
        stored = chunk[self.scales_at + sb * at : self.scales_at + sb * (at + n)]
        dtype = torch.float32 if sb == 4 else E8M0
        return codes, stored.view(dtype).view(rows // tr, cols // tc)

    # ---- tiles of segments -----------------------------------------------------------------
    def _segment_tiles(self, ranks: range, device: torch.device) -> torch.Tensor:
        """For every segment of ``ranks`` (in order), its tile's index in a ``[len(ranks),
        T + 1]`` array of scales, the last column holding padding's (only for tiles with
        rows: an MX tile is its segment). int64, ``len(ranks) * segments``."""
        tr, T, n = self.tile[0], self.tiles_per_rank, self.segments
        table = self._pieces_on.get(device)
        if table is None:
            table = self._pieces_on[device] = self._pieces.t().contiguous().to(device)
        first, end, across, base = table
        seg = torch.arange(ranks.start * n, ranks.stop * n, device=device)
        which = torch.searchsorted(first, seg, right=True) - 1
        inside = which >= 0
        which.clamp_(min=0)
        k = seg - first[which]  # segment within its piece
        nc = across[which]
        tile = base[which] + (k // (tr * nc)) * nc + k % nc
        inside &= seg < end[which]
        rank = seg // n - ranks.start
        return torch.where(inside, tile, T) + rank * (T + 1)

    # ---- scales ------------------------------------------------------------------------------
    def _scales(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp32 scales, what the send buffer holds)`` for fp32 tile amaxes."""
        # See [Note: FP8 edge values]: never below 2**-126, fp32's least normal number
        if self.policy.scale_dtype == torch.float32:
            scale = (amax / FP8_MAX).clamp_(min=LEAST_SCALE)
            return scale, scale
        bits = (amax / FP8_MAX).view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        exponent.clamp_(1, 254)  # the least power of two >= amax / 448, and >= 2**-126
        return (exponent << 23).view(torch.float32), exponent.to(torch.uint8)

    def _read_scales(self, stored: torch.Tensor) -> torch.Tensor:
        """fp32 scales from the bytes of a ``[ranks, T * scale_bytes]`` uint8 view."""
        if self.policy.scale_dtype == torch.float32:
            return stored.view(torch.float32)
        return (stored.to(torch.int32) << 23).view(torch.float32)

    # ---- the send side -------------------------------------------------------------------
    def quantize(self, shard: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's send buffer (1D uint8, ``send_bytes``): its codes, then its scales."""
        (tr, tc), n, T = self.tile, self.segments, self.tiles_per_rank
        send = torch.empty(self.send_bytes, dtype=torch.uint8, device=shard.device)
        x = shard.view(n, tc)
        # See [Note: FP8 edge values]: the finite amax, and where the NaN codes go
        finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # (n, tile[1])
        amax = torch.linalg.vector_norm(finite, ord=math.inf, dim=1).float()  # per segment
        nonfinite = x.ne(finite)  # (n, tile[1]) bool
        del finite  # S master elements, freed before the codes are written
        if tr > 1:  # per tile; padding's segments to the spare last slot
            where = self._mine.get(shard.device)  # this rank's: kept (1 / tile[1] of S)
            if where is None:
                where = self._mine[shard.device] = self._segment_tiles(
                    range(rank, rank + 1), shard.device
                )
            amax = amax.new_zeros(T + 1).scatter_reduce_(0, where, amax, "amax")[:T]
        scale, stored = self._scales(amax)
        width = self.policy.scale_bytes * T
        send[self.scales_at : self.scales_at + width].view(stored.dtype).copy_(stored)
        send[self.layout.shard_size : self.scales_at].zero_()
        send[self.scales_at + width :].zero_()
        if tr > 1:
            scale = torch.cat([scale, scale.new_ones(1)])[where]  # per segment
        codes = send[: n * tc].view(n, tc)  # uint8
        torch.div(x, scale.unsqueeze(1), out=codes.view(FP8_DTYPE))
        codes.masked_fill_(nonfinite, _NAN_CODE)
        return send

    # ---- the receive side ----------------------------------------------------------------
    def dequantize(self, received: torch.Tensor, out: torch.Tensor) -> None:
        """Decode every rank's codes of ``received`` (1D uint8, ``m * send_bytes``) into
        ``out`` (the global parameter storage, 1D ``m * S``, the compute dtype)."""
        (tr, tc), n, T = self.tile, self.segments, self.tiles_per_rank
        m = self.layout.world_size
        chunks = received.view(m, self.send_bytes)
        width = self.policy.scale_bytes * T
        scale = self._read_scales(chunks[:, self.scales_at : self.scales_at + width])  # [m, T]
        if tr > 1:
            where = self._segment_tiles(range(m), received.device)
            padded = torch.cat([scale, scale.new_ones(m, 1)], dim=1)
            scale = padded.view(-1)[where].view(m, n)
        dst = out.view(m, n, tc)
        dst.copy_(chunks[:, : n * tc].view(FP8_DTYPE).view(m, n, tc))
        dst.mul_(scale.unsqueeze(2))


def check_master_dtype(fqn: str, dtype: torch.dtype) -> None:
    """FP8 all-gather quantizes fp32, bf16 or fp16 masters.

    Raises:
        ValueError: another dtype, naming the parameter.
    """
    if dtype not in _MASTER_DTYPES:
        raise ValueError(
            f"fully_shard: FP8 all-gather of {fqn!r}: its dtype {dtype} has no FP8 path "
            f"(supported: {', '.join(map(str, _MASTER_DTYPES))}); cast the module, or leave "
            "all_gather unset in its MixedPrecisionPolicy"
        )
