"""AdamW8bit without a process group: the code maps, the exact encoder, round-trip error
bounds, block independence, eligibility, the block policy, state size, state dicts and
every user-facing error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from raggedfsdp.optim import AdamW8bit, adamw8bit_block_policy
from raggedfsdp.optim.adamw8bit import is_8bit_eligible
from raggedfsdp.optim.quant import (
    Blocks,
    decode,
    dequantize,
    dynamic_tree_map,
    encode,
    param_block_lengths,
    quantize_,
)
from tests.numerics import U

pytestmark = pytest.mark.numerics

STATE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


@pytest.fixture(autouse=True)
def _one_thread():
    """Small tensors: one thread is faster, and immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _wide(n, seed=0, signed=True):
    """Values over ~10 decades, the range a second moment spans in one block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    return x if signed else x.abs()


# ---- code maps and the encoder -----------------------------------------------------------
@pytest.mark.parametrize("signed", [True, False])
def test_maps(signed):
    q = dynamic_tree_map(signed)
    v = q.values
    assert v.dtype == torch.float32 and bool((v[1:] > v[:-1]).all())
    assert v.numel() == (255 if signed else 256)
    assert float(v[q.zero]) == 0.0 and float(v[-1]) == 1.0
    if signed:
        assert torch.equal(v, -v.flip(0)) and float(v[0]) == -1.0
    else:
        assert q.zero == 0 and float(v[1]) == float(torch.tensor(1e-7))  # 10.0**-7 in fp32
    # the top level has 2**6 (signed) / 2**7 (unsigned) fractions in (0.1, 1]
    assert int(((v > 0.1) & (v <= 1)).sum()) == (64 if signed else 128)


@pytest.mark.parametrize("signed", [True, False])
def test_encode_is_the_search_over_thresholds(signed):
    q = dynamic_tree_map(signed)
    t = q.thresholds
    assert bool((t[1:] > t[:-1]).all())
    assert torch.equal(
        t.view(torch.int32) & ((1 << 15) - 1), torch.zeros_like(t, dtype=torch.int32)
    )
    x = _wide(200_000, signed=signed)
    x = x / x.abs().max()
    adversarial = [
        t,
        torch.nextafter(t, torch.tensor(-2.0)),
        torch.nextafter(t, torch.tensor(2.0)),
        q.values,
        torch.tensor([0.0, -0.0, 1.0, 1e-30, 1e-45]),
    ]
    x = torch.cat([x, *adversarial])
    if signed:
        x = torch.cat([x, -x])
    steps = torch.searchsorted(t, x.abs(), side="right")  # thresholds <= |x|
    expected = q.zero + torch.where(x < 0, -steps, steps)
    assert torch.equal(encode(x, q).long(), expected)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    assert encode(x, q, out=out) is out and torch.equal(out, encode(x, q))
    # beyond [-1, 1] the end codes; a negative value of the unsigned map: code 0
    top = q.values.numel() - 1
    got = encode(torch.tensor([2.0, float("inf"), -2.0, -float("inf")]), q).tolist()
    assert got == [top, top, 0, 0]
    half = int(encode(torch.tensor([0.5]), q))  # a negative value mirrors its magnitude
    assert int(encode(torch.tensor([-0.5]), q)) == (2 * q.zero - half if signed else 0)


@pytest.mark.parametrize("signed", [True, False])
def test_decode_of_encode_is_a_nearest_value(signed):
    """Nearest up to the thresholds' rounding to 8 mantissa bits (2**-9 of a magnitude)."""
    q = dynamic_tree_map(signed)
    x = _wide(50_000, seed=1, signed=signed)
    x = x / x.abs().max()
    got = decode(encode(x, q), q)
    best = (x[:, None] - q.values[None, :]).abs().min(dim=1).values
    # Between a midpoint m of two values and its threshold (m rounded to fp32, U m, then to
    # 8 mantissa bits, 2**-9 m: sigma m in all), x takes the farther value, 2 |x - m| <=
    # 2 sigma m farther than the nearest, with m <= |x| / (1 - sigma). |x - got| and best
    # are each one fp32 rounding (relative U) from their exact values: a factor 1 + 3U.
    sigma = 2**-9 + 2 * U
    bound = (best.double() + 2 * sigma / (1 - sigma) * x.abs().double()) * (1 + 3 * U)
    assert torch.all((x - got).abs().double() <= bound)


