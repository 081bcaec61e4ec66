"""Real model shapes at 64 to 8192 ranks, simulated: peak memory per rank, raggedfsdp vs FSDP2.

    .venv/bin/python benchmarks/scale.py                       # the table (see --help)
    .venv/bin/python benchmarks/scale.py --models llama3-70b --worlds 64 --layers 2  # smoke
    .venv/bin/python benchmarks/scale.py --layers 2 --meshes replicate=4,shard=64 \
        --timeline gpt-oss-120b                               # the HSDP section only

Each row is one rank (rank 0) of a ``world``-rank job running one training step of a
catalogue model cut to K transformer blocks (embeddings and head included), simulated
by ``raggedfsdp.simulate`` in this process: fake tensors, torch's fake process group,
``MemTracker``; bf16 compute with fp32 master weights and fp32 gradient reduction,
``torch.optim.AdamW``, batch 1 x 4096 tokens, activation checkpointing per block, one
warm-up step first. Then ``fully_shard`` of whole models (every block, on ``meta``) is
timed at 16,384 ranks. Writes ``benchmarks/results/scale.md`` and its plots; each
simulation's result is cached in ``--raw`` (JSON lines), so an interrupted run resumes.

With ``--meshes`` (HSDP, ``replicate=R,shard=S`` each) it runs those meshes instead and
rewrites only the page's HSDP section (kept, with its hand-written analysis, when the
whole page is rewritten): peaks of both systems, and FSDP2's own ``FSDPMemTracker`` peak
beside MemTracker's; ``--timeline MODEL`` draws that model's step at the last mesh.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _common import ANALYSIS, RESULTS, git_state, header, write_results  # beside this script

from raggedfsdp.simulate import (
    ROLES,
    SimConfig,
    cross_check,
    parse_mesh,
    plot_timeline,
    simulate,
    time_fully_shard,
)

SYSTEMS = ("raggedfsdp", "fsdp2")
ROLE_NAMES = {
    "sharded_params": "sharded params",
    "unsharded_params": "unsharded params",
    "comm_buffers": "comm buffers",
    "sharded_grads": "sharded grads",
    "unsharded_grads": "unsharded grads",
    "optimizer": "optimizer",
    "activations": "activations",
    "temporaries": "bw temporaries",
}


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f}"


def _key(model: str, world: int, layers: int, system: str, replicate: int | None = None) -> str:
    return f"{model}|{world}|{layers}|{system}" + (f"|r{replicate}" if replicate else "")


def run_all(args, meshes: list[tuple[int, int]] | None = None) -> dict[str, dict]:
    """Every simulation of the sweep (or of the HSDP ``meshes`` instead of ``--worlds``),
    from the cache where it ran before."""
    done: dict[str, dict] = {}
    if args.raw.exists():
        for line in args.raw.read_text().splitlines():
            r = json.loads(line)
            c = r["config"]
            done[_key(c["model"], c["world"], c["layers"], c["system"], c.get("replicate"))] = r
    shapes = meshes or [(None, world) for world in args.worlds]
    code = git_state()
    for model in args.models:
        for layers in args.layers:
            for replicate, shard in shapes:
                world = (replicate or 1) * shard
                for system in SYSTEMS:
                    key = _key(model, world, layers, system, replicate)
                    if key in done:
                        continue
                    cfg = SimConfig(
                        model=model,
                        world=world,
                        layers=layers,
                        system=system,
                        seq=args.seq,
                        replicate=replicate,
                    )
                    t0 = time.perf_counter()
                    try:
                        r = simulate(cfg)
                    except Exception as e:  # a failure is a result too: say it in the table
                        r = {"config": vars(cfg) | {}, "error": f"{type(e).__name__}: {e}"}
                        r["config"] = {
                            "model": model, "world": world, "layers": layers, "system": system,
                            "replicate": replicate,
                        }  # fmt: skip
                    r["seconds"] = time.perf_counter() - t0
                    r["git"] = code
                    print(f"{key}: {r.get('peak', {}).get('total', r.get('error'))}", flush=True)
                    done[key] = r
                    with args.raw.open("a") as f:
                        f.write(json.dumps(r) + "\n")
    return done


def _get(done, model, world, layers, system, replicate=None):
    return done.get(_key(model, world, layers, system, replicate))


def table(done: dict, args) -> list[str]:
    """Peak per rank, the ratio, and the by-role breakdown at each system's peak."""
    lines = [
        "| model | K | ranks | peak raggedfsdp (GiB) | peak FSDP2 (GiB) | ratio | "
        + " | ".join(f"{ROLE_NAMES[r]} R / F" for r in ROLES)
        + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(ROLES),
    ]
    for model in args.models:
        for layers in args.layers:
            for world in args.worlds:
                a, b = (_get(done, model, world, layers, s) for s in SYSTEMS)
                if a is None or b is None:
                    continue
                if "error" in a or "error" in b:
                    err = a.get("error") or b.get("error")
                    lines.append(f"| {model} | {layers} | {world} | failed: {err} |")
                    continue
                pa, pb = a["peak"]["total"], b["peak"]["total"]
                cells = [f"{gib(a['roles'][r])} / {gib(b['roles'][r])}" for r in ROLES]
                lines.append(
                    f"| {model} | {layers} | {world} | {gib(pa)} | {gib(pb)} | {pa / pb:.3f} | "
                    + " | ".join(cells)
                    + " |"
                )
    return lines


