"""Optimizer-step time and optimizer state bytes per rank: AdamW, Muon, Shampoo.

    .venv/bin/python benchmarks/_shampoo_step.py [--model llama-small] [--nproc 2]
        [--steps 40]

The model is sharded on ``--nproc`` gloo ranks as ``train`` shards it (a ``fully_shard``
group per transformer block and one for the rest; each optimizer's block policy, as
``train --optim``) and each optimizer built as ``train`` builds it, with its default
hyperparameters. Every step runs a forward and backward on random tokens (untimed),
then ``opt.step()`` (timed, ``time.perf_counter`` around the call, the ranks' maximum).
Shampoo recomputes its roots every ``precondition_frequency`` (20) steps from step 20,
so its time is printed over all steps and over those root steps apart. State bytes:
the sum of ``nbytes`` of every local tensor in ``opt.state`` on a rank (max over ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, init_device_mesh

from raggedfsdp import fully_shard
from raggedfsdp.fsdp import BlockPolicy
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer
from raggedfsdp.optim import AdamW, Muon, Shampoo, muon_param_groups, shampoo_block_policy
from raggedfsdp.optim.muon import muon_block_policy

SEQ, BATCH, LR, WD = 64, 16, 3e-3, 0.1


def _optimizer(name, model):
    groups = muon_param_groups(model, lr=LR)
    if name == "flat-adamw":
        return AdamW(model.parameters(), lr=LR, weight_decay=WD)
    if name == "muon":
        return Muon(groups, lr=LR, weight_decay=WD)
    split = [
        {**{k: v for k, v in g.items() if k != "use_muon"}, "use_shampoo": g["use_muon"]}
        for g in groups
    ]
    return Shampoo(split, lr=LR, weight_decay=WD)


def _policy(name, model, world):
    if name == "muon":
        return muon_block_policy(model, world)
    if name == "shampoo":
        return shampoo_block_policy(base=BlockPolicy())
    return BlockPolicy()


def _state_bytes(opt) -> int:
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                t = v.to_local() if isinstance(v, DTensor) else v
                total += t.numel() * t.element_size()
    return total


def _rank(rank, world, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    cfg = get_config(args.model)
    for name in ("flat-adamw", "muon", "shampoo"):
        model = Transformer(cfg, max_seq_len=SEQ, seed=0)
        policy = _policy(name, model, world)
        for block in model.transformer_blocks():
            fully_shard(block, mesh=mesh, block_policy=policy)
        fully_shard(model, mesh=mesh, block_policy=policy)
        opt = _optimizer(name, model)
        gen = torch.Generator().manual_seed(rank)
        times = []
        for _ in range(args.steps):
            x = torch.randint(cfg.vocab_size, (BATCH, SEQ), generator=gen)
            logits = model(x)
            logits = logits[0] if isinstance(logits, tuple) else logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
            loss.backward()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times.append(float(dt))
            opt.zero_grad()
        nbytes = torch.tensor(_state_bytes(opt))
        dist.all_reduce(nbytes, op=dist.ReduceOp.MAX)
        params = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        if rank == 0:
            out[name] = (times, int(nbytes), params)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    print("Command: python " + " ".join(sys.argv))
    print(f"torch {torch.__version__}; {args.model}, {args.nproc} gloo ranks, 1 thread each\n")
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(args.nproc, args, out), nprocs=args.nproc)
    print(
        "| optimizer | step ms, mean | step ms, median | root steps ms, mean "
        "| state MiB / rank | state / param bytes |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in ("flat-adamw", "muon", "shampoo"):
        times, nbytes, params = out[name]
        t = times[1:]  # the first step makes the states
        roots = [times[s - 1] for s in range(20, args.steps + 1, 20)] if name == "shampoo" else []
        root = f"{1e3 * statistics.mean(roots):.1f}" if roots else "-"
        print(
            f"| {name} | {1e3 * statistics.mean(t):.1f} | {1e3 * statistics.median(t):.1f} "
            f"| {root} | {nbytes / 2**20:.2f} | {nbytes / params:.2f} |"
        )


if __name__ == "__main__":
    main()
