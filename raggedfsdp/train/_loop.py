"""One rank of ``python -m raggedfsdp train`` (started by torchrun; see ``_cli``).

Writes, on rank 0, ``metrics.jsonl`` (one line per step, plus validation lines),
``summary.json`` (throughput, memory, communication, copies, padding of the run)
and ``loss.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import init_device_mesh

from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.profiling import measure_step
from raggedfsdp.train.data import DataConfig, get_batch, load_corpus
from raggedfsdp.train.report import plot_losses


def _shard(model: Transformer, args, mesh) -> None:
    raf = args.reshard_after_forward.lower()
    raf = {"auto": None, "true": True, "false": False}[raf] if not raf.isdigit() else int(raf)
    if args.backend == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = dict(mesh=mesh, reshard_after_forward=raf)
    else:
        from raggedfsdp import BlockPolicy, MixedPrecisionPolicy, fully_shard

        rows = args.block_rows if args.block_rows == "whole" else int(args.block_rows)
        kw = dict(mesh=mesh, reshard_after_forward=raf, block_policy=BlockPolicy(rows=rows))
    if args.bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.transformer_blocks():
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def _optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    if args.optim == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    if args.optim == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    from raggedfsdp.optim import AdamW, AdamW8bit, Muon

    if args.optim == "muon":
        return Muon(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay)
    flat = {"flat-adamw": AdamW, "adamw8bit": AdamW8bit}[args.optim]
    return flat(groups, lr=args.lr, weight_decay=args.weight_decay)


def _lr_lambda(args):
    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def padding_ratio(model: nn.Module, backend: str, world: int) -> float:
    """Padded elements / parameter elements of the communication buffers."""
    total = sum(p.numel() for p in model.parameters())
    if backend == "fsdp2":  # per-parameter dim-0 chunks, each padded to ceil(rows / m)
        pad = 0
        for p in model.parameters():
            rows = p.shape[0]
            pad += (math.ceil(rows / world) * world - rows) * (p.numel() // rows)
        return pad / total
    from raggedfsdp.fsdp import buffers_of

    pad = sum(buf.layout.padding for buf in buffers_of(model))
    return pad / total


def _clip(model, args):
    if not args.clip:
        return
    if args.backend == "fsdp2":
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    else:
        from raggedfsdp import clip_grad_norm_

        clip_grad_norm_(model.parameters(), args.clip)


def main(argv: list[str]) -> int:
    (args_file,) = argv
    args = argparse.Namespace(**json.loads(Path(args_file).read_text()))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = Path(args.out)
    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus(DataConfig(path=args.data, max_bytes=args.max_bytes))
    model = Transformer(get_config(args.model), max_seq_len=args.seq_len, seed=args.seed)
    _shard(model, args, mesh)
    opt = _optimizer(model, args)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(args))
    start = 0
    if args.resume or args.ckpt_every:
        from raggedfsdp import checkpoint as ckpt
    if args.resume:
        start, _ = ckpt.load(out / "ckpt", model, opt)
        for _ in range(start):
            sched.step()

    def batch(step, split="train"):
        data = corpus.train if split == "train" else corpus.val
        return get_batch(
            data,
            seed=args.seed if split == "train" else args.seed + 1,
            step=step,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            rank=rank,
            world_size=world,
        )

    def one_step(step):
        x, y = batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        _clip(model, args)
        opt.step()
        opt.zero_grad()
        sched.step()
        return loss.detach()

    def mean(value: torch.Tensor) -> float:
        value = value.clone()
        dist.all_reduce(value)
        return value.item() / world

    log = open(out / "metrics.jsonl", "a" if args.resume else "w") if rank == 0 else None
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc=f"{args.backend} {args.model}")
    tokens = args.batch_size * args.seq_len
    times = []
    end = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    for step in range(start, end):
        t0 = time.perf_counter()
        loss = mean(one_step(step))
        dt = time.perf_counter() - t0
        times.append(dt)
        record = {"step": step, "loss": loss, "lr": sched.get_last_lr()[0], "step_time": dt}
        record["tokens_per_s"] = tokens / dt
        if args.val_every and (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            with torch.no_grad():
                vals = [
                    lm_loss(model(x), y)
                    for x, y in (batch(i, "val") for i in range(args.val_batches))
                ]
            record["val_loss"] = mean(torch.stack(vals).mean())
        if args.ckpt_every and ((step + 1) % args.ckpt_every == 0 or step + 1 == end):
            ckpt.save(out / "ckpt", model, opt, step=step + 1, keep_last=args.keep_last)
        if rank == 0:
            log.write(json.dumps(record) + "\n")
            log.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / dt:,.0f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    # Extra steps after training, counted (comms, copies) and tracked (memory): the
    # counters slow a step down, so none of the timed steps is measured. One plain step
    # first, so the measured one starts where a training step does (after a backward,
    # not after the no-grad validation forward, which leaves FSDP2's root unsharded).
    one_step(args.steps)
    measured = measure_step(model, lambda: one_step(args.steps + 1), args.backend)
    steady = times[min(5, len(times) - 1) :] or times
    summary = {
        "backend": args.backend,
        "model": args.model,
        "world": world,
        "optim": args.optim,
        "steps": args.steps,
        "median_step_s": statistics.median(steady),
        "tokens_per_s": tokens / statistics.median(steady),
        "padding_ratio": padding_ratio(model, args.backend, world),
        "final_loss": loss,
        **measured,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, measured)
    if rank == 0:
        summary["peak_memory_bytes_max_rank"] = max(g.get("peak_memory_bytes", 0) for g in gathered)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        log.close()
        if not args.no_plot:
            plot_losses({args.backend: out / "metrics.jsonl"}, out / "loss.png", args.model)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Leave without interpreter teardown: gloo's worker threads may still hold work
    # objects whose tensors need the GIL, and finalization then aborts the process
    # (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291).
    # Everything is written and the process group destroyed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