def per_block(done: dict, args) -> list[str]:
    """What one more block costs at the peak: (peak at K2 - peak at K1) / (K2 - K1)."""
    if len(args.layers) < 2:
        return []
    k1, k2 = min(args.layers), max(args.layers)
    lines = [
        f"Per block: (peak at K={k2} - peak at K={k1}) / {k2 - k1}, GiB per rank.",
        "",
        "| model | ranks | raggedfsdp | FSDP2 | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for model in args.models:
        for world in args.worlds:
            rs = [[_get(done, model, world, k, s) for k in (k1, k2)] for s in SYSTEMS]
            if any(r is None or "error" in r for pair in rs for r in pair):
                continue
            d = [(p[1]["peak"]["total"] - p[0]["peak"]["total"]) / (k2 - k1) for p in rs]
            ratio = f"{d[0] / d[1]:.3f}" if d[1] else "-"
            lines.append(f"| {model} | {world} | {gib(d[0])} | {gib(d[1])} | {ratio} |")
    return lines


def details(done: dict, args) -> list[str]:
    """Collectives, padding, allocations and times of every simulation."""
    lines = [
        "| model | K | ranks | system | all-gather: n, GiB out | reduce-scatter: n, GiB in | "
        "all-reduce: n, bytes | padding (elements, % of params) | allocations "
        "(distinct sizes) | fully_shard (s) | warm-up step (s) | measured step (s) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model in args.models:
        for layers in args.layers:
            for world in args.worlds:
                for s in SYSTEMS:
                    r = _get(done, model, world, layers, s)
                    if r is None or "error" in r:
                        continue
                    ag = r["comm"].get("all_gather", [0, 0, 0])
                    rs = r["comm"].get("reduce_scatter", [0, 0, 0])
                    ar = r["comm"].get("all_reduce", [0, 0, 0])
                    pad = r["layout"]["padding_elems"]
                    lines.append(
                        f"| {model} | {layers} | {world} | {s} | {ag[0]}, {gib(ag[2])} | "
                        f"{rs[0]}, {gib(rs[1])} | {ar[0]}, {ar[1]:,} | "
                        f"{pad:,} ({100 * pad / r['params']:.2f}%) | {r['allocations']:,} "
                        f"({r['distinct_sizes']}) | {r['shard_s']:.2f} | {r['warmup_s']:.1f} | "
                        f"{r['step_s']:.1f} |"
                    )
    return lines


def plot(done: dict, args, path: Path) -> bool:
    """Peak per rank against ranks, one panel per model, both systems, largest K."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    k = max(args.layers)
    fig, axes = plt.subplots(1, len(args.models), figsize=(4.5 * len(args.models), 3.6))
    axes = axes if len(args.models) > 1 else [axes]
    for ax, model in zip(axes, args.models):
        for s, style in zip(SYSTEMS, ("o-", "s--")):
            pts = [
                (w, r["peak"]["total"] / 2**30)
                for w in args.worlds
                if (r := _get(done, model, w, k, s)) is not None and "error" not in r
            ]
            if pts:
                ax.plot(*zip(*pts), style, label=s)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}, K={k}")
        ax.set_xlabel("ranks")
        ax.set_ylabel("simulated peak per rank (GiB)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ================================================================================================
# HSDP: a section of its own, rewritten in place
# ================================================================================================
HSDP = "## HSDP: replicate x shard meshes"
HSDP_ANALYSIS = "### What the HSDP numbers show"
HSDP_COMMAND = "HSDP section:"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def hsdp_tables(done: dict, args, meshes) -> list[str]:
    """Peaks and the FSDPMemTracker cross-check, then collectives, per (model, mesh)."""
    peaks = [
        "| model | K | mesh (R x S) | ranks | peak raggedfsdp (GiB) | peak FSDP2 (GiB) | ratio "
        "| FSDP2 by FSDPMemTracker (GiB) | FSDPMemTracker vs MemTracker | "
        + " | ".join(f"{ROLE_NAMES[r]} R / F" for r in ROLES)
        + " |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(ROLES),
    ]
    comms = [
        "| model | K | mesh | system | all-gather: n, GiB out, group | reduce-scatter: n, "
        "GiB in, group | all-reduce: n, MiB, groups | padding (elements, % of params) "
        "| FSDPMemTracker's categories at its peak (GiB) | warm-up / step / FSDPMemTracker "
        "step (s) |",
        "|---|---:|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for model in args.models:
        for layers in args.layers:
            for rep, shard in meshes:
                world, mesh = rep * shard, f"{rep} x {shard}"
                a, b = (_get(done, model, world, layers, s, rep) for s in SYSTEMS)
                if a is None or b is None:
                    continue
                if "error" in a or "error" in b:
                    err = a.get("error") or b.get("error")
                    peaks.append(f"| {model} | {layers} | {mesh} | {world} | failed: {err} |")
                    continue
                pa, pb = a["peak"]["total"], b["peak"]["total"]
                fmt = b["fsdp_mem_tracker"]
                tracked = gib(fmt["peak"]["total"]) if "peak" in fmt else f"failed: {fmt['error']}"
                cells = [f"{gib(a['roles'][r])} / {gib(b['roles'][r])}" for r in ROLES]
                peaks.append(
                    f"| {model} | {layers} | {mesh} | {world} | {gib(pa)} | {gib(pb)} | "
                    f"{pa / pb:.3f} | {tracked} | {_pct(cross_check(b))} | "
                    + " | ".join(cells)
                    + " |"
                )
                for s, r in zip(SYSTEMS, (a, b)):
                    comms.append(f"| {model} | {layers} | {mesh} | {s} | " + _comm_cells(r) + " |")
    return [
        "GiB per rank (rank 0). R / F: raggedfsdp / FSDP2, bytes by role at each system's own "
        "peak (MemTracker). FSDPMemTracker: torch's FSDP2 tracker on one more step of the "
        "same FSDP2 model, its peak and its difference from MemTracker's.",
        "",
        *peaks,
        "",
        "Per step on rank 0; group: the ranks of the collective's process group (S: the "
        "shard group, R: the replicas).",
        "",
        *comms,
    ]


def _comm_cells(r: dict) -> str:
    groups: dict[str, set[int]] = {}
    for kind, _, _, n in r["comm_events"]:
        groups.setdefault(kind, set()).add(n)
    ag, rs, ar = (
        r["comm"].get(k, [0, 0, 0]) for k in ("all_gather", "reduce_scatter", "all_reduce")
    )
    pad = r["layout"]["padding_elems"]
    fmt = r.get("fsdp_mem_tracker") or {}
    cats = ", ".join(
        f"{k} {gib(v)}" for k, v in fmt.get("peak", {}).items() if k != "total" and v >= 2**24
    )
    times = f"{r['warmup_s']:.0f} / {r['step_s']:.0f}"
    if r.get("fsdp_tracker_s") is not None:
        times += f" / {r['fsdp_tracker_s']:.0f}"

    def ranks(kind):
        return "/".join(map(str, sorted(groups.get(kind, ())))) or "-"

    return (
        f"{ag[0]}, {gib(ag[2])}, {ranks('all_gather')} | {rs[0]}, {gib(rs[1])}, "
        f"{ranks('reduce_scatter')} | {ar[0]}, {ar[1] / 2**20:,.1f}, {ranks('all_reduce')} | "
        f"{pad:,} ({100 * pad / r['params']:.2f}%) | {cats or '-'} | {times}"
    )


def _section(lines: list[str], heading: str, level: str = "## ") -> tuple[int, int] | None:
    """``(heading line, next heading of ``level`` or the end)``, or None."""
    if heading not in lines:
        return None
    start = lines.index(heading)
    stop = [level] if level == "## " else ["## ", level]
    end = next(
        (i for i in range(start + 1, len(lines)) if any(lines[i].startswith(h) for h in stop)),
        len(lines),
    )
    return start, end


def _insert(lines: list[str], section: list[str]) -> None:
    """Put ``section`` into the page's ``lines`` before its collectives section."""
    where = _section(lines, "## Collectives, padding, allocations, times")
    at = where[0] if where is not None else len(lines)
    lines[at:at] = section


def write_hsdp(path: Path, section: list[str], command_line: str) -> None:
    """Put the HSDP ``section`` into the page at ``path`` (replacing the old one, keeping
    its hand-written ``HSDP_ANALYSIS``), and its command under the page's own command."""
    lines = path.read_text().rstrip("\n").split("\n")
    analysis = ["_Not written yet: read the HSDP tables, then say what they show._"]
    if (old := _section(lines, HSDP)) is not None:
        if (kept := _section(lines[old[0] : old[1]], HSDP_ANALYSIS, "### ")) is not None:
            body = lines[old[0] : old[1]][kept[0] + 1 : kept[1]]
            analysis = "\n".join(body).strip("\n").split("\n")
        del lines[old[0] : old[1]]
    _insert(lines, [HSDP, "", *section, "", HSDP_ANALYSIS, "", *analysis, ""])
    _put_command(lines, command_line)
    path.write_text("\n".join(lines) + "\n")


def _put_command(lines: list[str], command_line: str) -> None:
    """The HSDP section's command, under the page's own (replacing the old one)."""
    old = [i for i, line in enumerate(lines) if line.startswith(HSDP_COMMAND)]
    for i in reversed(old):  # the line and the blank line above it
        del lines[i - (i > 0 and not lines[i - 1].strip()) : i + 1]
    first = next(i for i, line in enumerate(lines) if line.startswith("Command: "))
    lines[first + 1 : first + 1] = ["", command_line]


def report(done: dict, shard_times: list, args, command: str, seconds: float) -> str:
    lines = header("Real shapes at scale, simulated: raggedfsdp vs FSDP2", command, seconds)
    lines += [
        f"Configuration: rank 0 of a `world`-rank job, simulated in one process by "
        f"`raggedfsdp.simulate` (fake tensors, torch's fake process group, MemTracker): "
        f"catalogue models cut to K transformer blocks (embeddings and head kept), "
        f"`fully_shard` on each block then the root, defaults otherwise (blocks reshard "
        f"after forward, the root does not), bf16 compute with fp32 master weights and "
        f"fp32 gradient reduction, `torch.optim.AdamW` (foreach), batch 1 x {args.seq} "
        f"tokens, activation checkpointing per block (`checkpoint_wrapper`), one warm-up "
        f"step, then one measured step (forward, backward, `opt.step()`). Memory is "
        f"*simulated allocated bytes per rank* (no allocator rounding, no cache, no "
        f"fragmentation), not reserved memory on a device. MoE layers route evenly; "
        f"GPT-OSS runs with torchtitan's unfused experts (see `raggedfsdp/simulate.py`).",
        "",
        "## Peak memory per rank",
        "",
        "GiB. R / F: raggedfsdp / FSDP2, bytes by role at each system's own peak "
        "(they add up to the peak).",
        "",
        *table(done, args),
        "",
        *per_block(done, args),
        "",
        "![peak per rank](scale.png)",
        "",
        ANALYSIS,
        "",
        "## Collectives, padding, allocations, times",
        "",
        "Per step on rank 0. All-gather bytes are outputs, reduce-scatter bytes inputs "
        "(whole buffers, padding included).",
        "",
        *details(done, args),
        "",
        "## fully_shard of whole models",
        "",
        "Every block and the root, on `meta`, over a fake process group; planning included. "
        "Objects: Python objects the garbage collector sees after it, minus before.",
        "",
        "| model | blocks | ranks | system | seconds | objects kept |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for t in shard_times:
        if "error" in t:
            lines.append(f"| {t['model']} | | {t['world']} | {t['system']} | {t['error']} | |")
            continue
        lines.append(
            f"| {t['model']} | {t['blocks']} | {t['world']:,} | {t['system']} | "
            f"{t['seconds']:.2f} | {t['gc_objects']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama3-70b", "gpt-oss-120b"])
    p.add_argument("--worlds", nargs="+", type=int, default=[64, 256, 1024, 8192])
    p.add_argument("--layers", nargs="+", type=int, default=[2, 4], help="K values")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--shard-world", type=int, default=16384)
    p.add_argument("--shard-models", nargs="*", default=None, help="default: --models")
    p.add_argument(
        "--shard-systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="whose fully_shard to time (FSDP2's takes minutes at 16,384 ranks)",
    )
    p.add_argument("--raw", type=Path, default=Path("/tmp/raggedfsdp_scale.jsonl"))
    p.add_argument("--out", type=Path, default=RESULTS / "scale.md")
    p.add_argument(
        "--meshes",
        nargs="*",
        default=[],
        help="HSDP meshes (replicate=R,shard=S each): run these instead of --worlds and "
        "rewrite only the page's HSDP section",
    )
    p.add_argument("--timeline", help="with --meshes: draw this model's step at the last mesh")
    args = p.parse_args(argv)
    command = " ".join([".venv/bin/python", "benchmarks/scale.py", *sys.argv[1:]])
    print(command, flush=True)
    t0 = time.perf_counter()
    if args.meshes:
        main_hsdp(args, [parse_mesh(m, None) for m in args.meshes], command)
        return
    old = args.out.read_text().rstrip("\n").split("\n") if args.out.exists() else []
    kept = _section(old, HSDP)
    done = run_all(args)
    shard_times = []
    for model in args.models if args.shard_models is None else args.shard_models:
        for system in args.shard_systems:
            try:
                shard_times.append(time_fully_shard(model, args.shard_world, system))
            except Exception as e:
                shard_times.append(
                    {"model": model, "world": args.shard_world, "system": system,
                     "error": f"{type(e).__name__}: {e}"}
                )  # fmt: skip
            print(shard_times[-1], flush=True)
    plot(done, args, args.out.with_suffix(".png"))
    write_results(args.out, report(done, shard_times, args, command, time.perf_counter() - t0))
    if kept is not None:  # the HSDP section is made by its own command: keep it as it was
        lines = args.out.read_text().rstrip("\n").split("\n")
        _insert(lines, old[kept[0] : kept[1]])
        _put_command(lines, next(line for line in old if line.startswith(HSDP_COMMAND)))
        args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


def main_hsdp(args, meshes: list[tuple[int, int]], command: str) -> None:
    """The HSDP sweep: simulate, draw the timeline, rewrite the page's HSDP section."""
    done = run_all(args, meshes)
    section = hsdp_tables(done, args, meshes)
    if args.timeline is not None:
        rep, shard = meshes[-1]
        pair = [_get(done, args.timeline, rep * shard, max(args.layers), s, rep) for s in SYSTEMS]
        if all(r is not None and "error" not in r for r in pair):
            png = args.out.with_name(f"{args.out.stem}_hsdp_timeline.png")
            plot_timeline(pair, str(png))
            print(f"timeline drawn to {png}")
            section += [
                "",
                f"{args.timeline} at {rep} x {shard}, the step's ops by role (as "
                f"`python -m raggedfsdp simulate --png` draws it):",
                "",
                f"![memory over the step]({png.name})",
            ]
    # The simulations' own time and code (cached ones included): a rerun from --raw says the same.
    runs = [
        r
        for model in args.models
        for layers in args.layers
        for rep, shard in meshes
        for s in SYSTEMS
        if (r := _get(done, model, rep * shard, layers, s, rep)) is not None
    ]
    seconds = sum(r.get("seconds", 0) for r in runs)
    code = sorted({r.get("git", "an unrecorded state") for r in runs})
    section[:0] = [f"Simulated with raggedfsdp at {'; '.join(code)}.", ""]
    write_hsdp(
        args.out,
        section,
        f"{HSDP_COMMAND} `{command}` (simulations took {seconds:.0f} s).",
    )
    print(args.out.read_text())


if __name__ == "__main__":
    main()
