"""GPU check: raggedfsdp on one accelerator against FSDP2, in under 5 minutes, one table.

Prepared for a machine with one GPU (this project's machines have none):

    python benchmarks/gpu_check.py                 # NCCL, the accelerator torch finds
    python benchmarks/gpu_check.py --device cpu    # the same checks on gloo: a dry run
    python benchmarks/gpu_check.py --profile DIR   # and each system's torch.profiler table

On a machine whose torch is not 2.13 (the accelerator machine here had 2.11.0+cu130),
set ``RAGGEDFSDP_UNTESTED_TORCH=1``; results are in ``benchmarks/results/gpu.md``.

1. **World 1 over NCCL.** A single-process reference, raggedfsdp and FSDP2 train the
   same model from the same init with the same batches (torch AdamW); the table gives
   each system's largest loss difference from the reference, its median step time
   (device synchronized) and its peak reserved memory.
2. **A fake process group at world 8, on real device tensors.** One whole step
   (forward, backward, reduce-scatter, clip, optimizer) of each system over torch's
   fake backend: the code path a rank of an 8-GPU job runs, with the collectives
   faked, so the streams, events and allocations are the device's own. The table
   gives the peak allocated memory per rank and whether the step ran.

3. **FP8 all-gather on the device.** raggedfsdp with
   ``Float8BlockAllGather(tile=(128, 128))`` (param bf16) trains the model at world 1:
   the quantize, the uint8 all-gather and the dequantize run on the device. Then one
   weight's gathered codes and 128 x 128 tile scales (``BufferView.fp8.piece``) feed
   ``torch._scaled_mm`` directly, with activations quantized in 1 x 128 tiles, and its
   output is compared with the same GEMM on the dequantized operands; where this torch
   or device has no block-scaled ``_scaled_mm``, its error is the row's status.

Each system runs in its own child process, so peak-memory figures never mix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import shard  # beside this script, so on sys.path

from raggedfsdp.train.report import mib

MODEL = dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=32000)
SYSTEMS = ("reference", "raggedfsdp", "fsdp2")


def _config():
    from raggedfsdp.models import get_config

    return dataclasses.replace(get_config("llama-small"), name="gpu-check", **MODEL)


def _batches(n: int, batch: int, seq: int, vocab: int, device):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(n)]


def _peak(kind: str) -> int | None:
    import torch

    if not torch.accelerator.is_available():
        return None
    stat = torch.accelerator.max_memory_reserved if kind == "reserved" else None
    return (stat or torch.accelerator.max_memory_allocated)()


def _child(system: str, part: str, device_type: str, steps: int, seq: int, batch: int) -> dict:
    """One system, one part, in this (child) process; returns its figures."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.models.transformer import Transformer, lm_loss

    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    if device.type != "cpu":
        torch.accelerator.set_device_index(0)
    world = 1 if part == "nccl" else 8
    if part == "nccl":
        backend = "gloo" if device.type == "cpu" else "nccl"
        store = dist.FileStore(tempfile.mktemp(), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    cfg = _config()
    with torch.device(device):
        model = Transformer(cfg, max_seq_len=seq, seed=0)
    if system == "fp8":
        from raggedfsdp import Float8BlockAllGather, MixedPrecisionPolicy

        fp8 = Float8BlockAllGather(tile=(128, 128))
        shard(
            model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather=fp8)
        )
    elif system != "reference":
        shard(model, mesh, system)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    if system == "raggedfsdp":
        from raggedfsdp import clip_grad_norm_
    else:
        clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
    data = _batches(steps if part == "nccl" else 1, batch, seq, cfg.vocab_size, device)
    if device.type != "cpu":
        torch.accelerator.synchronize()
        torch.accelerator.reset_peak_memory_stats()
    losses, times = [], []
    profile_dir = os.environ.get("GPU_CHECK_PROFILE") if part == "nccl" else None
    profiled = len(data) - 3  # the last 3 steps, warm
    prof = None
    for i, x in enumerate(data):
        if profile_dir and i == profiled:
            prof = _profiler(device)
            prof.__enter__()
        t0 = time.perf_counter()
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().cpu().item())
        if device.type != "cpu":
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.__exit__(None, None, None)
        _write_profile(prof, os.path.join(profile_dir, f"{system}.txt"), device)
    out = {
        "scaled_mm": _scaled_mm_check(model, device) if system == "fp8" else None,
        "losses": losses,
        "step_s": statistics.median(times[1:] or times),  # the first step warms up
        "peak_reserved": _peak("reserved"),
        "peak_allocated": _peak("allocated"),
    }
    dist.destroy_process_group()
    return out


