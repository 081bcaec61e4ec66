"""A/B runs: raggedfsdp and torch's FSDP2 trained side by side in one process group.

``step.py`` and ``composition.py`` build each model twice from the same seed, once per
system, and train both on the same global batches. This module holds what they share:

- **the run** (``StepRun``): one sharded model and its optimizer, one training step at
  a time between two barriers, its wall and CPU time, its loss (the mean over ranks);
- **the alternation** (``alternate``): warm-up steps, then blocks of ``block`` steps per
  system in ABBA order, so that the machine's load falls on both alike;
- **the ratios** (``paired_ratios``, ``ratio_cell``, ``time_rows``): raggedfsdp over
  FSDP2, over the whole run and within each round of two adjacent blocks;
- **the page** (``add_arguments``, ``run_page`` and the raw-number tables).

A script imports it as ``import _ab`` (it sits beside them, so it is on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import RESULTS, gather_objects, persistent_storages, run_ranks, write_results

from raggedfsdp.tools.profiling import peak_memory
from raggedfsdp.train.report import ratio

SYSTEMS = ("raggedfsdp", "fsdp2")  # A, B; a result's "times", "losses", ... are keyed so


# ================================================================================================
# Inside a rank
# ================================================================================================
class StepRun:
    """One model sharded by one system, trained step by step on the shared data.

    Args:
        system: ``"raggedfsdp"`` or ``"fsdp2"``.
        model: the sharded model.
        opt: its optimizer.
        data: the training bytes (1-D token tensor) every run draws its batches from.
        args: the script's options; ``seed``, ``batch`` and ``seq`` are read.
        coord: ``(index, count)`` of this rank's data-parallel coordinate: it takes rows
            ``index`` of ``count`` of every global batch.
        world: ranks in all (the loss is averaged over them).
    """

    def __init__(self, system: str, model, opt, data, args, coord: tuple[int, int], world: int):
        self.system, self.model, self.opt, self.data, self.args = system, model, opt, data, args
        self.coord, self.world = coord, world
        self.step_index = 0
        self.losses: list[float] = []
        self.times: list[float] = []  # wall seconds per timed step (barrier to barrier)
        self.cpu: list[float] = []  # CPU seconds of this rank per timed step

    def step(self, timed: bool = False, around=contextlib.nullcontext) -> None:
        """One training step; ``around()`` (a counter or tracker) wraps its compute only."""
        from raggedfsdp.models import lm_loss
        from raggedfsdp.train import get_batch

        index, count = self.coord
        x, y = get_batch(
            self.data, seed=self.args.seed, step=self.step_index, batch_size=self.args.batch,
            seq_len=self.args.seq, rank=index, world_size=count,
        )  # fmt: skip
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with around():
            loss = lm_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        cpu = time.process_time() - c0  # this rank's threads (gloo's included), not others'
        dist.barrier()
        seconds = time.perf_counter() - t0
        if timed:
            self.times.append(seconds)
            self.cpu.append(cpu)
        loss = loss.detach()
        dist.all_reduce(loss)  # ranks that share a data coordinate hold the same loss
        self.losses.append(loss.item() / self.world)  # the mean over all ranks
        self.step_index += 1

    def persistent_storages(self) -> list[torch.Tensor]:
        return persistent_storages(self.model, self.system)

    def memory_step(self, tracker=None) -> dict:
        """Peak memory of one step by ``MemTracker`` category, the system's storages tracked
        (``tracker``: a ``MemTracker`` subclass; default ``MemTracker``)."""
        return peak_memory(
            self.step, self.model, self.opt, *self.persistent_storages(), tracker=tracker
        )


def alternate(runs: dict[str, StepRun], *, warmup: int, steps: int, block: int) -> None:
    """``warmup`` untimed steps of each run, then ``steps`` timed ones each in blocks of
    ``block``, the systems alternating ABBA (the last round may run past ``steps``)."""
    for _ in range(warmup):
        for s in SYSTEMS:
            runs[s].step()
    for r in range(math.ceil(steps / block)):
        for s in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
            for _ in range(block):
                runs[s].step(timed=True)


def timing_results(runs: dict[str, StepRun], memory: dict[str, dict]) -> dict:
    """What every A/B result holds: the losses, the timed steps (wall, and CPU summed over
    the ranks), rank 0's peak by category (``memory``, this rank's) and every rank's peak.

    Collective: every rank calls it.
    """
    peaks = gather_objects({s: memory[s]["Total"] for s in SYSTEMS})
    cpus = gather_objects({s: runs[s].cpu for s in SYSTEMS})
    a, b = (runs[s].losses for s in SYSTEMS)
    return {
        "losses": {s: runs[s].losses for s in SYSTEMS},
        "max_loss_diff": max(abs(x - y) for x, y in zip(a, b)),
        "times": {s: runs[s].times for s in SYSTEMS},
        "cpu": {s: [sum(c) for c in zip(*(p[s] for p in cpus))] for s in SYSTEMS},
        "memory_rank0": memory,
        "peak_per_rank": {s: [p[s] for p in peaks] for s in SYSTEMS},
    }


# ================================================================================================
# Ratios
# ================================================================================================
def paired_ratios(a: list[float], b: list[float], block: int) -> list[float]:
    """Median of ``a`` over median of ``b`` in each round of ``block`` steps (ABBA blocks)."""
    return [
        statistics.median(a[i : i + block]) / statistics.median(b[i : i + block])
        for i in range(0, min(len(a), len(b)), block)
    ]


def ratio_cell(a: float, b: float, digits: int = 3) -> str:
    """``a / b`` (raggedfsdp over FSDP2) with ``digits`` decimals."""
    return f"{ratio(a, b):.{digits}f}"


def time_rows(r: dict, block: int) -> list[tuple[str, str, str, str]]:
    """The summary's time rows of one result: median step time, its ratio per round (the
    two adjacent blocks), and CPU time per step; (metric, raggedfsdp, FSDP2, ratio)."""
    ta, tb = (statistics.median(r["times"][s]) * 1e3 for s in SYSTEMS)
    paired = paired_ratios(r["times"]["raggedfsdp"], r["times"]["fsdp2"], block)
    ua, ub = (statistics.median(r["cpu"][s]) * 1e3 for s in SYSTEMS)
    return [
        ("step time, median (ms)", f"{ta:.1f}", f"{tb:.1f}", ratio_cell(ta, tb)),
        (
            f"step time ratio per round, median (min-max) of {len(paired)}",
            "",
            "",
            f"{statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})",
        ),
        ("CPU time per step, all ranks, median (ms)", f"{ua:.1f}", f"{ub:.1f}", ratio_cell(ua, ub)),
    ]


def loss_diff_row(r: dict) -> tuple[str, str, str, str]:
    """The summary's last row: the largest per-step loss difference of the two systems."""
    steps = len(r["losses"]["raggedfsdp"])
    return (f"max abs loss difference over {steps} steps", "", "", f"{r['max_loss_diff']:.3g}")


