"""Real model shapes at 64 to 8192 ranks, simulated: peak memory per rank, raggedfsdp vs FSDP2.

    .venv/bin/python benchmarks/scale.py                       # the table (see --help)
    .venv/bin/python benchmarks/scale.py --models llama3-70b --worlds 64 --layers 2  # smoke
    .venv/bin/python benchmarks/scale.py --layers 2 --meshes replicate=4,shard=64 \
        --timeline gpt-oss-120b                               # the HSDP section only

Each row is one rank (rank 0) of a ``world``-rank job running one training step of a
catalogue model cut to K transformer blocks (embeddings and head included), simulated
by ``raggedfsdp.tools.simulate`` in this process: fake tensors, torch's fake process group,
``MemTracker``; bf16 compute with fp32 master weights and fp32 gradient reduction,
``torch.optim.AdamW``, batch 1 x 4096 tokens, activation checkpointing per block, one
warm-up step first. Then ``fully_shard`` of whole models (every block, on ``meta``) is
timed at 16,384 ranks. Writes ``benchmarks/results/scale.md`` and its plots; each
simulation's result is cached in ``--raw`` (JSON lines), so an interrupted run resumes.

With ``--meshes`` (HSDP, ``replicate=R,shard=S`` each) it runs those meshes instead and
rewrites only the page's HSDP section (kept, with its hand-written analysis, when the
whole page is rewritten): peaks of both systems, and FSDP2's own ``FSDPMemTracker`` peak
beside MemTracker's; ``--timeline MODEL`` draws that model's step at the last mesh.

With ``--sweep`` it runs ``python -m raggedfsdp simulate``'s sweep (``sweep_row``: per-rank
peak of the whole step, padding and bytes all-gathered per step, both systems) for every
catalogue model and every ``benchmarks/models/*.json`` config at ``--worlds`` (default
8 to 16,384 ranks), and rewrites only the page's sweep section (kept, with its analysis,
like the HSDP one)::

    .venv/bin/python benchmarks/scale.py --sweep --layers 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from _common import ANALYSIS, RESULTS, git_state, header, write_results  # beside this script

from raggedfsdp.models import CATALOGUE, get_config
from raggedfsdp.models.mesh import parse_hsdp_mesh
from raggedfsdp.tools.simulate import ROLES, SimConfig, simulate, time_fully_shard
from raggedfsdp.tools.simulate_results import cross_check, plot_timeline, sweep_row

SYSTEMS = ("raggedfsdp", "fsdp2")
RAW = Path("/tmp/raggedfsdp_scale.jsonl")
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
    points = [(world, None, str(world)) for world in args.worlds]
    for model, layers, where, a, b in _both_ran(done, args, points, lines):
        pa, pb = a["peak"]["total"], b["peak"]["total"]
        cells = [f"{gib(a['roles'][r])} / {gib(b['roles'][r])}" for r in ROLES]
        lines.append(
            f"| {model} | {layers} | {where} | {gib(pa)} | {gib(pb)} | {pa / pb:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _both_ran(done: dict, args, points, lines: list[str]):
    """``(model, K, where, raggedfsdp's, FSDP2's)`` for each model, K and point ``(world,
    replicate, where)`` that both systems ran; a pair that failed adds a row saying so to
    ``lines``, one not run yet is left out."""
    for model in args.models:
        for layers in args.layers:
            for world, replicate, where in points:
                a, b = (_get(done, model, world, layers, s, replicate) for s in SYSTEMS)
                if a is None or b is None:
                    continue
                if "error" in a or "error" in b:
                    err = a.get("error") or b.get("error")
                    lines.append(f"| {model} | {layers} | {where} | failed: {err} |")
                    continue
                yield model, layers, where, a, b


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
    points = [(rep * shard, rep, f"{rep} x {shard} | {rep * shard}") for rep, shard in meshes]
    for model, layers, where, a, b in _both_ran(done, args, points, peaks):
        pa, pb = a["peak"]["total"], b["peak"]["total"]
        fmt = b["fsdp_mem_tracker"]
        tracked = gib(fmt["peak"]["total"]) if "peak" in fmt else f"failed: {fmt['error']}"
        cells = [f"{gib(a['roles'][r])} / {gib(b['roles'][r])}" for r in ROLES]
        peaks.append(
            f"| {model} | {layers} | {where} | {gib(pa)} | {gib(pb)} | "
            f"{pa / pb:.3f} | {tracked} | {_pct(cross_check(b))} | " + " | ".join(cells) + " |"
        )
        mesh = where.partition(" | ")[0]
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
    _write_section(path, (HSDP, HSDP_ANALYSIS, HSDP_COMMAND), section, command_line)


def _write_section(
    path: Path, names: tuple[str, str, str], section: list[str], command_line: str
) -> None:
    """Put ``section`` under its heading into the page at ``path`` (replacing the old one,
    keeping its hand-written analysis), and its command under the page's own command.
    ``names``: the section's heading, its analysis heading and its command's prefix."""
    heading, analysis_heading, prefix = names
    lines = path.read_text().rstrip("\n").split("\n")
    analysis = ["_Not written yet: read the tables, then say what they show._"]
    if (old := _section(lines, heading)) is not None:
        if (kept := _section(lines[old[0] : old[1]], analysis_heading, "### ")) is not None:
            body = lines[old[0] : old[1]][kept[0] + 1 : kept[1]]
            analysis = "\n".join(body).strip("\n").split("\n")
        del lines[old[0] : old[1]]
    _insert(lines, [heading, "", *section, "", analysis_heading, "", *analysis, ""])
    _put_command(lines, command_line, prefix)
    path.write_text("\n".join(lines) + "\n")


def _put_command(lines: list[str], command_line: str, prefix: str = HSDP_COMMAND) -> None:
    """A section's command (a line starting with ``prefix``), under the page's own
    (replacing the old one)."""
    old = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    for i in reversed(old):  # the line and the blank line above it
        del lines[i - (i > 0 and not lines[i - 1].strip()) : i + 1]
    first = next(i for i, line in enumerate(lines) if line.startswith("Command: "))
    lines[first + 1 : first + 1] = ["", command_line]


def report(done: dict, shard_times: list, args, command: str, seconds: float) -> str:
    lines = header("Real shapes at scale, simulated: raggedfsdp vs FSDP2", command, seconds)
    lines += [
        f"Configuration: rank 0 of a `world`-rank job, simulated in one process by "
        f"`raggedfsdp.tools.simulate` (fake tensors, torch's fake process group, MemTracker): "
        f"catalogue models cut to K transformer blocks (embeddings and head kept), "
        f"`fully_shard` on each block then the root, defaults otherwise (blocks reshard "
        f"after forward, the root does not), bf16 compute with fp32 master weights and "
        f"fp32 gradient reduction, `torch.optim.AdamW` (foreach), batch 1 x {args.seq} "
        f"tokens, activation checkpointing per block (`checkpoint_wrapper`), one warm-up "
        f"step, then one measured step (forward, backward, `opt.step()`). Memory is "
        f"*simulated allocated bytes per rank* (no allocator rounding, no cache, no "
        f"fragmentation), not reserved memory on a device. MoE layers route evenly; "
        f"GPT-OSS runs with torchtitan's unfused experts (see `raggedfsdp/tools/simulate.py`).",
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
    p.add_argument("--raw", type=Path, default=RAW)
    p.add_argument("--out", type=Path, default=RESULTS / "scale.md")
    p.add_argument(
        "--meshes",
        nargs="*",
        default=[],
        help="HSDP meshes (replicate=R,shard=S each): run these instead of --worlds and "
        "rewrite only the page's HSDP section",
    )
    p.add_argument("--timeline", help="with --meshes: draw this model's step at the last mesh")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="the sweep over --worlds (default 8 to 16,384) of --models (default: every "
        "catalogue model and benchmarks/models/*.json); rewrite only the page's sweep section",
    )
    args = p.parse_args(argv)
    command = " ".join([".venv/bin/python", "benchmarks/scale.py", *sys.argv[1:]])
    print(command, flush=True)
    t0 = time.perf_counter()
    if args.sweep:
        main_sweep(args, argv if argv is not None else sys.argv[1:], command)
        return
    if args.meshes:
        main_hsdp(args, [parse_hsdp_mesh(m, None, "scale") for m in args.meshes], command)
        return
    old = args.out.read_text().rstrip("\n").split("\n") if args.out.exists() else []
    kept = [(_section(old, h), p) for h, p in ((HSDP, HSDP_COMMAND), (SWEEP, SWEEP_COMMAND))]
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
    for where, prefix in kept:  # sections made by their own commands: keep them as they were
        if where is None:
            continue
        lines = args.out.read_text().rstrip("\n").split("\n")
        _insert(lines, old[where[0] : where[1]])
        _put_command(lines, next(line for line in old if line.startswith(prefix)), prefix)
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


# ================================================================================================
# The sweep: every model, 8 to 16,384 ranks; a section of its own, rewritten in place
# ================================================================================================
SWEEP = "## Sweep: every model at 8 to 16,384 ranks"
SWEEP_ANALYSIS = "### What the sweep shows"
SWEEP_COMMAND = "Sweep section:"
SWEEP_WORLDS = (8, 64, 256, 1024, 4096, 16384)
MODEL_FILES = sorted((Path(__file__).parent / "models").glob("*.json"))
# Sequence lengths other than --seq: GPT-2's learned table has 1,024 positions; the
# 32,000-vocab LM runs the 128 tokens of the test that built it.
SWEEP_SEQ = {"gpt2": 1024, "lm-32k-head.json": 128}


def _sweep_seq(model: str, default: int) -> int:
    return SWEEP_SEQ.get(Path(model).name, default)


def run_sweep(args) -> dict[str, dict]:
    """Both systems at every (model, world), from the ``--raw`` cache where they ran."""
    done: dict[str, dict] = {}
    if args.raw.exists():
        for line in args.raw.read_text().splitlines():
            r = json.loads(line)
            done[_sweep_key(r["config"])] = r
    code = git_state()
    for model in args.models:
        for world in args.worlds:
            for system in SYSTEMS:
                cfg = SimConfig(
                    model=model,
                    world=world,
                    layers=_sweep_layers(model, args),
                    system=system,
                    seq=_sweep_seq(model, args.seq),
                    fsdp_tracker=False,
                )
                key = _sweep_key(vars(cfg))
                if key in done:
                    continue
                t0 = time.perf_counter()
                try:
                    r = simulate(cfg)
                except Exception as e:  # a failure is a result too: say it in the table
                    r = {"config": vars(cfg), "error": f"{type(e).__name__}: {e}"}
                r["seconds"] = time.perf_counter() - t0
                r["git"] = code
                print(f"{key}: {r.get('peak', {}).get('total', r.get('error'))} "
                      f"({r['seconds']:.0f} s)", flush=True)  # fmt: skip
                done[key] = r
                with args.raw.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    return done


def _sweep_layers(model: str, args) -> int | None:
    """K blocks (``--layers``' first), or the model's own count where that is fewer."""
    k = args.layers[0]
    if model.endswith(".json"):
        return k
    return min(k, get_config(model).n_layers)


def _sweep_key(c: dict) -> str:
    return f"{c['model']}|{c['world']}|{c['layers']}|{c['seq']}|{c['system']}"


def _sweep_pair(done, model, world, args):
    cfg = {"model": model, "world": world, "layers": _sweep_layers(model, args),
           "seq": _sweep_seq(model, args.seq)}  # fmt: skip
    return [done.get(_sweep_key(cfg | {"system": s})) for s in SYSTEMS]


def _label(model: str) -> str:
    return f"`{Path(model).as_posix()}`" if model.endswith(".json") else model


def sweep_tables(done: dict, args) -> tuple[list[str], list[dict]]:
    """The sweep's table (one row per model and world) and its rows."""
    lines = [
        "| model | K | seq | ranks | peak raggedfsdp (GiB) | peak FSDP2 (GiB) | peak ratio | "
        "peak R - F (MiB) | padding raggedfsdp | padding FSDP2 | gathered raggedfsdp (GiB) "
        "| gathered FSDP2 (GiB) | gathered ratio | gathered R - F (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for model in args.models:
        k, seq = _sweep_layers(model, args), _sweep_seq(model, args.seq)
        for world in args.worlds:
            a, b = _sweep_pair(done, model, world, args)
            head = f"| {_label(model)} | {k} | {seq} | {world:,} |"
            if a is None or b is None:
                continue
            if "error" in a or "error" in b:
                lines.append(f"{head} failed: {a.get('error') or b.get('error')} |")
                continue
            row = sweep_row(a, b)
            rows.append(row)
            dp = (row["peak_raggedfsdp"] - row["peak_fsdp2"]) / 2**20
            dg = (row["gathered_raggedfsdp"] - row["gathered_fsdp2"]) / 2**20
            lines.append(
                f"{head} {row['peak_raggedfsdp'] / 2**30:,.3f} | {row['peak_fsdp2'] / 2**30:,.3f}"
                f" | {row['peak_ratio']:.4f} | {dp:+,.2f} | {row['padding_raggedfsdp']:.3%} | "
                f"{row['padding_fsdp2']:.3%} | {row['gathered_raggedfsdp'] / 2**30:,.3f} | "
                f"{row['gathered_fsdp2'] / 2**30:,.3f} | {row['gathered_ratio']:.4f} | {dg:+,.2f} |"
            )
    return lines, rows


def plot_sweep_ratios(rows: list[dict], args, path: Path) -> bool:
    """Peak ratio and gathered-bytes ratio (raggedfsdp / FSDP2) over ranks, every model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), sharey=True)
    for ax, what, title in zip(
        axes, ("peak", "gathered"), ("per-rank peak", "bytes all-gathered per step")
    ):
        for i, model in enumerate(args.models):
            pts = [(r["world"], r[f"{what}_ratio"]) for r in rows if r["model"] == model]
            if pts:
                style = ("o-", "s--", "^-.", "v:")[i % 4]
                name = Path(model).stem if model.endswith(".json") else model
                ax.plot(*zip(*pts), style, ms=3.5, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(f"{title}: raggedfsdp / FSDP2", fontsize=10)
    axes[0].set_ylabel("ratio (below 1: raggedfsdp uses less)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main_sweep(args, argv: list[str], command: str) -> None:
    """The sweep: simulate, tabulate, draw, rewrite the page's sweep section."""
    if "--models" not in argv:
        args.models = [*CATALOGUE, *(os.path.relpath(f) for f in MODEL_FILES)]
    if "--worlds" not in argv:
        args.worlds = list(SWEEP_WORLDS)
    if args.raw == RAW:
        args.raw = Path("/tmp/raggedfsdp_scale_sweep.jsonl")
    done = run_sweep(args)
    table, rows = sweep_tables(done, args)
    png = args.out.with_name(f"{args.out.stem}_sweep.png")
    drawn = plot_sweep_ratios(rows, args, png)
    runs = [r for m in args.models for w in args.worlds for r in _sweep_pair(done, m, w, args) if r]
    seconds = sum(r.get("seconds", 0) for r in runs)
    code = sorted({r.get("git", "an unrecorded state") for r in runs})
    seqs = ", ".join(f"{m} {q}" for m, q in SWEEP_SEQ.items())
    section = [
        f"Simulated with raggedfsdp at {'; '.join(code)}.",
        "",
        f"What `python -m raggedfsdp simulate --model M --world "
        f"{','.join(map(str, args.worlds))}` prints, for every catalogue model and every "
        f"config in `benchmarks/models/`: rank 0 of a 1-D mesh, each model cut to its first "
        f"K blocks (embeddings and head kept; the model's own count where it has fewer), "
        f"`fully_shard` on each block then the root, bf16 compute with fp32 master weights "
        f"and fp32 reduction, `torch.optim.AdamW`, batch 1 x {args.seq} tokens (other "
        f"lengths: {seqs}), activation checkpointing per block, one warm-up step. Peak: "
        f"MemTracker's over the measured step (forward, backward, `opt.step()`), allocated "
        f"bytes on this rank. Padding: padding elements over parameter elements. Gathered: "
        f"the outputs of the step's all-gathers on this rank (padding included). Ratios and "
        f"differences: raggedfsdp over / minus FSDP2, from the same run.",
        "",
        *table,
    ]
    if drawn:
        section += ["", "![ratios over ranks](scale_sweep.png)"]
    _write_section(
        args.out,
        (SWEEP, SWEEP_ANALYSIS, SWEEP_COMMAND),
        section,
        f"{SWEEP_COMMAND} `{command}` (simulations took {seconds:.0f} s).",
    )
    print(args.out.read_text())


if __name__ == "__main__":
    main()