def _scaled_mm_check(model, device) -> str:
    """One gathered weight's codes and tile scales straight into ``torch._scaled_mm``."""
    import torch

    from raggedfsdp.fsdp import buffers_of

    view = next(b for b in buffers_of(model) if b.fp8 is not None)
    name = next(p.fqn for p in view.params if p.stop > p.start)
    send = view.fp8.quantize(view.shard, 0)  # world 1: rank 0's chunk is the whole gather
    w_codes, w_scales = view.fp8.piece(send, 0, name)  # [N, K], [N / 128, K / 128]
    n, k = w_codes.shape
    gen = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(256, k, generator=gen).to(device)
    tiles = x.view(256, k // 128, 128)
    x_scales = (tiles.abs().amax(-1) / 448).clamp(min=1e-12)  # [M, K / 128], 1 x 128 tiles
    x_codes = (tiles / x_scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(256, k)
    w = w_codes.float().view(n // 128, 128, k // 128, 128) * w_scales.view(n // 128, 1, -1, 1)
    want = (x_codes.float().view_as(tiles) * x_scales.unsqueeze(-1)).view(256, k) @ w.view(n, k).t()
    try:
        got = torch._scaled_mm(
            x_codes,
            w_codes.t(),  # column-major [K, N]
            scale_a=x_scales.t().contiguous().t(),  # outer-dim-major, as block scaling wants
            scale_b=w_scales.t(),
            out_dtype=torch.float32,
        )
    except Exception as e:
        return f"no block-scaled _scaled_mm: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    err = ((got - want).norm() / want.norm()).item()
    return f"{name}: _scaled_mm on the gathered codes, relative error {err:.1e} vs dequantized"


def _profiler(device):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=acts)


def _write_profile(prof, path: str, device) -> None:
    """Top ops of the profiled steps by self CPU time, and by device time where there is one."""
    avg = prof.key_averages()
    text = "## by self CPU time\n" + avg.table(sort_by="self_cpu_time_total", row_limit=30)
    if device.type == "cuda":
        text += "\n## by device time\n" + avg.table(sort_by="self_cuda_time_total", row_limit=30)
    with open(path, "w") as f:
        f.write(text)


def _run(system: str, part: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", system, part, "--device", args.device]
    cmd += ["--steps", str(args.steps), "--seq", str(args.seq), "--batch", str(args.batch)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-25:]
        print(f"## {system}, {part}: exit {done.returncode}\n" + "\n".join(tail), file=sys.stderr)
        return {"error": (tail or ["exit " + str(done.returncode)])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n) -> str:
    return "n/a" if n is None else mib(n, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="device type; default: the accelerator")
    p.add_argument("--steps", type=int, default=12, help="training steps of part 1")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--timeout", type=int, default=120, help="seconds per child process")
    p.add_argument("--profile", metavar="DIR", help="write each system's profile of part 1 here")
    p.add_argument("--child", nargs=2, metavar=("SYSTEM", "PART"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device is None:
        import torch

        acc = torch.accelerator.current_accelerator()
        args.device = acc.type if acc is not None else "cpu"
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["GPU_CHECK_PROFILE"] = os.path.abspath(args.profile)
    if args.child:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print(json.dumps(_child(*args.child, args.device, args.steps, args.seq, args.batch)))
        return
    nccl = {s: _run(s, "nccl", args) for s in SYSTEMS}
    fake = {s: _run(s, "fake8", args) for s in SYSTEMS if s != "reference"}
    fp8 = _run("fp8", "nccl", args)
    ref = nccl["reference"].get("losses")
    print(f"# gpu_check: {args.device}, model {MODEL}, seq {args.seq}, batch {args.batch}\n")
    print("| system | part | max loss diff vs reference | step (ms) | vs FSDP2 | peak reserved"
          " (MiB) | peak allocated (MiB) | status |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for part, rows in (("world 1 (NCCL)", nccl), ("fake PG, world 8", fake)):
        base = rows.get("fsdp2", {}).get("step_s")
        for system, r in rows.items():
            if "error" in r:
                print(f"| {system} | {part} | | | | | | {r['error'][:80]} |")
                continue
            diff = (
                max(abs(a - b) for a, b in zip(r["losses"], ref))
                if ref and part.startswith("world")
                else None
            )
            ratio = f"{r['step_s'] / base:.2f}x" if base else ""
            print(
                f"| {system} | {part} | {'' if diff is None else f'{diff:.2e}'} | "
                f"{1e3 * r['step_s']:.1f} | {ratio} | {_mib(r['peak_reserved'])} | "
                f"{_mib(r['peak_allocated'])} | ok |"
            )
    if "error" in fp8:
        print(f"\nFP8 all-gather (128 x 128 tiles), world 1: {fp8['error'][:200]}")
    else:
        print(
            f"\nFP8 all-gather (128 x 128 tiles), world 1: {len(fp8['losses'])} steps, final "
            f"loss {fp8['losses'][-1]:.4f} (bf16 reference {ref[-1] if ref else 'n/a'}), "
            f"{1e3 * fp8['step_s']:.1f} ms/step; {fp8['scaled_mm']}"
        )


if __name__ == "__main__":
    main()