# ================================================================================================
# Raw numbers
# ================================================================================================
def time_lines(r: dict, spread: bool = False) -> list[str]:
    """Each system's step times and CPU times in order (``spread``: min / median / max too)."""
    lines = []
    for s in SYSTEMS:
        t = r["times"][s]
        lines.append(f"- {s} step times (ms, in order): " + ", ".join(f"{x * 1e3:.1f}" for x in t))
        if spread:
            lines.append(
                f"- {s} min / median / max (ms): {min(t) * 1e3:.1f} / "
                f"{statistics.median(t) * 1e3:.1f} / {max(t) * 1e3:.1f}"
            )
        lines.append(
            f"- {s} CPU time per step, all ranks (ms, in order): "
            + ", ".join(f"{x * 1e3:.1f}" for x in r["cpu"][s])
        )
    return lines


def memory_lines(r: dict) -> list[str]:
    """The peak of every rank, and rank 0's by ``MemTracker`` category, in bytes."""
    lines = ["", "Peak memory (MemTracker, bytes):", ""]
    lines += ["| | raggedfsdp | FSDP2 |", "|---|---:|---:|"]
    for rk in range(len(r["peak_per_rank"]["raggedfsdp"])):
        a, b = (r["peak_per_rank"][s][rk] for s in SYSTEMS)
        lines.append(f"| rank {rk}, peak | {a:,} | {b:,} |")
    keys = list(dict.fromkeys([*r["memory_rank0"]["raggedfsdp"], *r["memory_rank0"]["fsdp2"]]))
    for key in keys:
        a, b = (r["memory_rank0"][s].get(key, 0) for s in SYSTEMS)
        lines.append(f"| rank 0 at its peak: {key} | {a:,} | {b:,} |")
    return lines


def loss_lines(r: dict) -> list[str]:
    """Each system's loss at every step."""
    lines = ["", "Losses per step:", ""]
    for s in SYSTEMS:
        lines.append(f"- {s}: " + ", ".join(f"{x:.6f}" for x in r["losses"][s]))
    return lines


# ================================================================================================
# The page
# ================================================================================================
def add_arguments(parser, *, steps: int, block: int, per: str, page: str) -> None:
    """The options every A/B script takes (``per``: what the timed steps are counted per,
    ``"model"`` or ``"mesh"``; ``page``: the results page's file name)."""
    parser.add_argument("--world", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--models", nargs="+", default=["llama-small", "moe-small"])
    parser.add_argument(
        "--steps", type=int, default=steps, help=f"timed steps per system and {per}"
    )
    parser.add_argument(
        "--block", type=int, default=block, help="steps per system before switching"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per system first")
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / page)


def run_page(script: str, rank_main, args, report) -> None:
    """Print the command, run ``rank_main`` on ``args.world`` ranks, write the page.

    Args:
        script: the script's file name (``"step.py"``), for the command line.
        rank_main: ``rank_main(rank, world, save, args)`` (see ``_common.run_ranks``).
        args: the parsed options; ``world`` and ``out`` are read.
        report: ``report(results, args, command, seconds, load)`` -> the page's text,
            ``load`` the 1-minute load average before and after the run.
    """
    command = " ".join([".venv/bin/python", f"benchmarks/{script}", *sys.argv[1:]])
    print(command, flush=True)
    t0, load = time.perf_counter(), [os.getloadavg()[0]]
    results = run_ranks(rank_main, args.world, args)
    load.append(os.getloadavg()[0])
    write_results(args.out, report(results, args, command, time.perf_counter() - t0, load))
    print(args.out.read_text())
