"""Block-wise 8-bit quantization kernels of ``AdamW8bit``: the code maps, encode / decode,
and per-block scales over runs of blocks of uneven length.

[Note: dynamic tree quantization]
A moment is stored as one fp32 scale per block of B elements (the block's absmax)
and one 8-bit code per element: the index of the nearest value of a fixed, sorted
table on [-1, 1] (``exp_avg``) or [0, 1] (``exp_avg_sq``). The table is a *dynamic
tree*: a value is ``10**-e * f`` where the exponent level ``e`` takes the leading
code bits and a linear fraction ``f`` in (0.1, 1] the rest, so the levels near the
block's absmax get 2**6 (signed) or 2**7 (unsigned) fractions and each level ten
times smaller gets half as many, down to ``1e-6`` / ``1e-7`` of the absmax::

    level e   magnitudes                     signed   unsigned
      0       (0.1, 1]         x 1           64       128
      1       (0.1, 1]         x 0.1         32        64
      ...                                    ...       ...
      6 / 7   1e-6 / 1e-7                     1         1
    plus 0 (exact)                    255 codes used  256 codes

Rounding is to the nearest table value, up to where the decision thresholds sit:
each midpoint between neighbouring values is rounded to the nearest float with 8
mantissa bits (a shift of at most 2**-9 of its size, against steps of 0.7% or more),
so that encoding is one table look-up (see the next note). A magnitude on a
threshold takes the larger code.

Why not linear absmax: Adam's second moment spans many decades inside one block;
with 255 equal steps every value below ``absmax / 510`` becomes 0, and a zero
second moment turns the update into ``m / eps``. The dynamic tree keeps a few
significant bits for values down to ``1e-7`` of the absmax, which is why
bitsandbytes (whose 8-bit optimizers introduced it, block-wise with 256-element
blocks and a 4096-element minimum size) and torchao's ``AdamW8bit`` use it.

[Note: encode by one look-up]
``torch.bucketize`` over 255 midpoints costs ~100x an element-wise op on CPU. With
every threshold a float whose low 15 bits are zero, the code of ``x`` depends only on
the top 17 bits of its float32 bit pattern (sign, exponent, 8 mantissa bits): the
code is ``lut[(bits >> 15) & 0x1FFFF]``, a 128 KiB uint8 table built once from the
thresholds (``dynamic_tree_map`` checks that every table value encodes to its own
code). Two integer ops and one gather, exact by construction.

[Note: bit-identical under any sharding]
Each step is a sequence of single, correctly rounded element-wise ops (no fused
multiply-add, no ``lerp``/``addcmul``, whose vector and scalar loops may round
differently), a max per block (exact), a division by it and table look-ups, so an
element's code depends only on its own values and its block's, never on where the
block sits in a buffer or how long the buffer is.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = [
    "Blocks",
    "QuantMap",
    "decode",
    "dequantize",
    "dynamic_tree_map",
    "encode",
    "param_block_lengths",
    "quantize_",
]

_KEY_SHIFT = 15  # float32 bits >> 15, masked to 17 bits: sign, 8 exponent, 8 mantissa bits
_KEY_MASK = (1 << 17) - 1
_NEGATIVE = 1 << 16  # keys of negative values start here
_ONE = 0x3F800000 >> _KEY_SHIFT  # the key of 1.0, the largest normalised magnitude


@dataclass(frozen=True, eq=False)
class QuantMap:
    """A sorted 8-bit code table and its encoder.

    Args:
        values: the table, fp32, sorted; ``values[code]`` is the decoded value.
        thresholds: the magnitude thresholds (fp32, ascending, on the key grid): a
            magnitude ``>= thresholds[i]`` is past the ``i``-th step from zero.
        lut: uint8, one code per 17-bit key (see [Note: encode by one look-up]).
        zero: the code of 0.0.
    """

    values: torch.Tensor
    thresholds: torch.Tensor
    lut: torch.Tensor
    zero: int


def _tree_magnitudes(levels: int) -> list[float]:
    """Positive magnitudes of a dynamic tree with ``levels`` exponent levels, ascending.

    Level ``e`` (0 = largest) has ``2**(levels - 1 - e)`` fractions spaced evenly over
    (0.1, 1], scaled by ``10**-e``; its largest value is exactly ``10**-e``.
    """
    out = []
    for e in range(levels):
        n = 2 ** (levels - 1 - e)
        out += [10.0**-e * (0.1 + 0.9 * (j + 1) / n) for j in range(n)]
    return sorted(out)


def _to_key_grid(x: torch.Tensor) -> torch.Tensor:
    """Positive fp32 ``x`` rounded to the nearest float with 8 mantissa bits."""
    bits = x.view(torch.int32)
    half = 1 << (_KEY_SHIFT - 1)
    return ((bits + half) >> _KEY_SHIFT << _KEY_SHIFT).view(torch.float32)


def dynamic_tree_map(signed: bool, device: torch.device | str = "cpu") -> QuantMap:
    """The dynamic tree code table: signed (first moment) or unsigned (second moment).

    See [Note: dynamic tree quantization]. Built once per process on the CPU,
    deterministically, and copied once to each other device it is asked for.

    Args:
        signed: the table on [-1, 1] (True) or on [0, 1] (False).
        device: where its tensors live (that of the codes it encodes). Default "cpu".
    """
    return _tree_map(signed, torch.device(device))


@functools.cache
def _tree_map(signed: bool, device: torch.device) -> QuantMap:
    if device.type != "cpu":
        cpu = _tree_map(signed, torch.device("cpu"))
        return QuantMap(
            values=cpu.values.to(device),
            thresholds=cpu.thresholds.to(device),
            lut=cpu.lut.to(device),
            zero=cpu.zero,
        )
    # built on the CPU on purpose: small tables, checked exactly below
    mags = torch.tensor(
        [0.0, *_tree_magnitudes(7 if signed else 8)], dtype=torch.float64, device="cpu"
    )
    mags = mags.to(torch.float32)
    m64 = mags.double()
    thresholds = _to_key_grid(((m64[1:] + m64[:-1]) / 2).to(torch.float32))
    assert bool((thresholds > mags[:-1]).all() and (thresholds < mags[1:]).all())
    # key k >= 0 of a magnitude: [lo[k], lo[k + 1]); thresholds are some of the lo's
    lo = (torch.arange(_ONE + 1, dtype=torch.int32, device="cpu") << _KEY_SHIFT).view(torch.float32)
    steps = torch.searchsorted(thresholds, lo, side="right")  # thresholds <= lo
    n = thresholds.numel()
    mag_lut = torch.full(
        (_KEY_MASK + 1,), n, dtype=torch.int64, device="cpu"
    )  # > 1, inf, NaN: the top
    mag_lut[: _ONE + 1] = steps
    mag_lut[_NEGATIVE:] = mag_lut[:_NEGATIVE]  # a negative value: the same magnitude
    negative = torch.arange(_KEY_MASK + 1, device="cpu") >= _NEGATIVE
    if signed:
        values = torch.cat([-mags.flip(0)[:-1], mags])
        zero = n
        lut = zero + torch.where(negative, -mag_lut, mag_lut)
    else:
        values, zero = mags, 0
        lut = mag_lut.masked_fill(negative, 0)
    assert values.numel() <= 256 and bool((values[1:] > values[:-1]).all())
    qmap = QuantMap(values=values, thresholds=thresholds, lut=lut.to(torch.uint8), zero=zero)
    assert torch.equal(encode(values, qmap).long(), torch.arange(values.numel(), device="cpu"))
    return qmap


def encode(x: torch.Tensor, qmap: QuantMap, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes of ``x`` (fp32, contiguous; normalised: ``|x| <= 1``), shaped like ``x``.

    The code of a magnitude is the number of ``qmap.thresholds`` at or below it, counted
    from ``qmap.zero`` away from zero by the sign; magnitudes beyond 1 (inf, NaN) take
    the end codes (the bottom one for a negative value of the unsigned map). See
    [Note: encode by one look-up].

    Args:
        out: a uint8 tensor of ``x.numel()`` elements to write into. Default: a new one.
    """
    key = (x.reshape(-1).view(torch.int32) >> _KEY_SHIFT).bitwise_and_(_KEY_MASK)
    if out is None:
        return qmap.lut.index_select(0, key).view(x.shape)
    torch.index_select(qmap.lut, 0, key, out=out.view(-1))
    return out


