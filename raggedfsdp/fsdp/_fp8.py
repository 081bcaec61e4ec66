"""FP8 all-gather with block scales that never leave their rank.

[Note: FP8 all-gather]
``MixedPrecisionPolicy(all_gather=Float8BlockAllGather(tile=(128, 128)))`` gathers the
selected matrices as ``torch.float8_e4m3fn`` codes with one fp32 scale per tile
(``amax / 448``), instead of in the compute dtype. The planner already keeps blocks
whole on every rank; the block policy of a selected parameter is raised to a multiple
of the tile's rows (``block_rows_for``), so every tile lies on one rank, and each rank
quantizes its own master rows: the result is bit-identical to quantizing the whole
matrix on one device, with no amax all-reduce and no padding beyond the plan's.

Selected parameters go to buffers of their own (``_api._new_group`` plans them apart
from the rest, which gather in the compute dtype). Per such buffer and all-gather:

- quantize: each of the rank's pieces (whole tiles of one parameter) is scaled and
  cast into the send buffer, one byte per element in the layout's order (``S`` bytes),
  followed by the rank's tile scales (``T`` fp32, ``T`` the most tiles any rank holds);
- one all-gather of that ``S + 4T``-byte buffer (codes and scales together);
- dequantize: each rank's pieces are decoded (``code * scale``, in fp32, cast to the
  compute dtype) straight into the global parameter storage, the unsharded
  parameters' views as before.

The quantize writes the send buffer and the dequantize reads the receive buffer: the
one cast each way, as a ``param_dtype`` cast is, run as one kernel per piece (a rank's
whole tiles of one parameter), not yet one per buffer. Backward is unchanged (gradients are
written over the dequantized parameters and reduce-scattered in ``reduce_dtype``);
optimizers step the master weights; checkpoints hold master weights only.

A tile is ``tile[0]`` rows by ``tile[1]`` columns of a 2-D matrix, or of one member
of a stacked ``[E, rows, cols]`` parameter. ``(1, 32)`` is MX-style scaling (one scale
per 32 elements of a row; here an fp32 scale, not MX's 8-bit exponent).

On an accelerator with ``torch._scaled_mm`` taking block scales, the gathered codes
and scales are already what it takes (row-major codes, one scale per tile): a module
could run its GEMM on them directly and skip the dequantize; this build (CPU) runs
the GEMMs on the dequantized weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from raggedfsdp.planner import WHOLE, BufferLayout

__all__ = ["FP8_MAX", "Float8BlockAllGather", "Fp8Layout"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class Float8BlockAllGather:
    """Gather selected matrices as float8_e4m3fn codes with one fp32 scale per tile.

    Args:
        tile: ``(rows, cols)`` of one scale's tile. Default ``(128, 128)``; ``(1, 32)``
            is MX-style. A parameter is selected when it is 2-D (or a stacked 3-D
            ``[E, rows, cols]``) and its rows (per member) and columns are whole tiles;
            the rest gathers in the compute dtype.
    """

    tile: tuple[int, int] = (128, 128)

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


class _Piece(NamedTuple):
    """Whole tiles of one parameter held by one rank."""

    start: int  # element range in the rank's shard
    stop: int
    cols: int
    scale_at: int  # index of its first tile's scale in the rank's scales
    row_tiles: int
    col_tiles: int


class Fp8Layout:
    """Where each rank's tiles and scales lie in one FP8 buffer (from its ``BufferLayout``).

    Args:
        layout: the buffer's plan; every tensor in it is selected.
        policy: the tile.

    Raises:
        AssertionError: a rank's piece of a tensor is not whole tiles (the block policy
            of ``block_rows_for`` makes that impossible).
    """

    def __init__(self, layout: BufferLayout, policy: Float8BlockAllGather):
        self.layout, self.tile = layout, policy.tile
        tr, tc = self.tile
        self.pieces: list[list[_Piece]] = []
        scales = []  # tiles per rank
        for rank in range(layout.world_size):
            mine, at = [], 0
            for t in sorted(layout.tensors, key=lambda t: t.offset):
                lo, hi = layout.local_range(t.name, rank)
                if hi <= lo:
                    continue
                start, stop = layout.shard_range(t.name, rank)
                cols = t.shape[-1]
                rows = (hi - lo) // cols
                if (hi - lo) % cols or rows % tr or (lo // cols) % t.shape[-2] % tr:
                    raise AssertionError(
                        f"FP8 all-gather: rank {rank}'s piece of {t.name!r} (elements "
                        f"[{lo}, {hi})) is not whole {tr}x{tc} tiles"
                    )
                mine.append(_Piece(start, stop, cols, at, rows // tr, cols // tc))
                at += (rows // tr) * (cols // tc)
            self.pieces.append(mine)
            scales.append(at)
        self.scales_per_rank = max(scales, default=0)
        self.send_bytes = layout.shard_size + 4 * self.scales_per_rank  # codes, fp32 scales

    # ---- the send side -------------------------------------------------------------------
    def quantize(self, shard: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's send buffer (1D uint8, ``send_bytes``): its codes, then its scales."""
        S = self.layout.shard_size
        send = torch.zeros(self.send_bytes, dtype=torch.uint8, device=shard.device)
        codes = send[:S].view(FP8_DTYPE)
        scales = send[S:].view(torch.float32)
        tr, tc = self.tile
        for p in self.pieces[rank]:
            nb, nc = p.row_tiles, p.col_tiles
            x = shard[p.start : p.stop].view(nb, tr, nc, tc).float()
            scale = tile_scales(x)
            scales[p.scale_at : p.scale_at + nb * nc].copy_(scale.view(-1))
            codes[p.start : p.stop].view(nb, tr, nc, tc).copy_(encode(x, scale))
        return send

    # ---- the receive side ----------------------------------------------------------------
    def dequantize(self, received: torch.Tensor, out: torch.Tensor) -> None:
        """Decode every rank's pieces of ``received`` (1D uint8, ``m * send_bytes``) into
        ``out`` (the global parameter storage, 1D ``m * S``, the compute dtype)."""
        S, P, (tr, tc) = self.layout.shard_size, self.send_bytes, self.tile
        for rank, pieces in enumerate(self.pieces):
            chunk = received[rank * P : (rank + 1) * P]
            codes = chunk[:S].view(FP8_DTYPE)
            scales = chunk[S:].view(torch.float32)
            base = rank * S
            for p in pieces:
                nb, nc = p.row_tiles, p.col_tiles
                c = codes[p.start : p.stop].view(nb, tr, nc, tc)
                s = scales[p.scale_at : p.scale_at + nb * nc].view(nb, 1, nc, 1)
                dst = out[base + p.start : base + p.stop].view(nb, tr, nc, tc)
                dst.copy_(decode(c, s))


def tile_scales(x: torch.Tensor) -> torch.Tensor:
    """One fp32 scale per tile of ``x`` (fp32, shaped ``[nb, tile_rows, nc, tile_cols]``):
    ``amax / 448``, and 1 for an all-zero tile. Shaped ``[nb, 1, nc, 1]``."""
    amax = x.abs().amax(dim=(1, 3), keepdim=True)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` as float8_e4m3fn (fp32 in; every value within +-448)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``code * scale`` in fp32."""
    return codes.float() * scale


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
