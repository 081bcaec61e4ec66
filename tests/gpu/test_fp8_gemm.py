"""FP8 all-gather on the accelerator: a gathered weight's codes and tile scales go straight
into ``torch._scaled_mm``, with no dequantize.

``Float8BlockAllGather(tile=(128, 128))`` quantizes each rank's shard into float8 codes and
one scale per 128 x 128 tile; ``BufferView.fp8.piece`` gives a tensor's codes ``[N, K]`` and
scales ``[N / 128, K / 128]`` as views of the all-gather's bytes. Activations are quantized
in 1 x 128 tiles, as block-scaled GEMMs take them. The GEMM on the codes must equal the
GEMM of the dequantized values within the accumulation's rounding (bound below). One rank (world 1,
the device's own backend): the codes a rank sends are what every rank receives. The CPU
build refuses block scales in ``_scaled_mm``: there, and on an accelerator without
block-scaled GEMMs, the test is skipped with torch's own message.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from raggedfsdp import Float8BlockAllGather, MixedPrecisionPolicy, fully_shard
from raggedfsdp.fsdp import buffers_of

ROWS, K, N = 256, 512, 256  # activations [ROWS, K], weight [N, K]
TILE = 128
E4M3_MAX = 448.0
U32 = 2.0**-24  # fp32's unit roundoff
U14 = 2.0**-14  # a 14-bit accumulator's


def _world_one(device: str, tmp_path) -> torch.device:
    """A process group of one rank on ``device``'s backend; the rank's device."""
    if device != "cpu":
        torch.accelerator.set_device_index(0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return torch.device(device, 0) if device != "cpu" else torch.device("cpu")


def test_gathered_fp8_codes_feed_scaled_mm(check, tmp_path):
    device = _world_one(check.device, tmp_path)
    try:
        mesh = init_device_mesh(check.device, (1,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(K, N, bias=False, device=device))
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, all_gather=Float8BlockAllGather(tile=(TILE, TILE))
        )
        fully_shard(model, mesh=mesh, mp_policy=policy)
        view = next(b for b in buffers_of(model) if b.fp8 is not None)
        name = next(p.fqn for p in view.params if p.stop > p.start)
        send = view.fp8.quantize(view.shard, 0)  # world 1: rank 0's send is the whole gather
        w_codes, w_scales = view.fp8.piece(send, 0, name)
        assert w_codes.shape == (N, K) and w_scales.shape == (N // TILE, K // TILE)

        gen = torch.Generator(device="cpu").manual_seed(2)
        x = torch.randn(ROWS, K, generator=gen).to(device)
        tiles = x.view(ROWS, K // TILE, TILE)
        x_scales = (tiles.abs().amax(-1) / E4M3_MAX).clamp(min=1e-12)  # [ROWS, K / 128]
        x_codes = (tiles / x_scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(ROWS, K)
        x_dq = (x_codes.float().view_as(tiles) * x_scales.unsqueeze(-1)).view(ROWS, K)
        w_dq = (
            w_codes.float().view(N // TILE, TILE, K // TILE, TILE)
            * w_scales.float().view(N // TILE, 1, K // TILE, 1)
        ).view(N, K)
        want = x_dq.double() @ w_dq.double().t()  # exact for these fp32 products and sums
        try:
            got = torch._scaled_mm(
                x_codes,
                w_codes.t(),  # column-major [K, N]
                scale_a=x_scales.t().contiguous().t(),  # outer-dim-major, as block scaling wants
                scale_b=w_scales.t(),
                out_dtype=torch.float32,
            )
        except (ValueError, RuntimeError, NotImplementedError) as err:
            pytest.skip(f"no block-scaled torch._scaled_mm here: {str(err).splitlines()[0]}")
        # Each output sums K exact products of codes, 128 at a time inside a tile, then the
        # K / 128 tile sums times their two scales. Inside a tile the tensor cores may keep
        # as few as 14 bits (DeepSeek-V3 technical report, 3.3.2, on Hopper FP8 GEMMs);
        # block-scaled kernels add the scaled tile sums in fp32. Summation error bound
        # (Higham, Accuracy and Stability, 3.1), to first order:
        # |got - want| <= (128 u14 + (K / 128 + 2) u32) * (|x_dq| @ |w_dq|^T).
        gamma = TILE * U14 + (K // TILE + 2) * U32
        bound = gamma * (x_dq.abs().double() @ w_dq.abs().double().t())
        excess = ((got.double() - want).abs() - bound).max().item()
        assert excess <= 0, f"the GEMM on the codes is off by {excess:.3e} beyond the bound"
        rel = ((got.double() - want).norm() / want.norm()).item()
        check.note(
            "FP8 all-gather (128 x 128 tiles): torch._scaled_mm on the gathered codes",
            f"relative error {rel:.1e} against the dequantized GEMM, within the derived bound",
        )
    finally:
        dist.destroy_process_group()