def decode(codes: torch.Tensor, qmap: QuantMap) -> torch.Tensor:
    """The table values (fp32) of ``codes``, shaped like ``codes``."""
    return qmap.values.index_select(0, codes.reshape(-1).int()).view(codes.shape)


@dataclass(frozen=True, eq=False)
class Blocks:
    """A 1-D run of elements cut into consecutive quantization blocks (and gaps).

    Each block has one scale. Lengths may differ (a tensor's last block, a member's
    last block, a gap between tensors); all are multiples of ``unit``, so the
    per-block max is one ``amax`` over a ``[numel / unit, unit]`` view plus, when the
    lengths are not all ``unit``, a segment max over the much shorter partial maxima.

    Args:
        numel: elements covered (the sum of the lengths).
        unit: the gcd of the lengths.
        lengths: int64, one entry per block, in units.
        uniform: every block is exactly ``unit`` long.
    """

    numel: int
    unit: int
    lengths: torch.Tensor
    uniform: bool

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> Blocks:
        """Blocks of ``lengths`` elements, their ``lengths`` tensor on ``device`` (the data's)."""
        if any(n <= 0 for n in lengths):
            raise AssertionError(f"quantization blocks must be non-empty, got {lengths[:8]}...")
        numel = sum(lengths)
        unit = functools.reduce(math.gcd, lengths, 0) or 1
        units = [n // unit for n in lengths]
        return cls(
            numel=numel,
            unit=unit,
            lengths=torch.tensor(units, dtype=torch.int64, device=device),
            uniform=all(u == 1 for u in units),
        )

    @property
    def count(self) -> int:
        return self.lengths.numel()

    def absmax(self, x: torch.Tensor) -> torch.Tensor:
        """Per-block max of ``|x|`` (``x``: 1-D, ``numel`` elements): ``count`` values."""
        part = x.abs().view(-1, self.unit).amax(dim=1)
        if self.uniform:
            return part
        return torch.segment_reduce(part, "max", lengths=self.lengths, unsafe=True)

    def per_unit(self, scales: torch.Tensor) -> torch.Tensor:
        """``scales`` (one per block) repeated per unit, shaped ``[numel / unit, 1]``."""
        if not self.uniform:
            scales = scales.repeat_interleave(self.lengths, output_size=self.numel // self.unit)
        return scales.view(-1, 1)


def quantize_(
    x: torch.Tensor,
    blocks: Blocks,
    qmap: QuantMap,
    codes_out: torch.Tensor,
    scales_out: torch.Tensor,
) -> None:
    """Write the codes and scales of ``x`` (1-D fp32) into ``codes_out`` / ``scales_out``."""
    if blocks.numel == 0:
        return
    absmax = blocks.absmax(x)
    scales_out.copy_(absmax)
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))  # all-zero block: 0/1
    xn = x.view(-1, blocks.unit) / blocks.per_unit(divisor)
    encode(xn, qmap, out=codes_out)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, blocks: Blocks, qmap: QuantMap
) -> torch.Tensor:
    """fp32 values of ``codes`` (1-D or any shape of ``numel`` elements): a new 1-D tensor."""
    if blocks.numel == 0:
        return torch.zeros(0, dtype=torch.float32, device=codes.device)
    values = decode(codes.reshape(-1), qmap).view(-1, blocks.unit)
    return values.mul_(blocks.per_unit(scales)).view(-1)


def param_block_lengths(numel: int, member_numel: int, lo: int, hi: int, block: int) -> list[int]:
    """Lengths of the quantization blocks covering elements ``[lo, hi)`` of a tensor.

    Blocks are ``block`` elements counted from the start of each member (the whole
    tensor for a non-stack, ``member_numel == numel``); a member's last block may be
    shorter. ``lo`` and ``hi`` must fall on block starts (or ``hi`` on a member's end).
    """
    out: list[int] = []
    pos = lo
    while pos < hi:
        member_end = (pos // member_numel + 1) * member_numel
        end = min(hi, member_end)
        full, tail = divmod(end - pos, block)
        out += [block] * full
        if tail:
            out.append(tail)
        pos = end
    assert pos == hi <= numel
    return out
