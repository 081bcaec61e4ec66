"""FP8 all-gather at the edges of the number line ([Note: FP8 edge values] in
``raggedfsdp/fsdp/_fp8.py``), without a process group: each of two ranks quantizes its
shard of a planned buffer, the send buffers are concatenated as the all-gather would,
and ``dequantize`` decodes them.

- Tiny tiles: a tile whose amax is far below ``448 * 2**-126`` takes the least scale,
  ``2**-126``, in every format, and decodes to exactly ``x * 2**126`` cast to
  float8_e4m3fn, times ``2**-126``. So an all-zero tile, and a tile of fp32 subnormals no
  larger than ``2**-136`` (one whose ``amax / 448`` underflows to 0, one whose
  ``amax / 448`` is a subnormal too coarse to keep ``x / scale`` within 448), decode to
  exactly zeros: ``|x| * 2**126 <= 2**-10``, half float8_e4m3fn's least subnormal, rounds
  to 0. No element anywhere decodes to NaN, and every one is within the quantizer's bound.
- Non-finite elements: a ``±inf`` or NaN decodes to NaN at its own position and nowhere
  else; the tile's finite elements decode bit for bit as they would with it replaced by
  0, within the quantizer's bound.

The bound, derived from the tile's scale ``s`` (``v = |x| / s``, at most 448): float8_e4m3fn
rounds ``v`` to the nearest multiple of ``2**(e - 3)`` in the binade ``[2**e, 2**(e + 1))``,
of ``2**-9`` below ``2**-6``, so the code is within half that step of ``v``; plus the fp32
roundings of ``x / s`` and ``code * s``.
"""

from __future__ import annotations

import pytest
import torch

from raggedfsdp.fsdp import Float8BlockAllGather, Fp8Layout
from raggedfsdp.planner import DEFAULT_ALIGNMENT_BYTES, TensorSpec, plan_buffer

pytestmark = pytest.mark.numerics

F32, BF16, E8M0 = torch.float32, torch.bfloat16, torch.float8_e8m0fnu
WORLD = 2
LEAST = 2.0**-126  # the least scale: fp32's least normal number
FORMATS = [((128, 128), F32), ((128, 128), E8M0), ((4, 32), F32), ((1, 32), E8M0)]
IDS = ["128x128-fp32", "128x128-e8m0", "4x32-fp32", "1x32-e8m0"]
R = 128  # a region: 128 x 128, whole tiles of every format above