# ---- block-wise quantize / dequantize ----------------------------------------------------
@pytest.mark.parametrize("signed", [True, False])
def test_roundtrip_error_bounds(signed):
    q = dynamic_tree_map(signed)
    n, block = 256 * 40 + 100, 256  # a short last block too
    x = _wide(n, seed=2, signed=signed)
    blocks = Blocks.from_lengths(param_block_lengths(n, n, 0, n, block))
    codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(blocks.count)
    quantize_(x, blocks, q, codes, scales)
    back = dequantize(codes, scales, blocks, q)
    # scales are the blocks' absmax; the absmax element itself comes back exactly
    starts = list(range(0, n, block))
    absmax = torch.stack([x[s : s + block].abs().max() for s in starts])
    assert torch.equal(scales, absmax)
    scale = absmax.repeat_interleave(torch.tensor([min(block, n - s) for s in starts]))
    err = (x - back).abs().double()
    # |x / scale - code| <= half the widest gap of the fp32 table (the top level's: ~0.9 /
    # 64 / 2 signed, 0.9 / 128 / 2 unsigned) + the thresholds' shift, (2**-9 + 2U) of a
    # magnitude. The fp32 roundings of x / scale, code * scale and x - back add ~4U |x| and
    # a factor (1 + U)**2 on scale * half_gap: all within 2**-8 |x| and a factor 1 + 3U.
    half_gap = (q.values[1:] - q.values[:-1]).max().item() / 2  # top-level gaps: exact
    x64, scale64 = x.abs().double(), scale.double()
    assert torch.all(err <= (scale64 * half_gap + 2**-8 * x64) * (1 + 3 * U))
    big = x64 >= 0.1 * scale64  # the top level: relative error <= half_gap / 0.1
    assert torch.all(err[big] <= x64[big] * (half_gap / 0.1 + 2**-8) * (1 + 4 * U))
    assert torch.all(back[x.abs() == scale] == x[x.abs() == scale])
    # codes of an all-zero block decode to exact zeros
    z = torch.zeros(512)
    zb = Blocks.from_lengths([256, 256])
    zc, zs = torch.empty(512, dtype=torch.uint8), torch.empty(2)
    quantize_(z, zb, q, zc, zs)
    assert torch.equal(zs, torch.zeros(2)) and torch.all(zc == q.zero)
    assert torch.equal(dequantize(zc, zs, zb, q), z)


