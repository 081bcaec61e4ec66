"""The command line of ``python -m raggedfsdp simulate``: arguments, the text report and
the sweep over world sizes (its table and plot). The simulation itself is
``raggedfsdp.tools.simulate``; what its results read as (the cross-check, the memory
timeline plot, a sweep's rows) is ``raggedfsdp.tools.simulate_results``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from raggedfsdp.models.mesh import parse_hsdp_mesh
from raggedfsdp.tools.simulate import (
    GROUPINGS,
    SYSTEMS,
    SimConfig,
    simulate,
    time_fully_shard,
)
from raggedfsdp.tools.simulate_results import cross_check, mesh_text, plot_timeline, sweep_row

__all__ = [
    "format_result",
    "format_sweep",
    "main",
    "plot_sweep",
    "sweep",
]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def format_result(r: dict[str, Any]) -> str:
    """A human-readable report of one ``simulate`` result."""
    c = r["config"]
    ranks: dict[str, set[int]] = {}
    for kind, _, _, n in r["comm_events"]:
        ranks.setdefault(kind, set()).add(n)
    lines = [
        f"{c['system']}: {c['model']} ({c['layers']} blocks, {r['params']:,} params), "
        f"rank {c['rank']} of {c['world']} ({mesh_text(r['mesh'], c['world'])}), "
        f"batch {c['batch']} x {c['seq']}, mp {c['mp']}, optim {c['optim']}, "
        f"AC {'on' if c['ac'] else 'off'}" + (f"  [{r['note']}]" if r["note"] else ""),
        f"  peak {_mib(r['peak'].get('total', 0))} MiB; MemTracker: "
        + ", ".join(f"{k} {_mib(v)}" for k, v in r["peak"].items() if k != "total" and v),
        "  by role: " + ", ".join(f"{k} {_mib(v)}" for k, v in r["roles"].items() if v),
        "  collectives: "
        + ", ".join(
            f"{k} {n}x in {_mib(i)} out {_mib(o)} MiB "
            f"(groups of {'/'.join(map(str, sorted(ranks[k])))} ranks)"
            for k, (n, i, o) in r["comm"].items()
        ),
        f"  padding {r['layout']['padding_elems']:,} elements; allocations {r['allocations']} "
        f"({r['distinct_sizes']} distinct sizes)",
        f"  fully_shard {r['shard_s']:.2f} s, warm-up {r['warmup_s']:.2f} s, "
        f"measured step {r['step_s']:.2f} s",
    ]
    fmt = r.get("fsdp_mem_tracker")
    if fmt is not None and "error" in fmt:
        lines.append(f"  FSDPMemTracker (FSDP2's own, one more step) failed: {fmt['error']}")
    elif fmt is not None:
        lines.append(
            f"  FSDPMemTracker (FSDP2's own, one more step): peak "
            f"{_mib(fmt['peak'].get('total', 0))} MiB ({cross_check(r):+.1%} vs MemTracker's); "
            + ", ".join(f"{k} {_mib(v)}" for k, v in fmt["peak"].items() if k != "total" and v)
        )
    return "\n".join(lines)


# ================================================================================================
# The sweep over world sizes
# ================================================================================================
def sweep(cfg: SimConfig, worlds: Iterable[int]) -> Iterator[dict[str, Any]]:
    """``sweep_row`` at each world size: ``cfg`` simulated by both systems (its ``world``
    and ``system`` replaced)."""
    for world in worlds:
        ours, fsdp2 = (simulate(dataclasses.replace(cfg, world=world, system=s)) for s in SYSTEMS)
        yield sweep_row(ours, fsdp2)


def _unit(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> tuple[str, int]:
    top = max((row[k] for row in rows for k in keys), default=0)
    return ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """The sweep as a Markdown table, one row per world size."""
    peak, ps = _unit(rows, ("peak_raggedfsdp", "peak_fsdp2"))
    gath, gs = _unit(rows, ("gathered_raggedfsdp", "gathered_fsdp2"))
    lines = [
        f"| ranks | peak raggedfsdp ({peak}) | peak FSDP2 ({peak}) | peak ratio | padding "
        f"raggedfsdp | padding FSDP2 | gathered raggedfsdp ({gath}) | gathered FSDP2 ({gath}) "
        "| gathered ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']:,} | {r['peak_raggedfsdp'] / ps:,.2f} | {r['peak_fsdp2'] / ps:,.2f} "
            f"| {_ratio(r['peak_ratio'])} | {r['padding_raggedfsdp']:.2%} | "
            f"{r['padding_fsdp2']:.2%} | {r['gathered_raggedfsdp'] / gs:,.2f} | "
            f"{r['gathered_fsdp2'] / gs:,.2f} | {_ratio(r['gathered_ratio'])} |"
        )
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Peak per rank and bytes gathered per step over world size, both systems (two panels).
    Needs matplotlib (the ``train`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    worlds = [r["world"] for r in rows]
    for ax, what, label in zip(
        axes, ("peak", "gathered"), ("peak per rank", "all-gathered per step")
    ):
        unit, scale = _unit(rows, (f"{what}_raggedfsdp", f"{what}_fsdp2"))
        for system, style in (("raggedfsdp", "o-"), ("fsdp2", "s--")):
            ax.plot(worlds, [r[f"{what}_{system}"] / scale for r in rows], style, label=system)
        values = [r[f"{what}_{s}"] for r in rows for s in SYSTEMS if r[f"{what}_{s}"]]
        if values and max(values) > 20 * min(values):
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel(f"{label} ({unit})")
        ax.legend()
    fig.suptitle(title or rows[0]["model"], fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep_title(cfg: SimConfig, params: int) -> str:
    blocks = "all" if cfg.layers is None else cfg.layers
    return (
        f"{cfg.model} ({blocks} blocks, {params:,} params), rank {cfg.rank}, batch "
        f"{cfg.batch} x {cfg.seq}, mp {cfg.mp}, optim {cfg.optim}, AC {'on' if cfg.ac else 'off'}"
    )


# ================================================================================================
# Arguments
# ================================================================================================
def _worlds(text: str) -> list[int]:
    """``--world``: a rank count or a comma list of them (a sweep)."""
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError(
            f"takes a rank count or a comma list of them, e.g. 64 or 8,64,256; got {text!r}"
        )
    return worlds


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp simulate",
        description="One rank of an N-rank training step on fake tensors: peak memory by "
        "category, collectives, allocations (see raggedfsdp/tools/simulate.py).",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a catalogue name, a JSON config file (TransformerConfig's fields, *.json) or "
        "hf:DIR (a Hugging Face config.json; needs transformers)",
    )
    p.add_argument(
        "--world",
        type=_worlds,
        help="ranks (default 64, or the --mesh's); a comma list (8,64,1024) sweeps them, "
        "both systems side by side",
    )
    p.add_argument(
        "--mesh",
        help="HSDP: replicate=R,shard=S (R x S ranks; shard over S, all-reduce over R)",
    )
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--system", choices=(*SYSTEMS, "both"), default="both")
    p.add_argument("--optim", choices=("adamw", "shampoo", "none"), default="adamw")
    p.add_argument("--mp", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument(
        "--grouping",
        choices=GROUPINGS,
        default="blocks",
        help="blocks: fully_shard each block, then the root (default); torchtitan: the "
        "embedding, each block, [norm, output], then the root",
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default 1)")
    p.add_argument("--time-shard", action="store_true", help="time fully_shard of all blocks")
    p.add_argument(
        "--png",
        help="draw the step's memory by role over its ops to this PNG (a sweep: peak and "
        "gathered bytes over world size)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (a sweep: its rows)")
    return p


def _configs(args: argparse.Namespace) -> list[SimConfig]:
    """One ``SimConfig`` per system; every argument checked (raises before any work)."""
    replicate = None
    worlds = [64] if args.world is None else args.world
    if args.mesh is not None:
        if len(worlds) > 1:
            raise ValueError(
                f"--mesh {args.mesh} fixes one world size; a sweep (--world "
                f"{','.join(map(str, worlds))}) runs 1-D meshes: drop one"
            )
        replicate, shard = parse_hsdp_mesh(args.mesh, args.world and args.world[0], "simulate")
        worlds = [replicate * shard]
    if args.png is not None and args.time_shard:
        raise ValueError("--png draws a simulated step, which --time-shard does not run; drop one")
    if len(worlds) > 1 and args.system != "both" and not args.time_shard:
        raise ValueError(
            f"a sweep (--world {','.join(map(str, worlds))}) compares both systems; drop "
            f"--system {args.system}"
        )
    if args.optim == "shampoo" and args.system != "raggedfsdp":
        raise ValueError(
            "--optim shampoo steps raggedfsdp's RaggedShard parameters only (FSDP2's Shard(0) "
            "would cut its blocks); pass --system raggedfsdp"
        )
    systems = SYSTEMS if args.system == "both" else (args.system,)
    return [
        SimConfig(
            model=args.model,
            world=world,
            layers=args.layers,
            system=s,
            optim=args.optim,
            mp=args.mp,
            batch=args.batch,
            seq=args.seq,
            ac=args.ac,
            rank=args.rank,
            warmup=args.warmup,
            replicate=replicate,
            grouping=args.grouping,
        )
        for world in worlds
        for s in systems
    ]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m raggedfsdp simulate``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        configs = _configs(args)
    except (ValueError, NotImplementedError, ImportError) as e:
        print(f"raggedfsdp simulate: error: {e}", file=sys.stderr)
        return 2
    if len(args.world or ()) > 1 and not args.time_shard:
        return _main_sweep(args, configs[0])
    results: list[dict[str, Any]] = []
    if args.time_shard:
        for cfg in configs:
            results.append(time_fully_shard(cfg.model, cfg.world, cfg.system, cfg.replicate))
            r = results[-1]
            if not args.json:
                print(
                    f"{r['system']}: fully_shard of {r['model']} ({r['blocks']} blocks) at "
                    f"{mesh_text(r['mesh'], r['world'])}: {r['seconds']:.2f} s, "
                    f"{r['gc_objects']:,} objects kept"
                )
    else:
        for cfg in configs:
            results.append(simulate(cfg))
            if not args.json:
                print(format_result(results[-1]), flush=True)
        if len(results) == 2 and not args.json:
            a, b = (r["peak"].get("total", 0) for r in results)
            print(f"peak raggedfsdp / FSDP2: {a / b:.3f}" if b else "")
        if args.png is not None:
            plot_timeline(results, args.png)
            if not args.json:
                print(f"memory over the step drawn to {args.png}")
    if args.json:
        for r in results:
            r.pop("timeline", None)
        print(json.dumps(results if len(results) > 1 else results[0]))
    return 0


def _main_sweep(args: argparse.Namespace, cfg: SimConfig) -> int:
    """``--world`` with several world sizes: the sweep's table (or rows), and its plot."""
    rows: list[dict[str, Any]] = []
    cfg = dataclasses.replace(cfg, fsdp_tracker=False)  # its rows need MemTracker's peak only
    for row in sweep(cfg, args.world):
        rows.append(row)
        print(f"simulated {row['world']:,} ranks ({len(rows)} of {len(args.world)})",
              file=sys.stderr, flush=True)  # fmt: skip
    if args.png is not None:
        plot_sweep(rows, args.png, _sweep_title(cfg, rows[0]["params"]))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(_sweep_title(cfg, rows[0]["params"]), "", format_sweep(rows), sep="\n")
    if args.png is not None:
        print(f"peak and gathered bytes over world size drawn to {args.png}")
    return 0