def _gather(policy: Float8BlockAllGather, w: torch.Tensor):
    """``w`` (rows, cols) planned alone over ``WORLD`` ranks, quantized rank by rank and
    decoded: the gathered matrix, fp32 (rows, cols), and each element's scale."""
    spec = TensorSpec(name="w", shape=tuple(w.shape), block_rows=policy.block_rows_for(1))
    align = policy.alignment_bytes(DEFAULT_ALIGNMENT_BYTES, w.dtype)
    layout = plan_buffer([spec], WORLD, dtype=w.dtype, alignment_bytes=align)
    fp8 = Fp8Layout(layout, policy)
    S, at, tr, tc = layout.shard_size, layout["w"].offset, *policy.tile
    flat = w.new_zeros(WORLD * S)  # 1D, m * S
    flat[at : at + w.numel()] = w.flatten()
    sends = [fp8.quantize(flat[r * S : (r + 1) * S], r) for r in range(WORLD)]
    out = torch.full((WORLD * S,), 7.0)  # the global storage (fp32 compute), all written
    fp8.dequantize(torch.cat(sends), out)
    scales = []
    for r in range(WORLD):
        if layout.local_range("w", r)[1] > layout.local_range("w", r)[0]:
            _, s = fp8.piece(sends[r], r, "w")  # (rows / tr, cols / tc)
            scales.append(s.float().repeat_interleave(tr, 0).repeat_interleave(tc, 1))
    return out[at : at + w.numel()].view(w.shape), torch.cat(scales)


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most ``|decoded - x|`` may be (see the module docstring), float64."""
    x, s = x.double().abs(), scale.double()
    v = x / s * (1 + 2.0**-23)  # at least |fl(x / s)|
    _, e = torch.frexp(v)  # v = f * 2**e, f in [0.5, 1): v's binade is 2**(e - 1)
    binade = torch.where(v > 0, e - 1, -6).clamp(min=-6)
    half_step = torch.ldexp(torch.ones_like(s), binade - 4)
    return s * half_step * (1 + 2.0**-22) + x * 2.0**-22


def _within_bound(x, decoded, scale):
    err = (decoded.double() - x.double()).abs()
    bound = _bound(x, scale)
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize(("tile", "scale_dtype"), FORMATS, ids=IDS)
def test_tiny_tiles_take_the_least_scale(tile, scale_dtype):
    gen = torch.Generator().manual_seed(0)
    ulp = 2.0**-149  # fp32's least subnormal
    w = torch.randn(2 * R, 3 * R, generator=gen)  # 2 x 3 regions
    w[:R, :R] = 0
    w[:R, R : 2 * R] = torch.randint(-200, 201, (R, R), generator=gen) * ulp  # amax / 448 -> 0
    w[:R, 2 * R :] = torch.randint(-4000, 4001, (R, R), generator=gen) * ulp  # <= 2**-136
    w[R:, :R] *= 2.0**-132  # below 448 * 2**-126: the least scale, values kept coarsely
    w[R:, 2 * R :] *= 1e-30  # small, with a normal scale of its own
    decoded, scale = _gather(Float8BlockAllGather(tile=tile, scale_dtype=scale_dtype), w)
    assert bool(decoded.isfinite().all()), f"{int(decoded.isnan().sum())} NaN"
    nonzero = int(decoded[:R].count_nonzero())
    assert nonzero == 0, f"{nonzero} elements of all-tiny tiles decode to nonzero values"
    least = torch.zeros_like(w, dtype=torch.bool)
    least[:R], least[R:, :R] = True, True
    assert bool((scale[least] == LEAST).all()) and bool((scale[~least] > LEAST).all())
    codes = (w[least] / LEAST).to(torch.float8_e4m3fn)  # exact: a power of two
    assert torch.equal(decoded[least], codes.float() * LEAST)
    _within_bound(w, decoded, scale)


@pytest.mark.parametrize("master", [F32, BF16], ids=["fp32-master", "bf16-master"])
@pytest.mark.parametrize(("tile", "scale_dtype"), FORMATS, ids=IDS)
def test_non_finite_elements_decode_as_nan_alone(tile, scale_dtype, master):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2 * R, 3 * R, generator=gen).to(master)
    w[5, 7] = float("inf")  # among finite elements, in three regions
    w[R + 2, R + 72] = -float("inf")
    w[77, 2 * R + 44] = float("nan")
    w[R + 9, 2 * R + 32 : 2 * R + 64] = float("inf")  # a whole 1 x 32 tile, a 4 x 32 row
    w[R + 20 : R + 40, 10] = float("nan")
    policy = Float8BlockAllGather(tile=tile, scale_dtype=scale_dtype)
    decoded, scale = _gather(policy, w)
    finite = w.isfinite()
    # the finite elements decode as they would with each non-finite one replaced by 0
    without, without_scale = _gather(policy, w.nan_to_num(0.0, 0.0, 0.0))
    changed = int((decoded[finite] != without[finite]).sum())
    assert changed == 0, f"{changed} finite elements decode otherwise beside non-finite ones"
    assert torch.equal(scale, without_scale)
    _within_bound(w[finite], decoded[finite], scale[finite])
    # and the non-finite ones as NaN, each at its own position
    nan = decoded.isnan()
    lost, kept = int((nan & finite).sum()), int((~nan & ~finite).sum())
    assert not lost and not kept, f"{lost} finite elements decode to NaN, {kept} non-finite not"
