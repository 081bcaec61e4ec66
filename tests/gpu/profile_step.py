"""One rank of the accelerator check's profiled training (run by torchrun from
``test_gpu_check.py``): raggedfsdp's ``fully_shard`` per block and the root, on the device
and backend ``train`` uses (``raggedfsdp.train.devices``), two warm steps, then
``PROFILED_STEPS`` steps under ``torch.profiler``, whose trace each rank writes to
``OUT/rank<k>.json``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from raggedfsdp.models import get_config
from raggedfsdp.models.parallelize import build_mesh, parallelize, parse_mesh_spec
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.train.devices import backend_for, rank_device

WARM_STEPS = 2
PROFILED_STEPS = 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--rows", type=int, required=True, help="rows per rank")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = rank_device(args.device)
    dist.init_process_group(
        backend_for(device.type), device_id=device if device.type != "cpu" else None
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    mesh = build_mesh(parse_mesh_spec(None, world), device.type)
    config = get_config(args.model)
    model = Transformer(config, max_seq_len=args.seq_len, seed=0)
    model.to(device)
    parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(rank)
    shape = (args.rows, args.seq_len + 1)

    def step() -> None:
        x = torch.randint(0, config.vocab_size, shape, generator=gen).to(device)
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(WARM_STEPS):
        step()
    activities = [ProfilerActivity.CPU]
    if device.type != "cpu":
        activities.append(getattr(ProfilerActivity, device.type.upper()))
        torch.accelerator.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        if device.type != "cpu":
            torch.accelerator.synchronize()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(args.out) / f"rank{rank}.json"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # No interpreter teardown: gloo's threads may still hold work (see train's loop.py).
    sys.stdout.flush()
    os._exit(0)
