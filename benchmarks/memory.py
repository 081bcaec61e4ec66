"""Peak memory per rank, raggedfsdp vs FSDP2, on every configuration this machine trains.

    .venv/bin/python benchmarks/memory.py                     # the grid below
    .venv/bin/python benchmarks/memory.py --worlds 2 --models llama-tiny  # smoke

The models of ``benchmarks/step.py`` (llama-small, moe-small) and of
``benchmarks/peers.py`` (llama-tiny, moe-tiny), at 2, 3 and 4 gloo ranks, with
``reshard_after_forward`` True and False, fp32 and bf16 (param bf16, reduce fp32): each
configuration builds the model twice from one seed, shards it with each system (each
block, then the root), takes one warm-up step each, then one step each under
``MemTracker`` (both systems' persistent storages tracked from the start), on the same
batch. The peak is the maximum over the ranks. Writes ``benchmarks/results/memory.md``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

from _common import ANALYSIS, RESULTS, gather_objects, header, run_ranks, write_results
from step import SYSTEMS, Run, memory_step

MODELS = ("llama-small", "moe-small", "llama-tiny", "moe-tiny")


def _config(args, raf: bool, mp: str) -> argparse.Namespace:
    """The arguments ``step.Run`` reads."""
    return argparse.Namespace(
        seq=args.seq,
        seed=args.seed,
        batch=args.batch,
        optim="adamw",
        lr=1e-3,
        reshard_after_forward=raf,
        mp=mp,
    )


def _rank_main(rank: int, world: int, save, args) -> None:
    from raggedfsdp.train.data import DataConfig, load_corpus

    data = load_corpus(DataConfig(max_bytes=1 << 20)).train
    rows = []
    for model, raf, mp in itertools.product(args.models, (True, False), ("fp32", "bf16")):
        cfg = _config(args, raf, mp)
        peaks, at_peak = {}, {}
        for system in SYSTEMS:
            run = Run(system, model, cfg, rank, world, data)
            run.step()  # warm-up: optimizer states exist, prefetch order recorded
            run.step_index = 0  # the measured step sees the same batch in both systems
            memory, _ = memory_step(run)
            peaks[system] = memory["Total"]
            at_peak[system] = {k: v for k, v in memory.items() if k != "Total"}
            del run
        every = gather_objects(peaks)
        rows.append(
            {
                "model": model,
                "world": world,
                "raf": raf,
                "mp": mp,
                "peak": {s: max(p[s] for p in every) for s in SYSTEMS},
                "rank0_by_kind": at_peak,
            }
        )
    save(rows)


def report(rows: list[dict], args, command: str, seconds: float) -> str:
    lines = [
        *header("Peak memory per rank: raggedfsdp vs FSDP2", command, seconds),
        f"Configuration: gloo ranks on this machine's CPUs; each model built from seed "
        f"{args.seed}, sharded by each system (`fully_shard` on each transformer block, then "
        f"the root, with the row's `reshard_after_forward` and mixed precision), "
        f"`torch.optim.AdamW`, global batch {args.batch} x {args.seq} tokens (rows split over "
        "ranks); one warm-up step, then one step (forward, backward, `opt.step()`, "
        "`zero_grad()`) under `MemTracker` with the system's persistent storages tracked. "
        "Peak: the largest over the ranks. bf16: parameters bf16, gradients reduced in fp32.",
        "",
        "## Peaks",
        "",
        "| model | ranks | reshard after forward | precision | raggedfsdp (MiB) | FSDP2 (MiB) "
        "| ratio |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    ratios = []
    for r in rows:
        a, b = (r["peak"][s] for s in SYSTEMS)
        ratios.append(a / b)
        lines.append(
            f"| {r['model']} | {r['world']} | {r['raf']} | {r['mp']} | {a / 2**20:.3f} | "
            f"{b / 2**20:.3f} | {a / b:.3f} |"
        )
    worst = max(range(len(rows)), key=lambda i: ratios[i])
    w = rows[worst]
    lines += [
        "",
        f"{len(rows)} configurations; ratio median {sorted(ratios)[len(ratios) // 2]:.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f}; at or below FSDP2's in "
        f"{sum(x <= 1 for x in ratios)} of {len(rows)}.",
        "",
        f"Rank 0 at its peak, by MemTracker category, in the highest-ratio configuration "
        f"({w['model']}, {w['world']} ranks, reshard after forward {w['raf']}, {w['mp']}), MiB:",
        "",
        "| category | raggedfsdp | FSDP2 |",
        "|---|---:|---:|",
    ]
    kinds = sorted(set(w["rank0_by_kind"][SYSTEMS[0]]) | set(w["rank0_by_kind"][SYSTEMS[1]]))
    for k in kinds:
        a, b = (w["rank0_by_kind"][s].get(k, 0) for s in SYSTEMS)
        lines.append(f"| {k} | {a / 2**20:.3f} | {b / 2**20:.3f} |")
    lines += ["", ANALYSIS, ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 3, 4])
    p.add_argument("--batch", type=int, default=12, help="global batch (rows)")
    p.add_argument("--seq", type=int, default=64, help="tokens per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "memory.md")
    args = p.parse_args(argv)
    for world in args.worlds:
        if args.batch % world:
            p.error(f"--batch {args.batch} must be a multiple of every world, not of {world}")
    command = " ".join([".venv/bin/python", "benchmarks/memory.py", *sys.argv[1:]])
    print(command, flush=True)
    t0, rows = time.perf_counter(), []
    for world in args.worlds:
        rows += run_ranks(_rank_main, world, args)
        print(f"{world} ranks done ({time.perf_counter() - t0:.0f} s)", flush=True)
    os.makedirs(args.out.parent, exist_ok=True)
    write_results(args.out, report(rows, args, command, time.perf_counter() - t0))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
