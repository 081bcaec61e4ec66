"""The command line of ``python -m raggedfsdp simulate``: arguments, the text report and the
memory timeline plot. The simulation itself is ``raggedfsdp.simulate``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from raggedfsdp.simulate import GROUPINGS, ROLES, SYSTEMS, SimConfig, simulate, time_fully_shard

__all__ = ["cross_check", "format_result", "main", "parse_mesh", "plot_timeline"]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _mesh_text(mesh: dict[str, int] | None, world: int) -> str:
    """``mesh replicate=R x shard=S`` (HSDP) or ``N ranks`` (a 1-D mesh)."""
    return (
        f"mesh replicate={mesh['replicate']} x shard={mesh['shard']}" if mesh else f"{world} ranks"
    )


def cross_check(r: dict[str, Any]) -> float | None:
    """FSDPMemTracker's peak relative to MemTracker's, minus 1 (None if it did not run)."""
    fmt = r.get("fsdp_mem_tracker") or {}
    if "peak" not in fmt or not r["peak"].get("total"):
        return None
    return fmt["peak"].get("total", 0) / r["peak"]["total"] - 1


def format_result(r: dict[str, Any]) -> str:
    """A human-readable report of one ``simulate`` result."""
    c = r["config"]
    ranks: dict[str, set[int]] = {}
    for kind, _, _, n in r["comm_events"]:
        ranks.setdefault(kind, set()).add(n)
    lines = [
        f"{c['system']}: {c['model']} ({c['layers']} blocks, {r['params']:,} params), "
        f"rank {c['rank']} of {c['world']} ({_mesh_text(r['mesh'], c['world'])}), "
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


ROLE_COLORS = {
    "sharded_params": "#4c72b0",
    "unsharded_params": "#8fb0e0",
    "comm_buffers": "#dd8452",
    "sharded_grads": "#55a868",
    "unsharded_grads": "#a6d9a0",
    "optimizer": "#8172b3",
    "activations": "#c44e52",
    "temporaries": "#f0a0a0",
}


def plot_timeline(results: list[dict[str, Any]], path: str) -> None:
    """Allocated bytes by role over the measured step's ops, one panel per result (same
    y-scale), stacked; the phases and the peak marked. Needs matplotlib (the ``train``
    extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(r["peak"].get("total", 0) for r in results)
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    fig, axes = plt.subplots(
        1, len(results), figsize=(6.5 * len(results), 4.2), sharey=True, squeeze=False
    )
    for ax, r in zip(axes[0], results):
        t = r["timeline"]
        ax.stackplot(
            t["at"],
            [[b / scale for b in t["roles"][role]] for role in ROLES],
            labels=[role.replace("_", " ") for role in ROLES],
            colors=[ROLE_COLORS[role] for role in ROLES],
            step="post",
        )
        for phase, op in t["phases"].items():
            right = op > 0.8 * t["ops"]  # a label near the end goes on the line's left
            ax.axvline(op, color="0.3", lw=0.8, ls=":")
            ax.annotate(phase, (op, 1), xycoords=("data", "axes fraction"), fontsize=8,
                        xytext=(-2 if right else 2, -10), textcoords="offset points",
                        ha="right" if right else "left")  # fmt: skip
        peak = r["peak"].get("total", 0) / scale
        ax.axhline(peak, color="k", lw=0.6)
        ax.set_title(f"{r['config']['system']}: peak {peak:,.2f} {unit}", fontsize=10)
        ax.set_xlabel(f"op of the measured step (of {t['ops']:,})")
        ax.set_xlim(0, max(t["ops"] - 1, 1))
    axes[0][0].set_ylabel(f"allocated per rank ({unit})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="center right", fontsize=8)
    c = results[0]["config"]
    fig.suptitle(
        f"{c['model']}, {c['layers']} blocks, rank {c['rank']} of {c['world']} "
        f"({_mesh_text(results[0]['mesh'], c['world'])}), batch {c['batch']} x {c['seq']}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


_MESH_EXAMPLE = "e.g. --mesh replicate=4,shard=64"


def parse_mesh(text: str, world: int | None) -> tuple[int, int]:
    """``--mesh replicate=R,shard=S`` (checked against ``--world`` if given) as ``(R, S)``.

    Raises:
        ValueError: what ``raggedfsdp._mesh_arg.parse_hsdp_mesh`` raises, or a ``world``
            other than ``R * S``.
        NotImplementedError: a dim of a parallelism ``simulate`` does not run (tp, ep, ...).
    """
    from raggedfsdp._mesh_arg import parse_hsdp_mesh

    r, s = parse_hsdp_mesh(
        text,
        _MESH_EXAMPLE,
        "simulate takes HSDP meshes: replicate=R,shard=S",
        "(or leave --mesh out and pass --world for a 1-D mesh)",
    )
    if world is not None and world != r * s:
        raise ValueError(
            f"--world {world} and --mesh {text} ({r} x {s} = {r * s} ranks) disagree; drop "
            f"--world (the mesh gives it) or make it {r * s}"
        )
    return r, s


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp simulate",
        description="One rank of an N-rank training step on fake tensors: peak memory by "
        "category, collectives, allocations (see raggedfsdp/simulate.py).",
    )
    p.add_argument("--model", required=True, help="a catalogue model name")
    p.add_argument("--world", type=int, help="ranks (default 64, or the --mesh's)")
    p.add_argument(
        "--mesh",
        help="HSDP: replicate=R,shard=S (R x S ranks; shard over S, all-reduce over R)",
    )
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--system", choices=(*SYSTEMS, "both"), default="both")
    p.add_argument("--optim", choices=("adamw", "none"), default="adamw")
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
    p.add_argument("--png", help="draw the step's memory by role over its ops to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _configs(args: argparse.Namespace) -> list[SimConfig]:
    """One ``SimConfig`` per system; every argument checked (raises before any work)."""
    replicate = None
    world = 64 if args.world is None else args.world
    if args.mesh is not None:
        replicate, shard = parse_mesh(args.mesh, args.world)
        world = replicate * shard
    if args.png is not None and args.time_shard:
        raise ValueError("--png draws a simulated step, which --time-shard does not run; drop one")
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
        for s in systems
    ]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m raggedfsdp simulate``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        configs = _configs(args)
    except (ValueError, NotImplementedError) as e:
        print(f"raggedfsdp simulate: error: {e}", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    if args.time_shard:
        for cfg in configs:
            results.append(time_fully_shard(cfg.model, cfg.world, cfg.system, cfg.replicate))
            r = results[-1]
            if not args.json:
                print(
                    f"{r['system']}: fully_shard of {r['model']} ({r['blocks']} blocks) at "
                    f"{_mesh_text(r['mesh'], r['world'])}: {r['seconds']:.2f} s, "
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