def test_blocks_are_independent_of_their_neighbours():
    """A shard quantized alone == the same blocks inside a whole buffer with gaps."""
    q = dynamic_tree_map(True)
    a, b = 256 * 5 + 32, 256 * 3  # tensor a (short last block), then a gap, then tensor b
    gap = 96
    buf = _wide(a + gap + b, seed=3)
    flat = Blocks.from_lengths(
        param_block_lengths(a, a, 0, a, 256) + [gap] + param_block_lengths(b, b, 0, b, 256)
    )
    assert flat.unit == 32 and not flat.uniform
    codes, scales = torch.empty(a + gap + b, dtype=torch.uint8), torch.empty(flat.count)
    quantize_(buf, flat, q, codes, scales)
    for lo, hi in [(0, 512), (512, a)]:  # two ranks' shards of tensor a
        part = Blocks.from_lengths(param_block_lengths(a, a, lo, hi, 256))
        c, s = torch.empty(hi - lo, dtype=torch.uint8), torch.empty(part.count)
        quantize_(buf[lo:hi].clone(), part, q, c, s)
        assert torch.equal(c, codes[lo:hi])
        assert torch.equal(s, scales[lo // 256 : lo // 256 + part.count])
    tail = Blocks.from_lengths(param_block_lengths(b, b, 0, b, 256))
    assert tail.uniform and tail.unit == 256


def test_param_block_lengths():
    assert param_block_lengths(600, 600, 0, 600, 256) == [256, 256, 88]
    assert param_block_lengths(600, 600, 256, 600, 256) == [256, 88]
    # a stack of 3 members of 300: blocks restart at each member
    assert param_block_lengths(900, 300, 0, 900, 256) == [256, 44] * 3
    assert param_block_lengths(900, 300, 300, 556, 256) == [256]
    assert param_block_lengths(900, 300, 5, 5, 256) == []


# ---- eligibility, policy, size -------------------------------------------------------------
def test_eligibility_by_size():
    assert not is_8bit_eligible((4095,)) and is_8bit_eligible((4096,))
    assert is_8bit_eligible((64, 64)) and not is_8bit_eligible((63, 64))
    assert not is_8bit_eligible((64, 8, 8))  # members of 64 < 256 elements
    assert is_8bit_eligible((16, 16, 16))
    params = [nn.Parameter(torch.randn(4095)), nn.Parameter(torch.randn(64, 64))]
    opt = AdamW8bit(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    small, big = (opt.state[p] for p in params)
    assert set(small) == {"step", "exp_avg", "exp_avg_sq"}
    assert small["exp_avg"].dtype == torch.float32
    assert set(big) == {"step", *STATE_KEYS}
    assert big["exp_avg_codes"].dtype == torch.uint8 and big["exp_avg_codes"].shape == (64, 64)
    assert big["exp_avg_scales"].shape == (16,)
    assert not opt.is_8bit(params[0]) and opt.is_8bit(params[1])


@pytest.mark.parametrize(
    "shape, rows",
    [
        ((96, 96), 8),  # 96-element rows: 8 rows = 768 = 3 blocks
        ((1001, 96), "whole"),  # 8 does not divide 1001
        ((260, 96), "whole"),
        ((96, 260), "whole"),  # gcd(256, 260) = 4: 64 rows, 96 % 64 != 0
        ((64, 100), 64),
        ((128, 256), 1),  # one row is one block
        ((64, 512), 1),
        ((6, 44, 96), "whole"),  # each whole member of a stack
        ((4, 64, 96), 8),
        ((32, 96), 1),  # 3072 elements: fp32 moments, no alignment needed
        ((5000,), "whole"),  # 1-D, 8-bit: 256 elements do not divide 5000
        ((32000,), 256),  # 1-D, 8-bit: cut between quantization blocks
        ((3000,), 1),  # 1-D, fp32 moments: cut between elements
    ],
)
def test_block_policy(shape, rows):
    policy = adamw8bit_block_policy()
    assert policy("w", torch.empty(shape, device="meta")) == rows
    if rows not in ("whole", 1):
        assert (rows * shape[-1]) % 256 == 0


def test_block_policy_other_sizes_and_errors():
    assert adamw8bit_block_policy(128)("w", torch.empty(96, 96)) == 4
    assert adamw8bit_block_policy(min_8bit_size=100)("w", torch.empty(32, 96)) == 8
    strict = adamw8bit_block_policy(whole_fallback=False)
    with pytest.raises(ValueError, match=r"'layers.0.w1' of shape \(260, 96\) has 260 rows"):
        strict("layers.0.w1", torch.empty(260, 96))
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        adamw8bit_block_policy(0)
    with pytest.raises(ValueError, match="min_8bit_size must be an int >= 0"):
        adamw8bit_block_policy(min_8bit_size=-1)


def test_state_bytes_per_parameter():
    params = [nn.Parameter(torch.randn(s)) for s in [(96, 96), (1001, 96), (6, 44, 96), (4096,)]]
    opt = AdamW8bit(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        state = opt.state[p]
        nbytes = sum(state[k].numel() * state[k].element_size() for k in STATE_KEYS)
        assert nbytes / p.numel() <= 2.1, (tuple(p.shape), nbytes / p.numel())


# ---- the optimizer -----------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64))


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g)
        loss = (model(x) - x.roll(1, dims=1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_tracks_fp32_adamw():
    ref, ours = _model(), _model()
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 50)
    our_losses = _train(ours, AdamW8bit(ours.parameters(), lr=1e-3, min_8bit_size=1024), 50)
    # quality bounds of 8-bit moments after 50 steps (quantization, not rounding): it
    # trains, and its loss and parameters stay near fp32 AdamW's
    assert our_losses[-1] < 0.8 * our_losses[0]
    assert abs(our_losses[-1] - ref_losses[-1]) <= 0.02 * ref_losses[-1]
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert (p - q).abs().max() < 5e-3


def test_state_dict_round_trip_continues_exactly():
    a = _model()
    opt_a = AdamW8bit(a.parameters(), lr=1e-3, min_8bit_size=1024)
    _train(a, opt_a, 5)
    b = copy.deepcopy(a)
    opt_b = AdamW8bit(b.parameters(), lr=1e-3, min_8bit_size=1024)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    _train(a, opt_a, 3, seed=1)
    _train(b, opt_b, 3, seed=1)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key


def test_bf16_parameters_keep_fp32_scales_and_moments():
    p = nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    s = nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    opt = AdamW8bit([p, s])
    for _ in range(2):
        p.grad, s.grad = torch.randn_like(p), torch.randn_like(s)
        opt.step()
    assert opt.state[p]["exp_avg_scales"].dtype == torch.float32
    assert opt.state[s]["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all()
    fresh = AdamW8bit([p, s])
    fresh.load_state_dict(opt.state_dict())
    assert torch.equal(fresh.state[p]["exp_avg_scales"], opt.state[p]["exp_avg_scales"])


def test_parameters_without_grad_are_skipped():
    p, q = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64, 64))
    opt = AdamW8bit([p, q])
    p.grad = torch.randn_like(p)
    before = q.detach().clone()
    opt.step()
    assert torch.equal(q, before) and not opt.state[q]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr must be >= 0, got -1.0"),
        (dict(eps=-1.0), "eps must be >= 0"),
        (dict(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\), got 1.0"),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
        (dict(block_size=0), "block_size must be a positive int, got 0"),
        (dict(block_size=2.5), "block_size must be a positive int, got 2.5"),
        (dict(min_8bit_size=-5), "min_8bit_size must be an int >= 0, got -5"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW8bit([nn.Parameter(torch.zeros(4))], **kwargs)


def test_load_state_dict_of_another_configuration_names_the_parameter():
    p = nn.Parameter(torch.randn(64, 64))
    opt = AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    fp32 = AdamW8bit([p], min_8bit_size=10**6)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*min_8bit_size"):
        fp32.load_state_dict(opt.state_dict())
