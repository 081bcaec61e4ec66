"""FP8 all-gather against the bf16 all-gather: convergence, bytes and step time.

    .venv/bin/python benchmarks/fp8.py                    # 300 steps, 2 ranks
    .venv/bin/python benchmarks/fp8.py --steps 20         # smoke

The demo's model (llama-small) trained twice from one seed on the same batches, with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, once gathering in bf16
and once with ``all_gather=Float8BlockAllGather(tile=(1, 32))`` (MX-style tiles: the
model's width, 192, is not a multiple of 128). Reports the final losses (mean of the
last 20 steps), one step's collective bytes (``CommCounter``) and step times, and draws
both loss curves. torchao's float8 all-gather for FSDP2 is tried in the same run; its
result or its error is recorded. Writes ``benchmarks/results/fp8.md`` and ``fp8.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import ANALYSIS, RESULTS, header, run_ranks, shard, write_results

MODEL = "llama-small"
TILE = (1, 32)
RUNS = ("bf16", "fp8")


def _rank_main(rank: int, world: int, save, args) -> None:
    from torch.distributed.tensor import init_device_mesh

    from raggedfsdp import Float8BlockAllGather, MixedPrecisionPolicy
    from raggedfsdp.models import Transformer, get_config
    from raggedfsdp.models.transformer import lm_loss
    from raggedfsdp.profiling import CommCounter
    from raggedfsdp.train.data import DataConfig, get_batch, load_corpus

    data = load_corpus(DataConfig(max_bytes=1 << 20)).train
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for run in RUNS:
        model = Transformer(get_config(MODEL), max_seq_len=args.seq, seed=args.seed)
        fp8 = Float8BlockAllGather(tile=TILE) if run == "fp8" else None
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, all_gather=fp8
        )
        shard(model, mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        losses, times, comm = [], [], None
        for step in range(args.steps):
            x, y = get_batch(
                data, seed=args.seed, step=step, batch_size=args.batch, seq_len=args.seq,
                rank=rank, world_size=world,
            )  # fmt: skip
            counted = step == 1  # one step's collectives
            dist.barrier()
            t0 = time.perf_counter()
            with CommCounter() if counted else contextlib.nullcontext() as counter:
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            if counted:
                comm = {k: list(v) for k, v in counter.summary().items()}
            dist.barrier()
            times.append(time.perf_counter() - t0)
            loss = loss.detach().double()
            dist.all_reduce(loss)
            losses.append(float(loss) / world)
        out[run] = {"losses": losses, "times": times, "comm": comm}
        del model, opt
    out["torchao"] = _torchao_probe()
    save(out)


def _torchao_probe() -> str:
    """torchao's float8 all-gather for FSDP2 on this machine: its result or its error."""
    try:
        import torchao  # noqa: F401
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # not installed, or not importable with this torch
        return f"not run: importing torchao.float8 raised {type(e).__name__}: {e}"
    try:
        from torch import nn

        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
        model(torch.randn(4, 64)).sum().backward()
        return "ran a float8 Linear step on the CPU"
    except Exception as e:
        return f"failed: {type(e).__name__}: {e}"[:400]


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in RUNS:
        ax.plot(r[run]["losses"], label=f"{run} all-gather", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(f"{MODEL}: bf16 vs FP8 ({TILE[0]}x{TILE[1]} tiles) all-gather")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(r: dict, args, command: str, seconds: float) -> str:
    tail = {run: statistics.mean(r[run]["losses"][-20:]) for run in RUNS}
    med = {run: statistics.median(r[run]["times"][2:]) * 1e3 for run in RUNS}

    def nbytes(run, kind, i):
        return r[run]["comm"].get(kind, [0, 0, 0])[i]

    ag = {run: nbytes(run, "all_gather", 2) for run in RUNS}
    rs = {run: nbytes(run, "reduce_scatter", 1) for run in RUNS}
    lines = [
        *header("FP8 all-gather: convergence, bytes, step time", command, seconds),
        f"Configuration: {MODEL}, {args.world} gloo ranks, {args.steps} steps, AdamW (lr "
        f"{args.lr}, weight decay 0.1), global batch {args.batch} x {args.seq} tokens, seed "
        f"{args.seed}; `fully_shard` on each block then the root, param bf16, reduce fp32; "
        f"the FP8 run adds `all_gather=Float8BlockAllGather(tile={TILE})`. Bytes: one step, "
        "per rank (an all-gather's output, a reduce-scatter's input).",
        "",
        "| metric | bf16 all-gather | FP8 all-gather | ratio |",
        "|---|---:|---:|---:|",
        f"| loss, mean of the last 20 steps | {tail['bf16']:.4f} | {tail['fp8']:.4f} | "
        f"{tail['fp8'] / tail['bf16']:.4f} |",
        f"| all-gather bytes per step | {ag['bf16']:,} | {ag['fp8']:,} | "
        f"{ag['fp8'] / ag['bf16']:.3f} |",
        f"| reduce-scatter bytes per step | {rs['bf16']:,} | {rs['fp8']:,} | "
        f"{rs['fp8'] / rs['bf16']:.3f} |",
        f"| step time, median (ms) | {med['bf16']:.1f} | {med['fp8']:.1f} | "
        f"{med['fp8'] / med['bf16']:.3f} |",
        "",
        f"torchao's float8 all-gather (FSDP2), same run: {r['torchao']}",
        "",
        "![loss curves](fp8.png)",
        "",
        ANALYSIS,
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "fp8.md")
    args = p.parse_args(argv)
    command = " ".join([".venv/bin/python", "benchmarks/fp8.py", *sys.argv[1:]])
    print(command, flush=True)
    t0 = time.perf_counter()
    r = run_ranks(_rank_main, args.world, args)
    plot(r, args.out.with_suffix(".png"))
    write_results(args.out, report(r, args, command, time.perf_counter() - t0))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
