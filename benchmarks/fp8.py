"""FP8 all-gather against the bf16 all-gather and torchao's: convergence, bytes, step time.

    .venv/bin/python benchmarks/fp8.py                    # 300 steps, 2 ranks
    .venv/bin/python benchmarks/fp8.py --steps 20         # smoke

The demo's model (llama-small) trained three times from one seed on the same batches,
param bf16 and reduce fp32:

- ``bf16``: raggedfsdp gathering in bf16;
- ``fp8``: raggedfsdp with ``all_gather=Float8BlockAllGather.mx()`` (MXFP8's layout: one
  E8M0 scale per 32 elements of a row; the model's width, 192, is not a multiple of 128);
- ``torchao``: torch's FSDP2 with torchao's float8 training
  (``convert_to_float8_training``, ``enable_fsdp_float8_all_gather=True``: tensor-wise
  scales, an amax all-reduce, float8 GEMMs too) on every linear whose sides are
  multiples of 16, as torchao requires. Not part of ``make``: install it into ``.venv``
  with ``PIP_CONSTRAINT`` holding ``torch==2.13.0`` (``pip install torchao==0.18.0``); a
  missing or failing torchao is recorded, not fatal.

Reports the final losses (mean of the last 20 steps), one step's collective bytes
(``CommCounter``) and step times, and draws the loss curves. Then one step's bytes of a
model whose every matrix is whole 128 x 128 tiles, with 128 x 128 fp32 scales and with
MX. Writes ``benchmarks/results/fp8.md`` and ``fp8.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _common import ANALYSIS, RESULTS, header, run_ranks, shard, write_results

MODEL = "llama-small"
RUNS = ("bf16", "fp8", "torchao")
TILED = ("bf16", "128x128 fp32 scales", "MX (1x32, E8M0)")


def _policy(run: str):
    from raggedfsdp import Float8BlockAllGather, MixedPrecisionPolicy

    fp8 = {
        "fp8": Float8BlockAllGather.mx(),
        "128x128 fp32 scales": Float8BlockAllGather(tile=(128, 128)),
        "MX (1x32, E8M0)": Float8BlockAllGather.mx(),
    }.get(run)
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, all_gather=fp8
    )


def _model(run: str, mesh, seq: int, seed: int, config=None):
    from raggedfsdp.models import Transformer, get_config

    model = Transformer(config or get_config(MODEL), max_seq_len=seq, seed=seed)
    if run != "torchao":
        shard(model, mesh, mp_policy=_policy(run))
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def sixteens(module, fqn):
        return isinstance(module, torch.nn.Linear) and all(n % 16 == 0 for n in module.weight.shape)

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=sixteens)
    mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard(model, mesh, "fsdp2", mp_policy=mp)
    return model


def _rank_main(rank: int, world: int, save, args) -> None:
    from torch.distributed.tensor import init_device_mesh

    from raggedfsdp.models.transformer import lm_loss
    from raggedfsdp.tools.profiling import CommCounter
    from raggedfsdp.train.data import DataConfig, get_batch, load_corpus

    data = load_corpus(DataConfig(max_bytes=1 << 20)).train
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for run in RUNS:
        try:
            model = _model(run, mesh, args.seq, args.seed)
        except Exception as e:  # torchao missing or refusing: recorded
            out[run] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        losses, times, comm = [], [], None
        try:
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
        except Exception:
            out[run] = {"error": traceback.format_exc(limit=2)[-600:], "losses": losses}
            continue
        finally:
            del model, opt
        out[run] = {"losses": losses, "times": times, "comm": comm}
        save(out)
    out["tiled"] = _tiled_bytes(mesh, args, rank, world, data)
    save(out)


def _tiled_config():
    """llama-small's shape family, every matrix whole 128 x 128 tiles."""
    from raggedfsdp.models import get_config

    base = get_config(MODEL)
    return dataclasses.replace(base, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=1024)


def _tiled_bytes(mesh, args, rank, world, data) -> dict:
    """One step's collective bytes of the whole-tile model, per all-gather policy."""
    from raggedfsdp.models.transformer import lm_loss
    from raggedfsdp.tools.profiling import CommCounter
    from raggedfsdp.train.data import get_batch

    x, y = get_batch(
        data, seed=args.seed, step=0, batch_size=args.batch, seq_len=args.seq, rank=rank,
        world_size=world,
    )  # fmt: skip
    x, y = x % 1024, y % 1024
    out = {}
    for run in TILED:
        model = _model(run, mesh, args.seq, args.seed, _tiled_config())
        with CommCounter() as counter:
            lm_loss(model(x), y).backward()
        out[run] = {k: list(v) for k, v in counter.summary().items()}
    return out


LABELS = {
    "bf16": "raggedfsdp, bf16 all-gather",
    "fp8": "raggedfsdp, FP8 all-gather (MX)",
    "torchao": "FSDP2 + torchao float8",
}


def _ran(r: dict) -> list[str]:
    return [run for run in RUNS if "error" not in r.get(run, {"error": "absent"})]


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in _ran(r):
        ax.plot(r[run]["losses"], label=LABELS[run], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(f"{MODEL}: bf16 vs FP8 all-gather")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _bytes(comm: dict, kind: str) -> int:
    stats = comm.get(kind, [0, 0, 0])
    return stats[2] if kind == "all_gather" else stats[1]  # [count, input, output]


def report(r: dict, args, command: str, seconds: float) -> str:
    ran = _ran(r)
    tail = {run: statistics.mean(r[run]["losses"][-20:]) for run in ran}
    med = {run: statistics.median(r[run]["times"][2:]) * 1e3 for run in ran}
    ag = {run: _bytes(r[run]["comm"], "all_gather") for run in ran}
    rs = {run: _bytes(r[run]["comm"], "reduce_scatter") for run in ran}
    ar = {run: r[run]["comm"].get("all_reduce", [0])[0] for run in ran}

    def row(name, values, fmt):
        cells = [fmt(values[run]) if run in values else "-" for run in RUNS]
        ratios = [
            f"{values[run] / values['bf16']:.3f}" if run in values and values["bf16"] else "-"
            for run in RUNS[1:]
        ]
        return f"| {name} | " + " | ".join(cells + ratios) + " |"

    lines = [
        *header(
            "FP8 all-gather: convergence, bytes, step time",
            command,
            seconds,
            packages=("torch", "torchao"),
        ),  # fmt: skip
        f"Configuration: {MODEL}, {args.world} gloo ranks, {args.steps} steps, AdamW (lr "
        f"{args.lr}, weight decay 0.1), global batch {args.batch} x {args.seq} tokens, seed "
        f"{args.seed}; `fully_shard` on each block then the root, param bf16, reduce fp32. "
        "`fp8` adds `all_gather=Float8BlockAllGather.mx()` (1x32 tiles, E8M0 scales); "
        "`torchao` is torch's FSDP2 with torchao's float8 training on the linears whose "
        "sides are multiples of 16 (tensor-wise scales, float8 all-gather and GEMMs). Bytes: "
        "one step, per rank (an all-gather's output, a reduce-scatter's input).",
        "",
        "| metric | "
        + " | ".join(LABELS[run] for run in RUNS)
        + " | fp8 / bf16 | torchao / bf16 |",
        "|---|" + "---:|" * (2 * len(RUNS) - 1),
        row("loss, mean of the last 20 steps", tail, lambda v: f"{v:.4f}"),
        row("all-gather bytes per step", ag, lambda v: f"{v:,}"),
        row("reduce-scatter bytes per step", rs, lambda v: f"{v:,}"),
        row("all-reduces per step", ar, str),
        row("step time, median (ms)", med, lambda v: f"{v:.1f}"),
        "",
    ]
    for run in RUNS:
        if run not in ran:
            lines += [f"`{run}` did not run: {r.get(run, {}).get('error', 'absent')}", ""]
    tiled = r.get("tiled")
    if tiled:
        base = _bytes(tiled["bf16"], "all_gather")
        lines += [
            "One step's bytes (forward and backward) of llama-small's shape family with every "
            "matrix whole 128 x 128 tiles (dim 256, 8 / 4 heads, feed-forward 768, vocabulary "
            "1024), per rank:",
            "",
            "| all-gather | all-gather bytes | ratio to bf16 | reduce-scatter bytes |",
            "|---|---:|---:|---:|",
            *(
                f"| {run} | {_bytes(c, 'all_gather'):,} | "
                f"{_bytes(c, 'all_gather') / base:.3f} | {_bytes(c, 'reduce_scatter'):,} |"
                for run, c in tiled.items()
            ),
            "",
        ]
    lines += ["![loss curves](fp8.png)", "", ANALYSIS, ""]
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
